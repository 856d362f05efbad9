"""Precision policies: each mode's loss and gradients against an fp32 full-logits reference, auto detection on this
machine (read from /proc/cpuinfo here, independently), refusals, and the loss-scaling recipe the trainer uses.
(What each mode keeps in which dtype through real trainer steps, and exact resume in each: tests/test_modes.py.)"""
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tunebook.lora import apply_lora
from tunebook.loss import ChunkedCrossEntropy, cross_entropy_loss
from tunebook.model import build_model, pico
from tunebook.precision import PRECISIONS, TOLERANCE, Precision, fast_bf16, resolve_precision, resume_problem, store_frozen_

MODES = ("fp32", "bf16", "bf16-mixed")


def model_and_batch(lora, tied=False, seed=0):
    torch.manual_seed(seed)
    m = build_model(pico(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=256, vocab_size=700, tie_embeddings=tied))
    if lora:
        apply_lora(m, rank=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        with torch.no_grad():  # B != 0, so that A's gradients are not all zero
            for n, p in m.named_parameters():
                if "lora_B" in n: p.normal_(0, 0.02)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 700, (3, 40), generator=g)
    labels = torch.randint(0, 700, (3, 40), generator=g)
    labels[0, :10] = -100
    return m, tokens, labels


def reference(m, tokens, labels):
    "fp32, full logits, F.cross_entropy: an independent path."
    m = copy.deepcopy(m).float()
    logits = m(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


def in_mode(m, tokens, labels, mode, chunked=True):
    p = resolve_precision(mode, "cpu")
    m = copy.deepcopy(m).to(p.param_dtype)
    with p.autocast():
        if chunked:
            h = m(tokens, return_hidden=True)
            w = m.output_weight if p.mixed else m.output_weight.to(h.dtype)
            loss = ChunkedCrossEntropy(4)(h, w, labels)
        else:
            loss = cross_entropy_loss(m(tokens), labels)
    loss.backward()
    return loss.detach(), {n: q.grad.float() for n, q in m.named_parameters() if q.requires_grad}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_loss_and_grads_match_fp32_reference(mode, lora, chunked):
    m, tokens, labels = model_and_batch(lora)
    ref_loss, ref_g = reference(m, tokens, labels)
    loss, g = in_mode(m, tokens, labels, mode, chunked)
    assert loss.dtype == torch.float32  # the loss is fp32 in every mode
    loss_tol, grad_tol = TOLERANCE[mode]
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() <= loss_tol
    flat_ref = torch.cat([v.flatten() for v in ref_g.values()])
    flat = torch.cat([g[n].flatten() for n in ref_g])
    assert set(g) == set(ref_g)
    assert rel(flat, flat_ref) <= grad_tol, rel(flat, flat_ref)
    if mode != "fp32":  # bf16 compute really happened: not bitwise the fp32 result
        assert rel(flat, flat_ref) > 1e-6


def test_auto_on_this_machine():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = {w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    have = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    p = resolve_precision("auto", "cpu")
    assert p.asked == "auto"
    if have:
        assert p.name == "bf16-mixed" and p.param_dtype == torch.float32 and p.compute_dtype == torch.bfloat16
        assert all(f in p.report() for f in have), p.report()
    else:
        assert p.name == "fp32", p.report()
    assert p.report().startswith(f"precision {p.name} (asked auto) on cpu: ")
    assert resolve_precision(None).name == p.name  # no dtype given: auto


def test_auto_without_bf16_flags_is_fp32(monkeypatch):
    import tunebook.precision as tp
    monkeypatch.setattr(tp, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"sse4_2", "avx2", "fma"}))
    p = resolve_precision("auto", "cpu")
    assert p.name == "fp32" and "amx_bf16" in p.reason and "fp32 is faster" in p.report()
    assert fast_bf16("cpu", flags=frozenset({"avx512_bf16"}))[0]


def test_refusals():
    with pytest.raises(ValueError, match="needs CUDA"): resolve_precision("fp16-mixed", "cpu")
    with pytest.raises(ValueError, match="fp16-mixed"): resolve_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"): resolve_precision("int8")
    with pytest.raises(ValueError, match="resolved mode"): Precision("auto")
    with pytest.raises(ValueError, match="not a training precision"): resolve_precision(torch.float16)
    assert set(PRECISIONS) == {"fp32", "bf16", "bf16-mixed", "fp16-mixed", "auto"}
    for m in MODES: assert resolve_precision(m).make_scaler() is None


