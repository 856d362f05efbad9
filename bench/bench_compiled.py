"""Compiled training steps on this CPU: tunebook against transformers + peft, both under torch.compile (H1, issue 18).

The same random SmolLM2-135M-shaped checkpoint (bench_device.SHAPES, written by transformers), the same batch, one
process, one thread. tunebook: `tunebook.compile.compile_model` (every block, sequence length dynamic, and the chunked
loss with its output projection). transformers + peft: each decoder layer `.compile()`d (its regional compilation; the
loss on full fp32 logits stays eager; `use_cache=False`, else its DynamicCache recompiles every layer until dynamo's limit
and the rest run eagerly), in the precision asked (bf16 weights, or "amp": fp32 weights + bf16 autocast).
Each run's first step (the compile) is timed on its own; then `--rounds` rounds alternate the runs (order rotated
every round), each timed step between two short bf16 matmul peak bursts, its share of peak against their mean.
LoRA A matrices are copied from tunebook's run into the others (B is zero), so the losses must agree step by step.

    .venv/bin/python bench/bench_compiled.py --layers 6 --json bench/results/h1_compiled_peers_6layers.json
    .venv/bin/python bench/bench_compiled.py --runs tunebook:bf16,transformers+peft:bf16,transformers+peft:amp
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device import SHAPES, make_checkpoint  # noqa: E402
from bench_step import provenance, timed  # noqa: E402
from peers import HFRun, TunebookRun, bf16_matmul_peaks, copy_lora_A, make_batch, train_flops_per_token  # noqa: E402

RUNS = {"tunebook": TunebookRun, "transformers+peft": HFRun}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--shape", default="4x128", help="batch x sequence length")
    ap.add_argument("--method", default="lora", choices=["lora", "full"])
    ap.add_argument("--runs", default="tunebook:bf16,transformers+peft:bf16", help="framework:precision,... (bf16 | amp)")
    ap.add_argument("--eager", action="store_true", help="also each run uncompiled")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default=None, help="inductor's cache (default: a fresh temporary one: cold compiles)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch._dynamo.config.recompile_limit = 64   # several precisions of one framework share its layers' code object
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.mkdtemp(prefix="tunebook_inductor_")
    B, T = map(int, a.shape.split("x"))
    shape = dict(SHAPES["smollm2-135m"], num_hidden_layers=a.layers)
    d = tempfile.mkdtemp(prefix="h1_ckpt_")
    cfg = make_checkpoint(d, shape, T, 0.02)
    batch = make_batch(B, T, cfg["vocab_size"])
    flops = train_flops_per_token(cfg, T, a.method) * B * T
    specs = [tuple(s.split(":")) for s in a.runs.split(",")]
    specs = [(fw, p, c) for fw, p in specs for c in ((False, True) if a.eager else (True,))]
    runs, start, prov = {}, bf16_matmul_peaks(seconds=1.5), provenance()
    for fw, prec, comp in specs:
        key = f"{fw} {prec}{' compiled' if comp else ' eager'}"
        torch._dynamo.utils.counters.clear()
        run = RUNS[fw](d, a.method, prec, "cpu", compile=comp)
        if fw == "transformers+peft":   # training: no KV cache (a DynamicCache's per-layer state recompiles every layer)
            (run.model.get_base_model() if a.method == "lora" else run.model).config.use_cache = False
        if a.method == "lora" and runs: copy_lora_A(next(iter(runs.values()))["run"].lora_A(), run)
        loss, first = timed(lambda: run.step(batch))
        graphs = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("stats", "recompiles", "graph_break")}
        runs[key] = dict(run=run, first=first, losses=[float(loss)], steps=[], dynamo=graphs)
        print(f"{key}: first step {first['wall_s']:.1f} s wall, {first['cpu_s']:.1f} s CPU; loss {float(loss):.5f}; {graphs}", flush=True)
    keys = list(runs)
    for r in range(a.rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            v = runs[k]
            before = bf16_matmul_peaks(seconds=0.3)
            loss, t = timed(lambda: v["run"].step(batch))
            after = bf16_matmul_peaks(seconds=0.3)
            t.update(peak_before=before, peak_after=after, share_adjacent_cpu=flops / t["cpu_s"] / ((before[1] + after[1]) / 2))
            v["steps"].append(t); v["losses"].append(float(loss))
        print(f"round {r}: " + "; ".join(f"{k} {runs[k]['steps'][-1]['cpu_s']:.2f} CPU-s loss {runs[k]['losses'][-1]:.5f}" for k in keys), flush=True)
    end = bf16_matmul_peaks(seconds=1.5)
    whole = max(start[1], end[1])
    out, ref = [], runs[keys[0]]["losses"]
    print(f"\n{a.method} {a.shape}, {a.layers} layers, {a.threads} thread(s), median of {a.rounds} rounds; peak start {start[1] / 1e12:.2f} "
          f"end {end[1] / 1e12:.2f} TFLOP per CPU-s")
    for k, v in runs.items():
        st = v["steps"]
        cpu = statistics.median(s["cpu_s"] for s in st)
        row = dict(run=k, method=a.method, batch=a.shape, layers=a.layers, model_flop=flops, cpu_s=cpu, wall_s=statistics.median(s["wall_s"] for s in st),
                   tok_per_cpu_s=B * T / cpu, share_adjacent_cpu=statistics.median(s["share_adjacent_cpu"] for s in st),
                   share_whole_run_cpu=flops / cpu / whole, peak_step_mib=max(s["peak_step_mib"] for s in st),
                   first_step=v["first"], compile_wall_s=v["first"]["wall_s"] - statistics.median(s["wall_s"] for s in st),
                   losses=v["losses"], max_rel_loss_diff=max(abs(x - y) / abs(y) for x, y in zip(v["losses"], ref)), steps=st,
                   dynamo=v["dynamo"])
        out.append(row)
        print(f"  {k:34s} {cpu:6.2f} CPU-s {row['tok_per_cpu_s']:6.0f} tok/CPU-s  adjacent {row['share_adjacent_cpu']:.1%}  "
              f"whole-run {row['share_whole_run_cpu']:.1%}  step peak {row['peak_step_mib']:.0f} MiB  first step {v['first']['wall_s']:.0f} s wall  "
              f"loss vs {keys[0]}: {row['max_rel_loss_diff']:.1e}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(peak_start=start, peak_end=end, code=prov, threads=a.threads, torch=torch.__version__,
                                                cache_dir=os.environ["TORCHINDUCTOR_CACHE_DIR"], runs=out), indent=1))
    shutil.rmtree(d, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
