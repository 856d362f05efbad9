"""Faults a run survives: non-finite steps, a busy or unwritable output folder, a failed save, damaged or
stale checkpoints, changed data, a moved run folder, and five kill -9s during checkpoint writes."""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import wait_until
from tunebook.checkpoint import save_hf
from tunebook.cli import main
from tunebook.data import make_task
from tunebook.model import build_model, pico
from tunebook.rundir import NonFiniteError, SaveFailed
from tunebook.tokenizer import train_tokenizer
from tunebook.train import TrainConfig, Trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random pico model folder with a tokenizer trained on the reverse task."""
    d = tmp_path_factory.mktemp("tiny") / "pico"
    tok = train_tokenizer([r["prompt"] + " " + r["response"] for r in make_task("reverse", 300, seed=0)], vocab_size=300)
    torch.manual_seed(0)
    save_hf(build_model(pico(vocab_size=tok.vocab_size, dim=32, hidden_dim=64)), d)
    tok.save(d)
    return d


def _cfg(tiny, out, **kw):
    base = dict(model=str(tiny), task="reverse", n_train=64, eval_samples=2, max_new_tokens=4, batch_size=8, max_steps=4,
                lr=1e-3, warmup_steps=0, dtype="fp32", output_dir=str(out))
    return TrainConfig(**{**base, **kw})


def _cli(tiny, out, *argv):
    return main(["finetune", "--quiet", "--model", str(tiny), "--task", "reverse", "--n-train", "64", "--eval-samples", "2",
                 "--max-new-tokens", "4", "--batch-size", "8", "--max-steps", "4", "--warmup-steps", "0",
                 "--output-dir", str(out), *argv])


def _err(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return [l for l in err if not l.startswith("tunebook: warning")]


# ---------------------------------------------------------------- non-finite
def test_nonfinite_loss_stops_with_the_last_good_checkpoint(tiny, tmp_path, capsys):
    """lr 1e30 blows the weights up after step 1: step 2's loss is not finite. The run stops there (exit 3),
    keeps step 1's checkpoint, writes no model, and summary.json says failed."""
    rc = _cli(tiny, tmp_path / "run", "--method", "full", "--lr", "1e30", "--max-grad-norm", "0")
    err = _err(capsys)
    assert rc == 3, err
    assert len(err) == 1 and "step 2" in err[0] and "not finite" in err[0] and "step_000001" in err[0], err
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "failed" and s["steps"] == 1 and "step 2" in s["error"], s
    assert s["last_good_checkpoint"].endswith("step_000001")
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / "adapter").exists()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000001"]


def test_nonfinite_step_is_not_applied(tiny, tmp_path):
    """A NaN loss at step 3 (injected into the loss): the weights and checkpoint are bitwise those after step 2."""
    ref = Trainer(_cfg(tiny, tmp_path / "ref", method="lora")).setup()
    for _ in range(2): ref.train_step()
    t = Trainer(_cfg(tiny, tmp_path / "run", method="lora")).setup()
    loss = t.objective.loss   # the objective's loss, as the one loop calls it
    t.objective.loss = lambda tr, b: (lambda l, st: (l * (float("nan") if tr.step == 2 else 1.0), st))(*loss(tr, b))
    with pytest.raises(NonFiniteError, match="step 3: loss nan") as e:
        t.fit(progress=False)
    assert "lora_" in str(e.value)   # names the first tensor with a non-finite gradient
    pr, pt = dict(ref.model.named_parameters()), dict(t.model.named_parameters())
    assert all(torch.equal(pr[n], pt[n]) for n in pr)
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_000002" / "trainable.safetensors"))
    assert all(torch.equal(saved[n], pr[n]) for n in saved)


def test_fp16_on_cpu_is_refused_before_any_file(tiny, tmp_path, capsys):
    assert _cli(tiny, tmp_path / "o", "--dtype", "fp16", "--device", "cpu") == 2
    err = _err(capsys)
    assert len(err) == 1 and "--dtype" in err[0] and "bf16" in err[0], err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- the output folder
