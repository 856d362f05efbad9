"""gpt-oss (tunebook.gptoss) against transformers' own `GptOssForCausalLM` on the same random weights, fp32: logits past the
sliding window, padded and packed batches, router choices, the load-balancing loss, gradients, greedy generation,
checkpoints both ways (MXFP4 experts dequantised as transformers' own routine does), the named builders' sizes, LoRA with peft."""
import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tunebook.checkpoint import config_from_hf, config_to_hf, load_hf, save_hf
from tunebook.core import count_params
from tunebook.generate import generate
from tunebook.gptoss import FP4_E2M1, SinkAttention, mxfp4_dequantize
from tunebook.model import build_model, get_config, gpt_oss_20b
from tunebook.moe import count_active_params, moe_aux_loss, moe_blocks

TOL = 1e-4  # max abs difference of fp32 logits

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256, pad_token_id=0)
YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=64, rope_theta=150000.0)
CONFIGS = {"yarn-notrunc": dict(BASE, rope_parameters=dict(YARN, truncate=False)),
           "yarn-trunc-mqa": dict(BASE, num_key_value_heads=1, num_experts_per_tok=3, num_hidden_layers=4, swiglu_limit=1.5,
                                  rope_parameters=dict(YARN, truncate=True, factor=8.0)),
           "plain-rope": dict(BASE, rope_parameters=dict(rope_type="default", rope_theta=10000.0), router_aux_loss_coef=0.05)}


def oss_model(name="yarn-notrunc", seed=0):
    """transformers' gpt-oss, fp32, eval: norms, biases and sinks randomised, a decisive router, experts large enough that the
    SwiGLU clamp (limit) is reached."""
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIGS[name])).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))
            if n.endswith("bias") or n.endswith("sinks"): p.normal_(0, 0.5)
            if n.endswith("router.weight"): p.normal_(0, 0.3)
            if n.endswith("experts.gate_up_proj"): p.normal_(0, 0.5)
    return hf


@pytest.fixture
def pair(tmp_path):
    def make(name="yarn-notrunc"):
        hf = oss_model(name)
        hf.save_pretrained(tmp_path / name)
        return hf, load_hf(tmp_path / name)
    return make


