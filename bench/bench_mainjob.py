"""Where the main job's time goes: `tunebook finetune` with no arguments (the embedded model and task), timed by phase.

The job runs in this process through `tunebook.cli.main(["finetune", "--output-dir", DIR])`, with timers wrapped around
the Trainer's phases from outside (nothing in tunebook is changed): imports (torch, then tunebook's CLI), building the
Trainer, `setup()` (model, tokenizer, data), `claim_output()`, the eval before training, the training steps, the
checkpoint, the eval after, and `write_outputs()`; what is left of the command (its printing, the summary) is "other".
Each phase is timed by the wall clock and by this process's CPU time (the CPU time is far less swayed by other
programs on a shared machine). Evaluation is split further into exact match (greedy generation) and the held-out
loss. `--repeats N` runs the whole job N times in fresh subprocesses and reports the median of each phase; the
held-out accuracy before and after must be the same in every run.

    python bench/bench_mainjob.py [--repeats 1] [--json bench/results/mainjob.json] [-- extra finetune flags]
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

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    "Wall and CPU seconds per phase name (summed over calls)."
    def __init__(self): self.wall, self.cpu, self.calls = {}, {}, {}

    def add(self, name, w, c):
        self.wall[name] = self.wall.get(name, 0.0) + w; self.cpu[name] = self.cpu.get(name, 0.0) + c
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, owner, attr, name):
        f = getattr(owner, attr)
        def timed(*a, **k):
            w0, c0 = time.perf_counter(), time.process_time()
            try: return f(*a, **k)
            finally: self.add(name(a) if callable(name) else name, time.perf_counter() - w0, time.process_time() - c0)
        setattr(owner, attr, timed)


def one_job(out_dir, extra):
    "Run the main job once in this process; return the phases and the summary."
    clock = Clock()
    w0, c0 = time.perf_counter(), time.process_time()
    import torch  # noqa: F401
    clock.add("import torch", time.perf_counter() - w0, time.process_time() - c0)
    w1, c1 = time.perf_counter(), time.process_time()
    import tunebook.cli as cli
    from tunebook.train import Trainer
    import tunebook.train.objective as objective
    import tunebook.train.evaluate as evaluate
    clock.add("import tunebook", time.perf_counter() - w1, time.process_time() - c1)
    n_eval = []
    clock.wrap(Trainer, "__init__", "Trainer()")
    clock.wrap(Trainer, "setup", "setup (model, tokenizer, data)")
    clock.wrap(Trainer, "claim_output", "claim output folder")
    clock.wrap(Trainer, "train_step", "train steps")
    clock.wrap(Trainer, "save_checkpoint", "checkpoint")
    clock.wrap(Trainer, "write_outputs", "write outputs")
    def which_eval(_):
        n_eval.append(1)
        return "eval before" if len(n_eval) == 1 else "eval after"   # eval_every is 0 by default: before and after only
    clock.wrap(Trainer, "evaluate", which_eval)
    # inside evaluate: the objective calls these through its own module's names
    clock.wrap(objective, "evaluate_accuracy", "  of which exact match (generation)")
    clock.wrap(objective, "held_out_loss", "  of which held-out loss")
    rc = cli.main(["finetune", "--output-dir", str(out_dir), *extra])
    total_w, total_c = time.perf_counter() - w0, time.process_time() - c0
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    top = {k for k in clock.wall if not k.startswith("  ")}
    clock.add("other (CLI, printing, summary)", total_w - sum(clock.wall[k] for k in top), total_c - sum(clock.cpu[k] for k in top))
    del evaluate
    return dict(rc=rc, total_wall_s=total_w, total_cpu_s=total_c, wall_s=clock.wall, cpu_s=clock.cpu, calls=clock.calls,
                accuracy_before=summary.get("eval_accuracy_before"), accuracy_after=summary.get("eval_accuracy_after"),
                eval_loss_before=summary.get("eval_loss_before"), eval_loss_after=summary.get("eval_loss_after"),
                steps=summary.get("steps", summary.get("max_steps")), tokens_per_second=summary.get("tokens_per_second"))


def profile_steps(out_dir, n, extra, top=20):
    "torch.profiler's top operators (self CPU time) over `n` training steps of the main job's Trainer, after 3 untimed ones."
    import tunebook.cli as cli
    from torch.profiler import ProfilerActivity, profile
    from tunebook.train import Trainer
    args = cli.build_parser().parse_args(["finetune", "--output-dir", str(out_dir), *extra])
    tr = Trainer(cli.config_from_args(args))
    tr.setup()
    print(f"main job's step: {tr.precision.report()}; loss {tr.loss_fn!r}; optimizer {type(tr.optimizer).__name__} "
          f"{ {k: v for k, v in tr.optimizer.defaults.items() if k in ('fused', 'foreach')} }", flush=True)
    for _ in range(3): tr.train_step()
    c0, w0 = time.process_time(), time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n): tr.train_step()
    cpu, wall = (time.process_time() - c0) / n, (time.perf_counter() - w0) / n
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ev)
    print(f"{n} steps profiled: {cpu * 1e3:.0f} ms CPU, {wall * 1e3:.0f} ms wall per step (profiler on); top operators by self CPU time:")
    for e in ev[:top]:
        print(f"  {e.key:48s} {e.self_cpu_time_total / 1e3 / n:8.1f} ms/step {e.self_cpu_time_total / total:6.1%} {e.count // n:6d} calls/step")
    return [dict(op=e.key, self_ms_per_step=e.self_cpu_time_total / 1e3 / n, share=e.self_cpu_time_total / total) for e in ev[:top]]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="whole jobs, each in a fresh subprocess (median per phase)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="instead: profile N training steps of the main job")
    ap.add_argument("extra", nargs="*", help="more `tunebook finetune` flags (after --)")
    a = ap.parse_args(argv)
    if a.child:  # one job, its result as one JSON line
        print("MAINJOB_JSON " + json.dumps(one_job(a.child, a.extra)), flush=True); return 0
    if a.profile:
        with tempfile.TemporaryDirectory() as d: profile_steps(Path(d) / "run", a.profile, a.extra)
        return 0
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    runs, load0 = [], os.getloadavg()
    for i in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            w0 = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, "--child", str(Path(d) / "run"), "--", *a.extra], cwd=d, env=env,
                               capture_output=True, text=True)
            proc_s = time.perf_counter() - w0
        line = [l for l in p.stdout.splitlines() if l.startswith("MAINJOB_JSON ")]
        if p.returncode or not line: raise SystemExit(f"the job failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        r = json.loads(line[0].removeprefix("MAINJOB_JSON ")); r["process_wall_s"] = proc_s; runs.append(r)
        print(f"run {i + 1}/{a.repeats}: {proc_s:.1f} s (process), accuracy {r['accuracy_before']:.1%} -> {r['accuracy_after']:.1%}", flush=True)
    names = list(runs[0]["wall_s"])
    med = {k: dict(wall_s=statistics.median(r["wall_s"][k] for r in runs), cpu_s=statistics.median(r["cpu_s"][k] for r in runs)) for k in names}
    tw, tc = statistics.median(r["total_wall_s"] for r in runs), statistics.median(r["total_cpu_s"] for r in runs)
    print(f"\n`tunebook finetune` (no arguments), {a.repeats} run(s), median; load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"  {'phase':40s} {'wall s':>8s} {'share':>6s} {'CPU s':>8s} {'share':>6s}")
    for k in names:
        print(f"  {k:40s} {med[k]['wall_s']:8.2f} {med[k]['wall_s'] / tw:6.1%} {med[k]['cpu_s']:8.2f} {med[k]['cpu_s'] / tc:6.1%}")
    print(f"  {'total (in process)':40s} {tw:8.2f} {'':6s} {tc:8.2f}")
    print(f"  process wall time (interpreter start included): {statistics.median(r['process_wall_s'] for r in runs):.2f} s")
    accs = {(r["accuracy_before"], r["accuracy_after"]) for r in runs}
    print(f"  held-out exact match before -> after: {', '.join(f'{b:.1%} -> {x:.1%}' for b, x in sorted(accs))}")
    res = dict(benchmark="mainjob", extra_flags=a.extra, repeats=a.repeats, median=med, total_wall_s=tw, total_cpu_s=tc,
               runs=runs, loadavg_start=load0, loadavg_end=os.getloadavg(), cpu_count=os.cpu_count(),
               threads=os.environ.get("OMP_NUM_THREADS"))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True); a.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