def test_resume_compares_the_mode_that_trained_not_the_words():
    "auto that chose bf16-mixed elsewhere must not resume as fp32 here; the same mode asked by name does."
    gpu = Precision("bf16-mixed", "cuda", "bf16 tensor cores", asked="auto").record()
    assert gpu == dict(name="bf16-mixed", asked="auto", device_type="cuda", reason="bf16 tensor cores")
    here = Precision("fp32", "cpu", "no fast bf16", asked="auto")
    msg = resume_problem(gpu, here)
    assert "trained in bf16-mixed (dtype='auto' chose it on cuda)" in msg and "continue in fp32 (dtype='auto'" in msg
    assert "--dtype bf16-mixed" in msg and "--output-dir" in msg
    assert resume_problem(gpu, resolve_precision("bf16-mixed")) is None
    assert resume_problem(None, here) is None and resume_problem(here.record(), resolve_precision("fp32")) is None
    assert resume_problem(resolve_precision("bf16").record(), resolve_precision("bf16-mixed")) is not None


def _train_scaled(scaler, steps=4, poison=None):
    "The trainer's recipe: scale(loss).backward(), unscale_, clip, scaler.step, update (or the plain one)."
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for i in range(steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(i))
        loss = net(x).pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if i == poison: net[0].weight.grad[0, 0] = float("inf")
        if scaler: scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        if scaler: scaler.step(opt); scaler.update()
        else: opt.step()
        opt.zero_grad(set_to_none=True)
    return net, opt


def test_loss_scaling_recipe_is_exact_and_skips_overflow():
    # fp16-mixed runs on CUDA only; the scaler's arithmetic is the same on the CPU, so the recipe is checked here
    plain, _ = _train_scaled(None)
    scaled, _ = _train_scaled(torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))
    for a, b in zip(plain.parameters(), scaled.parameters()): assert torch.equal(a, b)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    skipped, opt = _train_scaled(sc, steps=1, poison=0)  # the only step overflowed: skipped, scale halved
    torch.manual_seed(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for a, b in zip(fresh.parameters(), skipped.parameters()): assert torch.equal(a, b)
    assert sc.get_scale() == 2.0 ** 11 and not opt.state


def test_store_frozen_is_exactly_autocast():
    "Frozen linear weights stored in bf16 give bitwise the results autocast gives with fp32 copies; tied embeddings stay fp32."
    for tied in (False, True):
        m, tokens, labels = model_and_batch(lora=True, tied=tied)
        p = resolve_precision("bf16-mixed")
        a = in_mode(m, tokens, labels, "bf16-mixed")
        m2 = copy.deepcopy(m)
        n = store_frozen_(m2, p)
        assert n == 2 * 7 + (0 if tied else 1)  # every frozen projection, plus an untied lm_head
        assert m2.embed_tokens.weight.dtype == torch.float32 and m2.norm.weight.dtype == torch.float32
        assert all(q.dtype == torch.float32 for q in m2.parameters() if q.requires_grad)
        b = in_mode(m2, tokens, labels, "bf16-mixed")
        assert torch.equal(a[0], b[0])
        for k in a[1]: assert torch.equal(a[1][k], b[1][k]), k
    assert store_frozen_(m2, resolve_precision("fp32")) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16-mixed needs CUDA")
def test_fp16_mixed_on_cuda():
    m, tokens, labels = model_and_batch(lora=True)
    ref_loss, ref_g = reference(m, tokens, labels)
    p = resolve_precision("fp16-mixed", "cuda")
    m = m.cuda()
    scaler = p.make_scaler()
    with p.autocast():
        loss = ChunkedCrossEntropy(4)(m(tokens.cuda(), return_hidden=True), m.output_weight, labels.cuda())
    scaler.scale(loss).backward()
    g = torch.cat([q.grad.float().flatten().cpu() / scaler.get_scale() for n, q in m.named_parameters() if q.requires_grad])
    loss_tol, grad_tol = TOLERANCE["fp16-mixed"]
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() <= loss_tol
    assert rel(g, torch.cat([v.flatten() for v in ref_g.values()])) <= grad_tol
