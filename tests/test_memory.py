"""The memory lab: checkpointing and offloading leave gradients unchanged, the estimate matches a measured
step for every combination of techniques, the full stack cuts the peak, and the 70B estimate is cheap."""
import itertools
import json
import subprocess
import sys

import pytest
import torch

from tunebook.core import seed_everything
from tunebook.estimate import estimate
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


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_estimate_matches_measured_lora(method):
    r = estimate(TINY, method=method, batch_size=2, seq_len=64, dtype="fp32", chunked_ce=4,
                 activation_checkpointing=True, measure=True)
    assert abs(r.error) <= 0.01, (r.peak_bytes, r.measured_peak_bytes)
    assert r.categories["gradients"] + r.categories["optimizer"] < r.categories["parameters"]


def test_lean_tracker_pinned_to_memtracker():
    out = {}
    for tracker in ("lean", "memtracker"):
        seed_everything(0)
        out[tracker] = profile_step(build_model(TINY), batch_size=2, seq_len=64, chunked_ce=4,
                                    activation_checkpointing=True, tracker=tracker)
    lean, mt = out["lean"], out["memtracker"]
    assert lean.peak_bytes == mt.peak_bytes
    for c in ("parameters", "gradients", "optimizer", "inputs"):
        assert lean.categories[c] == mt.categories[c], c


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
    (dict(chunked_ce=0), "chunked_ce"),
    (dict(activation_checkpointing=0), "activation_checkpointing"),
    (dict(optimizer_in_backward=True, gradient_accumulation_steps=2), "cannot accumulate"),
])
def test_bad_input(kw, msg):
    with pytest.raises((ValueError, FileNotFoundError, TypeError), match=msg):
        estimate(**{"model": TINY, "seq_len": 32, **kw})


def test_measure_refuses_what_does_not_fit():
    with pytest.raises(MemoryError, match="would need"):
        estimate(get_config("llama3.1-70b", n_layers=2), seq_len=128, measure=True)   # ~30 GB: more than this machine


@pytest.mark.slow
def test_70b_estimate_is_fast_and_small():
    code = ("import time, resource; from tunebook.estimate import estimate; t = time.time(); "
            "r = estimate('llama3.1-70b', batch_size=1, seq_len=2048); "
            "print(r.peak_bytes, time.time() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    peak, seconds, rss_kib = out.stdout.split()
    print(f"70B: peak {int(peak) / 2**30:.1f} GiB estimated in {float(seconds):.0f} s, max RSS {int(rss_kib) / 2**20:.2f} GiB")
    assert float(seconds) < 120
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
