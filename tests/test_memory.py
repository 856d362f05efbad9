"""The memory lab: checkpointing and offloading leave gradients unchanged, the estimate matches a measured
step for every combination of techniques, the full stack cuts the peak, and the 70B estimate is cheap."""
import itertools
import json
import subprocess
import sys

import pytest
import torch

from tunebook.core import seed_everything
from tunebook.memory import estimate
from tunebook.lora import FrozenLinear, apply_lora
from tunebook.loss import cross_entropy_loss
from tunebook.memory import (OffloadActivations, apply_activation_checkpointing, profile_step,
                             remove_activation_checkpointing)
from tunebook.model import build_model, get_config, pico

TINY = pico(n_layers=2, dim=64, vocab_size=512)
# the small Llama-shaped model of the savings claim: 4 layers, width 256, GQA 4/2 heads, vocab 8192 (7.3M params)
SMALL = pico(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=768, vocab_size=8192, max_seq_len=2048)


def loss_and_grads(model, tokens, ctx=None):
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else torch.enable_grad():
        logits = model(tokens)
    loss = cross_entropy_loss(logits[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing,offloading", [(True, False), (False, True), (True, True), (2, True)])
def test_checkpointing_and_offloading_keep_loss_and_gradients(checkpointing, offloading):
    seed_everything(0)
    model = build_model(pico(n_layers=3)).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 48))
    ref_loss, ref_grads = loss_and_grads(model, tokens)
    if checkpointing: apply_activation_checkpointing(model, every=int(checkpointing))
    loss, grads = loss_and_grads(model, tokens, OffloadActivations() if offloading else None)
    remove_activation_checkpointing(model)
    assert (loss - ref_loss).abs().item() <= 1e-6
    for n, g in ref_grads.items():
        assert (grads[n] - g).abs().max().item() <= 1e-6, n


COMBOS = list(itertools.product((None, 4), (False, True), (False, True), (False, True)))


@pytest.mark.parametrize("chunked_ce,checkpointing,offloading,in_backward", COMBOS)
def test_estimate_matches_measured(chunked_ce, checkpointing, offloading, in_backward):
    r = estimate(TINY, batch_size=2, seq_len=64, dtype="fp32", chunked_ce=chunked_ce,
                 activation_checkpointing=checkpointing, activation_offloading=offloading,
                 optimizer_in_backward=in_backward, measure=True)
    assert abs(r.error) <= 0.01, (r.peak_bytes, r.measured_peak_bytes)
    assert sum(r.categories.values()) == r.peak_bytes


@pytest.mark.parametrize("method", ["lora", "dora", "qlora"])
def test_estimate_matches_measured_lora(method):
    r = estimate(TINY, method=method, batch_size=2, seq_len=64, dtype="fp32", chunked_ce=4,
                 activation_checkpointing=True, measure=True)
    assert abs(r.error) <= 0.01, (r.peak_bytes, r.measured_peak_bytes)
    assert r.categories["gradients"] + r.categories["optimizer"] < r.categories["parameters"]


TRACKER_COMBOS = list(itertools.product((False, True), repeat=5))


@pytest.mark.parametrize("checkpointing,offloading,in_backward,lora,chunked", TRACKER_COMBOS)
def test_lean_tracker_pinned_to_memtracker(checkpointing, offloading, in_backward, lora, chunked):
    """Every technique combination that runs on CPU: the same step, PyTorch's MemTracker against the lean tracker.
    On CPU MemTracker cannot tell the offloader's host copies from device tensors, so with offloading its peak is
    the lean tracker's joint device + host peak; without, the device peak and every category agree to the byte."""
    out = {}
    for tracker in ("lean", "memtracker"):
        seed_everything(0)
        model = build_model(TINY)
        if lora: apply_lora(model, rank=4, targets="all-linear")
        out[tracker] = profile_step(model, batch_size=2, seq_len=64, tracker=tracker, chunked_ce=4 if chunked else None,
                                    activation_checkpointing=checkpointing, activation_offloading=offloading,
                                    optimizer_in_backward=in_backward)
    lean, mt = out["lean"], out["memtracker"]
    if offloading:
        assert lean.peak_with_host_bytes == mt.peak_bytes and lean.offloaded_bytes >= 0
        assert lean.peak_with_host_bytes >= lean.peak_bytes
    else:
        assert lean.peak_bytes == mt.peak_bytes
        for c in ("parameters", "buffers", "gradients", "optimizer", "inputs"):
            assert lean.categories[c] == mt.categories[c], c
        both = lambda r: r.categories["activations"] + r.categories["temporaries"]   # MemTracker splits these differently
        assert both(lean) == both(mt)


