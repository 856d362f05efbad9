"""Gemma 4's text decoder (tunebook.gemma4) against transformers' own `Gemma4ForCausalLM` on the same random weights, fp32:
logits at several lengths past the sliding window, padded and packed batches, greedy generation with the KV cache (the
KV-sharing layers keeping none), the loss and its gradients (through the shared keys/values and the per-layer inputs, with
and without activation checkpointing), the 26B-A4B router token for token, checkpoints both ways (the multimodal folder
too), peft adapters both ways, the named builders' sizes on the meta device and the config errors.

Each config switches on a different set of Gemma 4's quirks:
- "ple-shared": per-layer input embeddings, the last 2 of 6 layers reusing keys/values (one sliding, one global),
  double-wide MLPs on those, wider global heads with proportional RoPE, the final soft-cap;
- "moe-keqv": the 26B-A4B shape: experts beside the dense MLP, global layers with v = k_proj's output and fewer KV heads;
- "plain-rope-bias": plain RoPE on the global layers, attention biases, untied embeddings, no PLE, no sharing.

The builders' numbers are the published `text_config`s of google/gemma-4-E2B, gemma-4-31B and gemma-4-26B-A4B: the
installed transformers gives the defaults (Gemma4TextConfig), E2B's hidden size (Gemma4AssistantConfig.backbone_hidden_size
= 1536) and 26B-A4B's num_global_key_value_heads = 2 (its expert-parallel plan's comment); the other numbers are those of
the published config.json files, and `test_builder_param_counts_equal_transformers` checks them against the model cards'
sizes (E2B: 2.3B effective, i.e. without the per-layer embedding table; 31B: 30.7B; 26B-A4B: 25.2B total, 3.8B active)."""
import copy
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tunebook.checkpoint import config_from_hf, config_to_hf, load_hf, save_hf
from tunebook.core import count_params
from tunebook.gemma4 import Gemma4MoEBlock, gemma4_kv_roles
from tunebook.generate import generate
from tunebook.model import build_model, gemma4_26b_a4b, gemma4_e2b, get_config
from tunebook.moe import count_active_params, moe_aux_loss, moe_blocks

TOL = 1e-4  # max abs difference of fp32 logits

S, F = "sliding_attention", "full_attention"
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            global_head_dim=32, sliding_window=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None,
            final_logit_softcapping=30.0, hidden_size_per_layer_input=0)
CONFIGS = {
    "ple-shared": dict(BASE, num_hidden_layers=6, layer_types=[S, F, S, F, S, F], num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                       vocab_size_per_layer_input=256, use_double_wide_mlp=True),
    "moe-keqv": dict(BASE, num_hidden_layers=4, layer_types=[S, F, S, F], attention_k_eq_v=True, num_global_key_value_heads=1,
                     enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
    "plain-rope-bias": dict(BASE, num_hidden_layers=3, layer_types=[S, S, F], attention_bias=True, tie_word_embeddings=False,
                            final_logit_softcapping=None, rope_parameters={S: dict(rope_type="default", rope_theta=10000.0),
                                                                           F: dict(rope_type="default", rope_theta=50000.0)}),
}


def gemma4_model(name, seed=0):
    """transformers' Gemma 4, fp32, eval: norms, router scales, biases and the layer scalars randomised, a decisive router."""
    torch.manual_seed(seed)
    hf = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**CONFIGS[name])).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("scale"): p.add_(0.2 * torch.randn_like(p))
            if n.endswith(".bias"): p.normal_(0, 0.1)
            if n.endswith("router.proj.weight"): p.normal_(0, 0.3)
        for n, b in hf.named_buffers():
            if n.endswith("layer_scalar"): b.uniform_(0.5, 1.5)
    return hf


@pytest.fixture
def pair(tmp_path):
    """pair(name) -> (transformers model, ours loaded by load_hf from the folder transformers saved)."""
    def make(name):
        hf = gemma4_model(name)
        hf.save_pretrained(tmp_path / name)
        return hf, load_hf(tmp_path / name)
    return make


