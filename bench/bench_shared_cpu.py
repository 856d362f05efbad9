"""A shared CPU: the main job's step, quiet and beside busy processes, with OpenMP threads that spin or sleep while they wait.

Each measurement is a fresh process (the wait policy is read when torch loads OpenMP): the embedded model's LoRA step
(`tunebook finetune`'s defaults), 3 warm-up steps, then `--steps` timed ones; the median step's wall and CPU seconds.
Conditions: quiet (nothing started by the benchmark; other work on the machine shows in the load average printed),
and loaded (one busy Python process per core, started by the benchmark for the measurement and stopped after).
Policies: `spin` (libgomp's default: `GOMP_SPINCOUNT=300000`, which tunebook leaves alone) and `tunebook` (what
`import tunebook` chooses: `OMP_WAIT_POLICY=PASSIVE` when other work takes half a CPU or more of its CPUs as it starts,
libgomp's default on idle CPUs), each with the threads torch starts (the cores). The peer is the
same model and LoRA step in transformers + peft, torch imported first (so it spins, as any torch program does by
default): its slowdown under the same load is the yardstick. Quote the ratios, with the CPU and the load printed.

    python bench/bench_shared_cpu.py [--steps 20] [--rounds 2] [--busy N] [--spin 10000] [--json bench/results/shared_cpu.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TUNEBOOK = r"""
import json, sys, tempfile, time
from tunebook.train import Trainer, TrainConfig
from tunebook.core import fit_threads
steps = int(sys.argv[1])
t = Trainer(TrainConfig(max_steps=steps + 3, eval_samples=0, output_dir=tempfile.mkdtemp())).setup()
threads = fit_threads()
for _ in range(3): t.train_step()
wall, cpu = [], []
for _ in range(steps):
    w, c = time.perf_counter(), time.process_time(); t.train_step()
    wall.append(time.perf_counter() - w); cpu.append(time.process_time() - c)
print(json.dumps(dict(wall=wall, cpu=cpu, threads=threads)))
"""

PEER = r"""
import json, sys, time
import torch
import transformers, peft
from tunebook.core import EMBEDDED_DIR
from tunebook.checkpoint import load_embedded
steps = int(sys.argv[1])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR, dtype=torch.float32)
model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
_, tok = load_embedded()
tokens = torch.randint(3, len(tok), (32, 48), generator=torch.Generator().manual_seed(0))
def step():
    out = model(input_ids=tokens, labels=tokens); out.loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3): step()
wall, cpu = [], []
for _ in range(steps):
    w, c = time.perf_counter(), time.process_time(); step()
    wall.append(time.perf_counter() - w); cpu.append(time.process_time() - c)
print(json.dumps(dict(wall=wall, cpu=cpu, threads=f"{torch.get_num_threads()} torch threads")))
"""


def cpu_info() -> str:
    flags, model = set(), "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "?": model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags: flags = set(line.split(":", 1)[1].split())
    has = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(has)}"


def measure(code: str, steps: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(steps)], capture_output=True, text=True, env=env, cwd="/tmp")
    if out.returncode: raise SystemExit(out.stderr[-3000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(wall=statistics.median(r["wall"]), cpu=statistics.median(r["cpu"]), threads=r["threads"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="each (condition, program) is measured this many times, alternating; medians")
    ap.add_argument("--busy", type=int, default=0, help="busy processes started for the loaded condition (default: one per core)")
    ap.add_argument("--spin", default="", help="also tunebook with these middle spin counts (GOMP_SPINCOUNT), e.g. 10000,30000")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "TUNEBOOK_SET_OMP_WAIT")}
    programs = {"tunebook, spinning (before)": (TUNEBOOK, {**base, "GOMP_SPINCOUNT": "300000"}),
                "tunebook (its default now)": (TUNEBOOK, base),
                **{f"tunebook, GOMP_SPINCOUNT={n}": (TUNEBOOK, {**base, "GOMP_SPINCOUNT": n}) for n in a.spin.split(",") if n},
                "transformers + peft (torch's default)": (PEER, base)}
    print(f"CPU: {cpu_info()}; load average at start {os.getloadavg()[0]:.2f}", flush=True)
    rows = {}
    for cond in ("quiet", "loaded"):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy or os.cpu_count() or 1)] if cond == "loaded" else []
        try:
            time.sleep(1 if busy else 0)
            for r in range(a.rounds):
                for name, (code, env) in (list(programs.items())[::-1] if r % 2 else programs.items()):
                    m = measure(code, a.steps, env)
                    rows.setdefault((cond, name), []).append(m)
                    print(f"  {cond:6} {name:38} step {m['wall']:.3f} s wall, {m['cpu']:.3f} s CPU  ({m['threads']})", flush=True)
        finally:
            for p in busy: p.kill(); p.wait()
    med = {k: statistics.median(m["wall"] for m in v) for k, v in rows.items()}
    print(f"\nload average at end {os.getloadavg()[0]:.2f}\n")
    print(f"| program | quiet step (s) | loaded step (s) | slowdown under load |\n|---|---|---|---|")
    out = {}
    for name in programs:
        q, l = med[("quiet", name)], med[("loaded", name)]
        out[name] = dict(quiet=q, loaded=l, slowdown=l / q)
        print(f"| {name} | {q:.3f} | {l:.3f} | {l / q:.2f}x |")
    before, now = out["tunebook, spinning (before)"], out["tunebook (its default now)"]
    print(f"\ntunebook's step under load: {before['loaded'] / now['loaded']:.2f}x faster than spinning; quiet: "
          f"{before['quiet'] / now['quiet']:.2f}x")
    if a.json: Path(a.json).write_text(json.dumps(dict(cpu=cpu_info(), results=out), indent=2))


if __name__ == "__main__":
    main()
