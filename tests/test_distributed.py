"""Two gloo processes against one: FSDP2 training parity (full, LoRA, optimizer_in_backward), loss parallel,
per-rank bytes, distributed checkpoints across world sizes, consolidation to HF, launch's error handling."""
import os

import pytest
import torch

from conftest import HANG
import torch.nn.functional as F

from tunebook.distributed import consolidate_to_hf, load_distributed, shard_model, torchrun_command
from tunebook.launch import RankError, launch, max_processes
from tunebook.memory import fsdp_memory
from tunebook.model import build_model, gemma3_270m, phi3_mini, pico, qwen3_0_6b

pytestmark = pytest.mark.skipif(max_processes("gloo") < 2, reason="needs 2 CPU cores for 2 gloo ranks")

LR, STEPS, B, T = 2e-3, 3, 4, 16
# Adam divides by sqrt(v) + eps: with the default eps=1e-8 a gradient at the fp32 noise floor (~1e-9, where the
# summation order of 2 ranks differs from 1) becomes a full +-lr step, so the comparison uses eps=1e-5.
EPS = 1e-5
CFG = dict(n_layers=2)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 512, (B, T), generator=g)
        labels = tokens.roll(-1, 1)
        labels[:, -1] = -100
        labels[0, :5] = -100          # uneven loss tokens across ranks: the normalisation must be global
        out.append((tokens, labels))
    return out


def train(lora=False, in_backward=False, config=None):
    """3 steps on a pico model (or `config`); sharded over the process group when there is one. Returns losses, weights, bytes."""
    import torch.distributed as dist
    from tunebook.distributed import dp_loss, global_mean, output_weight
    from tunebook.lora import apply_lora
    from tunebook.loss import ChunkedCrossEntropy
    from tunebook.optim import optimizer_in_backward
    torch.manual_seed(0)
    model = build_model(config or pico(**CFG))
    if lora: apply_lora(model, rank=4, alpha=8, targets=("all-linear",) if config else ("q_proj", "v_proj", "down_proj"))
    ws, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if ws > 1: shard_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (optimizer_in_backward(model, torch.optim.AdamW, lr=LR, eps=EPS) if in_backward
           else torch.optim.AdamW(params, lr=LR, eps=EPS))
    loss_fn, losses, nbytes = ChunkedCrossEntropy(num_chunks=2, reduction="sum"), [], {}
    for tokens, labels in _batches():
        tokens, labels = tokens.chunk(ws)[rank], labels.chunk(ws)[rank]
        s = loss_fn(model(tokens, return_hidden=True), output_weight(model), labels)
        n = (labels != -100).sum()
        dp_loss(s, n).backward()
        if not in_backward and not nbytes:
            nbytes["gradients"] = sum(local_bytes(p.grad) for p in params)
        opt.step(); opt.zero_grad()
        losses.append(global_mean(s, n))
    optims = list(opt.optimizers.values()) if in_backward else [opt]
    nbytes["parameters"] = sum(local_bytes(p) for p in model.parameters())
    nbytes["optimizer"] = sum(local_bytes(v) for o in optims for st in o.state.values()
                                    for k, v in st.items() if k != "step")
    return losses, {k: full(v) for k, v in model.state_dict().items()}, nbytes


CASES = [(False, False), (False, True), (True, False), (True, True)]


def train_all():
    return [train(lora, ib) for lora, ib in CASES]


@pytest.fixture(scope="module")
def two_rank_runs():
    return launch(train_all, nproc=2, verbose=False, timeout=HANG)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"lora={a}-in_backward={b}" for a, b in CASES])
