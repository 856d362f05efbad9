"""Faults of the user and the machine during a run: Ctrl-C and SIGTERM on every objective, a second Ctrl-C, a signal
while a checkpoint is written, a callback that raises, a re-run into a used folder, a full disk during a checkpoint
and during the export, a folder that becomes read-only. Each ends in one line naming what is intact, never a
half-written file, and resumes to the same bits as a run that never stopped."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from tunebook.objectives import OBJECTIVES
from tunebook.rundir import Interrupted, SaveFailed, UserCodeError
from tunebook.train import TrainConfig, Trainer

SMALL = dict(finetune=dict(batch_size=4), dpo=dict(batch_size=4), kto=dict(batch_size=4), distill=dict(batch_size=4),
             grpo=dict(group_size=4, prompts_per_step=2))


def _cfg(name, out, **kw):
    return OBJECTIVES[name].config(**{**SMALL[name], "max_steps": 5, "eval_samples": 2, "dtype": "fp32", "output_dir": str(out), **kw})


class Signal:
    "A callback that sends this process `n` signals after step `at` (as a user's Ctrl-C would arrive)."
    def __init__(self, at, n=1, sig=signal.SIGINT): self.at, self.n, self.sig = at, n, sig
    def on_step(self, tr, row):
        if tr.step == self.at:
            for _ in range(self.n): os.kill(os.getpid(), self.sig); time.sleep(0.02)


def _weights(t): return {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}


def _same_as_uninterrupted(name, tmp_path, resumed, ref_dir):
    ref = OBJECTIVES[name].trainer(_cfg(name, ref_dir)); ref.fit(progress=False)
    a, b = pd.read_csv(ref_dir / "metrics.csv"), pd.read_csv(resumed.out / "metrics.csv")
    assert a["loss"].tolist() == b["loss"].tolist()   # to the bit
    wa, wb = _weights(ref), _weights(resumed)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_ctrl_c_saves_the_step_and_resumes_bitwise(name, tmp_path):
    """Ctrl-C during step 3 of 5, on every objective: the step finishes, its checkpoint is written, `Interrupted`
    (exit 130) names it, summary.json says interrupted, no model; --resume ends where an uninterrupted run ends."""
    t = OBJECTIVES[name].trainer(_cfg(name, tmp_path / "run"), callbacks=[Signal(3)])
    with pytest.raises(Interrupted) as e: t.fit(progress=False)
    assert e.value.exit_code == 130 and "SIGINT: stopped after step 3 of 5" in str(e.value) and "step_000003" in str(e.value)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000003"]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (s["status"], s["steps"]) == ("interrupted", 3) and not (tmp_path / "run" / "model").exists()
    assert not (tmp_path / "run" / ".lock").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the handler is put back
    r = OBJECTIVES[name].trainer(_cfg(name, tmp_path / "run", resume=True)); r.fit(progress=False)
    _same_as_uninterrupted(name, tmp_path, r, tmp_path / "ref")


def test_second_ctrl_c_stops_at_once_and_the_newest_checkpoint_resumes(tmp_path):
    t = Trainer(_cfg("finetune", tmp_path / "run", save_every=2), callbacks=[Signal(3, n=2)])
    with pytest.raises(Interrupted) as e: t.fit(progress=False)
    assert "SIGINT twice: stopped at once" in str(e.value) and "step_000002 holds step 2" in str(e.value), str(e.value)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000002"]
    r = Trainer(_cfg("finetune", tmp_path / "run", save_every=2, resume=True)); r.fit(progress=False)
    _same_as_uninterrupted("finetune", tmp_path, r, tmp_path / "ref")


def test_a_signal_while_a_checkpoint_is_written_waits_for_it(tmp_path, monkeypatch):
    """Ctrl-C twice in the middle of writing a checkpoint: the checkpoint is finished whole, then the run stops."""
    write = Trainer._write_checkpoint
    def interrupted_write(self, final):
        if self.step == 2:
            for _ in range(2): os.kill(os.getpid(), signal.SIGINT); time.sleep(0.02)
        return write(self, final)
    monkeypatch.setattr(Trainer, "_write_checkpoint", interrupted_write)
    t = Trainer(_cfg("finetune", tmp_path / "run", save_every=2))
    with pytest.raises(Interrupted, match="stopped after step 2 of 5"): t.fit(progress=False)
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "progress.json").read_text())["step"] == 2
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_callback_that_raises_is_named_and_its_step_kept(tmp_path):
    class Broken:
        def on_step(self, tr, row):
            if tr.step == 2: raise ZeroDivisionError("division by zero")
    t = Trainer(_cfg("finetune", tmp_path / "run"), callbacks=[Broken()])
    with pytest.raises(UserCodeError) as e: t.fit(progress=False)
    msg = str(e.value)
    assert "Broken.on_step raised ZeroDivisionError: division by zero (at step 2)" in msg and "step_000002" in msg, msg
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    r = Trainer(_cfg("finetune", tmp_path / "run", resume=True)); r.fit(progress=False)
    _same_as_uninterrupted("finetune", tmp_path, r, tmp_path / "ref")


def test_a_rerun_into_a_used_folder_never_serves_the_earlier_outputs(tmp_path, capsys):
    """A LoRA run, then a full run into the same folder that fails on step 2: no adapter/ or model/ of the first run is
    left to be served as the second's, and samples.jsonl holds only the second run's rows."""
    out = tmp_path / "run"
    Trainer(_cfg("finetune", out, max_steps=2)).fit(progress=False)
    assert (out / "adapter").is_dir() and (out / "model").is_dir()
    bad = Trainer(_cfg("finetune", out, method="full", lr=1e30, warmup_steps=0, max_grad_norm=None, max_steps=3))
    with pytest.raises(Exception, match="no model was written"): bad.fit(progress=False)
    assert not (out / "adapter").exists() and not (out / "model").exists()
    assert "removed model, adapter, README.md, summary.json, metrics.csv, loss.png, samples.jsonl of the earlier run" in capsys.readouterr().err
    assert {json.loads(l)["step"] for l in (out / "samples.jsonl").read_text().splitlines()} == {0}


def test_sigterm_from_the_command_line_saves_releases_the_lock_and_resumes(tmp_path):
    """What `kill`, `timeout` and schedulers send: the CLI exits 143 with one line naming the checkpoint, the lock is
    gone, and the same command with --resume finishes the run."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "tunebook.cli", "finetune", "--quiet", "--max-steps", "300", "--log-every", "1",
            "--eval-samples", "2", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not ((out / "log.txt").exists() and "step 3/" in (out / "log.txt").read_text()):
        assert p.poll() is None and time.time() - t0 < 300, p.stderr.read() if p.poll() is not None else "no step 3"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    errors = [l for l in err.splitlines() if "error:" in l]
    assert p.returncode == 143 and len(errors) == 1 and "Traceback" not in err, err
    assert "SIGTERM: stopped after step" in errors[0] and "continue with --resume" in errors[0], errors[0]
    step = json.loads((out / "summary.json").read_text())["steps"]
    assert (out / "checkpoints" / f"step_{step:06d}" / "progress.json").exists() and not (out / ".lock").exists()
    done = subprocess.run(argv[:6] + [str(step + 2)] + argv[7:] + ["--resume"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 2


# ---------------------------------------------------------------- the disk: a small tmpfs in a mount namespace
def _can_mount():
    if not shutil.which("unshare"): return False
    return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True).returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs `unshare -m` and mount (root or user namespaces)")


def _in_tmpfs(tmp_path, size, script, copy_to):
    """Run `script` (sh) with $DIR a fresh tmpfs of `size`; copy $DIR/run to `copy_to` before the mount goes away."""
    mnt = tmp_path / "mnt"; mnt.mkdir()
    sh = (f"mount -t tmpfs -o size={size} tmpfs {mnt} || exit 99; DIR={mnt}; export DIR; ({script}); rc=$?; "
          f"cp -a {mnt}/run {copy_to} 2>/dev/null; exit $rc")
    return subprocess.run(["unshare", "-m", "sh", "-c", sh], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


CLI = f"{sys.executable} -m tunebook.cli finetune --quiet --eval-samples 2 --output-dir $DIR/run"


def _one_error(r):
    errors = [l for l in r.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return errors[0]


@needs_mount
def test_disk_full_during_a_checkpoint_keeps_the_previous_one_and_resumes_bitwise(tmp_path):
    """Full fine-tuning writes 19 MB checkpoints into a 28 MB disk: step 1's fits, step 2's does not. The run stops in
    one line naming the rescue copy and the intact step 1; nothing half-written stays; once there is room, --resume
    gives the bits of a run that never stopped."""
    r = _in_tmpfs(tmp_path, "28m", f"{CLI} --method full --max-steps 4 --save-every 1", tmp_path / "copy")
    line = _one_error(r)
    assert r.returncode == 3 and "could not write checkpoint" in line and "disk is full" in line, line
    assert "step_000001 (step 1) is intact" in line and "tunebook-rescue-run" in line, line
    shutil.rmtree(line.split("saved in ")[1].split(":")[0], ignore_errors=True)
    left = sorted(p.name for p in (tmp_path / "copy" / "checkpoints").iterdir())
    assert left == ["step_000001"], left
    base = ["finetune", "--quiet", "--eval-samples", "2", "--method", "full", "--max-steps", "4", "--save-every", "1"]
    from tunebook.cli import main
    assert main(base + ["--output-dir", str(tmp_path / "copy"), "--resume"]) == 0
    assert main(base + ["--output-dir", str(tmp_path / "ref")]) == 0
    a, b = pd.read_csv(tmp_path / "ref" / "metrics.csv"), pd.read_csv(tmp_path / "copy" / "metrics.csv")
    assert a["loss"].tolist() == b["loss"].tolist()


@needs_mount
def test_disk_full_during_the_export_keeps_the_checkpoint_and_resume_writes_the_model(tmp_path):
    """LoRA: the final checkpoint (2.6 MB) fits in 8 MB, the merged model (6.4 MB) and adapter beside it do not. One
    line names the intact checkpoint and --resume; no model/, adapter/, summary.json or staging folder is left; with
    room, --resume writes the same model an uninterrupted run writes."""
    r = _in_tmpfs(tmp_path, "8m", f"{CLI} --max-steps 3", tmp_path / "copy")
    line = _one_error(r)
    assert r.returncode == 3 and "could not write the run's model and summary" in line and "disk is full" in line, line
    assert "step_000003" in line and "--resume" in line, line
    names = sorted(p.name for p in (tmp_path / "copy").iterdir())
    assert not {"model", "adapter", "summary.json"} & set(names) and not [n for n in names if n.startswith(".")], names
    from safetensors.torch import load_file
    from tunebook.cli import main
    base = ["finetune", "--quiet", "--eval-samples", "2", "--max-steps", "3"]
    assert main(base + ["--output-dir", str(tmp_path / "copy"), "--resume"]) == 0
    assert main(base + ["--output-dir", str(tmp_path / "ref")]) == 0
    for f in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(tmp_path / "ref" / f), load_file(tmp_path / "copy" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


@needs_mount
def test_a_folder_made_read_only_mid_run_is_rescued_and_named(tmp_path):
    """The output folder's filesystem turns read-only after step 3: the next checkpoint goes to a rescue folder, the
    one error line names it (the lock that cannot be removed is a warning, not the error), and it resumes."""
    script = (f"{CLI} --method lora --max-steps 400 --save-every 1 --log-every 1 & pid=$!; "
              "while ! grep -q 'step 3/' $DIR/run/log.txt 2>/dev/null; do sleep 0.05; done; "
              # a remount fails ("busy") at an instant a file is open for writing (a checkpoint every step): try again
              "until mount -o remount,ro $DIR 2>/dev/null; do kill -0 $pid || break; sleep 0.01; done; wait $pid")
    r = _in_tmpfs(tmp_path, "64m", script, tmp_path / "copy")
    line = _one_error(r)
    assert r.returncode == 3 and "could not write checkpoint" in line and "Read-only file system" in line, line
    rescue = Path(line.split("saved in ")[1].split(":")[0])
    try:
        step = int(line.split("training state of step ")[1].split()[0])
        r2 = Trainer(TrainConfig(max_steps=400, save_every=1, eval_samples=2, output_dir=str(rescue), resume=True)).setup()
        assert r2.step == step
    finally:
        shutil.rmtree(rescue, ignore_errors=True)


# ---------------------------------------------------------------- GRPO's generator processes
def _fails_in_a_generator(completion, row):
    import multiprocessing
    if multiprocessing.current_process().name != "MainProcess": raise KeyError("score")
    return 0.0


def _async(out, **kw):
    return _cfg("grpo", out, async_mode=True, max_steps=4, **kw)


def test_a_reward_that_raises_in_a_generator_process_is_named(tmp_path):
    """Async GRPO: the reward runs in the generator processes. Its exception reaches the learner as a message naming
    the function and the row (not a dead process and 'see its traceback above'); the run fails with its state kept."""
    from tunebook.grpo import GRPOTrainer
    t = GRPOTrainer(_async(tmp_path / "run"), reward_fn=_fails_in_a_generator)
    with pytest.raises(UserCodeError) as e: t.fit(progress=False)
    msg = str(e.value)
    assert "in generator process 0: the reward function test_interrupts._fails_in_a_generator raised KeyError" in msg, msg
    assert "the row whose prompt is" in msg, msg
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    assert all(not w.is_alive() for w in t.workers)


def test_ctrl_c_reaching_the_generator_processes_too_saves_the_learner(tmp_path):
    """A Ctrl-C in a terminal reaches every process of the group: the generators ignore it, the learner finishes its
    step, saves and stops them."""
    from tunebook.grpo import GRPOTrainer
    class GroupCtrlC:
        def on_step(self, tr, row):
            if tr.step == 2:
                for w in tr.workers: os.kill(w.pid, signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT); time.sleep(0.02)
    t = GRPOTrainer(_async(tmp_path / "run"), callbacks=[GroupCtrlC()])
    with pytest.raises(Interrupted, match="stopped after step 2 of 4"): t.fit(progress=False)
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "progress.json").exists()
    assert all(not w.is_alive() for w in t.workers)


def test_a_custom_objective_that_raises_is_named_and_the_last_good_state_kept(tmp_path):
    """An objective of the user's (not tunebook's) whose loss raises at step 3: the run stops naming its class and method,
    keeps step 2's state as a checkpoint, says failed, and resumes."""
    from tunebook.train.objective import SFT
    class MyLoss(SFT):
        def loss(self, tr, b):
            if tr.step == 2: raise ValueError("my loss cannot take this batch")
            return super().loss(tr, b)
    t = Trainer(_cfg("finetune", tmp_path / "run"), objective=MyLoss())
    with pytest.raises(UserCodeError) as e: t.fit(progress=False)
    msg = str(e.value)
    assert "MyLoss.loss raised ValueError: my loss cannot take this batch (at step 3)" in msg and "step_000002" in msg, msg
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_summary_says_how_many_rows_a_step_trains(tmp_path):
    s = Trainer(_cfg("finetune", tmp_path / "run", batch_size=4, grad_accum_steps=3, max_steps=2)).fit(progress=False)
    assert (s["batch_size"], s["grad_accum_steps"], s["rows_per_step"]) == (4, 3, 12), s