def test_output_dir_is_a_file(tiny, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert _cli(tiny, tmp_path / "afile") == 2
    err = _err(capsys)
    assert len(err) == 1 and "is a file" in err[0] and "--output-dir" in err[0], err


def test_unwritable_output_dir_refused_before_training(tiny, tmp_path, capsys):
    """checkpoints/ cannot be created (a file is in the way; as root, chmod would not stop writes): refused at once."""
    out = tmp_path / "run"; out.mkdir(); (out / "checkpoints").write_text("in the way")
    assert _cli(tiny, out) == 2
    err = _err(capsys)
    assert len(err) == 1 and "not writable" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]   # no config.json: nothing ran


def test_busy_folder_refused_stale_lock_taken_over(tiny, tmp_path, capsys):
    """F15: a live process owns the folder: refused, naming its pid. After it is gone the lock is stale: taken over."""
    out = tmp_path / "run"; out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10**6)"])   # alive until killed below
    try:
        (out / ".lock").write_text(json.dumps(dict(pid=other.pid, host=socket.gethostname())))
        assert _cli(tiny, out) == 2
        err = _err(capsys)
        assert len(err) == 1 and f"in use by process {other.pid}" in err[0], err
        assert not (out / "config.json").exists()
    finally:
        other.kill(); other.wait()
    assert _cli(tiny, out) == 0
    assert "is gone: taking the folder over" in capsys.readouterr().err
    assert not (out / ".lock").exists() and (out / "model" / "config.json").exists()


def test_two_runs_at_once_into_one_folder(tiny, tmp_path):
    """F15 with two real runs: the second is refused while the first trains; the folder is the first's."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "tunebook.cli", "finetune", "--quiet", "--model", str(tiny), "--task", "reverse",
            "--n-train", "64", "--eval-samples", "2", "--max-new-tokens", "4", "--batch-size", "8", "--warmup-steps", "0",
            "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    a = subprocess.Popen(argv + ["--max-steps", "100000", "--seed", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (out / ".lock").exists() or a.poll() is not None, "the first run taking the folder's lock")
        assert (out / ".lock").exists(), a.stderr.read() if a.poll() is not None else "no lock"
        b = subprocess.run(argv + ["--max-steps", "2", "--seed", "2"], env=env, capture_output=True, text=True)
        assert b.returncode == 2 and f"in use by process {a.pid}" in b.stderr, b.stderr
        assert json.loads((out / "config.json").read_text())["seed"] == 1
    finally:
        a.kill(); a.wait()


def test_failed_save_keeps_the_state_elsewhere(tiny, tmp_path):
    """F10: checkpoints/ becomes unusable mid-run; the final save writes a rescue folder, says where, and it resumes."""
    out = tmp_path / "run"

    class Break:
        def on_step(self, trainer, row):
            if trainer.step == 2: shutil.rmtree(out / "checkpoints"); (out / "checkpoints").write_text("x")
    t = Trainer(_cfg(tiny, out, method="lora"), callbacks=[Break()])
    with pytest.raises(SaveFailed, match="--resume --output-dir") as e:
        t.fit(progress=False)
    rescue = Path(str(e.value).rsplit("--output-dir ", 1)[1])
    try:
        assert (rescue / "checkpoints" / "step_000004" / "progress.json").exists()
        r = Trainer(_cfg(tiny, rescue, method="lora", resume=True)).setup()
        assert r.step == 4
        pt, pr = dict(t.model.named_parameters()), dict(r.model.named_parameters())
        assert all(torch.equal(pt[n], pr[n]) for n in pt)
    finally:
        shutil.rmtree(rescue, ignore_errors=True)


def test_leftover_temp_folders_cleaned_and_earlier_run_replaced(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / ".step_000003.tmp-dead").mkdir(parents=True)
    (out / "checkpoints" / "step_000009").mkdir(); (out / "checkpoints" / "step_000009" / "progress.json").write_text("{}")
    assert _cli(tiny, out, "--max-steps", "2") == 0
    err = capsys.readouterr().err
    assert "unfinished checkpoint" in err and "earlier run" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002"]


# ---------------------------------------------------------------- resume
def _losses(t, n): return [t.train_step()["loss"] for _ in range(n)]


@pytest.mark.parametrize("damage", ["progress.json", "state.pt"])
def test_damaged_newest_checkpoint_falls_back(tiny, tmp_path, capsys, damage):
    """F2/F3: the newest checkpoint's file is truncated: resume warns and continues from the one before, exactly."""
    ref = Trainer(_cfg(tiny, tmp_path / "ref", max_steps=6)).setup(); want = _losses(ref, 6)
    t = Trainer(_cfg(tiny, tmp_path / "run", max_steps=6)).setup()
    for _ in range(4):
        t.train_step(); t.save_checkpoint()
    f = tmp_path / "run" / "checkpoints" / "step_000004" / damage
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    r = Trainer(_cfg(tiny, tmp_path / "run", max_steps=6, resume=True)).setup()
    assert r.step == 3
    assert "step_000004 is damaged" in capsys.readouterr().err
    assert _losses(r, 3) == want[3:]