def _tokens(B, T, seed=0):
    return torch.randint(3, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match(pair, name):
    hf, ours = pair(name)
    assert ours.config.arch == "gemma4_text"
    for T in (1, 7, 20, 40):   # past the window of 8
        tokens = _tokens(2, T, T)
        with torch.no_grad():
            diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
        assert diff <= TOL, f"{name} T={T}: max abs diff {diff}"


def test_the_quirks_are_in_the_test_models(pair):
    """What each quirk looks like in the loaded models: no k/v projections on the KV-sharing layers, no v_proj on the
    k=v global layers, wider global heads, double-wide MLPs, the per-layer inputs, the experts beside the MLP."""
    _, ours = pair("ple-shared")
    assert gemma4_kv_roles(ours.config) == [None, None, "store", "store", "reuse", "reuse"]
    a4, a5 = ours.layers[4].self_attn, ours.layers[5].self_attn
    assert a4.reuses_kv and a5.reuses_kv and not hasattr(a4, "k_proj") and a5.head_dim == 32 and ours.layers[0].self_attn.head_dim == 16
    assert ours.layers[4].mlp.up_proj.out_features == 64 and ours.layers[3].mlp.up_proj.out_features == 32
    assert ours.embed_tokens_per_layer.weight.shape == (256, 6 * 8)
    _, moe = pair("moe-keqv")
    assert moe.layers[1].self_attn.v_proj is None and moe.layers[1].self_attn.n_kv_heads == 1 and moe.layers[0].self_attn.v_proj is not None
    assert all(isinstance(l, Gemma4MoEBlock) for l in moe.layers) and len(moe_blocks(moe)) == 4


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["ple-shared", "moe-keqv"])
def test_padded_batch(pair, name, side):
    hf, ours = pair(name)
    T, lens = 30, [30, 17, 5]
    tokens = _tokens(3, T, 1)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, n in enumerate(lens):
        if side == "right": mask[i, :n] = 1
        else: mask[i, T - n:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(tokens, positions=positions, attn_mask=mask)
        b = hf(tokens, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert (a[real] - b[real]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["ple-shared", "moe-keqv"])
def test_packed_documents_equal_each_document_alone(pair, name):
    """A packed row of three documents (doc_ids, positions restarting) gives each the logits transformers gives it alone;
    the KV-sharing layers attend document by document over the keys their producer computed for the whole row."""
    hf, ours = pair(name)
    lens = [5, 14, 9]
    docs = [_tokens(1, n, 10 + i) for i, n in enumerate(lens)]
    tokens = torch.cat(docs, 1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lens)], 1)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = ours(tokens, positions=positions, doc_ids=doc_ids)
        ref = torch.cat([hf(d).logits for d in docs], 1)
    assert (packed - ref).abs().max().item() <= TOL


def test_router_choices_token_for_token(pair):
    """The 26B-A4B router: the same probabilities and top-k experts per token and layer as transformers' (which records
    the softmax as its router_logits), the same renormalised, per-expert-scaled weights; transformers adds no balancing loss."""
    hf, ours = pair("moe-keqv")
    tokens = _tokens(2, 19, 3)
    with torch.no_grad():
        ours(tokens)
        out = hf(tokens, output_router_logits=True)
    blocks, k = moe_blocks(ours), hf.config.top_k_experts
    assert len(blocks) == len(out.router_logits) == 4
    for i, (b, r) in enumerate(zip(blocks, out.router_logits)):
        p = b.router_logits.softmax(-1)
        assert (p - r).abs().max().item() <= 1e-6
        assert torch.equal(p.topk(k, -1)[1].sort(-1)[0], r.topk(k, -1)[1].sort(-1)[0])
        x = torch.randn(7, hf.config.hidden_size)
        with torch.no_grad():
            _, w, idx = b.router(x)
            _, w_ref, idx_ref = hf.model.layers[i].router(x)
        assert torch.equal(idx, idx_ref) and (w - w_ref).abs().max().item() <= 1e-6
    assert getattr(out, "aux_loss", None) is None and ours.config.router_aux_loss_coef == 0.0 and ours.router_aux_loss() == 0.0
    assert moe_aux_loss(ours).item() > 0   # the loss is there for a run that asks for it (router_aux_loss_coef > 0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_loss_and_gradients_equal_transformers(pair, checkpointing):
    """Cross-entropy and its gradients, through the per-layer inputs, the keys/values a producer hands to the KV-sharing
    layers (its k_proj gets their gradient too) and the router; with every block checkpointed, the same numbers."""
    from tunebook.memory.techniques import apply_activation_checkpointing
    hf, ours = pair("ple-shared")
    ours.train(); hf.train()
    if checkpointing: apply_activation_checkpointing(ours)
    tokens = _tokens(2, 20, 5)
    out = hf(tokens, labels=tokens)
    logits = ours(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    loss.backward(); out.loss.backward()
    ref, mine = dict(hf.named_parameters()), dict(ours.named_parameters())
    for n in ("layers.2.self_attn.k_proj.weight", "layers.3.self_attn.v_proj.weight", "layers.4.self_attn.q_proj.weight",
              "embed_tokens_per_layer.weight", "per_layer_model_projection.weight", "layers.1.per_layer_input_gate.weight",
              "layers.5.mlp.down_proj.weight", "embed_tokens.weight", "layers.0.self_attn.k_norm.weight"):
        g, r = mine[n].grad, ref["model." + n].grad
        assert (g - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item()), n


def test_moe_gradients_equal_transformers(pair):
    hf, ours = pair("moe-keqv")
    ours.train(); hf.train()
    tokens = _tokens(2, 12, 6)
    out = hf(tokens, labels=tokens)
    logits = ours(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) + ours.router_aux_loss()
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    loss.backward(); out.loss.backward()
    ref = dict(hf.named_parameters())
    for i in range(4):
        a, b = ours.layers[i], f"model.layers.{i}."
        for n, g in (("router.proj.weight", a.router.proj.weight.grad), ("router.scale", a.router.scale.grad),
                     ("router.per_expert_scale", a.router.per_expert_scale.grad), ("experts.down_proj", a.experts.down_proj.grad),
                     ("experts.gate_up_proj", torch.cat([a.experts.gate_proj.grad, a.experts.up_proj.grad], 1))):
            r = ref[b + n].grad
            assert (g - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item()), (i, n)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_equals_transformers(pair, name):
    """32 greedy tokens after a 9-token prompt (past the window of 8) equal transformers' generate; the KV-sharing
    layers hold no cache of their own."""
    hf, ours = pair(name)
    prompt = _tokens(1, 9, 6)
    ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)[0, 9:].tolist()
    assert generate(ours, prompt, max_new_tokens=32) == [ref]
    ours.setup_cache(1, 16)
    held = [l.self_attn.cache is not None for l in ours.layers]
    ours.clear_cache()
    assert held == [r != "reuse" for r in gemma4_kv_roles(ours.config)]