def _tokens(B, T, seed=0):
    return torch.randint(1, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_clamp_is_reached():
    """The test models' experts see gate/up values past the limit, so a missing clamp would show in the logits."""
    hf = oss_model("yarn-trunc-mqa")
    ex = hf.model.layers[0].mlp.experts
    x = torch.randn(50, 64)
    gu = x @ ex.gate_up_proj[0] + ex.gate_up_proj_bias[0]
    assert gu.abs().max() > ex.limit   # transformers: 1.5 here


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match(pair, name):
    hf, ours = pair(name)
    assert all(isinstance(l.self_attn, SinkAttention) for l in ours.layers)
    assert [l.self_attn.sliding_window for l in ours.layers] == [8 if t == "sliding_attention" else None for t in hf.config.layer_types]
    for T in (1, 7, 9, 33):   # past the window of 8
        tokens = _tokens(2, T, T)
        with torch.no_grad():
            diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
        assert diff <= TOL, f"{name} T={T}: max abs diff {diff}"


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_and_its_aux_loss(pair, side):
    hf, ours = pair("yarn-notrunc")
    tokens = _tokens(3, 14, 1)
    mask = torch.ones(3, 14, dtype=torch.long)
    for i, n in enumerate([14, 10, 3]):
        if side == "right": mask[i, n:] = 0
        else: mask[i, :14 - n] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(tokens, positions=positions, attn_mask=mask)
        out = hf(tokens, attention_mask=mask, position_ids=positions, output_router_logits=True)
    real = mask.bool()
    assert (a[real] - out.logits[real]).abs().max().item() <= TOL
    assert abs(moe_aux_loss(ours).item() - out.aux_loss.item()) <= 1e-6


def test_packed_documents_equal_each_document_alone(pair):
    """Sinks with document masks: a packed row of three documents gives each the logits transformers gives it alone."""
    hf, ours = pair("yarn-notrunc")
    lens = [5, 12, 4]
    docs = [_tokens(1, n, 10 + i) for i, n in enumerate(lens)]
    tokens = torch.cat(docs, 1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lens)], 1)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = ours(tokens, positions=positions, doc_ids=doc_ids)
        ref = torch.cat([hf(d).logits for d in docs], 1)
    assert (packed - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_router_choices_token_for_token_and_aux_loss(pair, name):
    hf, ours = pair(name)
    tokens = _tokens(2, 19, 3)
    with torch.no_grad():
        ours(tokens)
        out = hf(tokens, output_router_logits=True)
    blocks, k = moe_blocks(ours), hf.config.num_experts_per_tok
    assert len(blocks) == len(out.router_logits) == hf.config.num_hidden_layers
    for b, r in zip(blocks, out.router_logits):
        assert (b.router_logits - r).abs().max().item() <= 1e-5
        assert torch.equal(b.router_logits.topk(k, -1)[1].sort(-1)[0], r.topk(k, -1)[1].sort(-1)[0])
    assert abs(moe_aux_loss(ours).item() - out.aux_loss.item()) <= 1e-6
    assert abs(ours.router_aux_loss().item() - hf.config.router_aux_loss_coef * out.aux_loss.item()) <= 1e-8


def test_training_loss_and_gradients_equal_transformers(pair):
    """Cross-entropy + coef * aux: the same loss and gradients on sinks, router (weight and bias) and the experts."""
    hf, ours = pair("plain-rope")
    ours.train(); hf.train()
    tokens = _tokens(2, 12, 5)
    out = hf(tokens, labels=tokens, output_router_logits=True)
    logits = ours(tokens)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss = ce + ours.router_aux_loss()
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    loss.backward(); out.loss.backward()
    ref = dict(hf.named_parameters())
    ours_p = dict(ours.named_parameters())
    for n in ("layers.0.self_attn.sinks", "layers.1.mlp.router.weight", "layers.1.mlp.router.bias", "layers.0.mlp.experts.gate_up_proj",
              "layers.0.mlp.experts.gate_up_proj_bias", "layers.2.mlp.experts.down_proj", "layers.2.mlp.experts.down_proj_bias",
              "layers.1.self_attn.q_proj.bias"):
        g, r = ours_p[n].grad, ref["model." + n].grad
        assert (g - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item()), n


def test_greedy_generation_equals_transformers(pair):
    hf, ours = pair("yarn-trunc-mqa")
    prompt = _tokens(1, 9, 6)
    ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)[0, 9:].tolist()
    assert generate(ours, prompt, max_new_tokens=32) == [ref]


@pytest.mark.parametrize("name", ["yarn-notrunc", "yarn-trunc-mqa"])
def test_save_hf_loads_in_transformers(tmp_path, name):
    cfg = config_from_hf({**oss_model(name).config.to_dict(), "model_type": "gpt_oss"})
    torch.manual_seed(1)
    ours = build_model(cfg)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("bias") or n.endswith("sinks"): p.normal_(0, 0.5)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is transformers.GptOssForCausalLM
    assert back.config.layer_types == cfg.layer_types and back.config.rope_parameters["rope_type"] == "yarn"
    tokens = _tokens(2, 21)
    with torch.no_grad():
        assert (ours(tokens) - back(tokens).logits).abs().max().item() <= TOL


def test_round_trip_through_tunebook_is_exact(pair, tmp_path):
    from safetensors import safe_open
    hf, ours = pair("yarn-trunc-mqa")
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(2, 13)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)
    keys = lambda d: set(safe_open(str(d / "model.safetensors"), "pt").keys())
    assert keys(out) == keys(tmp_path / "yarn-trunc-mqa")


