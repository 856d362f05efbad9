"""`tunebook finetune` end to end, as a user runs it: a subprocess, no arguments but the output folder."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_help_lists_every_option():
    from dataclasses import fields
    from tunebook.train import TrainConfig
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for f in fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in out.stdout


@pytest.mark.slow
def test_finetune_default_end_to_end(tmp_path):
    """The embedded default: under 5 minutes on 2 cores, held-out exact match up by >= 50 points."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--output-dir", str(tmp_path / "run"), "--quiet"],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "2"})
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    for name in ("config.json", "metrics.csv", "loss.png", "summary.json", "model/config.json", "model/model.safetensors",
                 "model/tokenizer.json", "adapter/adapter_config.json"):
        assert (run / name).exists(), name
    s = json.loads((run / "summary.json").read_text())
    print(json.dumps(s, indent=1), f"wall {wall:.0f} s", sep="\n")
    assert s["eval_accuracy_after"] - s["eval_accuracy_before"] >= 0.5, s
    assert wall < 300, f"took {wall:.0f} s"
    for k in ("tokens_per_second", "peak_memory_bytes"):
        assert s[k] > 0


@pytest.mark.slow
def test_qlora_finetune_still_gains(tmp_path):
    """QLoRA (NF4 base, --quantize-base) on the embedded default still shows the accuracy gain."""
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--quantize-base", "--eval-samples", "100",
                          "--output-dir", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["method"] == "qlora"
    assert s["eval_accuracy_after"] - s["eval_accuracy_before"] >= 0.5, s
