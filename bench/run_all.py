"""Run every benchmark in bench/ one after another and print their results, then a summary of the ratios.

Each benchmark runs in its own Python process (so thread settings and allocator state do not leak from one
to the next) with its own output shown as it comes. Benchmarks that accept `--json` write their result into
`--out` (default: a temporary folder), and the summary at the end is read from those files.

    python bench/run_all.py                      # bench_model, bench_finetune, bench_grpo, bench_epoch (when present)
    python bench/run_all.py --only finetune      # names are matched against the script names
    python bench/run_all.py --out bench/results  # keep the JSON files
    python bench/run_all.py -- --steps 3         # extra arguments go to every benchmark (same flags needed)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHMARKS = ("bench_model.py", "bench_finetune.py", "bench_grpo.py", "bench_epoch.py")  # run in this order, when present


def _accepts_json(script: Path) -> bool:
    return '"--json"' in script.read_text()


def _summary(name: str, res: dict) -> list[str]:
    "One line per ratio a benchmark reports (the keys its JSON uses)."
    if "ratio_tunebook_over_transformers" in res:  # bench_model
        return [f"forward+backward tokens/s  tunebook/transformers  {res['ratio_tunebook_over_transformers']:.2f}x"]
    if res.get("benchmark") == "finetune":
        lines = []
        for method, r in res["results"].items():
            for peer, v in r["ratios"].items():
                lines.append(f"{method:4s} {peer:28s} tokens/s {v['tokens_per_s']:.2f}x   peak memory {v['peak_memory']:.2f}x")
        lines.append(f"first-step losses agree: {res['losses_agree']}")
        return lines
    if res.get("benchmark") == "epoch":   # one epoch of ragged rows: each one's epoch time over tunebook's (default, else packed)
        return [f"{r['method']:4s} {r['framework'] + ':' + r['mode']:26s} epoch {r['x_tunebook']:.2f}x tunebook {r['tunebook_ref']}'s, "
                f"held-out loss {r['eval_loss']:.4f}" for r in res["rows"] if "error" not in r]
    ratios = {k: v for k, v in res.items() if "ratio" in k and isinstance(v, (int, float))}
    return [f"{k} {v:.2f}" for k, v in ratios.items()] or ["(see its output above)"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run only benchmarks whose file name contains this (repeatable)")
    ap.add_argument("--out", type=Path, help="folder for the JSON results (default: a temporary one)")
    ap.add_argument("extra", nargs="*", help="arguments after -- are passed to every benchmark")
    a = ap.parse_args(argv)
    scripts = [HERE / n for n in BENCHMARKS if (HERE / n).exists()]
    if a.only: scripts = [s for s in scripts if any(o in s.name for o in a.only)]
    if not scripts: sys.exit(f"no benchmark matches {a.only}; present: {[n for n in BENCHMARKS if (HERE / n).exists()]}")
    out = a.out or Path(tempfile.mkdtemp(prefix="tunebook-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = []
    for s in scripts:
        cmd = [sys.executable, str(s), *a.extra]
        js = out / (s.stem + ".json")
        if _accepts_json(s): cmd += ["--json", str(js)]
        print(f"\n######## {s.name}  ({' '.join(cmd[1:])})", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        done.append((s.name, rc, time.perf_counter() - t0, js if js.exists() and _accepts_json(s) else None))
    print("\n######## summary (ratios are tunebook over the peer, measured in the same process; "
          "tokens/s > 1: tunebook faster, memory < 1: tunebook smaller)")
    for name, rc, secs, js in done:
        status = "ok" if rc == 0 else f"exit code {rc}"
        print(f"{name}: {status}, {secs:.0f} s" + (f", {js}" if js else ""))
        if js:
            for line in _summary(name, json.loads(js.read_text())): print(f"    {line}")
    return 0 if all(rc == 0 for _, rc, _, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
