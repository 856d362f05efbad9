"""Two "nodes" of one process each on localhost, joined by torchrun's c10d rendezvous (`tunebook finetune --nnodes 2
--nproc-per-node 1 --rdzv-endpoint HOST:PORT`, one command per node), against the same run in one process."""
import os
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from conftest import HANG

from tunebook.checkpoint import load_hf, save_hf
from tunebook.data import make_task
from tunebook.launch import free_port
from tunebook.model import build_model, pico
from tunebook.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "pico"
    rows = make_task("reverse", 300, seed=0)
    tok = train_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=300)
    torch.manual_seed(0)
    save_hf(build_model(pico(vocab_size=tok.vocab_size, dim=32, hidden_dim=64, tie_embeddings=False)), d)
    tok.save(d)
    return d


def _argv(model_dir, out, *extra):
    return [sys.executable, "-m", "tunebook.cli", "finetune", "--quiet", "--model", str(model_dir), "--task", "reverse",
            "--n-train", "64", "--eval-samples", "2", "--max-new-tokens", "4", "--batch-size", "8", "--max-steps", "3",
            "--lr", "1e-3", "--warmup-steps", "0", "--dtype", "fp32", "--method", "full", "--output-dir", str(out), *extra]


def _nodes(argv, n=2, env=None):
    "Start the same command as `n` nodes of one process each, rendezvous on localhost; (returncode, output) of each."
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen(argv + ["--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                      "--rdzv-id", f"t{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(n)]
    return [(p.wait(timeout=HANG), p.stdout.read()) for p in procs]


@pytest.mark.slow
def test_two_nodes_match_one_process(model_dir, tmp_path):
    t0 = time.time()
    r = subprocess.run(_argv(model_dir, tmp_path / "one"), capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=HANG)
    assert r.returncode == 0, r.stderr[-3000:]
    nodes = _nodes(_argv(model_dir, tmp_path / "two"))
    for rc, out in nodes: assert rc == 0, out[-4000:]
    one, two = pd.read_csv(tmp_path / "one" / "metrics.csv"), pd.read_csv(tmp_path / "two" / "metrics.csv")
    assert len(two) == 3 and (one["loss"] - two["loss"]).abs().max() <= 1e-5, (one["loss"].tolist(), two["loss"].tolist())
    a, b = load_hf(tmp_path / "one" / "model"), load_hf(tmp_path / "two" / "model")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= 1e-5
    # rank 0 of the job alone writes: one line per step in metrics.csv, one run header in log.txt
    assert (tmp_path / "two" / "log.txt").read_text().count("tokens/s") <= (tmp_path / "one" / "log.txt").read_text().count("tokens/s")
    print(f"two nodes vs one process: {time.time() - t0:.0f} s")


def test_nnodes_needs_an_endpoint(model_dir, tmp_path):
    r = subprocess.run(_argv(model_dir, tmp_path / "o") + ["--nnodes", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs --rdzv-endpoint HOST:PORT" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(_argv(model_dir, tmp_path / "o") + ["--nnodes", "2", "--rdzv-endpoint", "node001"], capture_output=True, text=True)
    assert r.returncode == 2 and "is not HOST:PORT" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(_argv(model_dir, tmp_path / "o") + ["--nnodes", "3", "--rdzv-endpoint", "h:1"], capture_output=True, text=True)
    assert r.returncode == 2 and "multiple of nnodes x nproc=3" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_hsdp_on_two_nodes_matches_one_process(model_dir, tmp_path):
    """`--nnodes 2 --nproc-per-node 2 --mesh dp_replicate=2,dp_shard=2`: shards inside each node, a replica per node."""
    t0 = time.time()
    r = subprocess.run(_argv(model_dir, tmp_path / "one"), capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=HANG)
    assert r.returncode == 0, r.stderr[-3000:]
    port = free_port()
    argv = _argv(model_dir, tmp_path / "hsdp") + ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                                  "--rdzv-id", f"h{port}", "--mesh", "dp_replicate=2,dp_shard=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=HANG) == 0, p.stdout.read()[-4000:]
    one, hsdp = pd.read_csv(tmp_path / "one" / "metrics.csv"), pd.read_csv(tmp_path / "hsdp" / "metrics.csv")
    assert (one["loss"] - hsdp["loss"]).abs().max() <= 1e-5, (one["loss"].tolist(), hsdp["loss"].tolist())
    a, b = load_hf(tmp_path / "one" / "model"), load_hf(tmp_path / "hsdp" / "model")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= 1e-5
    print(f"HSDP 2 nodes x 2 processes vs one process: {time.time() - t0:.0f} s")


def test_mesh_options_are_checked(model_dir, tmp_path):
    r = subprocess.run(_argv(model_dir, tmp_path / "o") + ["--nproc", "2", "--mesh", "dp=1,tp=2", "--chunked-ce", "4"],
                       capture_output=True, text=True)   # what a tp mesh cannot do is said before any process starts
    assert r.returncode == 2 and "with tp: lm_head is already split over the vocabulary" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(_argv(model_dir, tmp_path / "o") + ["--nproc", "2", "--mesh", "dp_replicate=2,dp_shard=2"], capture_output=True, text=True)
    assert r.returncode == 2 and "has 4 ranks but the run starts 2 process(es)" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_killed_two_node_run_resumes(model_dir, tmp_path):
    """Both nodes killed (SIGKILL) after the step-2 checkpoint; the same command with --resume ends where an
    uninterrupted run in one process ends (losses of the resumed steps and weights within 1e-5)."""
    import signal
    t0 = time.time()
    steps = ["--max-steps", "5", "--save-every", "2"]
    r = subprocess.run(_argv(model_dir, tmp_path / "one") + steps, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=HANG)
    assert r.returncode == 0, r.stderr[-3000:]
    out, port = tmp_path / "two", free_port()
    argv = _argv(model_dir, out) + steps + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                            "--rdzv-id", f"k{port}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True) for _ in range(2)]
    deadline = time.time() + HANG
    while not (out / "checkpoints" / "step_000002").exists() and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    assert (out / "checkpoints" / "step_000002").exists(), "no checkpoint at step 2"
    for p in procs: os.killpg(p.pid, signal.SIGKILL)
    for p in procs: p.wait()
    assert not (out / "summary.json").exists()   # killed before the end
    nodes = _nodes(_argv(model_dir, out) + steps + ["--resume"])
    for rc, text in nodes: assert rc == 0, text[-4000:]
    one, two = pd.read_csv(tmp_path / "one" / "metrics.csv"), pd.read_csv(out / "metrics.csv")
    assert two["step"].tolist()[-3:] == [3, 4, 5] and (two["step"] == 1).sum() == 1   # went on from the checkpoint, not from step 0
    assert not any("starts at step 0" in text for _, text in nodes)
    assert (one.set_index("step")["loss"] - two.drop_duplicates("step", keep="last").set_index("step")["loss"]).abs().max() <= 1e-5
    a, b = load_hf(tmp_path / "one" / "model"), load_hf(out / "model")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= 1e-5
    print(f"killed and resumed on 2 nodes: {time.time() - t0:.0f} s")