def test_mxfp4_dequantize_equals_transformers_routine():
    """Random blocks and every scale byte but NaN's (255): the same numbers as transformers' convert_moe_packed_tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 20, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 20, 4), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 127, 254])
    for dt in (torch.bfloat16, torch.float32):
        ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dt)     # (E, G * 32, rows)
        ours = mxfp4_dequantize(blocks, scales, dt).transpose(1, 2)
        assert ours.dtype == dt and torch.equal(ours.nan_to_num(), ref.nan_to_num())
    assert len(FP4_E2M1) == 16
    with pytest.raises(ValueError, match="uint8"): mxfp4_dequantize(blocks.float(), scales)


def _to_mxfp4_folder(hf, d, seed=0):
    """A folder laid out as openai/gpt-oss-* publishes it: experts as random MXFP4 blocks + scales, quantization_config mxfp4.
    Returns the transformers model holding the weights transformers' own routine dequantises them to."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(seed)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    ref = copy.deepcopy(hf)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, rows_in, cols = sd[k].shape   # stored (E, out, in / 32, 16): out = cols, in = rows_in
        blocks = torch.randint(0, 256, (E, cols, rows_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(119, 124, (E, cols, rows_in // 32), dtype=torch.uint8, generator=g)
        del sd[k]
        sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
        with torch.no_grad(): ref.get_parameter(k).copy_(convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32))
    d.mkdir()
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                    "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg))
    half = len(sd) // 2   # two shards, so blocks and scales may sit in different files
    names = list(sd)
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: sd[k] for k in part}, str(d / f"model-0000{i + 1}-of-00002.safetensors"), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(names)}}))
    return ref


def test_mxfp4_folder_loads_to_transformers_logits(tmp_path):
    hf = oss_model("yarn-notrunc")
    ref = _to_mxfp4_folder(hf, tmp_path / "mx")
    ours = load_hf(tmp_path / "mx")
    tokens = _tokens(2, 17)
    with torch.no_grad():
        assert (ours(tokens) - ref(tokens).logits).abs().max().item() <= TOL
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() > 1e-2   # the experts did change
    assert torch.equal(ours.layers[1].mlp.experts.down_proj, ref.model.layers[1].mlp.experts.down_proj)
    bf = load_hf(tmp_path / "mx", dtype="bf16")
    assert bf.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(bf.layers[0].mlp.experts.gate_up_proj.float(), ref.model.layers[0].mlp.experts.gate_up_proj)   # exact in bf16
    # a scales tensor missing: one clear error
    idx = json.loads((tmp_path / "mx" / "model.safetensors.index.json").read_text())
    idx["weight_map"].pop("model.layers.0.mlp.experts.down_proj_scales")
    from safetensors.torch import load_file
    for f in sorted((tmp_path / "mx").glob("*.safetensors")):
        t = load_file(str(f)); t.pop("model.layers.0.mlp.experts.down_proj_scales", None); save_file(t, str(f), metadata={"format": "pt"})
    (tmp_path / "mx" / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ValueError, match="down_proj_scales"): load_hf(tmp_path / "mx")


