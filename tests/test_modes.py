"""Every precision x compile mode of the main job's trainer: a run interrupted and resumed is bitwise the
uninterrupted run (losses, weights, optimizer state), and compiled losses agree with eager ones.

The embedded model and the main job's recipe (LoRA rank 16 on every linear layer, its lr and warmup), shrunk to a
few steps of 8 rows; LoRA dropout is on so that the training RNG is part of what a resume must restore. compile=True
runs the trainer's own regional compile with aot_eager (dynamo + AOTAutograd traces forward and backward as inductor
does, without generating C++: inductor takes ~80 s a run here; bench/bench_modes.py measures it on the full job).
Steps 1-2 of every run are profiled by the memory tracker and run eagerly, so runs go to step 5 and break at 3:
compiled step 3 feeds the checkpoint, compiled steps 4-5 follow the resume.
"""
import functools

import pytest
import torch

import tunebook.compile
from tunebook.compile import is_compiled
from tunebook.precision import resolve_precision
from tunebook.train import TrainConfig, Trainer

STEPS, BREAK = 5, 3
# compiled vs eager training loss, relative, any step. Measured here: fp32 0 and bf16-mixed 0 (the traced graphs run
# the same kernels in the same order), bf16 weights 1.7e-3 (AOTAutograd's decompositions round some bf16 intermediates
# where eager's fused kernels do not). Stated: fp32 1e-6; bf16 modes one bf16 rounding unit of the loss, 2**-8 = 3.9e-3.
COMPILED_VS_EAGER = {"fp32": 1e-6, "bf16": 2 ** -8, "bf16-mixed": 2 ** -8}


@pytest.fixture(autouse=True)
def cheap_compile(monkeypatch):
    "The trainer's compile=True, with the aot_eager backend; a fresh dynamo cache per test."
    monkeypatch.setattr(tunebook.compile, "compile_model", functools.partial(tunebook.compile.compile_model, backend="aot_eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trainer(out, mode, compile_, **kw):
    kw = {**dict(n_train=48, batch_size=8, max_steps=STEPS, warmup_steps=2, lora_dropout=0.1, eval_samples=2), **kw}
    cfg = TrainConfig(dtype=mode, compile=compile_, output_dir=str(out), **kw)
    return Trainer(cfg).setup()


def _state(tr):
    "Trainable weights and AdamW moments, for a bitwise comparison."
    params = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    moments = [v.clone() for s in tr.optimizer.state_dict()["state"].values() for k, v in s.items() if k != "step"]
    return params, moments


def _run(tmp_path, mode, compile_):
    "(uninterrupted losses, resumed losses, states of both, the resumed trainer): the resume reads a checkpoint written at BREAK."
    out = tmp_path / f"{mode}-{int(compile_)}"
    a = _trainer(out, mode, compile_)
    ref = [a.train_step()["loss"] for _ in range(BREAK)]
    a.save_checkpoint()   # reads the state, changes nothing: the run goes on as if never saved
    ref += [a.train_step()["loss"] for _ in range(STEPS - BREAK)]
    c = _trainer(out, mode, compile_, resume=True)   # a new trainer (a new process would be the same): only the files carry over
    assert c.step == BREAK
    got = ref[:BREAK] + [c.train_step()["loss"] for _ in range(STEPS - BREAK)]
    return ref, got, _state(a), _state(c), c


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-mixed"])
def test_resume_bitwise_and_compiled_agrees(tmp_path, mode):
    runs = {}
    for compile_ in (False, True):
        ref, got, (pa, ma), (pc, mc), c = _run(tmp_path, mode, compile_)
        assert got == ref, (mode, compile_, ref, got)   # to the bit, every step
        assert pa.keys() == pc.keys() and all(torch.equal(pa[n], pc[n]) for n in pa), (mode, compile_)
        assert len(ma) == len(mc) and all(torch.equal(x, y) for x, y in zip(ma, mc)), (mode, compile_)
        p = resolve_precision(mode)   # what the mode promises to keep in which dtype: weights and AdamW moments alike
        assert c.precision.name == mode and {q.dtype for q in pc.values()} == {x.dtype for x in mc} == {p.param_dtype}
        assert all(is_compiled(blk) for blk in c.model.layers) == compile_
        stats = c.run_stats()   # what summary.json records: the mode that ran and whether it was compiled
        assert (stats["precision"], stats["compile"]) == (mode, compile_)
        runs[compile_] = ref
    other = "bf16" if mode != "bf16" else "fp32"   # the checkpoint's precision is not changed on resume: refused, saying which
    with pytest.raises(ValueError, match=r"cannot resume from .*(dtype was|trained in)"):
        _trainer(tmp_path / f"{mode}-0", other, False, resume=True)
    eager, compiled = runs[False], runs[True]
    rel = max(abs(x - y) / abs(y) for x, y in zip(compiled, eager))
    assert rel <= COMPILED_VS_EAGER[mode], (mode, rel, eager, compiled)
    assert eager[-1] < eager[0]   # it learns: the comparison is of a run that moves


def test_auto_resumes_by_the_mode_it_chose(tmp_path, monkeypatch):
    "dtype=auto is recorded as the mode it chose: resumed under that mode by name, bitwise; refused where auto now picks another."
    import tunebook.precision as tp
    monkeypatch.setattr(tp, "fast_bf16", lambda device="cpu", flags=None: (True, "fast bf16 (test)"))
    monkeypatch.setattr(tp, "AUTO_MIN_WIDTH_CPU", 64)   # the 192-wide embedded model counts as wide: auto -> bf16-mixed
    out = tmp_path / "auto"
    a = _trainer(out, "auto", False, max_steps=4)
    assert a.precision.name == "bf16-mixed" and a.precision.asked == "auto"
    ref = [a.train_step()["loss"] for _ in range(2)]
    a.save_checkpoint()
    ref += [a.train_step()["loss"] for _ in range(2)]
    stats = a.run_stats()   # summary.json: the mode auto chose, and that auto chose it
    assert stats["precision"] == "bf16-mixed" and "(asked auto)" in stats["precision_report"] and stats["compile"] is False
    c = _trainer(out, "bf16-mixed", False, max_steps=4, resume=True)   # the chosen mode, asked by name
    assert c.step == 2 and ref[2:] == [c.train_step()["loss"] for _ in range(2)]
    monkeypatch.setattr(tp, "fast_bf16", lambda device="cpu", flags=None: (False, "no fast bf16 (test)"))
    with pytest.raises(ValueError, match=r"trained in bf16-mixed \(dtype='auto' chose it on cpu\), but this run would continue in fp32"):
        _trainer(out, "auto", False, max_steps=4, resume=True)
