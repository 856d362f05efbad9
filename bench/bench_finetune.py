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
The bf16 matmul peak is also measured for `--peak-s` seconds right before and after every step ("adjacent"), and
each step's MFU is taken over the higher of the two. `--one-at-a-time` builds, times and frees one configuration
after another, for shapes whose configurations do not fit in memory together (then the adjacent peaks, not the
alternation, carry the comparison). First-step losses are checked against transformers' fp32 forward loss of the
first batch when no transformers+peft:fp32 configuration runs. torchtune's output is not chunked by default
(`--tt-output-chunks 1`): its chunked output is 10-100x slower in bf16 on the CPU (see peers.TorchtuneRun).

    python bench/bench_finetune.py [--shape smollm2-135m --batch 4 --seq 256 --steps 4 --json out.json]
    python bench/bench_finetune.py --shape llama3.2-1b --methods full --full-configs tb:bf16,hf:bf16,tt:bf16 --one-at-a-time
"""
import argparse
import gc
import json
import resource
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
from peers import HFRun, TorchtuneRun, TunebookRun, bf16_matmul_peak, bf16_matmul_peaks, copy_lora_A, make_batch, train_flops_per_token  # noqa: E402

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


def build(fw, prec, d, method, a):
    torch.manual_seed(0)
    p, _, comp = prec.partition("+")
    kw = dict(num_chunks=a.tt_output_chunks) if fw == "torchtune" else {}
    return RUNS[fw](d, method, p, "cpu", rank=a.rank, alpha=a.alpha, lr=a.lr, compile=bool(comp), **kw)


def timed_step(run, batch, peak_s):
    "One step timed by the wall clock and the CPU time, with the bf16 matmul peak (wall, CPU) measured right before and after."
    before = bf16_matmul_peaks(seconds=peak_s) if peak_s else None
    t0, c0 = time.perf_counter(), time.process_time()
    loss = float(run.step(batch))  # .item() inside the timed step, as a training loop logs
    t, c = time.perf_counter() - t0, time.process_time() - c0
    after = bf16_matmul_peaks(seconds=peak_s) if peak_s else None
    return loss, t, c, (dict(wall=max(before[0], after[0]), cpu=max(before[1], after[1]), wall_before=before[0], wall_after=after[0],
                             cpu_before=before[1], cpu_after=after[1]) if peak_s else None)


def bench_method(method, d, cfg, a, configs, batches, log):
    names = [f"{fw}:{prec}" for fw, prec in configs]
    rec = {k: dict(times=[], cpu=[], losses=[], peaks=[]) for k in names}
    info, prof, lora_ref = {}, {}, [None]

    def make(fw, prec):
        r = build(fw, prec, d, method, a)
        if method == "lora":  # every configuration trains the same function: the first one's A matrices (B is zero)
            if lora_ref[0] is None: lora_ref[0] = {k: v.detach().float().clone() for k, v in r.lora_A().items()}
            copy_lora_A(lora_ref[0], r)
        return r

    def one(k, r, i):
        loss, t, c, pk = timed_step(r, batches[i], a.peak_s)
        for key, v in zip(("losses", "times", "cpu", "peaks"), (loss, t, c, pk)): rec[k][key].append(v)

    def finish(k, r):
        info[k] = dict(peak_bytes=peak_cpu(r, batches[0]), trainable_params=r.n_trainable())

    def say(i, ks):
        log(f"  {method} round {i + 1}/{a.warmup + a.steps}: " + ", ".join(
            f"{k} {rec[k]['times'][i]:.2f}s ({rec[k]['cpu'][i]:.2f} CPU-s"
            + (f", matmul {rec[k]['peaks'][i]['cpu'] / 1e12:.2f} TFLOP/CPU-s" if rec[k]['peaks'][i] else "") + ")" for k in ks))

    if a.one_at_a_time:  # one configuration alive at a time: built, warmed up, timed, measured, freed
        for (fw, prec), k in zip(configs, names):
            r = make(fw, prec)
            for i in range(a.warmup + a.steps):
                one(k, r, i); say(i, [k])
            finish(k, r)
            if a.profile: prof[k] = profile_step(r, batches[0])
            del r; gc.collect()
    else:  # all alive; each round runs one step of each, the order rotated
        runs = {k: make(fw, prec) for (fw, prec), k in zip(configs, names)}
        for i in range(a.warmup + a.steps):
            for k in names[i % len(names):] + names[:i % len(names)]: one(k, runs[k], i)
            say(i, names)
        for k, r in runs.items(): finish(k, r)
        if a.profile:  # tunebook's configurations and the fastest peer's (by CPU time), side by side
            peers_ = [k for k in names if not k.startswith("tunebook:")]
            fastest = [min(peers_, key=lambda k: statistics.median(rec[k]["cpu"][a.warmup:]))] if peers_ else []
            for k in [k for k in names if k.startswith("tunebook:")] + fastest: prof[k] = profile_step(runs[k], batches[0])
        del runs; gc.collect()
    ntok, w = a.batch * a.seq, a.warmup
    fl = train_flops_per_token(cfg, a.seq, method, a.rank) * ntok
    res = {}
    for k in names:
        t, c, pk = rec[k]["times"], rec[k]["cpu"], rec[k]["peaks"]
        res[k] = dict(tokens_per_s=ntok / statistics.median(t[w:]), median_step_s=statistics.median(t[w:]),
                      step_s=[round(x, 4) for x in t], cpu_s=[round(x, 4) for x in c], median_cpu_s=statistics.median(c[w:]),
                      losses=rec[k]["losses"], model_flops_per_s=fl / statistics.median(t[w:]),
                      model_flops_per_cpu_s=fl / statistics.median(c[w:]), **info[k])
        if pk[0]:  # MFU of each step over the matmul peak measured next to it (the host's speed drifts within a minute)
            res[k].update(matmul_peak_adjacent=pk, mfu_cpu_adjacent=statistics.median(fl / ci / p["cpu"] for ci, p in zip(c[w:], pk[w:])),
                          mfu_wall_adjacent=statistics.median(fl / ti / p["wall"] for ti, p in zip(t[w:], pk[w:])))
    ref = "transformers+peft:fp32" if "transformers+peft:fp32" in res else ("reference" if a.ref_loss is not None else names[0])
    ref_loss = res[ref]["losses"][0] if ref in res else a.ref_loss
    for k in names:
        res[k]["loss_diff_vs_ref"] = res[k]["losses"][0] - ref_loss
        res[k]["loss_ok"] = abs(res[k]["loss_diff_vs_ref"]) <= TOL[k.split(":")[1].split("+")[0]]
    ratios = {}
    for t in [k for k in names if k.startswith("tunebook:")]:
        for p in [k for k in names if not k.startswith("tunebook:")]:
            rt, rp = rec[t], rec[p]
            ratios[f"{t} / {p}"] = dict(
                tokens_per_s=statistics.median(b / a_ for a_, b in zip(rt["times"][w:], rp["times"][w:])),
                tokens_per_cpu_s=statistics.median(b / a_ for a_, b in zip(rt["cpu"][w:], rp["cpu"][w:])),
                peak_memory=res[t]["peak_bytes"] / res[p]["peak_bytes"])
            if rt["peaks"][0] and rp["peaks"][0]:  # each step's CPU time over the matmul peak next to it, then paired
                ratios[f"{t} / {p}"]["mfu_cpu_adjacent"] = statistics.median(
                    (b * pb["cpu"]) / (a_ * pa["cpu"]) for a_, b, pa, pb in zip(rt["cpu"][w:], rp["cpu"][w:], rt["peaks"][w:], rp["peaks"][w:]))
    return dict(frameworks=res, ratios=ratios, loss_reference=ref, reference_loss=ref_loss, profile=prof,
                schedule="one at a time" if a.one_at_a_time else "alternating")


def print_method(method, r, a, peak, peak_cpu_s):
    print(f"\n== {method}: {a.steps} timed rounds after {a.warmup} warm-up, batch {a.batch} x seq {a.seq}, {r['schedule']} ==")
    print(f"  {'configuration':30s} {'tokens/s':>9s} {'tok/CPU-s':>9s} {'step s':>7s} {'peak MiB':>9s} {'trainable':>11s} "
          f"{'loss@1':>9s} {'diff vs ' + r['loss_reference']:>30s} {'of bf16 peak':>12s} {'(CPU time)':>10s} {'(adjacent)':>10s}")
    for k, f in r["frameworks"].items():
        print(f"  {k:30s} {f['tokens_per_s']:9.0f} {a.batch * a.seq / f['median_cpu_s']:9.0f} {f['median_step_s']:7.2f} "
              f"{f['peak_bytes'] / 2**20:9.0f} {f['trainable_params']:11,d} {f['losses'][0]:9.5f} "
              f"{f['loss_diff_vs_ref']:+30.2e}{'' if f['loss_ok'] else ' MISMATCH'} {f['model_flops_per_s'] / peak:11.1%} "
              f"{f['model_flops_per_cpu_s'] / peak_cpu_s:10.1%} {f.get('mfu_cpu_adjacent', float('nan')):10.1%}")
    peers = {k: v for k, v in r["frameworks"].items() if not k.startswith("tunebook:")}
    fastest = max(peers, key=lambda k: peers[k]["tokens_per_s"]) if peers else None
    fastest_cpu = min(peers, key=lambda k: peers[k]["median_cpu_s"]) if peers else None
    if peers: print(f"  fastest peer configuration: {fastest} (wall clock), {fastest_cpu} (CPU time)")
    for k, v in r["ratios"].items():
        mark = "  <- vs fastest peer" if k.endswith(fastest_cpu) else ""
        adj = f", over the adjacent matmul peak {v['mfu_cpu_adjacent']:.2f}x" if "mfu_cpu_adjacent" in v else ""
        print(f"  ratio {k:56s} tokens/s {v['tokens_per_s']:.2f}x (CPU time {v['tokens_per_cpu_s']:.2f}x{adj})   peak memory {v['peak_memory']:.2f}x{mark}")
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
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="build, time and free one configuration after another (when they do not fit in memory together)")
    ap.add_argument("--peak-s", type=float, default=0.3, help="seconds of bf16 matmul peak measured before and after each step (0: off)")
    ap.add_argument("--tt-output-chunks", type=int, default=1,
                    help="torchtune's output chunks (its recipes: 8; on the CPU 1 is its fastest: chunks are views F.linear cannot fold)")
    ap.add_argument("--checkpoint", type=Path, help="keep the random checkpoint in this folder and reuse it (made if missing)")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers fp32 forward loss that losses are checked against")
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
    with tempfile.TemporaryDirectory() as tmp:
        d = str(a.checkpoint or tmp)
        cfg = checkpoint(d, shape, a)
        configs = {m: parse_configs(getattr(a, f"{m}_configs")) for m in a.methods.split(",")}
        need_ref = not a.no_reference and any(("transformers+peft", "fp32") not in c for c in configs.values())
        a.ref_loss = reference_loss(d, batches[0]) if need_ref else None
        if need_ref: print(f"reference: transformers fp32 forward loss on the first batch {a.ref_loss:.6f}", flush=True)
        for m in a.methods.split(","):
            results[m] = bench_method(m, d, cfg, a, configs[m], batches, lambda s: print(s, flush=True))
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
               loadavg_start=load0, loadavg_end=load1, max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
               losses_agree=ok, results=results)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True); a.json.write_text(json.dumps(res, indent=2, default=str))
    return res


def checkpoint(d, shape, a):
    "The random checkpoint of `shape` in `d`: made by transformers, or reused when `d` already holds one of this shape."
    cj = Path(d) / "config.json"
    if cj.exists():
        cfg = json.loads(cj.read_text())
        diff = {k: (cfg.get(k), v) for k, v in shape.items() if k not in ("rope_scaling", "rope_theta", "max_position_embeddings") and cfg.get(k) != v}
        if diff: raise SystemExit(f"--checkpoint {d} holds another shape ({diff}); give an empty folder")
        cfg.setdefault("rope_theta", shape["rope_theta"])
        return cfg
    return make_checkpoint(d, shape, a.seq, a.init_std)


def reference_loss(d, batch) -> float:
    "The loss of the first step's forward pass (before any update) by transformers in fp32: what every configuration starts from."
    import transformers
    m = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad(): loss = float(m(input_ids=batch["tokens"], labels=batch["hf_labels"]).loss)
    del m; gc.collect()
    return loss


def _versions():
    out = {"torch": torch.__version__}
    for m in ("transformers", "peft", "torchtune", "torchao"):
        try: out[m] = __import__(m).__version__
        except Exception as e: out[m] = f"unavailable ({type(e).__name__})"
    return out


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:])["losses_agree"] else 1)
