"""2-D meshes on 4 gloo processes (2 cores: oversubscribed) against one process on the same batches: HSDP 2x2, and
FSDP 2 x TP 2 with loss parallel for a full fine-tune (also with sequence parallel on the norms), LoRA and DPO;
distributed checkpoints resharded 4 -> 2 -> 1."""
import contextlib
import time

import pytest
import torch

from conftest import HANG

from tunebook.launch import launch

LR, EPS, STEPS, B, T = 2e-3, 1e-5, 2, 4, 16   # eps: see test_distributed (Adam at the fp32 noise floor)
TOL = 1e-5
CASES = [("dp_replicate=2,dp_shard=2", "full"), ("dp=2,tp=2", "full"), ("dp=2,tp=2", "full-sp"), ("dp=2,tp=2", "lora"),
         ("dp=2,tp=2", "dpo")]   # full-sp: sequence parallel, the norms and residual adds on half of the tokens each


def _batches(pairs=False):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 512, (2 * B if pairs else B, T), generator=g)
        labels = tokens.roll(-1, 1)
        labels[:, -1] = -100
        labels[:, :4] = -100            # the prompt
        labels[0, 4:7] = -100           # uneven loss tokens across ranks: the normalisation must be global
        out.append((tokens, labels))
    return out


def _model(kind):
    from tunebook.lora import apply_lora
    from tunebook.model import build_model, pico
    torch.manual_seed(0)
    model = build_model(pico(n_layers=2, tie_embeddings=False))
    if kind == "lora": apply_lora(model, rank=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    return model


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(spec=None, kind="full", save=None):
    """STEPS steps of `kind` on a pico model, on the mesh `spec` (None: one process). Returns (losses, weights)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel
    from tunebook.distributed import dp_loss, global_mean, save_distributed
    from tunebook.dpo import dpo_loss
    from tunebook.logprobs import token_logprobs
    from tunebook.mesh import build_mesh, data_rank, parallelize
    model = _model(kind)
    mesh = build_mesh(spec) if spec else None
    if mesh is not None: parallelize(model, mesh, sequence_parallel=kind == "full-sp")
    r, n = data_rank(mesh)
    tp = mesh is not None and "tp" in mesh.mesh_dim_names
    lp = loss_parallel if tp else contextlib.nullcontext
    local = lambda x: x.to_local() if hasattr(x, "to_local") else x   # a replicated DTensor: every TP rank holds the whole value
    def seq_logprobs(tokens, labels):   # (pairs, 2): chosen and rejected rows interleaved
        return local(token_logprobs(model(tokens), labels).sum(-1)).view(-1, 2)
    data = _batches(pairs=kind == "dpo")
    if kind == "dpo":   # the reference: the model before training, as DPO's frozen copy would score it
        with torch.no_grad(), lp(): refs = [seq_logprobs(t.chunk(n)[r], l.chunk(n)[r]) for t, l in data]
        # FSDP2 leaves the root's parameters (embeddings, final norm, lm_head) gathered after a forward under no_grad:
        # reshard, so that model.parameters(), and the optimizer built next, are the shards that training updates
        if hasattr(model, "reshard"): model.reshard()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    losses = []
    for i, (tokens, labels) in enumerate(data):
        tokens, labels = tokens.chunk(n)[r], labels.chunk(n)[r]
        with lp():
            if kind == "dpo":
                pol = seq_logprobs(tokens, labels)
                s = dpo_loss(pol[:, 0], pol[:, 1], refs[i][:, 0], refs[i][:, 1], beta=0.5)[0].sum()
                units = pol.shape[0]
            else:
                s = local(F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(), reduction="sum"))
                units = (labels != -100).sum()
            (dp_loss(s, units) if mesh is not None else s / units).backward()
        opt.step(); opt.zero_grad()
        losses.append(global_mean(s, units) if mesh is not None else (s / units).item())
    if save: save_distributed(save, model, opt)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    nbytes = sum(local(p).numel() * local(p).element_size() for p in model.parameters())   # this rank's parameter bytes
    return losses, {k: full(v) for k, v in model.state_dict().items()}, nbytes


def on_four(ckpt_dir):
    out = {}
    for spec, kind in CASES:
        save = f"{ckpt_dir}/{spec.split('=')[0]}-{kind}" if kind == "full" else None
        t0 = time.time()
        out[spec, kind] = (*train(spec, kind, save), time.time() - t0)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp")
    t0 = time.time()
    out = launch(on_four, nproc=4, args=(str(d),), oversubscribe=True, verbose=False, timeout=HANG)
    print(f"\n4 ranks, {len(CASES)} cases: {time.time() - t0:.0f} s")
    return d, out


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_mesh_matches_one_process(four, case):
    _, runs = four
    ref_losses, ref_w, _ = train(None, case[1])
    init = _model(case[1]).state_dict()
    for rank in range(4):
        losses, w, _, secs = runs[rank][case]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
        for k, v in ref_w.items(): torch.testing.assert_close(w[k], v, rtol=0, atol=TOL, msg=k)
    assert sum(not torch.equal(v, init[k]) for k, v in ref_w.items()) > 0   # training moved weights
    print(f"{case}: {secs:.1f} s on 4 ranks, losses {losses}")


def test_per_rank_estimate_is_what_the_ranks_hold(four):
    """`fsdp_memory(model, dp, tp=)` (the estimator's per-rank formula) against the parameter bytes each rank holds."""
    from tunebook.memory import fsdp_memory
    _, runs = four
    for spec, tp in (("dp_replicate=2,dp_shard=2", 1), ("dp=2,tp=2", 2)):
        held = max(runs[r][spec, "full"][2] for r in range(4))
        assert held == fsdp_memory(_model("full"), 2, tp=tp)["parameters"], (spec, held)
    assert runs[0]["dp=2,tp=2", "full"][2] < runs[0]["dp_replicate=2,dp_shard=2", "full"][2]   # the projections split 4 ways, HSDP shards them 2 ways


def reload(src, dst):
    """Load the HSDP checkpoint `src` on this world's 1-D FSDP mesh, save it again to `dst`; the weights loaded."""
    import torch.distributed as dist
    from tunebook.distributed import load_distributed, save_distributed, shard_model
    model = _model("full")
    if dist.is_initialized(): shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    load_distributed(src, model, opt)
    save_distributed(dst, model, opt)
    return {k: full(v) for k, v in model.state_dict().items()}


def test_checkpoints_reshard_4_2_1(four, tmp_path):
    """HSDP on 4 ranks -> FSDP on 2 -> one process, and FSDP x TP on 4 -> one process: bitwise for the weights;
    the Hugging Face folder is the same bytes whichever mesh wrote the checkpoint."""
    from tunebook.distributed import consolidate_to_hf, load_distributed
    from tunebook.model import pico
    d, runs = four
    trained = runs[0][CASES[0]][1]
    on_two = launch(reload, nproc=2, args=(str(d / "dp_replicate-full"), str(tmp_path / "two")), verbose=False, timeout=HANG)
    for w in on_two:
        for k, v in trained.items(): assert torch.equal(w[k], v), k
    one = reload(tmp_path / "two", tmp_path / "one")
    for k, v in trained.items(): assert torch.equal(one[k], v), k
    tp = _model("full")
    load_distributed(d / "dp-full", tp)
    for k, v in runs[0][CASES[1]][1].items(): assert torch.equal(tp.state_dict()[k], v), k
    a = consolidate_to_hf(d / "dp_replicate-full", tmp_path / "hf4", pico(n_layers=2, tie_embeddings=False))
    b = consolidate_to_hf(tmp_path / "one", tmp_path / "hf1", pico(n_layers=2, tie_embeddings=False))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