def test_full_stack_cuts_peak_by_60_percent():
    seed_everything(0)
    model = build_model(SMALL)   # fp32, full fine-tune, batch 2 x 1024
    plain = profile_step(model, batch_size=2, seq_len=1024)
    stack = profile_step(model, batch_size=2, seq_len=1024, chunked_ce=8, activation_checkpointing=True,
                         optimizer_in_backward=True)
    saved = 1 - stack.peak_bytes / plain.peak_bytes
    print(f"plain {plain.peak_bytes / 2**20:.1f} MiB, stack {stack.peak_bytes / 2**20:.1f} MiB, saved {saved:.1%}")
    assert saved >= 0.60


def test_report_json_and_table():
    r = estimate(TINY, seq_len=32, chunked_ce=2)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["peak_bytes"] == r.peak_bytes and d["settings"]["chunked_ce"] == 2 and "FakeTensorMode" in d["how"]
    assert r.table().loc["peak", "bytes"] == r.peak_bytes


def test_local_folder(tmp_path):
    from tunebook.checkpoint import save_hf
    save_hf(build_model(TINY), tmp_path / "m")
    a, b = estimate(tmp_path / "m", seq_len=32, dtype="fp32"), estimate(TINY, seq_len=32, dtype="fp32")
    assert a.peak_bytes == b.peak_bytes


@pytest.mark.parametrize("kw,msg", [
    (dict(model="llama9-1t"), "known names"),
    (dict(model="/no/such/folder"), "not a folder with a config.json"),
    (dict(method="prefix"), "method must be one of"),
    (dict(dtype="fp8"), "dtype must be one of"),
    (dict(batch_size=0), "batch_size must be"),
    (dict(seq_len=10**6), "max_seq_len"),
    (dict(chunked_ce=-1), "chunked_ce must be >= 0"),
    (dict(activation_checkpointing=0), "activation_checkpointing"),
    (dict(optimizer_in_backward=True, gradient_accumulation_steps=2), "cannot accumulate"),
    (dict(nproc=0), "nproc"),
    (dict(nproc=2, measure=True), "measure=True runs one process"),
])
def test_bad_input(kw, msg):
    with pytest.raises((ValueError, FileNotFoundError, TypeError), match=msg):
        estimate(**{"model": TINY, "seq_len": 32, **kw})


def test_measure_refuses_what_does_not_fit():
    with pytest.raises(MemoryError, match="would need"):
        estimate(get_config("llama3.1-70b", n_layers=2), seq_len=128, measure=True)   # ~30 GB: more than this machine


