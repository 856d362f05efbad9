"""Precision policies: each mode's loss and gradients against an fp32 full-logits reference, auto detection on this
machine (read from /proc/cpuinfo here, independently), refusals, and the loss-scaling recipe the trainer uses.
(What each mode keeps in which dtype through real trainer steps, and exact resume in each: tests/test_modes.py.)"""
import copy
import json
import math
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


def _reference_speedup() -> float:
    "fp32's time over bf16's for tunebook's calibration matmul, timed by torch.utils.benchmark (not by tunebook's timer)."
    from torch.utils.benchmark import Timer
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    took = {dt: Timer("a @ b", globals=dict(a=a.to(dt), b=b.to(dt))).blocked_autorange(min_run_time=0.2).median
            for dt in (torch.float32, torch.bfloat16)}
    return took[torch.float32] / took[torch.bfloat16]


def test_auto_on_this_machine(tmp_path, monkeypatch):
    "auto picks bf16-mixed where a bf16 matmul is measured (independently) well over 1.3x fp32's speed, fp32 where well under; the report names the flags."
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = {w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    have = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    p = resolve_precision("auto", "cpu")
    ref = _reference_speedup()
    assert p.asked == "auto" and p.name in ("bf16-mixed", "fp32")
    if abs(math.log(ref / 1.3)) > math.log(1.5):   # clear of the line (AMX: 4-7x; emulated bf16: under 1x)
        assert (p.name == "bf16-mixed") == (ref >= 1.3), (ref, p.report())
    if p.name == "bf16-mixed":
        assert p.param_dtype == torch.float32 and p.compute_dtype == torch.bfloat16
    assert all(f in p.report() for f in have) and "x as fast as fp32 here" in p.report(), p.report()
    assert p.report().startswith(f"precision {p.name} (asked auto) on cpu: ")
    assert resolve_precision(None).name == p.name  # no dtype given: auto
    assert json.loads((tmp_path / "tunebook" / "bf16_speed.json").read_text())   # measured once, kept


def _fake_calibration(monkeypatch, speedup):
    import tunebook.precision as tp
    monkeypatch.setattr(tp, "bf16_calibration", lambda refresh=False: dict(speedup=speedup, measured="2026-01-01 00:00:00", cached=True))


def test_auto_without_bf16_flags_is_fp32(monkeypatch):
    import tunebook.precision as tp
    monkeypatch.setattr(tp, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"sse4_2", "avx2", "fma"}))
    _fake_calibration(monkeypatch, 0.4)   # what a CPU that emulates bf16 measures
    p = resolve_precision("auto", "cpu")
    assert p.name == "fp32" and "amx_bf16" in p.reason and "0.4x as fast" in p.reason and "fp32 is faster" in p.report()
    assert fast_bf16("cpu", flags=frozenset({"avx512_bf16"}))[0]


def test_the_measurement_decides_against_the_flags(monkeypatch):
    "Flags that claim bf16 but a slow matmul: fp32; no flags but a fast matmul (an Arm CPU, say): bf16-mixed; each says why."
    import tunebook.precision as tp
    monkeypatch.setattr(tp, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2", "amx_bf16", "amx_tile"}))
    _fake_calibration(monkeypatch, 0.8)
    p = resolve_precision("auto", "cpu", width=576)
    assert p.name == "fp32" and "has amx_bf16" in p.reason and "but a bf16 matmul ran 0.8x" in p.reason and "under the 1.3x" in p.reason
    monkeypatch.setattr(tp, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"fp", "asimd", "bf16"}))
    _fake_calibration(monkeypatch, 3.0)
    p = resolve_precision("auto", "cpu", width=576)
    assert p.name == "bf16-mixed" and "neither amx_bf16 nor avx512_bf16, but a bf16 matmul ran 3.0x" in p.reason
    _fake_calibration(monkeypatch, 1.29)
    assert resolve_precision("auto", "cpu", width=576).name == "fp32"   # the line is 1.3x


