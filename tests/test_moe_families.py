"""Mixtral, OLMoE and Qwen3.5-MoE against transformers' own `MixtralForCausalLM`, `OlmoeForCausalLM` and
`Qwen3_5MoeForCausalLM` on the same random weights, fp32: logits at several lengths (past Mixtral's sliding window, past
the DeltaNet chunk of 64), padded batches, router choices token for token, the load-balancing loss (each family's own
`load_balancing_loss_func`), greedy generation, checkpoints both ways (Mixtral's block_sparse_moe / w1-w3 names, the
published multimodal Qwen3.5-MoE layout), the named builders' sizes and the config errors."""
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from tunebook.checkpoint import config_from_hf, config_to_hf, load_hf, save_hf
from tunebook.core import count_params
from tunebook.generate import generate
from tunebook.model import build_model, get_config, mixtral_8x7b, olmoe_1b_7b
from tunebook.moe import SharedExpertMoE, count_active_params, moe_aux_loss, moe_blocks

TOL = 1e-4  # max abs difference of fp32 logits

BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=None, eos_token_id=None)   # no EOS: min_new_tokens would mask it
QWEN35 = dict(BASE, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
FAMILIES = {
    "mixtral": ("Mixtral", dict(BASE, intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)),
    # a sliding window shorter than the longest test length; 3 of 6 experts
    "mixtral-window": ("Mixtral", dict(BASE, intermediate_size=32, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=3,
                                       sliding_window=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "olmoe": ("Olmoe", dict(BASE, intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "olmoe-norm-bias-tied": ("Olmoe", dict(BASE, intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=3,
                                           norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True, num_key_value_heads=4)),
    # transformers' default pattern on 4 layers: 3 DeltaNet, then gated attention; every layer MoE with a shared expert
    "qwen3_5_moe": ("Qwen3_5Moe", dict(QWEN35, num_hidden_layers=4)),
    "qwen3_5_moe-tied": ("Qwen3_5Moe", dict(QWEN35, num_hidden_layers=2, layer_types=["full_attention", "linear_attention"],
                                            tie_word_embeddings=True, attention_bias=True, num_experts_per_tok=3)),
}
MAIN = ["mixtral", "olmoe", "qwen3_5_moe"]


def hf_family(name, seed=0):
    """transformers' model of family `name` with every weight random and a decisive router (std 0.3), fp32, eval."""
    prefix, kw = FAMILIES[name]
    cfg_cls = getattr(transformers, prefix + ("TextConfig" if prefix == "Qwen3_5Moe" else "Config"))
    torch.manual_seed(seed)
    hf = getattr(transformers, prefix + "ForCausalLM")(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))
            if n.endswith(".bias"): p.normal_(0, 0.1)
            if n.endswith("mlp.gate.weight") or n.endswith("shared_expert_gate.weight"): p.normal_(0, 0.3)
            if n.endswith("dt_bias"): p.normal_(0, 0.5)
            if n.endswith("A_log"): p.uniform_(-1, 1)
            if n.endswith("conv1d.weight"): p.normal_(0, 0.3)
    return hf


@pytest.fixture
def pair(tmp_path):
    """pair(name) -> (transformers model, ours loaded by load_hf from the folder transformers saved)."""
    def make(name):
        hf = hf_family(name)
        hf.save_pretrained(tmp_path / name)
        return hf, load_hf(tmp_path / name)
    return make


def _tokens(B, T, seed=0):
    return torch.randint(3, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match(pair, name):
    hf, ours = pair(name)
    assert ours.config.arch == hf.config.model_type.removesuffix("_text") + ("_text" if "qwen3_5" in name else "")
    assert len(moe_blocks(ours)) == hf.config.num_hidden_layers   # every layer is MoE in these families
    for T in (1, 7, 33, 70):   # 33 and 70: past the window of 16; 70: past one DeltaNet chunk
        tokens = _tokens(2, T, T)
        with torch.no_grad():
            diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
        assert diff <= TOL, f"{name} T={T}: max abs diff {diff}"


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", MAIN + ["mixtral-window"])
def test_padded_batch_and_its_aux_loss(pair, name, side):
    hf, ours = pair(name)
    T, lens = 40, [40, 23, 6]
    tokens = _tokens(3, T, 1)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, n in enumerate(lens):
        if side == "right": mask[i, :n] = 1
        else: mask[i, T - n:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(tokens, positions=positions, attn_mask=mask)
        out = hf(tokens, attention_mask=mask, position_ids=positions, output_router_logits=True)
    real = mask.bool()
    assert (a[real] - out.logits[real]).abs().max().item() <= TOL
    assert abs(moe_aux_loss(ours).item() - out.aux_loss.item()) <= 1e-6   # padding left out, as transformers does


@pytest.mark.parametrize("name", FAMILIES)
def test_router_choices_and_aux_loss_equal_transformers(pair, name):
    hf, ours = pair(name)
    tokens = _tokens(2, 19, 3)
    with torch.no_grad():
        ours(tokens)
        out = hf(tokens, output_router_logits=True)
    blocks, k = moe_blocks(ours), hf.config.num_experts_per_tok
    assert len(blocks) == len(out.router_logits) > 0
    for b, r in zip(blocks, out.router_logits):
        assert (b.router_logits - r).abs().max().item() <= 1e-5
        mine = b.router_logits.softmax(-1).topk(k, -1)[1].sort(-1)[0]
        assert torch.equal(mine, r.softmax(-1).topk(k, -1)[1].sort(-1)[0])
    assert abs(moe_aux_loss(ours).item() - out.aux_loss.item()) <= 1e-6
    assert abs(ours.router_aux_loss().item() - hf.config.router_aux_loss_coef * out.aux_loss.item()) <= 1e-7   # the coefficient times the same loss, in fp32 (its rounding at 0.05 is about 4e-9)


def test_router_weights_renormalise_as_each_family_does(pair):
    """Mixtral and Qwen3.5-MoE always renormalise the top-k weights; OLMoE only with norm_topk_prob (its default: not)."""
    for name, norm in (("mixtral", True), ("olmoe", False), ("olmoe-norm-bias-tied", True), ("qwen3_5_moe", True)):
        hf, ours = pair(name)
        assert ours.config.norm_topk_prob is norm
        x = torch.randn(5, hf.config.hidden_size)
        _, w, idx = moe_blocks(ours)[0].gate(x)
        _, w_ref, idx_ref = hf.model.layers[0].mlp.gate(x)
        assert torch.equal(idx, idx_ref) and (w - w_ref).abs().max().item() <= 1e-6


def test_training_loss_and_gradients_equal_transformers(pair):
    """Qwen3.5-MoE: cross-entropy + coef * aux loss, the same loss and gradients on router, experts and the shared expert."""
    hf, ours = pair("qwen3_5_moe")
    ours.train(); hf.train()
    tokens = _tokens(2, 12, 5)
    out = hf(tokens, labels=tokens, output_router_logits=True)
    logits = ours(tokens)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss = ce + ours.router_aux_loss()
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    loss.backward(); out.loss.backward()
    ref = dict(hf.named_parameters())
    for i in range(hf.config.num_hidden_layers):
        a, b = ours.layers[i].mlp, f"model.layers.{i}.mlp."
        assert isinstance(a, SharedExpertMoE)
        assert (a.gate.weight.grad - ref[b + "gate.weight"].grad).abs().max().item() <= 1e-6
        assert (a.shared_expert_gate.weight.grad - ref[b + "shared_expert_gate.weight"].grad).abs().max().item() <= 1e-6
        assert (a.shared_expert.up_proj.weight.grad - ref[b + "shared_expert.up_proj.weight"].grad).abs().max().item() <= 1e-6
        assert (a.experts.down_proj.grad - ref[b + "experts.down_proj"].grad).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", MAIN)
def test_greedy_generation_equals_transformers(pair, name):
    hf, ours = pair(name)
    prompt = _tokens(1, 9, 6)
    ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)[0, 9:].tolist()
    assert generate(ours, prompt, max_new_tokens=32) == [ref]


def _keys(d):
    return set(safe_open(str(d / "model.safetensors"), "pt").keys())


@pytest.mark.parametrize("name", FAMILIES)
def test_save_hf_loads_in_transformers(tmp_path, name):
    """A model we built and saved: transformers reads it (its class, its tensor names) to the same logits."""
    hf = hf_family(name)
    hf.save_pretrained(tmp_path / "theirs")
    cfg = config_from_hf(json.loads((tmp_path / "theirs" / "config.json").read_text()))
    torch.manual_seed(1)
    ours = build_model(cfg)
    with torch.no_grad():
        for b in moe_blocks(ours): b.gate.weight.normal_(0, 0.3)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    assert _keys(out) == _keys(tmp_path / "theirs")   # Mixtral: block_sparse_moe.experts.N.w1/w2/w3
    tokens = _tokens(2, 13)
    with torch.no_grad():
        assert (ours(tokens) - back(tokens).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("name", MAIN)
def test_round_trip_through_tunebook_is_exact(pair, tmp_path, name):
    """transformers' folder -> load_hf -> save_hf -> transformers: bit-identical logits."""
    hf, ours = pair(name)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(2, 13)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def test_load_hf_reads_a_multimodal_qwen3_5_moe_folder(tmp_path):
    """The published Qwen3.5-MoE folders are Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe): the text decoder
    under model.language_model.*, experts one tensor each; the vision tower and mtp.* are skipped."""
    from safetensors.torch import load_file, save_file
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(0)
    vlm = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=FAMILIES["qwen3_5_moe"][1], vision_config=vision)).eval()
    with torch.no_grad():
        for n, p in vlm.named_parameters():
            if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))
            if n.endswith("mlp.gate.weight") or n.endswith("shared_expert_gate.weight"): p.normal_(0, 0.3)
    vlm.save_pretrained(tmp_path / "vlm")
    sd = load_file(tmp_path / "vlm" / "model.safetensors")
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in sd and any(k.startswith("model.visual.") for k in sd)
    sd["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(sd, str(tmp_path / "vlm" / "model.safetensors"), metadata={"format": "pt"})
    ours = load_hf(tmp_path / "vlm")
    assert ours.config.arch == "qwen3_5_moe_text" and ours.config.shared_expert_dim == 24
    tokens = _tokens(2, 70, 9)
    with torch.no_grad():
        assert (ours(tokens) - vlm(input_ids=tokens).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("name, total, active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("olmoe-1b-7b", 6.9e9, 1.3e9)])
def test_builder_param_counts_equal_transformers(name, total, active):
    """Total and active parameters equal transformers' model on the same config (meta device), and the model card's."""
    ours = build_model(name, device="meta")
    hf_cfg = config_to_hf(ours.config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            hf_cfg.pop("model_type"), **{k: v for k, v in hf_cfg.items() if k != "architectures"}))
    n_hf = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    E, k = hf.config.num_local_experts if name.startswith("mixtral") else hf.config.num_experts, hf.config.num_experts_per_tok
    assert count_params(ours) == n_hf
    assert count_active_params(ours) == n_hf - experts // E * (E - k)
    assert abs(count_params(ours) - total) <= 0.01 * total and abs(count_active_params(ours) - active) <= 0.02 * active


def test_published_configs_read_as_the_builders():
    for name in ("mixtral-8x7b", "olmoe-1b-7b"):
        cfg = get_config(name)
        assert config_from_hf(config_to_hf(cfg)) == cfg
    mixtral = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                   max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, router_aux_loss_coef=0.02, sliding_window=None,
                   bos_token_id=1, eos_token_id=2, hidden_act="silu", tie_word_embeddings=False, output_router_logits=False)
    assert config_from_hf(mixtral) == mixtral_8x7b()
    olmoe = dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                 norm_topk_prob=False, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, router_aux_loss_coef=0.01,
                 clip_qkv=None, eos_token_id=50279, pad_token_id=1, hidden_act="silu", attention_bias=False, tie_word_embeddings=False)
    assert config_from_hf(olmoe) == olmoe_1b_7b()


def test_config_errors_name_the_problem():
    mixtral = config_to_hf(mixtral_8x7b())
    with pytest.raises(ValueError, match="router_jitter_noise"): config_from_hf({**mixtral, "router_jitter_noise": 0.01})
    with pytest.raises(ValueError, match="clip_qkv"): config_from_hf({**config_to_hf(olmoe_1b_7b()), "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="head_dim"): config_to_hf(olmoe_1b_7b(head_dim=64))
    with pytest.raises(ValueError, match="moe_hidden_dim"): config_to_hf(mixtral_8x7b(moe_hidden_dim=1024))
    with pytest.raises(ValueError, match="n_experts=0"): config_to_hf(mixtral_8x7b(n_experts=0, experts_per_token=0))
    with pytest.raises(ValueError, match="shared_expert_dim"):
        config_to_hf(config_from_hf({"model_type": "qwen3_5_moe_text", **QWEN35, "num_hidden_layers": 4}).replace(shared_expert_dim=0))
    with pytest.raises(ValueError, match="norm_topk_prob"): config_to_hf(mixtral_8x7b(norm_topk_prob=False))
    with pytest.raises(ValueError, match="shared_expert_dim"): get_config("pico", shared_expert_dim=8)


# LoRA: attention, the shared expert's linears and per-expert adapters on the stacked experts, in peft 0.18's format both ways
LORA = {"mixtral": ("q_proj", "v_proj", "experts"), "olmoe": ("q_proj", "o_proj", "experts"),
        "qwen3_5_moe": ("all-linear", "experts")}   # all-linear: attention, DeltaNet projections, the shared expert (not its gate)


def _randomise_B(model, std=0.1, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.mark.parametrize("name", MAIN)
def test_our_adapter_loads_in_peft_and_merges_exactly(tmp_path, name):
    import peft
    from tunebook.lora import apply_lora, expert_lora_modules, lora_modules, merge_lora, save_adapter
    hf = hf_family(name); hf.save_pretrained(tmp_path / "base")
    ours = apply_lora(load_hf(tmp_path / "base"), rank=4, alpha=8, targets=LORA[name]).eval()
    assert len(expert_lora_modules(ours)) == hf.config.num_hidden_layers
    if name == "qwen3_5_moe":
        assert "layers.0.mlp.shared_expert.up_proj" in lora_modules(ours) and "layers.0.mlp.shared_expert_gate" not in lora_modules(ours)
    _randomise_B(ours)
    save_adapter(ours, tmp_path / "ad")
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    ids = _tokens(2, 11)
    with torch.no_grad():
        mine = ours(ids)
        diff = (mine - pm(ids).logits).abs().max().item()
        with pm.disable_adapter(): moved = (mine - pm(ids).logits).abs().max().item()
        merged = (merge_lora(ours)(ids) - mine).abs().max().item()
    assert diff <= 1e-5 and moved > 1e-3 and merged <= 1e-5, (diff, moved, merged)


@pytest.mark.parametrize("name", MAIN)
def test_peft_adapter_loads_in_tunebook(tmp_path, name):
    import copy
    import peft
    from tunebook.lora import expert_lora_modules, load_adapter
    hf = hf_family(name); hf.save_pretrained(tmp_path / "base")
    tm = ["q_proj", "shared_expert.down_proj", "shared_expert_gate"] if name == "qwen3_5_moe" else ["q_proj", "k_proj"]
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5, target_modules=tm,
                                                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])).eval()
    _randomise_B(pm)
    pm.save_pretrained(tmp_path / "ad")
    ours = load_adapter(load_hf(tmp_path / "base"), tmp_path / "ad").eval()
    assert len(expert_lora_modules(ours)) == hf.config.num_hidden_layers
    ids = _tokens(2, 11)
    with torch.no_grad(): diff = (ours(ids) - pm(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


def _small_cfg(name):
    return config_from_hf({**FAMILIES[name][1], "model_type": {"Mixtral": "mixtral", "Olmoe": "olmoe", "Qwen3_5Moe": "qwen3_5_moe_text"}[FAMILIES[name][0]]})


@pytest.mark.parametrize("name", ["mixtral", "olmoe", "qwen3_5_moe-tied"])   # the last: DeltaNet and attention, shared experts
def test_rough_memory_formula_counts_each_family(name):
    """The rough formula's parameter count (OLMoE's whole-projection q/k norms, the shared expert and its gate) is the
    model's, and its parameter and optimizer bytes equal the estimator's (which runs the step on shapes), full and LoRA."""
    from torch import nn
    from tunebook.memory import estimate, rough_estimate
    from tunebook.memory.formulas import _n_params
    cfg = _small_cfg(name)
    m = build_model(cfg, device="meta", init=False)
    tensors = list({id(p): p for p in m.parameters()}.values())
    block_w = sum(mod.weight.numel() for layer in m.layers for mod in layer.modules() if isinstance(mod, nn.Linear))
    assert _n_params(cfg) == (block_w, count_params(m), len(tensors))
    for method in ("full", "lora"):
        # a batch large enough that the estimator's peak falls in backward, not in the optimizer step's temporaries
        kw = dict(method=method, batch_size=1 if "qwen3_5" in name else 2, seq_len=32 if "qwen3_5" in name else 128, dtype="fp32", lora_rank=4)
        rough, est = rough_estimate(cfg, **kw), estimate(cfg, **kw)
        assert rough.categories["parameters"] == est.categories["parameters"], method
        assert rough.categories["optimizer"] == est.categories["optimizer"], method


def test_a_qwen3_5_moe_lora_fine_tune_learns_with_the_balancing_loss_on(tmp_path):
    """LoRA (rank 8) on attention, DeltaNet, the shared expert and every routed expert of a random Qwen3.5-MoE, 40 steps on
    the embedded task with the balancing loss on (coef 0.05, logged as router_aux_loss): the held-out loss falls (measured
    5.61 -> 5.12; the random embeddings and lm_head stay frozen, so less than a full fine-tune's 2+ nats), and no expert
    takes more than 40% of the routed (token, slot) pairs in any layer (uniform: 12.5%; measured 31%; the router itself is
    frozen under LoRA, so the balancing loss acts through the adapted layers before it)."""
    from tunebook.checkpoint import load_embedded
    from tunebook.train import TrainConfig, Trainer
    _, tok = load_embedded()
    cfg = {**FAMILIES["qwen3_5_moe-tied"][1], "vocab_size": len(tok), "router_aux_loss_coef": 0.05}
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**cfg))
    hf.save_pretrained(tmp_path / "m"); tok.save(tmp_path / "m")
    tr = Trainer(TrainConfig(model=str(tmp_path / "m"), method="lora", dtype="fp32", batch_size=16, max_steps=40, lr=1e-2,
                             warmup_steps=4, n_train=512, eval_samples=16, lora_rank=8, lora_targets="all-linear,experts",
                             output_dir=str(tmp_path / "run")))
    s = tr.fit(progress=False)
    assert s["eval_loss_after"] < s["eval_loss_before"] - 0.3, s
    import csv
    rows = [r for r in csv.DictReader((tmp_path / "run" / "metrics.csv").open()) if r.get("router_aux_loss")]
    assert rows and all(float(r["router_aux_loss"]) > 0 for r in rows)
    tr.model.eval()
    with torch.no_grad(): tr.model(tr.micro_batch(0)["tokens"])
    k = cfg["num_experts_per_tok"]
    share = max((torch.bincount(b.router_logits.topk(k, -1).indices.flatten(), minlength=8).float()
                 / b.router_logits.shape[0] / k).max().item() for b in moe_blocks(tr.model))
    assert share <= 0.4, share