def test_every_checkpoint_damaged_is_a_clear_error(tiny, tmp_path, capsys):
    t = Trainer(_cfg(tiny, tmp_path / "run")).setup(); t.train_step(); t.save_checkpoint()
    (tmp_path / "run" / "checkpoints" / "step_000001" / "progress.json").write_text('{"step": 1, "met')
    assert _cli(tiny, tmp_path / "run", "--resume") == 2
    err = _err(capsys)
    assert len(err) == 1 and "no intact checkpoint" in err[0] and "step_000001" in err[0], err


def test_copied_run_folder_resumes(tiny, tmp_path):
    """F5: output_dir is not part of what must match."""
    t = Trainer(_cfg(tiny, tmp_path / "a")).setup()
    for _ in range(2): t.train_step()
    t.save_checkpoint()
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert Trainer(_cfg(tiny, tmp_path / "copy", resume=True)).setup().step == 2


def test_resume_without_checkpoint_says_so(tiny, tmp_path, capsys):
    """F6."""
    assert _cli(tiny, tmp_path / "run", "--resume", "--max-steps", "1") == 0
    assert "has no checkpoint yet, so this run starts at step 0" in capsys.readouterr().err


def test_resume_on_changed_data_is_refused(tiny, tmp_path, capsys):
    """D37: the data file's sha256 is in every checkpoint."""
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"reverse {w}=", "response": w[::-1]}) for w in ("abc", "hello", "xyz") * 10))
    assert _cli(tiny, tmp_path / "run", "--data", str(f), "--max-steps", "2") == 0
    f.write_text("\n".join(json.dumps({"prompt": f"reverse {w}=", "response": w[::-1]}) for w in ("qrs", "tuv") * 20))
    assert _cli(tiny, tmp_path / "run", "--data", str(f), "--max-steps", "4", "--resume") == 2
    err = _err(capsys)
    assert len(err) == 1 and "changed since that run started" in err[0], err


def test_summary_keeps_the_true_before_after_resume(tmp_path):
    """F7: a 3-step run that wrecks the embedded model (lr 0.05, full), then --resume to 4 steps."""
    from tunebook.embedded import EMBEDDED_DIR
    kw = dict(model=str(EMBEDDED_DIR), task="add", method="full", lr=0.05, warmup_steps=0, n_train=64, batch_size=8,
              eval_samples=20, max_new_tokens=8, output_dir=str(tmp_path / "run"))
    s1 = Trainer(TrainConfig(max_steps=3, **kw)).fit(progress=False)
    assert s1["eval_accuracy_before"] >= 0.2 and s1["eval_accuracy_after"] <= s1["eval_accuracy_before"] - 0.15, s1
    s2 = Trainer(TrainConfig(max_steps=4, resume=True, **kw)).fit(progress=False)
    assert s2["eval_accuracy_before"] == s1["eval_accuracy_before"], (s1, s2)


# ---------------------------------------------------------------- five kill -9s during checkpoint writes
_CHILD = """
import sys, time, torch
from pathlib import Path
import tunebook.train as T
marker, slow = Path(sys.argv[2]), sys.argv[3] == "slow"
real = torch.save
def save(*a, **k):   # a checkpoint write is under way while the marker exists
    marker.touch()
    if slow: time.sleep(0.2)
    real(*a, **k)
    marker.unlink(missing_ok=True)
torch.save = save
cfg = T.TrainConfig(model=sys.argv[1], task="reverse", n_train=64, eval_samples=2, max_new_tokens=4, batch_size=8,
                    max_steps=10, lr=1e-3, warmup_steps=2, save_every=1, method="lora", resume=True, output_dir=sys.argv[4])
T.Trainer(cfg).fit(progress=False)
"""