def test_fsdp_matches_one_process(two_rank_runs, case):
    ref_losses, ref_w, _ = train(*CASES[case])
    (l0, w0, _), (l1, w1, _) = two_rank_runs[0][case], two_rank_runs[1][case]
    assert l0 == l1
    torch.testing.assert_close(torch.tensor(l0), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    moved, init = 0, build_model(pico(**CFG)).state_dict()
    for k, v in ref_w.items():
        torch.testing.assert_close(w0[k], v, rtol=0, atol=1e-5, msg=k)
        torch.testing.assert_close(w1[k], v, rtol=0, atol=1e-5, msg=k)
        moved += not torch.equal(v, init.get(k, v))
    assert moved > 0                        # training changed weights


# the other families' blocks (Gemma's sandwich norms and local/global layers, Phi-3's fused projections, Qwen3's
# q/k norms) are sharded per block the same way: two ranks must train them exactly as one process does
FAMILIES = {
    "qwen3": qwen3_0_6b(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=512, head_dim=16),
    "gemma3": gemma3_270m(n_layers=2, dim=64, n_heads=4, n_kv_heads=1, hidden_dim=128, vocab_size=512, head_dim=16,
                          query_pre_attn_scalar=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "phi3": phi3_mini(n_layers=2, dim=64, n_heads=4, n_kv_heads=4, hidden_dim=128, vocab_size=512, sliding_window=8),
}


def train_families():
    return {(name, lora): train(lora, False, cfg) for name, cfg in FAMILIES.items() for lora in (False, True)}


@pytest.fixture(scope="module")
def two_rank_family_runs():
    return launch(train_families, nproc=2, verbose=False, timeout=HANG)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp_families_match_one_process(two_rank_family_runs, name, lora):
    ref_losses, ref_w, _ = train(lora, False, FAMILIES[name])
    (l0, w0, _), (l1, w1, _) = two_rank_family_runs[0][(name, lora)], two_rank_family_runs[1][(name, lora)]
    assert l0 == l1
    torch.testing.assert_close(torch.tensor(l0), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    init = build_model(FAMILIES[name]).state_dict()
    moved = 0
    for k, v in ref_w.items():
        torch.testing.assert_close(w0[k], v, rtol=0, atol=1e-5, msg=k)
        moved += not torch.equal(v, init.get(k, v))
    assert moved > 0


@pytest.mark.parametrize("case", [0, 2], ids=["full", "lora"])
def test_per_rank_bytes_are_half(two_rank_runs, case):
    _, _, one = train(*CASES[case])
    for rank in (0, 1):
        two = two_rank_runs[rank][case][2]
        for k in ("parameters", "gradients", "optimizer"):
            assert two[k] * 2 == one[k], (k, two[k], one[k])
    if case == 0:                           # the estimate's shard arithmetic equals what the ranks hold
        est = fsdp_memory(build_model(pico(**CFG), device="meta", init=False), 2)
        for k in ("parameters", "gradients", "optimizer"):
            assert est[k] == two_rank_runs[0][case][2][k], k
        assert est["all_gather"] > 0 and fsdp_memory("pico", 1)["all_gather"] == 0


def loss_parallel_check():
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel
    from tunebook.distributed import shard_vocab, vocab_parallel_cross_entropy
    torch.manual_seed(0)
    model = build_model(pico(n_layers=1))
    tokens, labels = _batches()[0]
    ref = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    ref.backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shard_vocab(model)
    logits = model(tokens)
    with loss_parallel():
        loss = vocab_parallel_cross_entropy(logits, labels)
        loss.backward()
    gdiff = max((full(p.grad) - ref_g[n]).abs().max().item() for n, p in model.named_parameters())
    return abs(full(loss).item() - ref.item()), gdiff, tuple(logits.to_local().shape), dist.get_rank()


def test_loss_parallel_matches_plain_ce():
    for r, (dl, dg, local_shape, rank) in enumerate(launch(loss_parallel_check, nproc=2, verbose=False)):
        assert rank == r and dl <= 1e-5 and dg <= 1e-5, (dl, dg)
        assert local_shape == (B, T, 256)   # each rank holds half the vocabulary, never all 512


def ckpt(path, mode, lora=False):
    """mode 'save': 1 step then save; 'load': a fresh model loads it. Returns full model and optimizer state."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from tunebook.distributed import save_distributed
    from tunebook.lora import apply_lora
    from tunebook.optim import optimizer_in_backward
    torch.manual_seed(0 if mode == "save" else 7)
    model = build_model(pico(n_layers=1))
    if lora: apply_lora(model, rank=4, alpha=8)
    if dist.is_initialized(): shard_model(model)
    opt = (optimizer_in_backward(model, torch.optim.AdamW, lr=LR) if lora
           else torch.optim.AdamW(model.parameters(), lr=LR))
    optims = list(opt.optimizers.values()) if lora else opt
    if mode == "save":
        model(torch.arange(8)[None]).square().mean().backward()
        opt.step()
        save_distributed(path, model, opt)
    else:
        load_distributed(path, model, opt)
    osd = get_optimizer_state_dict(model, optims)
    ostate = {f"{k}.{s}": full(v) for k, st in osd["state"].items() for s, v in st.items()}
    return {k: full(v) for k, v in model.state_dict().items()}, ostate


def test_dcp_saved_by_two_loads_into_one_and_two(tmp_path):
    path = str(tmp_path / "ckpt")
    (m0, o0), (m1, _) = launch(ckpt, nproc=2, args=(path, "save"), verbose=False)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]                 # the temporary folder was renamed away
    for (m, o) in [ckpt(path, "load")] + launch(ckpt, nproc=2, args=(path, "load"), verbose=False):
        assert m.keys() == m0.keys() and o.keys() == o0.keys() and o0
        for k in m0: assert torch.equal(m[k], m0[k]), k
        for k in o0: assert torch.equal(o[k], o0[k]), k


def test_dcp_lora_in_backward_roundtrip(tmp_path):
    path = str(tmp_path / "ckpt")
    (m0, o0), _ = launch(ckpt, nproc=2, args=(path, "save", True), verbose=False)
    m, o = ckpt(path, "load", True)
    assert any("lora_A" in k for k in o0)
    for k in m0: assert torch.equal(m[k], m0[k]), k
    for k in o0: assert torch.equal(o[k], o0[k]), k
    with pytest.raises(ValueError, match="LoRA adapters"):
        consolidate_to_hf(path, tmp_path / "hf", pico(n_layers=1))
    from tunebook.checkpoint import load_hf
    from tunebook.lora import apply_lora, merge_lora
    hf = load_hf(consolidate_to_hf(path, tmp_path / "hf", pico(n_layers=1), lora=dict(rank=4, alpha=8)))
    ref = apply_lora(build_model(pico(n_layers=1)), rank=4, alpha=8)
    ref.load_state_dict(m0)
    tokens = torch.arange(12)[None]
    torch.testing.assert_close(hf(tokens), merge_lora(ref).eval()(tokens), rtol=0, atol=1e-5)


def test_consolidate_to_hf_identical_logits(tmp_path):
    import transformers
    from tunebook.checkpoint import load_hf
    path = str(tmp_path / "ckpt")
    (m0, _), _ = launch(ckpt, nproc=2, args=(path, "save"), verbose=False)
    out = consolidate_to_hf(path, tmp_path / "hf", pico(n_layers=1))
    ref = build_model(pico(n_layers=1)).eval()
    ref.load_state_dict(m0)
    tokens = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(tokens)
        assert torch.equal(load_hf(out)(tokens), want)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        torch.testing.assert_close(theirs(tokens).logits, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="lacks"):
        consolidate_to_hf(path, tmp_path / "hf2", pico(n_layers=2))


def _raise():
    import torch.distributed as dist
    if dist.get_rank() == 1: raise KeyError("no such thing")
    dist.barrier()


def _crash():
    import torch.distributed as dist
    if dist.get_rank() == 0: os._exit(7)
    dist.barrier()


def _sleep():
    import time
    time.sleep(60)


def test_launch_errors(tmp_path):
    with pytest.raises(RankError, match="KeyError: 'no such thing'") as e:
        launch(_raise, nproc=2, grace=1, verbose=False)
    assert e.value.rank == 1
    with pytest.raises(RankError, match="exited with code 7") as e:
        launch(_crash, nproc=2, grace=1, verbose=False)
    assert e.value.rank == 0
    with pytest.raises(TimeoutError, match="still running"):
        launch(_sleep, nproc=2, timeout=3, verbose=False)
    with pytest.raises(ValueError, match=f"nproc<={max_processes('gloo')}"):
        launch(_raise, nproc=max_processes("gloo") + 1, backend="gloo")
    with pytest.raises(ValueError, match="positive integer"): launch(_raise, nproc=0)
    with pytest.raises(ValueError, match="backend must be"): launch(_raise, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="GPU"): launch(_raise, nproc=1, backend="nccl")
    with pytest.raises(TypeError, match="needs a function"): launch(42)


def test_bad_inputs(tmp_path):
    with pytest.raises(RuntimeError, match="process group"): shard_model(build_model(pico()))
    with pytest.raises(FileNotFoundError, match="not a distributed checkpoint"):
        load_distributed(tmp_path, build_model(pico()))
    with pytest.raises(FileNotFoundError, match="not a distributed checkpoint"):
        consolidate_to_hf(tmp_path, tmp_path / "hf", pico())
    with pytest.raises(ValueError, match="positive integer"): fsdp_memory("pico", 0)
    assert torchrun_command(1, argv=["finetune"])[-3:] == ["-m", "tunebook.cli", "finetune"]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_two_gpus():
    def _on_gpu():
        import torch.distributed as dist
        t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return dist.get_backend(), t.item()
    assert launch(_on_gpu, nproc=2, backend="nccl", verbose=False) == [("nccl", 3.0)] * 2


def test_launch_ships_notebook_code_by_value():
    """What a notebook cell defines lives in `__main__`, which a fresh process lacks: cloudpickle ships a closure, a
    class and the arguments built from it by value, across two real ranks."""
    offset = 5

    class Scaler:
        def __init__(self, k): self.k = k
        def __call__(self, x): return self.k * x
    Scaler.__module__ = "__main__"

    def work(scaler):
        import torch.distributed as dist
        return scaler(dist.get_rank()) + offset
    work.__module__ = "__main__"
    assert launch(work, nproc=2, args=(Scaler(10),), verbose=False) == [5, 15]
    import threading
    lock = threading.Lock()
    def bad(): return lock.locked()
    with pytest.raises(TypeError, match="cannot ship 'bad'"): launch(bad, nproc=2, verbose=False)