@pytest.mark.slow
def test_70b_estimate_is_small():
    code = ("import time, resource; from tunebook.memory import estimate; t = time.time(); "
            "r = estimate('llama3.1-70b', batch_size=1, seq_len=2048); "
            "print(r.peak_bytes, time.time() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    peak, seconds, rss_kib = out.stdout.split()
    print(f"70B: peak {int(peak) / 2**30:.1f} GiB estimated in {float(seconds):.0f} s, max RSS {int(rss_kib) / 2**20:.2f} GiB")
    assert int(rss_kib) * 1024 < 4 * 2**30
    assert int(peak) > 70e9 * 2 * 4   # bf16 weights + grads + two AdamW states


def test_optimizer_steps_in_other_threads_are_ignored():
    """Optimizer step hooks are global; a tracker (a thread-local dispatch mode) must ignore other threads'
    steps, e.g. a widget's estimate running beside a training run."""
    import threading
    from tunebook.memory import MemoryTracker
    mine, theirs = torch.nn.Linear(8, 8), torch.nn.Linear(64, 64)
    opt, other = torch.optim.AdamW(mine.parameters()), torch.optim.AdamW(theirs.parameters())
    theirs(torch.randn(2, 64)).sum().backward()
    with MemoryTracker().watch(mine, opt) as tr:
        tr.phase = "forward"
        before = dict(tr.current)
        t = threading.Thread(target=other.step); t.start(); t.join()
        assert tr.phase == "forward"
        assert tr.current["optimizer"] == before["optimizer"]  # their AdamW state is not counted here


def test_chunked_ce_zero_is_off_as_in_training():
    # long enough that the logits (not the optimizer step) set the peak, so chunking shows in it
    a, b = estimate(TINY, seq_len=256, chunked_ce=0), estimate(TINY, seq_len=256, chunked_ce=None)
    assert a.peak_bytes == b.peak_bytes and a.categories == b.categories
    assert estimate(TINY, seq_len=256, chunked_ce=4).peak_bytes < a.peak_bytes


def test_estimate_lora_defaults_are_the_trainers():
    from tunebook.lora import lora_modules
    from tunebook.train import TrainConfig
    r = estimate(TINY, method="lora", seq_len=32)
    cfg = TrainConfig()
    trainer_targets = sorted({n.rsplit(".", 1)[-1] for n in lora_modules(apply_lora(build_model(TINY), targets=cfg.lora_targets))})
    assert (r.settings["lora_rank"], r.settings["lora_alpha"], r.settings["lora_targets"]) == \
        (cfg.lora_rank, cfg.lora_alpha, trainer_targets)


def test_estimate_default_targets_fit_phi3():
    "The default targets ('all-linear') adapt Phi-3's fused layers, as peft names them."
    from tunebook.core import count_params
    r = estimate(TINY.replace(arch="phi3"), method="lora", seq_len=32)
    assert r.settings["lora_targets"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    model = apply_lora(build_model(TINY.replace(arch="phi3")), rank=16, alpha=32.0, targets="all-linear")
    assert r.settings["trainable_params"] == count_params(model, trainable_only=True)


# the formulas, each pinned to the tracker on the same model

def test_fsdp_formula_one_rank_is_the_tracker():
    from tunebook.memory import fsdp_memory
    seed_everything(0)
    model = build_model(TINY)
    r, f = profile_step(model, batch_size=2, seq_len=32), fsdp_memory(model, 1)
    assert f["parameters"] == r.categories["parameters"]
    assert f["optimizer"] + 4 * len(list(model.parameters())) == r.categories["optimizer"]   # + AdamW step counters
    assert f["all_gather"] == f["reduce_scatter"] == 0


@pytest.mark.parametrize("nproc", [2, 4])
def test_estimate_per_rank_is_the_fsdp_formula(nproc):
    from tunebook.memory import fsdp_memory
    r, one = estimate(TINY, seq_len=32, dtype="fp32", nproc=nproc), estimate(TINY, seq_len=32, dtype="fp32")
    f = fsdp_memory(TINY, nproc, categories=one.categories)
    assert r.categories == f and r.peak_bytes == sum(f.values()) and r.settings["nproc"] == nproc
    assert r.categories["parameters"] < one.categories["parameters"] and "FSDP" in r.how
    assert estimate(TINY, seq_len=32, dtype="fp32", nproc=1).categories == one.categories


@pytest.mark.parametrize("quantize", [False, True])
def test_lora_bytes_is_the_tracker(quantize):
    from tunebook.memory import lora_bytes
    seed_everything(0)
    model = apply_lora(build_model(TINY), rank=4, targets="all-linear", quantize_base=quantize)
    b, r = lora_bytes(model), profile_step(model, batch_size=2, seq_len=32)
    rope = sum(x.nbytes for m in model.modules() if not isinstance(m, FrozenLinear) for x in m.buffers(recurse=False))
    assert b["frozen"] + b["trainable"] == r.categories["parameters"] + r.categories["buffers"] - rope
    n_train = len([p for p in model.parameters() if p.requires_grad])
    assert b["optimizer"] + 4 * n_train == r.categories["optimizer"]


@pytest.mark.parametrize("in_backward", [False, True])
def test_state_bytes_is_the_tracker(in_backward):
    from tunebook.memory import MemoryTracker, state_bytes
    from tunebook.optim import optimizer_in_backward
    seed_everything(0)
    model = build_model(TINY)
    opt = (optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3) if in_backward
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    opts = list(opt.optimizers.values()) if in_backward else [opt]
    with MemoryTracker().watch(model, *opts) as tr:
        tr.phase = "forward"
        loss = model(torch.randint(0, 512, (2, 32))).logsumexp(-1).mean()
        tr.phase = "backward"
        loss.backward()
        grads = tr.current["gradients"]
        if not in_backward: opt.step()
    s = state_bytes(model, opt, in_backward)
    assert s["optimizer"] == tr.current["optimizer"] > 0
    assert s["parameters"] == tr.current["parameters"] + tr.current["buffers"]
    if in_backward: assert grads == 0 and s["gradients"] == max(p.numel() * 4 for p in model.parameters())
    else: assert s["gradients"] == grads
    if in_backward: opt.remove()


@pytest.mark.parametrize("method", ["full", "lora", "dora"])
def test_rough_formula_against_the_estimator(method):
    from tunebook.memory import rough_estimate
    cfg = get_config("smollm2-135m")
    kw = dict(method=method, batch_size=2, seq_len=256, dtype="fp32", lora_rank=16)
    rough, est = rough_estimate(cfg, **kw), estimate(cfg, **kw)
    assert rough.categories["parameters"] == est.categories["parameters"]
    assert rough.categories["optimizer"] == est.categories["optimizer"]
    # rough / fake-tensor peak, measured (smollm2-135m, batch 2 x 256, fp32, rank 16): full 1.1414, lora 0.9456,
    # dora 0.6663 (the formula leaves out DoRA's saved weight norms and counts activations per block, not per op).
    # Both sides are deterministic arithmetic, so the ratio is pinned to +-0.01: a change to either is seen here.
    ratio = rough.peak_bytes / est.peak_bytes
    assert abs(ratio - {"full": 1.1414, "lora": 0.9456, "dora": 0.6663}[method]) < 0.01, ratio


def test_rough_parameter_count_is_the_model_for_every_builder():
    "The rough formula's parameter count equals the model's on meta for every builder: q/k norms, Gemma's norms, biases."
    from torch import nn
    from tunebook.core import count_params
    from tunebook.memory.formulas import _n_params
    from tunebook.model import BUILDERS
    for name in BUILDERS:
        m = build_model(name, device="meta", init=False)
        tensors = list({id(p): p for p in m.parameters()}.values())
        block_w = sum(mod.weight.numel() for layer in m.layers for mod in layer.modules() if isinstance(mod, nn.Linear))
        assert _n_params(get_config(name)) == (block_w, count_params(m), len(tensors)), name


FAMILIES = {  # small shapes of each family's parts
    "qwen2": pico(arch="qwen2", qkv_bias=True, n_layers=2),
    "qwen3": pico(arch="qwen3", qk_norm=True, head_dim=32, n_layers=2),
    "gemma3": pico(arch="gemma3_text", qk_norm=True, hidden_act="gelu_pytorch_tanh", tie_embeddings=True, n_layers=2),
    "phi3": pico(arch="phi3", n_layers=2),
    "qwen3_moe": pico(arch="qwen3_moe", qk_norm=True, head_dim=32, n_layers=3, n_experts=4, experts_per_token=2, moe_hidden_dim=32,
                      mlp_only_layers=[1]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["full", "lora", "dora"])
def test_rough_formula_against_the_estimator_per_family(family, method):
    "Parameters and optimizer state to the byte on every family, LoRA/DoRA on all linears (the estimator's default)."
    from tunebook.memory import rough_estimate
    cfg = FAMILIES[family]
    kw = dict(method=method, batch_size=2, seq_len=64, dtype="fp32", lora_rank=8)
    rough, est = rough_estimate(cfg, **kw), estimate(cfg, **kw)
    assert rough.categories["parameters"] == est.categories["parameters"]
    assert rough.categories["optimizer"] == est.categories["optimizer"]
