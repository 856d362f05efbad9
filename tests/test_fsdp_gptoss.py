"""FSDP2 on gpt-oss: a small gpt-oss (sinks, alternating windows, biased experts sharded on the expert dimension, the
load-balancing loss summed over ranks) trains on two gloo ranks exactly as in one process (test_fsdp_families' loop)."""
import pytest
import torch

import test_fsdp_families as fam
from conftest import HANG
from tunebook.launch import launch, max_processes
from tunebook.memory import fsdp_memory
from tunebook.model import build_model, gpt_oss_20b

pytestmark = pytest.mark.skipif(max_processes("gloo") < 2, reason="needs 2 CPU cores for 2 gloo ranks")

# 2 layers (sliding, full; window 4 < T = 12); 4 experts (2 per rank) of width 16, 2 per token; a large aux coefficient
fam.FAMILIES["gpt_oss"] = gpt_oss_20b(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=16, moe_hidden_dim=16,
                                      n_experts=4, experts_per_token=2, vocab_size=128, sliding_window=4, max_seq_len=64,
                                      router_aux_loss_coef=0.5)


def train_gpt_oss():
    return {summed: fam.train("gpt_oss", summed=summed) for summed in (False, True)}


@pytest.fixture(scope="module")
def two_rank_runs():
    return launch(train_gpt_oss, nproc=2, verbose=False, timeout=HANG)


@pytest.mark.parametrize("summed", [False, True], ids=["mean", "summed"])
def test_fsdp_gpt_oss_matches_one_process(two_rank_runs, summed):
    ref_losses, ref_aux, ref_w, _ = fam.train("gpt_oss", summed=summed)
    (l0, a0, w0, b0), (l1, a1, w1, b1) = two_rank_runs[0][summed], two_rank_runs[1][summed]
    assert b0 == b1 == fsdp_memory(build_model(fam.FAMILIES["gpt_oss"], device="meta", init=False), 2)["parameters"]
    assert l0 == l1 and a0 == a1 and min(ref_aux) > 0
    torch.testing.assert_close(torch.tensor(l0), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(a0), torch.tensor(ref_aux), rtol=0, atol=1e-6)
    init = build_model(fam.FAMILIES["gpt_oss"]).state_dict()
    for k, v in ref_w.items():
        torch.testing.assert_close(w0[k], v, rtol=0, atol=1e-5, msg=k)
        torch.testing.assert_close(w1[k], v, rtol=0, atol=1e-5, msg=k)
    # sinks, the router (weight and bias) and every expert tensor moved
    assert all(not torch.equal(ref_w[k], init[k]) for k in ref_w if "experts" in k or "router" in k or "sinks" in k)
