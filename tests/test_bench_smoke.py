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

from conftest import HANG

ROOT = Path(__file__).resolve().parents[1]
PY = os.environ.get("TUNEBOOK_BENCH_PY", sys.executable)
FRAMEWORKS = ("tunebook", "torchtune", "transformers+peft")
METHODS = ("lora", "full", "model")


def _peers_missing():
    r = subprocess.run([PY, "-c", "import torchtune, torchao, transformers, peft"], capture_output=True, text=True)
    return r.returncode != 0 and (r.stderr.strip().splitlines() or ["?"])[-1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    missing = _peers_missing()
    if missing:
        pytest.skip(f"bench peers not importable in {PY} ({missing}); install them with "
                    "`pip install -e '.[bench,dev]'` in a separate venv and set TUNEBOOK_BENCH_PY to its python")
    js = tmp_path_factory.mktemp("bench") / "device.json"
    env = dict(os.environ, TUNEBOOK_BENCH_PY=PY, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", "bench/device.sh", "--smoke", "--json", str(js)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=HANG)   # a hang guard: a loaded machine is slow, not broken
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("BENCH_JSON ")]
    assert len(line) == 1, p.stdout[-3000:]
    return json.loads(line[0].removeprefix("BENCH_JSON ")), json.loads(js.read_text()), p.stdout


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
