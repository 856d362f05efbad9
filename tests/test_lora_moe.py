"""LoRA on MoE experts (tunebook.lora.experts): per-expert adapters inside the grouped product, apply_lora's expert targets,
exact merging, peft 0.18's target_parameters format both ways against `PeftModel` (transformers 5's Qwen3-MoE), QLoRA of
the stacked experts, and the memory estimator/formula with expert adapters."""
import copy
import json

import peft
import pytest
import torch
from torch import nn

from test_moe import moe_model
from tunebook.checkpoint import load_hf
from tunebook.lora import (LoRAExperts, apply_lora, expert_lora_modules, load_adapter, lora_modules, lora_state_dict, merge_lora,
                           save_adapter, disable_adapters)
from tunebook.model import build_model, pico, qwen3_30b_a3b
from tunebook.moe import Experts

TOL = 1e-5   # fp32 logits against peft
ALL = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def _randomise_B(model, std=0.1, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * std)


def _tokens(B=2, T=11, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _small(**kw):
    return pico(arch="qwen3_moe", qk_norm=True, head_dim=32, n_layers=2, n_experts=4, experts_per_token=2, moe_hidden_dim=16, **kw)


def test_grouped_product_equals_a_loop_over_tokens_and_experts():
    "Each (token, expert) pair gets x W_e^T + s (x A_e^T) B_e^T, gate and up sharing A_e; A and B get gradients."
    torch.manual_seed(0)
    ex = Experts(6, 24, 10); ex.normal_init(0.1)
    lx = LoRAExperts(ex, rank=3, alpha=6)
    _randomise_B(lx)
    x, idx, w = torch.randn(17, 24), torch.randint(0, 6, (17, 2)), torch.rand(17, 2)
    out = lx(x, idx, w)
    ref = torch.zeros_like(x)
    gu, dn = lx.lora_gate_up_proj, lx.lora_down_proj
    for t in range(17):
        for j in range(2):
            e = idx[t, j].item()
            Wgu = torch.cat([ex.gate_proj[e], ex.up_proj[e]]) + 2.0 * gu.lora_B[e] @ gu.lora_A[e]
            g, u = (Wgu @ x[t]).chunk(2)
            ref[t] += w[t, j] * ((ex.down_proj[e] + 2.0 * dn.lora_B[e] @ dn.lora_A[e]) @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (gu.lora_A, gu.lora_B, dn.lora_A, dn.lora_B))
    assert ex.gate_proj.grad is None


def test_apply_lora_expert_targets_as_peft_names_them():
    cfg = _small(mlp_only_layers=[1])
    m = apply_lora(build_model(cfg), rank=4, targets=("experts",))
    assert list(expert_lora_modules(m)) == ["layers.0.mlp.experts"] and not lora_modules(m)
    assert list(m.layers[0].mlp.experts.adapters) == ["gate_up_proj", "down_proj"]
    train = {n for n, p in m.named_parameters() if p.requires_grad}
    assert train == {f"layers.0.mlp.experts.lora_{t}.lora_{ab}" for t in ("gate_up_proj", "down_proj") for ab in "AB"}
    assert set(lora_state_dict(m)) == train
    m = apply_lora(build_model(cfg), rank=4, targets=("q_proj", "mlp.experts.down_proj"))
    assert list(m.layers[0].mlp.experts.adapters) == ["down_proj"] and "layers.0.self_attn.q_proj" in lora_modules(m)
    # names of linears reach linears only (the dense layer 1), "all-linear" leaves the experts alone: as peft's target_modules
    for t in ("down_proj", "all-linear"):
        assert not expert_lora_modules(apply_lora(build_model(cfg), targets=t))
    m = apply_lora(build_model(cfg), targets=("all-linear", "experts"))
    assert expert_lora_modules(m) and "layers.1.mlp.down_proj" in lora_modules(m)
    with pytest.raises(ValueError, match="DoRA on stacked MoE experts"): apply_lora(build_model(cfg), targets="experts", dora=True)
    with pytest.raises(ValueError, match="dropout"): apply_lora(build_model(cfg), targets="experts", dropout=0.1)
    with pytest.raises(ValueError, match="no MoE layers"): apply_lora(build_model(pico()), targets="experts")
    with pytest.raises(ValueError, match="'experts' for the stacked MoE experts"): apply_lora(build_model(cfg), targets="gate_up_proj")
    with pytest.raises(ValueError, match="already has LoRA"): apply_lora(m, targets="experts")


def test_fresh_adapters_change_nothing_disable_and_merge_exactly():
    torch.manual_seed(0)
    base = build_model(_small()); ids = _tokens()
    ref = base(ids)
    m = apply_lora(copy.deepcopy(base), rank=4, alpha=8, targets=("q_proj", "experts"))
    torch.testing.assert_close(m(ids), ref, atol=0, rtol=0)
    _randomise_B(m)
    out = m(ids)
    assert (out - ref).abs().max() > 1e-2
    with disable_adapters(m): torch.testing.assert_close(m(ids), ref, atol=0, rtol=0)
    merged = merge_lora(copy.deepcopy(m))
    assert type(merged.layers[0].mlp.experts) is Experts and not expert_lora_modules(merged)
    torch.testing.assert_close(merged(ids), out, atol=1e-5, rtol=0)
    # in place and reversibly (GRPO's weight sync): merged output, base inside disable_adapters, exact unmerge, remerge
    from tunebook.lora import remerge_lora, unmerge_lora
    lx = m.layers[0].mlp.experts
    orig = {n: getattr(lx, n) for n in ("gate_proj", "up_proj", "down_proj")}
    merge_lora(m, replace=False)
    assert lx.merged and lx.gate_proj is not orig["gate_proj"]
    torch.testing.assert_close(m(ids), out, atol=1e-5, rtol=0)
    with disable_adapters(m): torch.testing.assert_close(m(ids), ref, atol=0, rtol=0)
    _randomise_B(m, seed=2)
    remerge_lora(m)
    fresh = copy.deepcopy(m); unmerge_lora(fresh)
    torch.testing.assert_close(m(ids), fresh(ids), atol=1e-5, rtol=0)
    unmerge_lora(m)
    assert not lx.merged and all(getattr(lx, n) is p for n, p in orig.items())
    q = apply_lora(copy.deepcopy(base), targets="experts", quantize_base=True)
    with pytest.raises(ValueError, match="NF4 experts cannot be merged in place"): merge_lora(q, replace=False)


TARGETS = {"experts": (["experts"], [], ALL),
           "down-only+q": (["q_proj", "experts.down_proj"], ["q_proj"], ["mlp.experts.down_proj"]),
           "gate_up-only": (["experts.gate_up_proj"], [], ["mlp.experts.gate_up_proj"])}


@pytest.mark.parametrize("name", TARGETS)
def test_our_expert_adapter_loads_in_peft(tmp_path, name):
    ours_t, tm, tp = TARGETS[name]
    hf = moe_model(); hf.save_pretrained(tmp_path / "base")
    ours = apply_lora(load_hf(tmp_path / "base"), rank=4, alpha=8, targets=ours_t).eval()
    _randomise_B(ours)
    save_adapter(ours, tmp_path / "ad")
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert (cfg["target_modules"], cfg["target_parameters"]) == (tm, tp)
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    ids = _tokens()
    with torch.no_grad():
        diff = (ours(ids) - pm(ids).logits).abs().max().item()
        with pm.disable_adapter(): moved = (ours(ids) - pm(ids).logits).abs().max().item()
    assert diff <= TOL and moved > 1e-3, (diff, moved)


@pytest.mark.parametrize("tp", [ALL, ["mlp.experts.down_proj"], ["experts.gate_up_proj"]])
def test_peft_expert_adapter_loads_in_tunebook(tmp_path, tp):
    hf = moe_model(); hf.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj"],
                                                                 target_parameters=tp)).eval()
    _randomise_B(pm)
    pm.save_pretrained(tmp_path / "ad")
    ours = load_adapter(load_hf(tmp_path / "base"), tmp_path / "ad").eval()
    assert expert_lora_modules(ours) and ours.layers[0].mlp.experts.rank == 3
    ids = _tokens()
    with torch.no_grad(): diff = (ours(ids) - pm(ids).logits).abs().max().item()
    assert diff <= TOL, diff
    # and back: ours saved again is what peft wrote
    from safetensors.torch import load_file
    save_adapter(ours, tmp_path / "again", base_model_name_or_path="x")
    a, b = load_file(str(tmp_path / "ad" / "adapter_model.safetensors")), load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_adapter_refuses_expert_adapters_of_another_shape(tmp_path):
    hf = moe_model(); hf.save_pretrained(tmp_path / "base")
    ours = apply_lora(load_hf(tmp_path / "base"), rank=2, targets="experts")
    save_adapter(ours, tmp_path / "ad")
    with pytest.raises(ValueError, match="another shape"):
        load_adapter(build_model(pico(arch="qwen3_moe", qk_norm=True, head_dim=16, n_heads=4, n_kv_heads=2, dim=64, n_layers=3,
                                      n_experts=8, experts_per_token=2, moe_hidden_dim=24, mlp_only_layers=[1], vocab_size=256)),
                     tmp_path / "ad")