@pytest.mark.slow
def test_five_kills_during_checkpoint_writes_resume_bitwise(tiny, tmp_path):
    script = tmp_path / "child.py"; script.write_text(_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda out, slow: subprocess.Popen([sys.executable, str(script), str(tiny), str(tmp_path / "writing"), slow, str(out)],
                                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ref = run(tmp_path / "ref", "fast"); assert ref.wait() == 0, ref.stderr.read()
    rng, kills = random.Random(0), 0
    while kills < 5:
        (tmp_path / "writing").unlink(missing_ok=True)
        p = run(tmp_path / "run", "slow")
        while not (tmp_path / "writing").exists() and p.poll() is None: time.sleep(0.002)
        if p.poll() is not None:   # finished before a write could be hit: the test needs five kills
            pytest.fail(f"the run ended before kill {kills + 1}: {p.stderr.read()[-2000:]}")
        time.sleep(rng.uniform(0, 0.25))
        p.send_signal(signal.SIGKILL); p.wait(); kills += 1
    p = run(tmp_path / "run", "fast"); assert p.wait() == 0, p.stderr.read()
    a, b = pd.read_csv(tmp_path / "ref" / "metrics.csv"), pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert a["loss"].tolist() == b["loss"].tolist()   # to the bit
    assert not [q for q in (tmp_path / "run" / "checkpoints").iterdir() if q.name.startswith(".")]
    assert not (tmp_path / "run" / ".lock").exists()


# ---------------------------------------------------------------- data and model mismatches
def test_much_smaller_tokenizer_is_warned(tiny, tmp_path, capsys):
    """M12: a tokenizer covering a fraction of the model's embedding loads, with a warning naming both sizes."""
    small = train_tokenizer([r["prompt"] for r in make_task("reverse", 100, seed=0)], vocab_size=100)
    small.save(tmp_path / "tok")
    Trainer(_cfg(tiny, tmp_path / "run", tokenizer=str(tmp_path / "tok"))).setup()
    err = capsys.readouterr().err
    assert f"has {len(small)} tokens but the model was trained with 300" in err, err


def test_distillation_never_trains_on_its_held_out_rows(tmp_path):
    """D35: with a data file, the prompts scored at eval are not among the training rows."""
    from tunebook.distill import DistillConfig, DistillTrainer
    from tunebook.embedded import EMBEDDED_DIR
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"reverse {w}{i}=", "response": f"{i}{w[::-1]}"}) for i, w in
                           enumerate(["abc", "hello", "xyz", "tune"] * 10)))
    t = DistillTrainer(DistillConfig(teacher=str(EMBEDDED_DIR), data=str(f), eval_fraction=0.25, eval_samples=8, max_steps=1,
                                     output_dir=str(tmp_path / "run"))).setup()
    held = {e["messages"][-1]["content"] for e in t.eval_data}
    trained = {t.tokenizer.decode(t.train_data[i]["tokens"]) for i in range(len(t.train_data))}
    assert len(held) == 8 and len(trained) == 32
    assert not [p for p in held if any(p in text for text in trained)]


def test_chat_eval_rows_without_an_answer_are_skipped(tmp_path, capsys):
    """D16: half the chat rows have no assistant turn; one landing in the eval split used to end the run with
    'max() arg is an empty sequence'."""
    rows = [{"messages": [{"role": "user", "content": f"copy ab{i}="}] + ([{"role": "assistant", "content": f"ab{i}"}] if i % 2 else [])}
            for i in range(40)]
    f = tmp_path / "chat.jsonl"; f.write_text("\n".join(json.dumps(r) for r in rows))
    rc = main(["finetune", "--quiet", "--data", str(f), "--eval-fraction", "0.25", "--max-steps", "1", "--batch-size", "4",
               "--output-dir", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "ok"