def test_other_quantisations_are_refused():
    cfg = {**oss_model().config.to_dict(), "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(ValueError, match="bitsandbytes"): config_from_hf(cfg)


# openai/gpt-oss-20b: 20.9B total, 3.6B active; openai/gpt-oss-120b: 116.8B total, 5.1B active (the model card's, whose active
# count leaves out the embedding table: a lookup, not a product)
@pytest.mark.parametrize("name, total, active", [("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9)])
def test_builder_param_counts_equal_transformers(name, total, active):
    ours = build_model(name, device="meta")
    hf_cfg = config_to_hf(ours.config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            hf_cfg.pop("model_type"), **{k: v for k, v in hf_cfg.items() if k != "architectures"}))
    assert type(hf) is transformers.GptOssForCausalLM
    n_hf = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    E, k = hf.config.num_local_experts, hf.config.num_experts_per_tok
    assert count_params(ours) == n_hf
    assert count_active_params(ours) == n_hf - experts // E * (E - k)
    lookup = ours.embed_tokens.weight.numel()
    assert abs(count_params(ours) - total) <= 0.01 * total and abs(count_active_params(ours) - lookup - active) <= 0.02 * active


def test_published_config_reads_as_the_builder():
    published = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
                 "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
                 "initializer_range": 0.02, "intermediate_size": 2880,
                 "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
                 "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
                 "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
                 "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                    "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
                 "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                 "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
                 "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
    assert config_from_hf(published) == gpt_oss_20b()
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        assert config_from_hf(config_to_hf(get_config(name))) == get_config(name)


def test_yarn_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from tunebook.attention import RotaryEmbedding
    for trunc in (True, False):
        hc = transformers.GptOssConfig(**dict(BASE, rope_parameters=dict(YARN, truncate=trunc)))
        inv, att = ROPE_INIT_FUNCTIONS["yarn"](hc)
        r = RotaryEmbedding(16, 150000.0, {k: v for k, v in YARN.items() if k != "rope_theta"} | {"truncate": trunc})
        assert (r.inv_freq - inv).abs().max().item() <= 1e-7 * inv.abs().max().item() and abs(r.attention_factor - att) <= 1e-12


def test_config_errors():
    with pytest.raises(ValueError, match="attn_sinks"): get_config("gpt-oss-20b", attn_sinks=False)
    with pytest.raises(ValueError, match="norm_topk_prob"): get_config("gpt-oss-20b", norm_topk_prob=True)
    with pytest.raises(ValueError, match="gpt_oss's"): get_config("qwen3-0.6b", swiglu_limit=7.0)


def _small_oss(vocab, **kw):
    return get_config("gpt-oss-20b", **{**dict(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=16,
                                              moe_hidden_dim=16, n_experts=4, experts_per_token=2, sliding_window=8, max_seq_len=256), **kw})


def test_the_training_loop_trains_a_small_gpt_oss_with_the_aux_loss(tmp_path):
    """tunebook's Trainer, full fine-tune: held-out loss falls, the load-balancing loss (coef 0.9, the published one) is logged
    every step, and afterwards no expert takes more than 1.5x its even share (k/E) of the held-out tokens' assignments."""
    from tunebook.data import make_task
    from tunebook.tokenizer import train_tokenizer
    from tunebook.train import TrainConfig, Trainer
    rows = make_task("reverse", 300, seed=0)
    tok = train_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=300)
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"reverse {w}", "response": w[::-1]})
                           for w in ["abc", "hello", "tune", "book", "loop", "step", "model", "data"] * 5))
    torch.manual_seed(0)
    model = build_model(_small_oss(tok.vocab_size))
    cfg = TrainConfig(model="given", data=str(f), eval_fraction=0.2, max_seq_len=40, batch_size=8, max_steps=8, eval_every=8,
                      dtype="fp32", method="full", lr=3e-3, output_dir=str(tmp_path / "run"))
    t = Trainer(cfg, model=model, tokenizer=tok)
    s = t.fit(progress=False)
    assert s["eval_loss_after"] < s["eval_loss_before"] - 0.5, (s["eval_loss_before"], s["eval_loss_after"])
    aux = [r["router_aux_loss"] for r in t.metrics if "router_aux_loss" in r]
    assert len(aux) == 8 and all(0.0 < a < 2.0 for a in aux), aux   # coef 0.9 x a loss of k=2 when balanced
    counts = torch.zeros(4)
    with torch.no_grad():
        for r in t.held_out:
            t.model(torch.tensor([r["tokens"]]))
            for b in moe_blocks(t.model): counts += torch.bincount(b.router_logits.topk(2, -1)[1].reshape(-1), minlength=4)
    share = counts / counts.sum()
    assert share.max().item() <= 1.5 * 2 / 4 / 2, share   # even share of one expert: 1/E = 0.25 of all assignments


def test_lora_on_attention_loads_in_peft_both_ways(tmp_path):
    """apply_lora on q/k/v/o (biased) of gpt-oss: peft 0.18 loads our adapter to logits within 1e-5, and we load peft's."""
    import peft
    from tunebook.lora import apply_lora, load_adapter, save_adapter
    hf = oss_model("yarn-notrunc"); hf.save_pretrained(tmp_path / "base")
    ours = apply_lora(load_hf(tmp_path / "base"), rank=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_adapter(ours, tmp_path / "ad")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ad").eval()
    ids = _tokens(2, 13)
    with torch.no_grad():
        assert (ours(ids) - pm(ids).logits).abs().max().item() <= 1e-5
        assert (ours(ids) - hf(ids).logits).abs().max().item() > 1e-3
    pm2 = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "o_proj"])).eval()
    with torch.no_grad():
        for n, p in pm2.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm2.save_pretrained(tmp_path / "ad2")
    back = load_adapter(load_hf(tmp_path / "base"), tmp_path / "ad2").eval()
    with torch.no_grad(): assert (back(ids) - pm2(ids).logits).abs().max().item() <= 1e-5


EXPERTS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


@pytest.mark.parametrize("targets, tp", [(("q_proj", "experts"), EXPERTS), (("experts.down_proj",), ["mlp.experts.down_proj"]),
                                         (("experts.gate_up_proj",), ["mlp.experts.gate_up_proj"])])
