"""One 2-D mesh row: a few training steps of a Llama-shaped model on every layout the ranks allow (FSDP over all,
HSDP dp_replicate x dp_shard, FSDP x TP with loss parallel), each against the loss of FSDP over all ranks on the
same batch: tokens/s, per-rank peak (the CUDA allocator's on GPUs) and the loss difference. On a CUDA machine with
4+ GPUs it runs nccl on 4 of them; `--smoke` runs 2 gloo ranks on the CPU with tiny shapes (CI keeps it from rotting).

    python bench/bench_mesh.py [--smoke] [--json PATH]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tunebook.launch import launch   # noqa: E402


def run(spec, shape, steps, batch, seq):
    import contextlib
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel
    from tunebook.distributed import dp_loss, global_mean, shard_model
    from tunebook.mesh import build_mesh, data_rank, parallelize
    from tunebook.model import build_model, pico
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(pico(**shape, tie_embeddings=False)).to(dev)
    mesh = build_mesh(spec) if spec else None
    if mesh is not None: parallelize(model, mesh)
    else: shard_model(model)
    r, n = data_rank(mesh)
    lp = loss_parallel if mesh is not None and "tp" in mesh.mesh_dim_names else contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g).to(dev)
    tokens, labels = tokens.chunk(n)[r], tokens.roll(-1, 1).chunk(n)[r]
    if dev.type == "cuda": torch.cuda.reset_peak_memory_stats()
    losses, t0 = [], None
    for i in range(steps):
        if i == 1:   # the first step pays the lazy initialisations
            if dev.type == "cuda": torch.cuda.synchronize()
            t0 = time.perf_counter()
        with lp():
            s = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(), reduction="sum")
            dp_loss(s, labels.numel()).backward()
        opt.step(); opt.zero_grad()
        s = s.full_tensor() if hasattr(s, "full_tensor") else s
        losses.append(global_mean(s, labels.numel()))
    if dev.type == "cuda": torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    return dict(layout=spec or f"fsdp={dist.get_world_size()}", first_loss=losses[0], last_loss=losses[-1],
                tokens_per_s=batch * seq * (steps - 1) / secs, peak_bytes_rank0=peak)


def layouts(nproc):
    half = nproc // 2
    return [None, f"dp_replicate=2,dp_shard={half}", f"dp={half},tp=2"] if nproc >= 4 else [None, "dp_replicate=1,dp_shard=2", "dp=1,tp=2"]


def all_layouts(nproc, shape, steps, batch, seq):
    return [run(spec, shape, steps, batch, seq) for spec in layouts(nproc)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="2 gloo ranks on the CPU, tiny shapes")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if a.smoke:
        nproc, shape, steps, batch, seq = 2, dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=512), 3, 4, 32
    elif gpus >= 4:
        nproc = 4
        shape = dict(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, hidden_dim=8192, vocab_size=128256, head_dim=64, max_seq_len=2048)
        steps, batch, seq = 6, 8, 2048
    else:
        print(f"bench_mesh: a 2-D mesh needs 4 GPUs, this machine has {gpus}; --smoke runs it on the CPU", file=sys.stderr)
        return 3
    rows = launch(all_layouts, nproc=nproc, args=(nproc, shape, steps, batch, seq), verbose=False, timeout=600)[0]
    ref = rows[0]["first_loss"]
    print(f"{'layout':<28}{'tokens/s':>12}{'peak/rank':>14}{'|loss - fsdp|':>16}")
    for r in rows:
        r["first_loss_diff"] = abs(r["first_loss"] - ref)
        peak = f"{r['peak_bytes_rank0'] / 2**30:.2f} GiB" if r["peak_bytes_rank0"] else "-"
        print(f"{r['layout']:<28}{r['tokens_per_s']:>12.0f}{peak:>14}{r['first_loss_diff']:>16.2e}")
    if a.json: Path(a.json).write_text(json.dumps(dict(nproc=nproc, shape=shape, rows=rows), indent=1))
    return 0 if all(r["first_loss_diff"] < 1e-3 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
