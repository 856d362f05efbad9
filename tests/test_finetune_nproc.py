"""`tunebook finetune --nproc 2` (torchrun, gloo, FSDP2) against the same run in one process."""
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from conftest import HANG

from tunebook.checkpoint import load_hf, save_hf
from tunebook.data import make_task
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


def _run(model_dir, out, nproc, *extra):
    argv = [sys.executable, "-m", "tunebook.cli", "finetune", "--quiet", "--model", str(model_dir), "--task", "reverse",
            "--n-train", "64", "--eval-samples", "2", "--max-new-tokens", "4", "--batch-size", "8", "--max-steps", "3",
            "--lr", "1e-3", "--warmup-steps", "0", "--dtype", "fp32", "--nproc", str(nproc), "--output-dir", str(out), *extra]
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=HANG)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return pd.read_csv(out / "metrics.csv")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_processes_match_one(model_dir, tmp_path, method):
    one = _run(model_dir, tmp_path / "one", 1, "--method", method)
    two = _run(model_dir, tmp_path / "two", 2, "--method", method)
    assert (one["loss"] - two["loss"]).abs().max() <= 1e-5, (one["loss"].tolist(), two["loss"].tolist())
    a, b = load_hf(tmp_path / "one" / "model"), load_hf(tmp_path / "two" / "model")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= 1e-5


@pytest.mark.slow
def test_two_processes_padding_free_match_one_padded(model_dir, tmp_path):
    "Each process lays its share of a batch's rows end to end: the same losses and weights as one process padding them."
    one = _run(model_dir, tmp_path / "one", 1, "--method", "lora", "--no-padding-free")
    two = _run(model_dir, tmp_path / "two", 2, "--method", "lora", "--padding-free")
    assert (one["loss"] - two["loss"]).abs().max() <= 1e-5, (one["loss"].tolist(), two["loss"].tolist())
    a, b = load_hf(tmp_path / "one" / "model"), load_hf(tmp_path / "two" / "model")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= 1e-5


def test_nproc_must_divide_batch(model_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--model", str(model_dir), "--nproc", "3",
                        "--batch-size", "8", "--output-dir", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and "multiple of nproc=3" in r.stderr


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused(model_dir, tmp_path):
    _run(model_dir, tmp_path / "run", 2, "--method", "full")
    r = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--quiet", "--model", str(model_dir), "--task", "reverse",
                        "--n-train", "64", "--eval-samples", "2", "--batch-size", "8", "--max-steps", "5", "--lr", "1e-3",
                        "--warmup-steps", "0", "--method", "full", "--max-new-tokens", "4", "--resume",
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True)
    assert r.returncode == 2 and "nproc was 2, now 1" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_second_run_exports_its_own_weights(model_dir, tmp_path):
    """F16: run A (seed 1, 3 steps) then run B (seed 2, 2 steps) into one folder with --nproc 2. B's model/ must be
    B's weights (equal to B in one process), never A's newer-numbered checkpoint."""
    _run(model_dir, tmp_path / "shared", 2, "--method", "full", "--seed", "1")
    a = load_hf(tmp_path / "shared" / "model")
    _run(model_dir, tmp_path / "shared", 2, "--method", "full", "--seed", "2", "--max-steps", "2")
    _run(model_dir, tmp_path / "one", 1, "--method", "full", "--seed", "2", "--max-steps", "2")
    b, ref = load_hf(tmp_path / "shared" / "model"), load_hf(tmp_path / "one" / "model")
    pa, pb, pr = dict(a.named_parameters()), dict(b.named_parameters()), dict(ref.named_parameters())
    assert max((pb[n] - pr[n]).abs().max().item() for n in pb) <= 1e-5
    assert max((pb[n] - pa[n]).abs().max().item() for n in pb) > 1e-4
    assert sorted(p.name for p in (tmp_path / "shared" / "checkpoints").iterdir()) == ["step_000002"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, 2 per token, router_aux_loss_coef 0.5) with the reverse task's tokenizer."""
    from conftest import hf_model
    d = tmp_path_factory.mktemp("moe") / "moe"
    rows = make_task("reverse", 300, seed=0)
    tok = train_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=300)
    hf = hf_model("qwen3_moe", seed=0, vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, router_aux_loss_coef=0.5,
                  tie_word_embeddings=False)
    hf.save_pretrained(d); tok.save(d)
    return d


@pytest.mark.slow
def test_two_processes_match_one_on_an_moe(moe_dir, tmp_path):
    """The load-balancing loss of the whole batch, not each rank's: two processes train the MoE as one does."""
    one = _run(moe_dir, tmp_path / "one", 1, "--method", "full")
    two = _run(moe_dir, tmp_path / "two", 2, "--method", "full")
    assert (one["loss"] - two["loss"]).abs().max() <= 1e-5, (one["loss"].tolist(), two["loss"].tolist())
    assert (one["router_aux_loss"] - two["router_aux_loss"]).abs().max() <= 1e-6
    a, b = load_hf(tmp_path / "one" / "model"), load_hf(tmp_path / "two" / "model")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= 1e-5
