"""The main job in every precision and compile mode: does each train the embedded default to the same held-out gain?

`tunebook finetune` with no options trains the embedded model (LoRA, rank 16, all linear layers) on a task it never
saw ("reverse"), 500 steps, and scores held-out exact match before and after. This script runs exactly that
configuration (`TrainConfig()` with only `dtype`, `compile` and the output folder set) once per mode:

  fp32, bf16, bf16-mixed       each eager and with compile=True (regional torch.compile, inductor)
  fp16-mixed                   the same two, only where CUDA is available

Each run is its own process (a fresh dynamo cache, its own memory), one at a time. A run reports held-out exact
match before/after, the held-out loss after, the last training loss, train wall and CPU seconds (the steps alone),
eval seconds, the median step, and for compiled runs the compile time two ways: dynamo's own total
(`_compile.compile_inner`, forward and backward graphs) and the steps' excess over the median step. Compiled and
eager losses of the same precision are compared step by step (|a - b| / |b| at step 3, the first compiled step, and
the max over steps 1-10) and by the mean of the last 100 steps. Timings on a shared machine swing: read the gains and losses as the result, the seconds as this
machine's load that hour.

    OMP_NUM_THREADS=2 python bench/bench_modes.py [--modes fp32,bf16,bf16-mixed] [--compile both|off|on]
                                                  [--max-steps 500] [--json bench/results/modes.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(mode: str, compile_: bool, overrides: dict) -> dict:
    "One main-job run in this process: the summary's numbers plus wall/CPU time by phase and the step losses."
    import torch
    from tunebook.train import TrainConfig, Trainer

    out = tempfile.mkdtemp(prefix=f"bench-modes-{mode}-{int(compile_)}-")
    t_start, c_start = time.perf_counter(), time.process_time()
    tr = Trainer(TrainConfig(dtype=mode, compile=compile_, output_dir=out, **overrides))
    times = {"train": [0.0, 0.0], "eval": [0.0, 0.0]}
    step_wall, step_cpu = [], []

    def timed(fn, phase):
        def call(*a, **k):
            w, c = time.perf_counter(), time.process_time()
            r = fn(*a, **k)
            dw, dc = time.perf_counter() - w, time.process_time() - c
            times[phase][0] += dw; times[phase][1] += dc
            if phase == "train": step_wall.append(dw); step_cpu.append(dc)
            return r
        return call

    w, c = time.perf_counter(), time.process_time()
    tr.setup()
    setup = (time.perf_counter() - w, time.process_time() - c)
    tr.train_step, tr.evaluate = timed(tr.train_step, "train"), timed(tr.evaluate, "eval")
    s = tr.fit(progress=False)
    total = (time.perf_counter() - t_start, time.process_time() - c_start)
    med = statistics.median(step_wall)
    dyn = None
    if compile_:
        from torch._dynamo.utils import compile_times
        names, values = compile_times(repr="csv", aggregate=True)
        dyn = float(dict(zip(names, values)).get("_compile.compile_inner", 0.0))
    return dict(mode=mode, compile=compile_, precision=s["precision"], precision_report=s["precision_report"],
                recorded_compile=s["compile"], steps=s["steps"],
                acc_before=s["eval_accuracy_before"], acc_after=s["eval_accuracy_after"],
                eval_loss_before=s["eval_loss_before"], eval_loss_after=s["eval_loss_after"], final_train_loss=s["final_loss"],
                setup_wall_s=setup[0], setup_cpu_s=setup[1], train_wall_s=times["train"][0], train_cpu_s=times["train"][1],
                eval_wall_s=times["eval"][0], eval_cpu_s=times["eval"][1], total_wall_s=total[0], total_cpu_s=total[1],
                median_step_s=med, step_excess_s=sum(step_wall) - med * len(step_wall), dynamo_compile_s=dyn,
                losses=[r["loss"] for r in tr.metrics], threads=torch.get_num_threads(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"), torch=torch.__version__)


def max_rel(a, b, n=None):
    a, b = a[:n], b[:n]
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def table(results: list[dict]) -> str:
    head = ("mode", "compile", "acc before", "acc after", "eval loss", "train loss", "train wall s", "train CPU s",
            "median step s", "compile s (dynamo / excess)", "eval s", "total wall s")
    rows = []
    for r in results:
        comp = "-" if not r["compile"] else f"{r['dynamo_compile_s']:.0f} / {r['step_excess_s']:.0f}"
        rows.append((r["mode"], "on" if r["compile"] else "off", f"{r['acc_before']:.1%}", f"{r['acc_after']:.1%}",
                     f"{r['eval_loss_after']:.4f}", f"{r['final_train_loss']:.4f}", f"{r['train_wall_s']:.0f}",
                     f"{r['train_cpu_s']:.0f}", f"{r['median_step_s']:.3f}", comp, f"{r['eval_wall_s']:.0f}",
                     f"{r['total_wall_s']:.0f}"))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(x) + " |" for x in rows]
    pairs = []
    by = {(r["mode"], r["compile"]): r for r in results}
    for mode in dict.fromkeys(r["mode"] for r in results):
        if (mode, False) in by and (mode, True) in by:
            e, c = by[(mode, False)]["losses"], by[(mode, True)]["losses"]
            rel = [abs(x - y) / abs(y) for x, y in zip(c, e)]
            mean = lambda L: sum(L[-100:]) / len(L[-100:])
            # steps 1-2 are profiled by the memory tracker and run eagerly in both: step 3 is the first compiled one
            pairs.append(f"{mode}: compiled vs eager training loss, relative: step 3 (first compiled) {rel[2] if len(rel) > 2 else float('nan'):.1e}, "
                         f"max over steps 1-10 {max(rel[:10]):.1e}; mean of the last 100 steps eager {mean(e):.4f}, compiled {mean(c):.4f} "
                         f"(the trajectories part after a few hundred steps: step-wise differences there are not rounding)")
    return "\n".join(lines + [""] + pairs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=None, help="comma-separated; default fp32,bf16,bf16-mixed (+fp16-mixed on CUDA)")
    ap.add_argument("--compile", default="both", choices=("both", "off", "on"))
    ap.add_argument("--max-steps", type=int, default=None, help="override the main job's steps (default: its own, 500)")
    ap.add_argument("--eval-samples", type=int, default=None, help="override the main job's held-out prompts (default 200)")
    ap.add_argument("--runs", default=None, help="explicit runs in this order, e.g. fp32:off,bf16-mixed:on (overrides --modes/--compile)")
    ap.add_argument("--merge", nargs="+", default=None, help="only print the table of these results files together (and write --json)")
    ap.add_argument("--json", default=str(HERE / "results" / "modes.json"))
    ap.add_argument("--one", nargs=3, metavar=("MODE", "COMPILE", "OUT"), help=argparse.SUPPRESS)   # the child process
    a = ap.parse_args()
    overrides = {k: v for k, v in (("max_steps", a.max_steps), ("eval_samples", a.eval_samples)) if v is not None}
    if a.one:
        r = run_one(a.one[0], a.one[1] == "1", overrides)
        Path(a.one[2]).write_text(json.dumps(r))
        return
    if a.merge:
        parts = [json.loads(Path(f).read_text()) for f in a.merge]
        results = [r for p in parts for r in p["results"] if "error" not in r]
        order = {m: i for i, m in enumerate(("fp32", "bf16", "bf16-mixed", "fp16-mixed"))}
        results.sort(key=lambda r: (order.get(r["mode"], 9), r["compile"]))
        print(table(results))
        Path(a.json).write_text(json.dumps(dict(meta=[p["meta"] for p in parts], sources=a.merge, results=results,
                                                table=table(results)), indent=1))
        return
    import torch
    modes = a.modes.split(",") if a.modes else ["fp32", "bf16", "bf16-mixed"] + (["fp16-mixed"] if torch.cuda.is_available() else [])
    comps = {"both": (False, True), "off": (False,), "on": (True,)}[a.compile]
    plan = [(m, c) for m in modes for c in comps]
    if a.runs:
        plan = []
        for item in a.runs.split(","):
            m, _, c = item.partition(":")
            if c not in ("on", "off"): raise SystemExit(f"--runs {item!r}: use MODE:on or MODE:off")
            plan.append((m, c == "on"))
    results, started = [], time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load0 = os.getloadavg()
    for mode, comp in plan:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f: tmp = f.name
        cmd = [sys.executable, __file__, "--one", mode, "1" if comp else "0", tmp]
        if a.max_steps is not None: cmd += ["--max-steps", str(a.max_steps)]
        if a.eval_samples is not None: cmd += ["--eval-samples", str(a.eval_samples)]
        t0 = time.time()
        for attempt in range(3):   # another job's nbdev_export rewrites the package for a moment: retry an import that caught it
            p = subprocess.run(cmd, capture_output=True, text=True)
            if not (p.returncode and "ImportError" in p.stderr): break
            time.sleep(20)
        if p.returncode:
            print(f"{mode} compile={comp}: failed (exit {p.returncode})\n{p.stderr[-3000:]}", flush=True)
            results.append(dict(mode=mode, compile=comp, error=p.stderr[-3000:]))
            continue
        r = json.loads(Path(tmp).read_text()); os.unlink(tmp)
        results.append(r)
        print(f"{mode} compile={comp}: acc {r['acc_before']:.1%} -> {r['acc_after']:.1%}, eval loss {r['eval_loss_after']:.4f}, "
              f"train {r['train_wall_s']:.0f} s wall / {r['train_cpu_s']:.0f} s CPU, run {time.time() - t0:.0f} s", flush=True)
    ok = [r for r in results if "error" not in r]
    print(table(ok))
    meta = dict(started=started, finished=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), loadavg_start=load0,
                loadavg_end=os.getloadavg(), cpu_count=os.cpu_count(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                overrides=overrides)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(dict(meta=meta, results=results, table=table(ok)), indent=1))
    print(f"raw results: {a.json}")


if __name__ == "__main__":
    main()