def test_qlora_experts_are_nf4_close_to_the_dequantized_reference_and_train():
    torch.manual_seed(0)
    base = build_model(_small()); ids = _tokens()
    q = apply_lora(copy.deepcopy(base), rank=4, alpha=8, targets=("q_proj", "experts"), quantize_base=True)
    lx = q.layers[0].mlp.experts
    assert lx.quantized and "gate_proj" not in dict(lx.named_parameters()) and lx.gate_proj_nf4.dtype == torch.uint8
    # 4 bits a weight plus scales (each expert pads its int8 scales to a block of 256: 0.19 at this tiny size, ~0.13 at real ones)
    assert lx.base_nbytes < 0.2 * sum(getattr(base.layers[0].mlp.experts, n).nbytes for n in ("gate_proj", "up_proj", "down_proj"))
    _randomise_B(q)
    # reference: the same adapters on the NF4-dequantized weights, fp32; the NF4 path dequantizes per expert: equal to 1e-5
    from tunebook.lora import FrozenLinear
    ref = copy.deepcopy(base)
    for n, mod in q.named_modules():
        if isinstance(mod, LoRAExperts):
            for k, v in mod.base_weights().items(): getattr(ref.get_submodule(n), k).data.copy_(v)
        elif isinstance(mod, FrozenLinear) and mod.quantized: ref.get_submodule(n).weight.data.copy_(mod.base_weight())
    ref = apply_lora(ref, rank=4, alpha=8, targets=("q_proj", "experts"))
    ref.load_state_dict(lora_state_dict(q), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(q(ids), ref(ids), atol=1e-5, rtol=0)
        # against the unquantized fp32 model with the same adapters: NF4's error only, relative (Frobenius) under 0.3
        full = apply_lora(copy.deepcopy(base), rank=4, alpha=8, targets=("q_proj", "experts"))
        full.load_state_dict(lora_state_dict(q), strict=False)
        rel = ((q(ids) - full(ids)).norm() / full(ids).norm()).item()
        assert rel < 0.3, rel
    # gradients through the NF4 experts (dequantized again in backward) are the reference's: to the attention adapters too
    for model in (q, ref):
        nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    gq, gr = ({n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (q, ref))
    assert gq.keys() == gr.keys() and all(torch.allclose(gq[n], gr[n], atol=1e-5) for n in gq)
    q.zero_grad(set_to_none=True)
    # lora_bytes counts the NF4 experts' codes and scales as frozen bytes
    from tunebook.memory import lora_bytes
    nf4 = sum(b.nbytes for n, b in q.named_buffers() if "_nf4" in n or "_absmax" in n)
    assert lora_bytes(q)["frozen"] == nf4 + sum(p.nbytes for p in {id(p): p for p in q.parameters()}.values() if not p.requires_grad)
    # a step trains the adapters only; the NF4 buffers do not move
    before = {k: v.clone() for k, v in q.state_dict().items() if "_nf4" in k}
    opt = torch.optim.AdamW([p for p in q.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(q(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert lx.lora_gate_up_proj.lora_A.grad is not None and all(torch.equal(v, q.state_dict()[k]) for k, v in before.items())
    # merging a quantized base gives plain Experts in the original dtype
    assert merge_lora(q).layers[0].mlp.experts.gate_proj.dtype == torch.float32


def test_qlora_bf16_experts_close_to_the_dequantized_reference():
    "bf16: the NF4 experts' output against plain bf16 experts holding the dequantized weights (tolerance 2e-2 abs, outputs ~0.3)."
    torch.manual_seed(0)
    ex = Experts(8, 64, 32); ex.normal_init(0.05); ex = ex.to(torch.bfloat16)
    lx = LoRAExperts(ex, rank=4, alpha=8); _randomise_B(lx, std=0.05); lx.quantize_()
    ref = Experts(8, 64, 32).to(torch.bfloat16)
    for n, v in lx.merged_weights().items(): getattr(ref, n).data.copy_(v)
    x, idx, w = torch.randn(40, 64, dtype=torch.bfloat16), torch.randint(0, 8, (40, 2)), torch.rand(40, 2, dtype=torch.bfloat16)
    with torch.no_grad(): out, r = lx(x, idx, w).float(), ref(x, idx, w).float()
    assert (out - r).abs().max() < 2e-2 and r.abs().max() > 0.1


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_memory_estimate_of_an_moe_expert_lora_step_equals_the_measured_one(method):
    from tunebook.memory import estimate, rough_estimate
    cfg = qwen3_30b_a3b(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, moe_hidden_dim=32,
                        n_experts=8, experts_per_token=2)
    kw = dict(method=method, batch_size=2, seq_len=64, dtype="fp32", lora_rank=8)
    r = estimate(cfg, measure=True, lora_targets=("all-linear", "experts"), **kw)
    assert abs(r.error) <= 0.01, (r.peak_bytes, r.measured_peak_bytes)
    assert "experts.gate_up_proj" in r.settings["lora_targets"]
    attn_only = estimate(cfg, **kw)
    adapters = 2 * 8 * 8 * (2 * 64 + 3 * 32) * 4   # layers x experts x r x (2 dim + 3 moe_hidden) x fp32 bytes
    assert r.categories["optimizer"] - attn_only.categories["optimizer"] == 2 * adapters + 4 * 4 * 2
    if method == "lora":   # the rough formula counts them to the byte
        rough = rough_estimate(cfg, lora_experts=True, **kw)
        assert rough.categories["parameters"] == r.categories["parameters"]
        assert rough.categories["optimizer"] == r.categories["optimizer"]


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_training_loop_trains_expert_adapters(tmp_path, method):
    "TrainConfig(lora_targets=(..., 'experts')): the trainer's steps move the expert adapters, and the run saves them for peft."
    from conftest import hf_model
    from test_moe import CONFIGS
    from tunebook.checkpoint import load_embedded
    from tunebook.train import TrainConfig, Trainer
    _, tok = load_embedded()
    hf = hf_model("qwen3_moe", seed=0, **{**CONFIGS["raw-topk"], "vocab_size": len(tok)})
    hf.save_pretrained(tmp_path / "m"); tok.save(tmp_path / "m")
    tr = Trainer(TrainConfig(model=str(tmp_path / "m"), method=method, dtype="fp32", batch_size=4, max_steps=2, n_train=16, lr=1e-2,
                             eval_samples=0, lora_rank=4, lora_targets="q_proj,experts", output_dir=str(tmp_path / "run"))).setup()
    lx = tr.model.layers[0].mlp.experts
    assert isinstance(lx, LoRAExperts) and lx.quantized == (method == "qlora")
    for _ in range(2): row = tr.train_step()
    assert torch.isfinite(torch.tensor(row["loss"])) and lx.lora_down_proj.lora_B.abs().max() > 0
    save_adapter(tr.model, tmp_path / "ad", base_model_name_or_path=str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ALL and cfg["target_modules"] == ["q_proj"]