def test_calibration_off_trusts_the_flags(monkeypatch):
    import tunebook.precision as tp
    def never(refresh=False): raise AssertionError("measured although TUNEBOOK_BF16_CALIBRATION=off")
    monkeypatch.setattr(tp, "bf16_calibration", never)
    monkeypatch.setenv("TUNEBOOK_BF16_CALIBRATION", "off")
    monkeypatch.setattr(tp, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2", "avx512_bf16"}))
    ok, why = fast_bf16("cpu")
    assert ok and "avx512_bf16" in why and "matmul" not in why
    monkeypatch.setattr(tp, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2"}))
    assert fast_bf16("cpu") == (False, "the CPU has neither amx_bf16 nor avx512_bf16 (bf16 would be emulated, slower than fp32)")


def test_calibration_is_measured_once_and_kept_whole(tmp_path, monkeypatch):
    import tunebook.precision as tp
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tp, "_MEASURED", {})
    calls = []
    real = tp.measure_bf16_speedup
    monkeypatch.setattr(tp, "measure_bf16_speedup", lambda *a, **k: calls.append(1) or real(reps=2))
    first = tp.bf16_calibration()
    path = tmp_path / "tunebook" / "bf16_speed.json"
    saved = json.loads(path.read_text())
    assert not first["cached"] and saved[tp.calibration_key()]["speedup"] == first["speedup"] > 0
    assert first["fp32_ms"] > 0 and first["bf16_ms"] > 0 and first["shape"] == [512, 1024, 1024]
    again = tp.bf16_calibration()
    assert again["cached"] and again["speedup"] == first["speedup"] and len(calls) == 1
    assert not tp.bf16_calibration(refresh=True)["cached"] and len(calls) == 2
    monkeypatch.setattr(tp, "calibration_key", lambda: "another CPU | flags 0 | torch x | 1 threads")
    tp.bf16_calibration()
    assert len(json.loads(path.read_text())) == 2 and len(calls) == 3   # one entry per CPU, threads and torch
    path.write_text("{ half a file")   # a damaged cache is measured again by the next process and rewritten, not an error
    monkeypatch.setattr(tp, "_MEASURED", {})
    assert not tp.bf16_calibration()["cached"] and json.loads(path.read_text()) and len(calls) == 4
    assert [p.name for p in path.parent.iterdir()] == ["bf16_speed.json"]   # no temporary file left behind


def test_an_instruction_set_cap_is_its_own_cpu(monkeypatch):
    "ONEDNN_MAX_CPU_ISA=AVX2 on an AMX host runs an AVX2 CPU's code: its own calibration entry, and no bf16 by the flags."
    import tunebook.precision as tp
    monkeypatch.setattr(tp, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2", "avx512_bf16", "amx_bf16"}))
    for k in tp.ISA_LIMITS: monkeypatch.delenv(k, raising=False)
    plain = tp.calibration_key()
    monkeypatch.setenv("TUNEBOOK_BF16_CALIBRATION", "off")
    assert tp.fast_bf16("cpu")[0]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")   # ATen's own kernels capped: oneDNN's bf16 matmuls still run
    assert tp.calibration_key() == plain.replace(" | torch", " | ATEN_CPU_CAPABILITY=avx2 | torch") and tp.fast_bf16("cpu")[0]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert "ONEDNN_MAX_CPU_ISA=avx2" in tp.calibration_key()
    ok, why = tp.fast_bf16("cpu")
    assert not ok and "but ONEDNN_MAX_CPU_ISA=avx2 keeps oneDNN from using them" in why and "emulated" in why
    assert tp.fast_bf16("cpu", flags=frozenset({"amx_bf16"}))[0]   # flags given: a question about another CPU, no cap
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")   # a cap above bf16 takes nothing away
    assert tp.fast_bf16("cpu")[0]


def test_a_capped_process_measures_its_own_speed(tmp_path):
    "Real subprocesses sharing one cache: the uncapped one measures, the AVX2-capped one measures again and picks fp32."
    import os, subprocess, sys
    code = ("import json, torch; torch.set_num_threads(1); from tunebook.precision import bf16_calibration, resolve_precision; "
            "print(json.dumps(dict(cal=bf16_calibration(), auto=resolve_precision('auto', 'cpu', width=576).name)))")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    env.update(XDG_CACHE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    run = lambda e: json.loads(subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    plain = run(env)
    capped = run(dict(env, ONEDNN_MAX_CPU_ISA="AVX2"))
    assert not plain["cal"]["cached"] and not capped["cal"]["cached"]   # not the uncapped answer read back
    assert capped["cal"]["speedup"] < 1 and capped["auto"] == "fp32"   # bf16 without its instructions: slower than fp32
    assert len(json.loads((tmp_path / "tunebook" / "bf16_speed.json").read_text())) == 2
    assert run(dict(env, ONEDNN_MAX_CPU_ISA="AVX2"))["cal"]["cached"]   # a second capped process reads its own entry


def test_calibration_without_a_writable_cache(tmp_path, monkeypatch):
    import tunebook.precision as tp
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "f"))   # a file where the folder would go: nothing can be written
    monkeypatch.setattr(tp, "_MEASURED", {})
    first, again = tp.bf16_calibration(), tp.bf16_calibration()
    assert not first["cached"] and again["cached"] and again["speedup"] == first["speedup"]   # this process remembers it
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


def _auto_on_a_rank(out):
    "One rank of a two-process run whose ranks measure their CPU's bf16 differently (rank 0: fast, rank 1: slow)."
    import torch.distributed as dist
    import tunebook.precision as tp
    from tunebook.config import TrainConfig
    from tunebook.train import Trainer
    tp.AUTO_MIN_WIDTH_CPU = 1   # the embedded model counts as wide: the measurement decides
    speed = 3.0 if dist.get_rank() == 0 else 0.5
    tp.bf16_calibration = lambda refresh=False: dict(speedup=speed, measured="2026-01-01 00:00:00", cached=True)
    t = Trainer(TrainConfig(max_steps=1, eval_samples=0, n_train=64, device="cpu", nproc=2, output_dir=out)).setup()
    return t.precision.name, t.precision.reason


def test_ranks_train_in_rank_zeros_choice(tmp_path):
    "dtype=auto in a multi-process CPU run: every rank trains in the precision rank 0 measured, and says so."
    from tunebook.launch import launch
    (n0, why0), (n1, why1) = launch(_auto_on_a_rank, nproc=2, args=(str(tmp_path / "run"),), verbose=False, timeout=300)
    assert n0 == n1 == "bf16-mixed"
    assert "3.0x as fast" in why0 and why1.startswith("rank 0's choice: ") and "3.0x as fast" in why1
