"""One packed LoRA step of SmolLM2-135M-Instruct, tunebook against torchtune 0.6.1, alternating in one process.

bench_epoch.py times whole epochs, one framework after another, each in its own process: on a host whose CPU time
is partly taken by a hypervisor (steal, in /proc/stat) or by other jobs, a minute-long run of one framework can land
in a slower minute than the other's. Here the steps alternate (A B A B ...) on the same batch in one process, each
timed by the wall clock and by the CPU time of the process (which steal is not charged to), so both see the same
machine; `--profile` adds the top operators of one step of each (torch.profiler, self CPU time).

The batch is bench_epoch.py's data: the first `--packs` packed rows of 1024 tokens (rows greedily packed in file order,
the same packs in both: torchtune's PackedDataset and tunebook's `pack`, checked equal), one document at a time in
tunebook's attention, torchtune's block-causal mask in its SDPA. LoRA rank 16 / alpha 32 on the seven projections,
every run starting from the same A matrices.

    python bench/bench_packed_step.py [--steps 5] [--precisions bf16,amp] [--profile] [--json PATH]

Needs the bench venv (torchtune 0.6.1) with tunebook on PYTHONPATH and tests/realckpt.py's SmolLM2 folder.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_epoch import IGNORE, cpu_line, default_model, make_data   # noqa: E402
from peers import TorchtuneRun, TunebookRun, copy_lora_A   # noqa: E402


class PackedTunebook(TunebookRun):
    "tunebook's step on packed rows: positions restart per document and attention runs document by document."
    def loss_of(self, b):
        h = self.model(b["tokens"], positions=b["positions"], doc_ids=b["doc_ids"], return_hidden=True)
        w = self.model.output_weight
        return self.loss_fn(h, w if torch.is_autocast_enabled(h.device.type) else w.to(h.dtype), b["labels"])


class PackedTorchtune(TorchtuneRun):
    "torchtune's step on its packed batch: the block-causal mask and input_pos from padded_collate_packed."
    def loss_of(self, b):
        labels = torch.hstack((b["tt_labels"][..., 1:], torch.full_like(b["tt_labels"][..., :1], IGNORE)))   # its recipe's shift
        return self.loss_fn(self.model(b["tokens"], mask=b["mask"], input_pos=b["input_pos"]), labels)


def batches(model_dir, packs: int) -> dict:
    "The first `packs` packed rows of bench_epoch's data, as tunebook's batch and torchtune's, checked to hold the same tokens."
    from torchtune.data import padded_collate_packed
    from torchtune.datasets import PackedDataset
    from transformers import AutoTokenizer
    from tunebook.batches import collate_fn, pack
    with tempfile.TemporaryDirectory() as tmp:
        make_data(model_dir, Path(tmp), 64, 0, 1024, 0)
        rows = json.loads((Path(tmp) / "train_tok.json").read_text())
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id or 0
    ours = pack([dict(tokens=r["ids"], labels=[IGNORE] * (r["prompt_len"] - 1) + r["ids"][r["prompt_len"]:] + [IGNORE]) for r in rows], 1024, pad)
    theirs = PackedDataset([dict(tokens=r["ids"], labels=[IGNORE] * r["prompt_len"] + r["ids"][r["prompt_len"]:]) for r in rows],
                           max_seq_len=1024, padding_idx=pad, split_across_pack=False)
    b = collate_fn([ours[i] for i in range(packs)], pad_id=pad)
    t = padded_collate_packed([theirs[i] for i in range(packs)])
    if not torch.equal(b["tokens"], t["tokens"]): raise SystemExit("bench_packed_step: the two packings differ")
    return dict(tokens=b["tokens"], labels=b["labels"], positions=b["positions"], doc_ids=b["doc_ids"], mask=t["mask"],
                input_pos=t["input_pos"], tt_labels=t["labels"])


def top_ops(run, batch, n=12) -> list:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as p: run.step(batch)
    ev = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [(e.key, e.count, round(e.self_cpu_time_total / 1e6, 3)) for e in ev]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--packs", type=int, default=2, help="packed rows of 1024 tokens a step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each run, after one untimed")
    ap.add_argument("--precisions", default="bf16,amp", help="tunebook's: bf16 (pure, as torchtune) and/or amp (bf16-mixed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    d = a.model or default_model()
    batch = batches(d, a.packs)
    runs = {"torchtune:bf16": PackedTorchtune(d, "lora", "bf16", "cpu", lr=1e-4, num_chunks=1)}
    for p in a.precisions.split(","): runs[f"tunebook:{p}"] = PackedTunebook(d, "lora", p, "cpu", lr=1e-4)
    ref = {k: v.detach().float().clone() for k, v in next(iter(runs.values())).lora_A().items()}
    for r in runs.values(): copy_lora_A(ref, r)
    rec = {k: dict(wall=[], cpu=[], loss=[]) for k in runs}
    print(f"CPU: {cpu_line()}; {a.threads} thread(s); {a.packs} x 1024 packed, "
          f"{int((batch['labels'] != IGNORE).sum())} trained tokens", flush=True)
    for i in range(a.steps + 1):
        keys = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]   # who goes first rotates
        for k in keys:
            run = runs[k]
            t0, c0 = time.perf_counter(), time.process_time()
            loss = float(run.step(batch))
            t, c = time.perf_counter() - t0, time.process_time() - c0
            if i: rec[k]["wall"].append(t); rec[k]["cpu"].append(c)
            rec[k]["loss"].append(loss)
    tt = rec["torchtune:bf16"]
    out = dict(cpu=cpu_line(), threads=a.threads, packs=a.packs, runs={})
    for k, v in rec.items():
        w, c = statistics.median(v["wall"]), statistics.median(v["cpu"])
        out["runs"][k] = dict(wall_s=w, cpu_s=c, losses=v["loss"], torchtune_wall_ratio=statistics.median(tt["wall"]) / w,
                              torchtune_cpu_ratio=statistics.median(tt["cpu"]) / c)
        print(f"{k:18s} median step {w:6.2f} s wall {c:6.2f} s CPU | torchtune's / this: wall {out['runs'][k]['torchtune_wall_ratio']:.2f}x "
              f"CPU {out['runs'][k]['torchtune_cpu_ratio']:.2f}x | losses {[round(x, 4) for x in v['loss']]}", flush=True)
    if a.profile:
        for k, run in runs.items():
            out["runs"][k]["top_ops"] = top_ops(run, batch)
            print(f"\n{k}: top operators of one step (self CPU s)")
            for name, n, s in out["runs"][k]["top_ops"]: print(f"  {s:7.3f} {n:6d}  {name}")
    if a.json: Path(a.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
