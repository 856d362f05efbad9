"""`bash bench/device.sh --smoke`: the GPU benchmark script run on the CPU with tiny shapes, so that it cannot rot.

The bench peers (torchtune 0.6.1 with torchao 0.15.0, transformers, peft) live beside tunebook in the python
that device.sh uses: $TUNEBOOK_BENCH_PY, else this test's own interpreter. Without them the test is skipped.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG, built_once

ROOT = Path(__file__).resolve().parents[1]
PY = os.environ.get("TUNEBOOK_BENCH_PY", sys.executable)
FRAMEWORKS = ("tunebook", "torchtune", "transformers+peft")
METHODS = ("lora", "full", "model")


def _peers_missing():
    r = subprocess.run([PY, "-c", "import torchtune, torchao, transformers, peft"], capture_output=True, text=True)
    return r.returncode != 0 and (r.stderr.strip().splitlines() or ["?"])[-1]


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    "One `device.sh --smoke` run per session, whichever xdist workers draw these tests (conftest.built_once): its files and output."
    missing = _peers_missing()
    if missing:
        pytest.skip(f"bench peers not importable in {PY} ({missing}); install them with "
                    "`pip install -e '.[bench,dev]'` in a separate venv and set TUNEBOOK_BENCH_PY to its python")
    def build(d):
        env = dict(os.environ, TUNEBOOK_BENCH_PY=PY, OMP_NUM_THREADS="1")
        p = subprocess.run(["bash", "bench/device.sh", "--smoke", "--json", str(d / "device.json")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=HANG)   # a hang guard: a loaded machine is slow, not broken
        (d / "run.json").write_text(json.dumps(dict(rc=p.returncode, stdout=p.stdout, stderr=p.stderr)))
    return built_once(tmp_path_factory, "bench-smoke", build)


@pytest.fixture(scope="module")
def smoke(bench_dir):
    p = json.loads((bench_dir / "run.json").read_text())
    assert p["rc"] == 0, p["stdout"][-3000:] + p["stderr"][-3000:]
    line = [l for l in p["stdout"].splitlines() if l.startswith("BENCH_JSON ")]
    assert len(line) == 1, p["stdout"][-3000:]
    return json.loads(line[0].removeprefix("BENCH_JSON ")), json.loads((bench_dir / "device.json").read_text()), p["stdout"]


def test_smoke_json_has_every_row(smoke):
    printed, written, _ = smoke
    assert printed == written  # the JSON it prints is the file it writes
    got = {(r["framework"], r["method"], r["compile"], r["liger"]) for r in printed["rows"]}
    want = {(f, m, c, False) for f in FRAMEWORKS for m in METHODS for c in (False, True)}
    assert got == want, (want - got, [s for s in printed["skipped"] if not s["liger"]])
    # Liger is CUDA-only: on the CPU its rows are listed as skipped, with the reason
    assert {(s["method"], s["compile"]) for s in printed["skipped"] if s["liger"]} == {(m, c) for m in METHODS for c in (False, True)}
    assert all("CUDA" in s["reason"] for s in printed["skipped"])
    assert printed["device"] == "cpu" and printed["published_bf16_peak"] is None and printed["ok"] is True


def test_smoke_numbers_finite(smoke):
    res = smoke[0]
    assert math.isfinite(res["measured_bf16_matmul"]) and res["measured_bf16_matmul"] > 0
    for r in res["rows"]:
        for k in ("tokens_per_s", "median_step_s", "model_flops_per_s", "mfu_measured", "loss_first", "loss_last"):
            assert isinstance(r[k], float) and math.isfinite(r[k]), (r["framework"], r["method"], k, r[k])
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 and r["mfu"] is None
        # the rate is the tokens of one batch over the median step
        assert r["tokens_per_s"] == pytest.approx(res["config"]["batch"] * res["config"]["seq"] / r["median_step_s"], rel=1e-9)


def test_smoke_same_problem_everywhere(smoke):
    "Same weights, batch and LoRA init: every configuration of a method starts from the same loss (bf16 tolerance)."
    res = smoke[0]
    for m in METHODS:
        first = [r["loss_first"] for r in res["rows"] if r["method"] == m]
        assert max(first) - min(first) <= 2e-2, (m, first)
        assert res["loss_spread"][m] == pytest.approx(max(first) - min(first))
    # LoRA trains r * (in + out) per adapted projection in every framework; full and model train everything
    by = {(r["framework"], r["method"]): r["trainable_params"] for r in res["rows"]}
    for m in METHODS: assert len({by[f, m] for f in FRAMEWORKS}) == 1, (m, {f: by[f, m] for f in FRAMEWORKS})
    s = res["shape"]
    d, f, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    hd = d // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    r = res["config"]["rank"]
    assert by["tunebook", "lora"] == L * r * ((d + q) * 2 + (d + kv) * 2 + 3 * (d + f))


def test_smoke_prints_table(smoke):
    out = smoke[2]
    assert "MFU*" in out and "first-step loss spread by method" in out
    assert not [l for l in out.splitlines() if "liger=True" in l and "tok/s" in l]  # Liger rows are not run on the CPU


# ---- the ragged-epoch row (bench/bench_epoch.py --smoke --methods lora, run by device.sh --smoke beside the above)
EPOCH_ENTRIES = {("tunebook", "default"), ("tunebook", "packed"), ("tunebook", "padded"), ("trl", "grouped"), ("torchtune", "packed")}


@pytest.fixture(scope="module")
def epoch(smoke, bench_dir):
    line = [l for l in smoke[2].splitlines() if l.startswith("EPOCH_JSON ")]
    assert len(line) == 1, smoke[2][-3000:]
    res = json.loads(line[0].removeprefix("EPOCH_JSON "))
    assert res == json.loads((bench_dir / "device_epoch.json").read_text())   # what it prints is what it writes
    return res


def test_epoch_every_framework_ran(epoch):
    assert {(r["framework"], r["mode"]) for r in epoch["rows"]} == EPOCH_ENTRIES
    assert not [r for r in epoch["rows"] if "error" in r], [r["error"] for r in epoch["rows"] if "error" in r]
    assert all(r["method"] == "lora" for r in epoch["rows"]) and epoch["smoke"] is True
    assert "flags" in epoch["cpu"] and epoch["cpu"].split(",")[0]   # the CPU is named, with its flags
    d = epoch["data"]
    assert 0 < d["min"] <= d["median"] <= d["p90"] <= d["max"] <= 128 and d["rows"] == 12 and d["eval_rows"] == 4


def test_epoch_same_rows_everywhere(epoch):
    "Each framework rendered/read the same rows: it trains exactly the response tokens, and computes each row's tokens once."
    d = epoch["data"]
    for r in epoch["rows"]:
        assert r["trained_tokens"] == d["label_tokens"], (r["framework"], r["mode"], r["trained_tokens"], d["label_tokens"])
        real = r["computed_tokens"] * (1 - r["padding_waste"])   # padding waste = padded positions / computed positions
        assert real == pytest.approx(d["tokens"], abs=0.5), (r["framework"], r["mode"], real, d["tokens"])
        assert r["trained_tokens_per_s"] == pytest.approx(r["trained_tokens"] / r["epoch_s"], rel=1e-9)


def test_epoch_common_evaluator(epoch):
    "One evaluator scores every result: finite, and one epoch of LoRA lowers the held-out loss of the untrained model."
    base = epoch["eval_loss_base"]
    assert math.isfinite(base) and 1.0 < base < 10.0, base
    for r in epoch["rows"]:
        assert math.isfinite(r["eval_loss"]) and r["eval_loss"] < base - 0.05, (r["framework"], r["mode"], r["eval_loss"], base)
        assert r["peak_rss"] > 2**28 and r["epoch_s"] > 0


def test_epoch_prints_table(epoch, smoke):
    out = smoke[2]
    assert "tokens per row min" in out and "held-out loss of the untrained model" in out and "CPU: " in out
    assert len([l for l in out.splitlines() if l.startswith("lora ")]) == len(EPOCH_ENTRIES)