def test_our_expert_adapter_loads_in_peft(tmp_path, targets, tp):
    """Per-expert LoRA on gpt-oss's stacked gate_up_proj / down_proj: peft 0.18 (target_parameters) gives our logits within 1e-5."""
    import peft
    from tunebook.lora import apply_lora, save_adapter
    hf = oss_model("yarn-notrunc"); hf.save_pretrained(tmp_path / "base")
    ours = apply_lora(load_hf(tmp_path / "base"), rank=3, alpha=6, targets=targets).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_adapter(ours, tmp_path / "ad")
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["target_parameters"] == tp
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ad").eval()
    ids = _tokens(2, 13)
    with torch.no_grad():
        assert (ours(ids) - pm(ids).logits).abs().max().item() <= 1e-5
        assert (ours(ids) - hf(ids).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("tp", [EXPERTS, ["mlp.experts.down_proj"], ["experts.gate_up_proj"]])
def test_peft_expert_adapter_loads_in_tunebook_and_merges_exactly(tmp_path, tp):
    import peft
    from safetensors.torch import load_file
    from tunebook.gptoss import GptOssExperts
    from tunebook.lora import load_adapter, merge_lora, save_adapter, disable_adapters
    hf = oss_model("yarn-notrunc"); hf.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj"], target_parameters=tp)).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(tmp_path / "ad")
    ours = load_adapter(load_hf(tmp_path / "base"), tmp_path / "ad").eval()
    ids = _tokens(2, 13)
    with torch.no_grad():
        lo = ours(ids)
        assert (lo - pm(ids).logits).abs().max().item() <= 1e-5
        with disable_adapters(ours): assert (ours(ids) - hf(ids).logits).abs().max().item() <= TOL
    save_adapter(ours, tmp_path / "again", base_model_name_or_path="x")
    a, b = load_file(str(tmp_path / "ad" / "adapter_model.safetensors")), load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    merged = merge_lora(ours)
    assert type(merged.layers[0].mlp.experts) is GptOssExperts
    with torch.no_grad(): assert (merged(ids) - lo).abs().max().item() <= 1e-5


def test_expert_lora_trains_and_qlora_of_gpt_oss_experts_is_refused():
    from tunebook.lora import apply_lora, quantize_base
    m = apply_lora(build_model(_small_oss(256)), rank=2, targets=("q_proj", "experts"))
    ids = _tokens(2, 9)
    (m(ids).logsumexp(-1).mean() + m.router_aux_loss()).backward()
    ex = m.layers[0].mlp.experts
    assert ex.lora_gate_up_proj.lora_B.grad.abs().max() > 0 and ex.gate_up_proj.grad is None
    with pytest.raises(ValueError, match="gpt-oss"): quantize_base(m)
    m = apply_lora(build_model(_small_oss(256)), rank=2, targets="all-linear")   # attention only: router and experts stay frozen
    assert not any(p.requires_grad for b in moe_blocks(m) for p in b.parameters())


@pytest.mark.parametrize("method, experts", [("full", False), ("lora", False), ("lora", True)])
def test_memory_formula_counts_gpt_oss_and_the_estimate_is_measured(method, experts):
    """The rough formula's parameters and optimizer state equal the estimator's to the byte (sinks, router and expert biases,
    expert adapters), its peak is within 25% of the measured one, and the estimate (FakeTensorMode) within 1%; QLoRA is refused."""
    from tunebook.memory import estimate, rough_estimate
    cfg = _small_oss(512, dim=64, n_heads=4, head_dim=16, hidden_dim=32, moe_hidden_dim=32)
    kw = dict(method=method, batch_size=2, seq_len=128, dtype="fp32", lora_rank=4)
    est = estimate(cfg, measure=True, **kw, **({"lora_targets": ("all-linear", "experts")} if experts else {}))
    rough = rough_estimate(cfg, lora_experts=experts, **kw)
    assert rough.categories["parameters"] == est.categories["parameters"]
    assert rough.categories["optimizer"] == est.categories["optimizer"]
    assert abs(est.error) <= 0.01 and 0.75 <= rough.peak_bytes / est.measured_peak_bytes <= 1.25
    with pytest.raises(ValueError, match="gpt-oss"): rough_estimate(cfg, method="qlora")