def test_generation_of_several_samples_and_padded_prompts(pair):
    """Left-padded prompts of different lengths and several samples per prompt (the caches copied per sample, the
    KV-sharing layers skipped) give what each prompt gives alone."""
    _, ours = pair("ple-shared")
    a, b = _tokens(1, 11, 7)[0].tolist(), _tokens(1, 4, 8)[0].tolist()
    alone = [generate(ours, [p], max_new_tokens=12)[0] for p in (a, b)]
    assert generate(ours, [a, b], max_new_tokens=12) == alone
    assert generate(ours, [a, b], max_new_tokens=12, num_samples=2) == [alone[0], alone[0], alone[1], alone[1]]


def _keys(d):
    return set(safe_open(str(d / "model.safetensors"), "pt").keys())


@pytest.mark.parametrize("name", CONFIGS)
def test_save_hf_loads_in_transformers(tmp_path, name):
    """A model we built and saved: transformers reads it (its class, its tensor names: stacked experts, layer_scalar,
    no k/v tensors on the KV-sharing layers) to the same logits."""
    hf = gemma4_model(name)
    hf.save_pretrained(tmp_path / "theirs")
    cfg = config_from_hf(json.loads((tmp_path / "theirs" / "config.json").read_text()))
    torch.manual_seed(1)
    ours = build_model(cfg)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "norm" in n or n.endswith("scale"): p.add_(0.2 * torch.randn_like(p))
            if n.endswith("router.proj.weight"): p.normal_(0, 0.3)
        for n, b in ours.named_buffers():
            if n.endswith("layer_scalar"): b.uniform_(0.5, 1.5)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    assert _keys(out) == _keys(tmp_path / "theirs")
    tokens = _tokens(2, 21)
    with torch.no_grad():
        assert (ours(tokens) - back(tokens).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_through_tunebook_is_exact(pair, tmp_path, name):
    """transformers' folder -> load_hf -> save_hf -> transformers: bit-identical logits."""
    hf, ours = pair(name)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(2, 13)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def test_load_hf_reads_a_multimodal_gemma4_folder(tmp_path):
    """The published Gemma 4 folders are Gemma4ForConditionalGeneration (model_type gemma4): the text decoder under
    model.language_model.*, its config in text_config (listing only what differs from Gemma4TextConfig's defaults), beside
    vision and audio towers, which load_hf skips."""
    hf = gemma4_model("ple-shared")
    hf.save_pretrained(tmp_path / "text")
    sd = {("model.language_model." + k[len("model."):]): v for k, v in load_file(tmp_path / "text" / "model.safetensors").items()}
    sd["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.zeros(4, 4)
    sd["model.embed_vision.embedding_projection.weight"] = torch.zeros(4, 4)
    (tmp_path / "mm").mkdir()
    save_file(sd, str(tmp_path / "mm" / "model.safetensors"), metadata={"format": "pt"})
    text = dict(CONFIGS["ple-shared"])
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                                                             "text_config": text, "vision_config": {"hidden_size": 32}}))
    ours = load_hf(tmp_path / "mm")
    assert ours.config == config_from_hf(json.loads((tmp_path / "text" / "config.json").read_text()))
    tokens = _tokens(2, 20, 9)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("name, total, active", [("gemma4-e2b", None, None), ("gemma4-31b", 30.7e9, None),
                                                 ("gemma4-26b-a4b", 25.2e9, 3.8e9)])
