"""--epochs: the run's steps follow from the data; every row is trained exactly once per epoch (also when the last step
holds fewer micro-batches); a resume inside the second epoch continues to the same bits; max_steps caps only when set."""
import collections
import json
import os
import signal
import time

import pytest

from tunebook.cli import main
from tunebook.rundir import Interrupted
from tunebook.train import TrainConfig, Trainer


def _cfg(out, **kw):
    return TrainConfig(**{"n_train": 40, "batch_size": 8, "eval_samples": 2, "epochs": 2, "output_dir": str(out), **kw})


@pytest.mark.parametrize("ga", [1, 3])
def test_every_row_is_trained_exactly_once_per_epoch(tmp_path, ga):
    """40 rows in micro-batches of 8: 5 per epoch. With 3 micro-batches a step, 2 epochs are 10 micro-batches in 4 steps,
    the last holding one. The micro-batches the loop trains are exactly 0..9, and their rows are each row twice."""
    t = Trainer(_cfg(tmp_path / "run", grad_accum_steps=ga))
    trained, rows = [], collections.Counter()
    batch = t.objective.batch
    def recording(tr, g):
        trained.append(g)
        for r in tr.objective.rows_of(tr, g): rows[id(r)] += 1
        return batch(tr, g)
    t.objective.batch = recording
    s = t.fit(progress=False)
    assert trained == list(range(10)), trained
    assert len(rows) == len(t.rows) == 40 and set(rows.values()) == {2}
    assert s["steps"] == t.config.max_steps == -(-10 // ga)
    assert t.metrics[-1]["epoch"] == 2.0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["max_steps"] == -(-10 // ga)
    log = (tmp_path / "run" / "log.txt").read_text()
    assert f"epochs: 2 epoch(s) of 40 rows = 10 micro-batches of up to 8 rows, {ga} per step: {-(-10 // ga)} steps" in log, log


def test_a_resume_inside_the_second_epoch_is_bitwise(tmp_path):
    class CtrlC:
        def on_step(self, tr, row):
            if tr.step == 7: os.kill(os.getpid(), signal.SIGINT); time.sleep(0.02)
    with pytest.raises(Interrupted): Trainer(_cfg(tmp_path / "run"), callbacks=[CtrlC()]).fit(progress=False)
    r = Trainer(_cfg(tmp_path / "run", resume=True)); r.fit(progress=False)
    ref = Trainer(_cfg(tmp_path / "ref")); ref.fit(progress=False)
    assert [m["loss"] for m in r.metrics] == [m["loss"] for m in ref.metrics]   # to the bit
    assert [m["epoch"] for m in r.metrics][6:8] == [1.4, 1.6]


def test_max_steps_caps_only_when_set():
    capped = Trainer(_cfg("/tmp/unused-epochs", max_steps=3)).setup()
    assert capped.config.max_steps == 3 and "capped at --max-steps 3" in capped.choices["epochs_report"]
    long = Trainer(_cfg("/tmp/unused-epochs", epochs=101)).setup()   # 505 steps: the default max_steps (500) does not cap
    assert long.config.max_steps == 505 and "capped" not in long.choices["epochs_report"]


def test_epochs_from_the_command_line(tmp_path, capsys):
    assert main(["finetune", "--quiet", "--n-train", "40", "--batch-size", "8", "--epochs", "2", "--eval-samples", "2",
                 "--output-dir", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 10
    assert main(["finetune", "--epochs", "0", "--output-dir", str(tmp_path / "bad")]) == 2
    assert "epochs=0 (--epochs) must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit): main(["grpo", "--epochs", "2"])   # GRPO draws prompts without end: no such flag


@pytest.mark.parametrize("ga", [1, 2])
def test_eval_at_the_end_of_each_epoch(tmp_path, ga):
    """--eval-each-epoch: 3 epochs of 5 micro-batches; the held-out metrics are in the rows of the steps where epochs 1 and
    2 end (the third's is the final eval), and in no other row; without --epochs it is refused."""
    t = Trainer(_cfg(tmp_path / "run", epochs=3, grad_accum_steps=ga, eval_each_epoch=True))
    t.fit(progress=False)
    ends = {-(-5 * e // ga) for e in (1, 2)}   # the step holding an epoch's last micro-batch
    evaluated = {m["step"] for m in t.metrics if "eval_loss" in m and m["step"] < t.config.max_steps}
    assert evaluated == ends, (evaluated, ends)
    with pytest.raises(ValueError, match="eval_each_epoch.*give --epochs N"):
        Trainer(_cfg(tmp_path / "x", epochs=None, eval_each_epoch=True)).setup()
