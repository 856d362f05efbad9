"""FSDP2 on the newer families: a small Qwen3-MoE (stacked expert weights sharded on the expert dimension, the router's
load-balancing loss summed over ranks), a small Qwen3.5 (Gated DeltaNet blocks) and a small Qwen3.5-MoE (DeltaNet and
attention layers with routed and shared experts) train on two gloo ranks exactly as in one process; a DCP checkpoint two ranks wrote consolidates to a folder transformers loads."""
import pytest
import torch

from conftest import HANG
from tunebook.distributed import consolidate_to_hf, shard_model
from tunebook.launch import launch, max_processes
from tunebook.memory import fsdp_memory
from tunebook.model import ModelConfig, build_model, qwen3_30b_a3b

pytestmark = pytest.mark.skipif(max_processes("gloo") < 2, reason="needs 2 CPU cores for 2 gloo ranks")

LR, STEPS, B, T, EPS = 2e-3, 3, 4, 12, 1e-5   # eps: see test_distributed
FAMILIES = {
    # 2 layers, layer 1 dense; 4 experts (2 per rank) of width 16, 2 per token; a large coefficient so the aux loss counts
    "qwen3_moe": qwen3_30b_a3b(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, moe_hidden_dim=16,
                               n_experts=4, experts_per_token=2, vocab_size=128, mlp_only_layers=[1], router_aux_loss_coef=0.5),
    "qwen3_5": ModelConfig(arch="qwen3_5_text", vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                           head_dim=8, layer_types=["linear_attention", "full_attention"], linear_key_heads=2,
                           linear_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
    # Qwen3.5-MoE: a DeltaNet and an attention layer, each with 4 routed experts and a sigmoid-gated shared expert
    "qwen3_5_moe": ModelConfig(arch="qwen3_5_moe_text", vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=16,
                               head_dim=8, qk_norm=True, attn_output_gate=True, layer_types=["linear_attention", "full_attention"],
                               linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               n_experts=4, experts_per_token=2, moe_hidden_dim=16, norm_topk_prob=True, shared_expert_dim=24,
                               router_aux_loss_coef=0.5),
}


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (B, T), generator=g)
        labels = tokens.roll(-1, 1)
        labels[:, -1] = -100
        labels[0, :5] = -100          # uneven loss tokens across ranks
        out.append((tokens, labels))
    return out


def train(name, ckpt=None, summed=False):
    """STEPS AdamW steps of family `name`, sharded over the process group when there is one; losses, aux losses, weights.
    summed: the training step's form (summed token loss + aux x the micro-batch's units, then divided), else a mean loss."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from tunebook.distributed import dp_loss, dp_router_aux_loss, global_mean, save_distributed
    torch.manual_seed(0)
    model = build_model(FAMILIES[name])
    ws, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if ws > 1:
        shard_model(model)
        experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
        for e in experts:    # the 3-D expert weights are split on dim 0: each rank holds half the experts
            assert e.gate_proj.to_local().shape[0] == FAMILIES[name].n_experts // ws
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, auxes = [], []
    for tokens, labels in _batches():
        tokens, labels = tokens.chunk(ws)[rank], labels.chunk(ws)[rank]
        logits = model(tokens)
        s = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        n = (labels != -100).sum()
        if ws > 1:
            term, aux = dp_router_aux_loss(model, n if summed else None)
            (dp_loss(s + term, n) if summed else dp_loss(s, n) + term).backward()
        else:
            term = model.router_aux_loss(); aux = float(term.detach()) if torch.is_tensor(term) else term
            ((s + term * n) / n if summed else s / n + term).backward()
        opt.step(); opt.zero_grad()
        losses.append(global_mean(s, n)); auxes.append(aux)
    if ckpt: save_distributed(ckpt, model)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    return losses, auxes, {k: full(v) for k, v in model.state_dict().items()}, held


CASES = [("qwen3_moe", False), ("qwen3_moe", True), ("qwen3_5", False), ("qwen3_5_moe", True)]


def train_both(ckpt):
    return {(name, summed): train(name, ckpt if (name, summed) == ("qwen3_moe", False) else None, summed) for name, summed in CASES}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("dcp") / "moe"
    return launch(train_both, nproc=2, args=(str(ckpt),), verbose=False, timeout=HANG), ckpt


@pytest.mark.parametrize("name,summed", CASES, ids=["moe-mean", "moe-summed", "qwen3_5", "qwen3_5_moe"])
def test_fsdp_moe_and_deltanet_match_one_process(two_rank_runs, name, summed):
    runs, _ = two_rank_runs
    ref_losses, ref_aux, ref_w, _ = train(name, summed=summed)
    (l0, a0, w0, b0), (l1, a1, w1, b1) = runs[0][name, summed], runs[1][name, summed]
    # the shard arithmetic of fsdp_memory (3-D expert weights chunked on dim 0) is what the fuller rank holds (Qwen3.5-MoE's
    # (1, dim) shared-expert gate has its one row on rank 0)
    assert max(b0, b1) == fsdp_memory(build_model(FAMILIES[name], device="meta", init=False), 2)["parameters"]
    assert b0 == b1 or name == "qwen3_5_moe"
    assert l0 == l1 and a0 == a1
    torch.testing.assert_close(torch.tensor(l0), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(a0), torch.tensor(ref_aux), rtol=0, atol=1e-6)
    if name in ("qwen3_moe", "qwen3_5_moe"): assert min(ref_aux) > 0
    init, moved = build_model(FAMILIES[name]).state_dict(), 0
    for k, v in ref_w.items():
        torch.testing.assert_close(w0[k], v, rtol=0, atol=1e-5, msg=k)
        torch.testing.assert_close(w1[k], v, rtol=0, atol=1e-5, msg=k)
        moved += not torch.equal(v, init.get(k, v))
    assert moved > 0
    if name in ("qwen3_moe", "qwen3_5_moe"):   # every expert's weights, the router (and the shared expert) moved
        assert all(not torch.equal(ref_w[k], init[k]) for k in ref_w if "expert" in k or "gate.weight" in k)
    else:
        assert any("linear_attn" in k and not torch.equal(v, init[k]) for k, v in ref_w.items())


def test_dcp_moe_consolidates_to_hf(two_rank_runs, tmp_path):
    import transformers
    runs, ckpt = two_rank_runs
    out = consolidate_to_hf(ckpt, tmp_path / "hf", FAMILIES["qwen3_moe"])
    ref = build_model(FAMILIES["qwen3_moe"]).eval()
    ref.load_state_dict(runs[0]["qwen3_moe", False][2])
    tokens = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ref(tokens), rtol=0, atol=1e-5)