def test_builder_param_counts_equal_transformers(name, total, active):
    """Total and active parameters equal transformers' Gemma4ForCausalLM on the same config (meta device), and the model
    cards' sizes (E2B: 2.3B "effective", its parameters without the per-layer embedding table)."""
    ours = build_model(name, device="meta")
    hf_cfg = config_to_hf(ours.config)
    with torch.device("meta"):
        hf = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")}))
    n_hf = sum(p.numel() for p in hf.parameters())
    assert count_params(ours) == n_hf
    c = ours.config
    if c.n_experts:
        experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
        assert count_active_params(ours) == n_hf - experts // c.n_experts * (c.n_experts - c.experts_per_token)
        assert abs(count_active_params(ours) - active) <= 0.02 * active
    if total: assert abs(count_params(ours) - total) <= 0.01 * total
    else: assert abs(count_params(ours) - ours.embed_tokens_per_layer.weight.numel() - 2.3e9) <= 0.02 * 2.3e9


def test_published_configs_read_as_the_builders():
    """The text_config of the published multimodal folders (only what differs from Gemma4TextConfig's defaults, plus the
    fields they list anyway) reads as the builders."""
    L35 = ([S] * 4 + [F]) * 7
    e2b = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "tie_word_embeddings": True,
           "text_config": {"hidden_size": 1536, "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1,
                           "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": None, "attention_k_eq_v": False,
                           "sliding_window": 512, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
                           "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
                           "intermediate_size": 6144, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                           "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "pad_token_id": 0,
                           "bos_token_id": 2, "eos_token_id": 1, "layer_types": L35, "model_type": "gemma4_text",
                           "rope_parameters": {F: {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                                               S: {"rope_theta": 10000.0, "rope_type": "default"}}}}
    assert config_from_hf(e2b) == gemma4_e2b()
    moe = {"model_type": "gemma4", "text_config": {
        "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2, "attention_k_eq_v": True, "enable_moe_block": True,
        "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704, "sliding_window": 1024, "max_position_embeddings": 262144,
        "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0, "layer_types": ([S] * 5 + [F]) * 5,
        "rope_parameters": {F: {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                            S: {"rope_theta": 10000.0, "rope_type": "default"}}}}
    assert config_from_hf(moe) == gemma4_26b_a4b()
    for name in ("gemma4-e2b", "gemma4-31b", "gemma4-26b-a4b"):
        assert config_from_hf(config_to_hf(get_config(name))) == get_config(name)


def test_config_errors_name_the_problem():
    text = {"model_type": "gemma4_text", **CONFIGS["ple-shared"]}
    with pytest.raises(ValueError, match="use_bidirectional_attention"): config_from_hf({**text, "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="text_config"): config_from_hf({**text, "model_type": "gemma4"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        config_from_hf({**text, "rope_parameters": {S: {"rope_type": "default"}, F: {"rope_type": "yarn", "factor": 2.0}}})
    with pytest.raises(ValueError, match="sliding layers"):
        config_from_hf({**text, "rope_parameters": {S: {"rope_type": "linear", "factor": 2.0}, F: {"rope_type": "default"}}})
    with pytest.raises(ValueError, match="per_layer_config"): config_from_hf({**text, "per_layer_config": {"0": {"head_dim": 32}}})
    with pytest.raises(ValueError, match="num_experts"): config_from_hf({**text, "enable_moe_block": True})
    with pytest.raises(ValueError, match="kv_shared_layers"): config_from_hf({**text, "num_kv_shared_layers": 5})
    with pytest.raises(ValueError, match="Gemma 4's"): get_config("pico", kv_shared_layers=1)
    with pytest.raises(ValueError, match="ending with full_attention"): gemma4_e2b(layer_types=[S] * 35)
    with pytest.raises(ValueError, match="k_eq_v"): gemma4_e2b(global_kv_heads=2)
    with pytest.raises(ValueError, match="qk_norm"): config_to_hf(gemma4_e2b(qk_norm=False))
    with pytest.warns(UserWarning, match="forces it to full_attention"):
        assert config_from_hf({**text, "layer_types": [S, F, S, F, F, S]}).layer_types[-1] == F
    with pytest.raises(ValueError, match="rough formula"):
        from tunebook.memory import rough_estimate
        rough_estimate(get_config("gemma4-e2b", n_layers=5, kv_shared_layers=0))
    # transformers' own spelling of the global heads (save_pretrained's per_layer_config) reads as the published one
    hf = gemma4_model("moe-keqv").config.to_dict()
    assert "per_layer_config" in hf and "global_head_dim" not in hf
    cfg = config_from_hf(hf)
    assert (cfg.global_head_dim, cfg.global_kv_heads, cfg.k_eq_v) == (32, 1, True)


# LoRA: attention, the per-layer input projections and per-expert adapters on the stacked experts, in peft 0.18's format both ways
def _randomise_B(model, std=0.1, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.mark.parametrize("name, targets", [("ple-shared", ("all-linear",)), ("moe-keqv", ("all-linear", "experts"))])
def test_our_adapter_loads_in_peft_and_merges_exactly(tmp_path, name, targets):
    import peft
    from tunebook.lora import apply_lora, expert_lora_modules, lora_modules, merge_lora, save_adapter
    hf = gemma4_model(name); hf.save_pretrained(tmp_path / "base")
    ours = apply_lora(load_hf(tmp_path / "base"), rank=4, alpha=8, targets=targets).eval()
    adapted = {n.rsplit(".", 1)[-1] for n in lora_modules(ours)}
    assert "proj" not in adapted and "lm_head" not in adapted   # all-linear leaves out the router's proj, as the other routers
    if name == "ple-shared": assert {"per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"} <= adapted
    else: assert len(expert_lora_modules(ours)) == 4
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


@pytest.mark.parametrize("name", ["ple-shared", "moe-keqv"])
def test_peft_adapter_loads_in_tunebook(tmp_path, name):
    import peft
    from tunebook.lora import expert_lora_modules, load_adapter
    hf = gemma4_model(name); hf.save_pretrained(tmp_path / "base")
    moe = name == "moe-keqv"
    lc = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "k_proj", "per_layer_input_gate", "o_proj"] if not moe else ["q_proj", "v_proj"],
                         **(dict(target_parameters=["experts.gate_up_proj", "experts.down_proj"]) if moe else {}))
    pm = peft.get_peft_model(copy.deepcopy(hf), lc).eval()
    _randomise_B(pm)
    pm.save_pretrained(tmp_path / "ad")
    ours = load_adapter(load_hf(tmp_path / "base"), tmp_path / "ad").eval()
    if moe: assert len(expert_lora_modules(ours)) == 4
    ids = _tokens(2, 11)
    with torch.no_grad(): diff = (ours(ids) - pm(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("name", ["ple-shared", "moe-keqv"])
def test_the_memory_estimator_counts_gemma4(name):
    """The estimator (the step run on shapes) counts the model's parameters, its LoRA adapters on all linears and the
    experts, and for the MoE the active ones; the rough formula counts the parameters exactly but refuses the rest."""
    from tunebook.memory import estimate, rough_estimate
    from tunebook.memory.formulas import _n_params
    cfg = config_from_hf({"model_type": "gemma4_text", **CONFIGS[name]})
    m = build_model(cfg, device="meta")
    full = estimate(cfg, method="full", batch_size=2, seq_len=16, dtype="fp32")
    assert full.settings["params"] == count_params(m) == _n_params(cfg)[1] and full.categories["parameters"] == 4 * count_params(m)
    lora = estimate(cfg, method="lora", batch_size=2, seq_len=16, dtype="fp32", lora_rank=4,
                    lora_targets=("all-linear", "experts") if cfg.n_experts else ("all-linear",))
    assert lora.settings["params"] - lora.settings["trainable_params"] == count_params(m)
    if cfg.n_experts: assert full.settings["active_params"] == count_active_params(m) < count_params(m)
    with pytest.raises(ValueError, match="rough formula"): rough_estimate(cfg)
