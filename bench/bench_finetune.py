"""Fine-tuning step speed and peak memory on a real model's shape: tunebook against torchtune 0.6.1 and
transformers + peft, each in the precisions it offers, alternating in one process on this machine.

One random-weight checkpoint of the chosen shape (default SmolLM2-135M: 30 layers, dim 576, vocab 49152; or
Llama-3.2-1B with `--shape llama3.2-1b --layers N`), saved by transformers and loaded by each framework its own
way (bench/peers.py). LoRA is rank 16, alpha 32 on q, k, v, o, gate, up and down; full trains every weight.
AdamW (no weight decay), constant lr, no clipping, eager. A configuration is `framework:precision`:

  fp32  fp32 weights                     (all three)
  bf16  bf16 weights and optimizer state (tunebook, torchtune; transformers+peft has no such recipe)
  amp   fp32 weights, bf16 torch.autocast (tunebook, transformers+peft; torchtune has no autocast)

Every configuration of a method is built at once; each round runs one whole optimizer step of each, the order
rotated, timed from outside. tokens/s is batch x seq over the median step after warm-up; a speed ratio is the
median over rounds of that round's paired ratio (peer step time / tunebook step time), which resists load
spikes on a shared machine. Peak memory is tunebook.memory.MemoryTracker's (live tensor bytes) over one more
step. All get the same batches and (LoRA) the same adapter init, so first-step losses are compared with the
transformers fp32 loss: 1e-3 for fp32, 3e-2 for bf16 compute. tunebook's model FLOPs/s is given as a share
of the bf16 matmul peak (a loop of 2048^3 bf16 matmuls) measured in the same run, before and after, by the wall clock
and per CPU-second (MFU (CPU time): model FLOPs per CPU-second of the step over matmul FLOPs per CPU-second).
`--profile` adds torch.profiler's top operators of one step of each tunebook configuration and of the fastest peer's.

    python bench/bench_finetune.py [--shape smollm2-135m --batch 4 --seq 256 --steps 4 --json out.json]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device import SHAPES, make_checkpoint, peak_cpu  # noqa: E402
from peers import HFRun, TorchtuneRun, TunebookRun, bf16_matmul_peak, copy_lora_A, make_batch, train_flops_per_token  # noqa: E402

RUNS = {"tunebook": TunebookRun, "torchtune": TorchtuneRun, "transformers+peft": HFRun}
SHORT = {"tb": "tunebook", "tt": "torchtune", "hf": "transformers+peft"}
DEFAULT = {"lora": "tb:fp32,tb:bf16,tb:amp,tt:fp32,tt:bf16,hf:fp32,hf:amp",
           "full": "tb:fp32,tb:bf16,tb:amp,tt:bf16,hf:amp"}  # full: the fastest peers only (RAM: all live at once)
TOL = {"fp32": 1e-3, "bf16": 3e-2, "amp": 3e-2, "bf16-mixed": 3e-2}


def parse_configs(s):
    out = []
    for item in s.split(","):
        fw, _, prec = item.partition(":")
        prec, plus, comp = prec.partition("+")
        fw = SHORT.get(fw, fw)
        if fw not in RUNS or prec not in TOL or (plus and comp != "compile"):
            raise SystemExit(f"bad configuration {item!r}: use framework:precision[+compile] with framework in {list(SHORT)} "
                             f"and precision in {list(TOL)}")
        out.append((fw, prec + plus + comp))
    return out


def profile_step(run, batch, n=15):
    "torch.profiler's top operators (self CPU time) of one step."
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        run.step(batch)
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ev)
    return [dict(op=e.key, self_ms=e.self_cpu_time_total / 1e3, share=e.self_cpu_time_total / total, calls=e.count)
            for e in ev[:n]], total / 1e3


def bench_method(method, d, cfg, a, configs, batches, log):
    torch.manual_seed(0)
    runs = {}
    for fw, prec in configs:
        torch.manual_seed(0)
        p, _, comp = prec.partition("+")
        runs[f"{fw}:{prec}"] = RUNS[fw](d, method, p, "cpu", rank=a.rank, alpha=a.alpha, lr=a.lr, compile=bool(comp))
    if method == "lora":
        ref = {k: v.detach().float().clone() for k, v in next(iter(runs.values())).lora_A().items()}
        copy_lora_A(ref, *runs.values())
    names = list(runs)
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}  # this process's CPU time: far less swayed by other programs on a shared machine
    losses = {k: [] for k in names}
    for i in range(a.warmup + a.steps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            losses[k].append(float(runs[k].step(batches[i])))  # .item() inside the timed step, as a training loop logs
            times[k].append(time.perf_counter() - t0); cpu[k].append(time.process_time() - c0)
        log(f"  {method} round {i + 1}/{a.warmup + a.steps}: " + ", ".join(f"{k} {times[k][-1]:.2f}s ({cpu[k][-1]:.2f} CPU-s)" for k in names))
    peaks = {k: peak_cpu(r, batches[0]) for k, r in runs.items()}
    prof = {}
    if a.profile:  # tunebook's configurations and the fastest peer's (by CPU time), side by side
        peers_ = [k for k in names if not k.startswith("tunebook:")]
        fastest = [min(peers_, key=lambda k: statistics.median(cpu[k][a.warmup:]))] if peers_ else []
        for k in [k for k in names if k.startswith("tunebook:")] + fastest:
            prof[k] = profile_step(runs[k], batches[0])
    ntok = a.batch * a.seq
    fl = train_flops_per_token(cfg, a.seq, method, a.rank) * ntok
    fl_cpu = {k: fl / statistics.median(cpu[k][a.warmup:]) for k in names}
    res = {k: dict(tokens_per_s=ntok / statistics.median(times[k][a.warmup:]), median_step_s=statistics.median(times[k][a.warmup:]),
                   step_s=[round(x, 4) for x in times[k]], cpu_s=[round(x, 4) for x in cpu[k]],
                   median_cpu_s=statistics.median(cpu[k][a.warmup:]), losses=losses[k], peak_bytes=peaks[k],
                   trainable_params=runs[k].n_trainable(), model_flops_per_s=fl / statistics.median(times[k][a.warmup:]),
                   model_flops_per_cpu_s=fl_cpu[k])
           for k in names}
    ref = "transformers+peft:fp32" if "transformers+peft:fp32" in res else names[0]
    for k in names:
        res[k]["loss_diff_vs_ref"] = res[k]["losses"][0] - res[ref]["losses"][0]
        res[k]["loss_ok"] = abs(res[k]["loss_diff_vs_ref"]) <= TOL[k.split(":")[1].split("+")[0]]
    ratios = {}
    for t in [k for k in names if k.startswith("tunebook:")]:
        for p in [k for k in names if not k.startswith("tunebook:")]:
            ratios[f"{t} / {p}"] = dict(
                tokens_per_s=statistics.median(b / a_ for a_, b in zip(times[t][a.warmup:], times[p][a.warmup:])),
                tokens_per_cpu_s=statistics.median(b / a_ for a_, b in zip(cpu[t][a.warmup:], cpu[p][a.warmup:])),
                peak_memory=res[t]["peak_bytes"] / res[p]["peak_bytes"])
    del runs
    return dict(frameworks=res, ratios=ratios, loss_reference=ref, profile=prof)


def print_method(method, r, a, peak, peak_cpu_s):
    print(f"\n== {method}: {a.steps} timed rounds after {a.warmup} warm-up, batch {a.batch} x seq {a.seq} ==")
    print(f"  {'configuration':30s} {'tokens/s':>9s} {'tok/CPU-s':>9s} {'step s':>7s} {'peak MiB':>9s} {'trainable':>11s} "
          f"{'loss@1':>9s} {'diff vs ' + r['loss_reference']:>30s} {'of bf16 peak':>12s} {'(CPU time)':>10s}")
    for k, f in r["frameworks"].items():
        print(f"  {k:30s} {f['tokens_per_s']:9.0f} {a.batch * a.seq / f['median_cpu_s']:9.0f} {f['median_step_s']:7.2f} "
              f"{f['peak_bytes'] / 2**20:9.0f} {f['trainable_params']:11,d} {f['losses'][0]:9.5f} "
              f"{f['loss_diff_vs_ref']:+30.2e}{'' if f['loss_ok'] else ' MISMATCH'} {f['model_flops_per_s'] / peak:11.1%} "
              f"{f['model_flops_per_cpu_s'] / peak_cpu_s:10.1%}")
    peers = {k: v for k, v in r["frameworks"].items() if not k.startswith("tunebook:")}
    fastest = max(peers, key=lambda k: peers[k]["tokens_per_s"]) if peers else None
    fastest_cpu = min(peers, key=lambda k: peers[k]["median_cpu_s"]) if peers else None
    if peers: print(f"  fastest peer configuration: {fastest} (wall clock), {fastest_cpu} (CPU time)")
    for k, v in r["ratios"].items():
        mark = "  <- vs fastest peer" if k.endswith(fastest_cpu) else ""
        print(f"  ratio {k:56s} tokens/s {v['tokens_per_s']:.2f}x (CPU time {v['tokens_per_cpu_s']:.2f}x)   peak memory {v['peak_memory']:.2f}x{mark}")
    for k, (ops, total) in r["profile"].items():
        print(f"  profile of one {k} {method} step ({total:.0f} ms of self CPU time), top operators:")
        for o in ops: print(f"    {o['op']:44s} {o['self_ms']:9.1f} ms {o['share']:6.1%} {o['calls']:6d} calls")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="override the shape's layer count (a 1B shape on a small CPU)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds (the first step of each builds its state)")
    ap.add_argument("--steps", type=int, default=4, help="timed rounds")
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--lora-configs", default=DEFAULT["lora"], help="framework:precision,... (tb, tt, hf)")
    ap.add_argument("--full-configs", default=DEFAULT["full"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--profile", action="store_true", help="torch.profiler top operators of tunebook's steps and the fastest peer's")
    ap.add_argument("--json", type=Path, help="also write the result here")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    import transformers
    transformers.logging.set_verbosity_error(); transformers.logging.disable_progress_bar()
    load0, t_start = os.getloadavg(), time.perf_counter()
    shape = dict(SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {}))
    peak0 = bf16_matmul_peak("cpu", seconds=2.0)
    peak0_cpu = bf16_matmul_peak("cpu", seconds=2.0, clock="cpu")  # per CPU-second: the same threads, not swayed by the load
    print(f"fine-tune benchmark: {a.shape} ({shape['num_hidden_layers']} layers), CPU, {torch.get_num_threads()} threads, "
          f"load average {load0[0]:.1f}; bf16 2048^3 matmul {peak0 / 1e12:.2f} TFLOP/s", flush=True)
    batches = [make_batch(a.batch, a.seq, shape["vocab_size"], seed=i) for i in range(a.warmup + a.steps)]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        cfg = make_checkpoint(d, shape, a.seq, a.init_std)
        for m in a.methods.split(","):
            results[m] = bench_method(m, d, cfg, a, parse_configs(getattr(a, f"{m}_configs")), batches, lambda s: print(s, flush=True))
    peak = max(peak0, bf16_matmul_peak("cpu", seconds=2.0))
    peak_cpu_s = max(peak0_cpu, bf16_matmul_peak("cpu", seconds=2.0, clock="cpu"))
    for r in results.values():
        for f in r["frameworks"].values():
            f["mfu_wall"], f["mfu_cpu"] = f["model_flops_per_s"] / peak, f["model_flops_per_cpu_s"] / peak_cpu_s
    for m, r in results.items(): print_method(m, r, a, peak, peak_cpu_s)
    ok = all(f["loss_ok"] for r in results.values() for f in r["frameworks"].values())
    load1 = os.getloadavg()
    print(f"\nbf16 matmul peak (best of the runs before and after) {peak / 1e12:.2f} TFLOP/s, {peak_cpu_s / 1e12:.2f} TFLOP per CPU-s; ratios: tokens/s > 1 and peak "
          f"memory < 1 favour tunebook. Load average {load0[0]:.1f} -> {load1[0]:.1f} on {os.cpu_count()} cores: indicative "
          f"only on a shared machine. {time.perf_counter() - t_start:.0f} s in all.")
    res = dict(benchmark="finetune", shape=a.shape, model_shape=shape, config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
               bf16_matmul_peak=peak, bf16_matmul_peak_per_cpu_s=peak_cpu_s, versions=_versions(), machine=dict(cpu_count=os.cpu_count(), threads=torch.get_num_threads(),
               loadavg_start=load0, loadavg_end=load1), losses_agree=ok, results=results)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True); a.json.write_text(json.dumps(res, indent=2, default=str))
    return res


def _versions():
    out = {"torch": torch.__version__}
    for m in ("transformers", "peft", "torchtune", "torchao"):
        try: out[m] = __import__(m).__version__
        except Exception as e: out[m] = f"unavailable ({type(e).__name__})"
    return out


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:])["losses_agree"] else 1)
