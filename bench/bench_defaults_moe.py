"""The real-model defaults rule (bench_defaults.py) extended to mixture-of-experts: the LoRA learning rate of the MoE recipes.

No MoE checkpoint is on the registry, so the model is a small Qwen3-MoE built from `get_config("qwen3-30b-a3b", ...)`
(dim 128, 4 layers, 8 experts top-2 of width 128, q/k norms, router aux-loss coefficient 0.001 as Qwen3-30B-A3B's
config.json) with random weights, first trained briefly (full fine-tuning on a mixture of the synthetic tasks copy,
upper, sort and add) so that the LoRA runs start from a model that knows the format. A dense Qwen3 of the same shape
(its MLP as wide as the two active experts together) gets the same pre-training and the same sweep: the control that
says whether an MoE wants another learning rate than a dense model at the same budget.

Then, as bench_defaults.py's sft-lora sweep: a fixed budget (20 steps x 8 rows, warmup 10, LoRA r16/alpha32) on a task
neither model saw (reverse), one run per learning rate, held-out loss and exact match after; for the MoE also the expert
load on the held-out prompts (the busiest expert's share x n_experts, averaged over layers: 1.0 = even) and the router's
load-balancing loss (added to the loss by the training loop with the config's coefficient). Three arms:

    moe-experts   LoRA on q/k/v/o_proj and every expert (the MoE recipes' targets)
    moe-attn      LoRA on q/k/v/o_proj only (experts frozen)
    dense         LoRA on every linear (the dense recipes' all-linear)

    python bench/bench_defaults_moe.py            # all three arms, lrs 5e-4 1e-3 2e-3 5e-3 1e-2
    python bench/bench_defaults_moe.py --arms moe-experts --lrs 2e-3 --pre-steps 20   # a quick look

One JSON object per run is appended to bench/results/defaults_moe-lora.json. Run with OMP_NUM_THREADS=1 (~1 s a step).
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, max_seq_len=512, tie_embeddings=True)
MOE = dict(n_experts=8, experts_per_token=2, moe_hidden_dim=128, hidden_dim=256)   # Qwen3-30B-A3B's config otherwise
ARMS = {"moe-experts": ("moe", ("q_proj", "k_proj", "v_proj", "o_proj", "experts")),
        "moe-attn": ("moe", ("q_proj", "k_proj", "v_proj", "o_proj")),
        "dense": ("dense", ("all-linear",))}
LRS = (5e-4, 1e-3, 2e-3, 5e-3, 1e-2)
PRE_TASKS = ("copy", "upper", "sort", "add")


def models(tok):
    "(MoE, dense) tunebook models, random weights, the embedded tokenizer's vocabulary and special ids."
    from tunebook.model import build_model
    from tunebook.modelconfig import get_config
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    moe = get_config("qwen3-30b-a3b", **SHAPE, **MOE, **ids)
    dense = get_config("qwen3-0.6b", **SHAPE, hidden_dim=MOE["experts_per_token"] * MOE["moe_hidden_dim"], **ids)
    return {"moe": build_model(moe), "dense": build_model(dense)}


def pretrain(model, tok, data: Path, work: Path, steps: int) -> dict:
    "Full fine-tuning on the task mixture (in place): the base the LoRA runs start from."
    from tunebook.config import TrainConfig
    from tunebook.train import Trainer
    cfg = TrainConfig(data=str(data), method="full", lr=3e-3, batch_size=32, max_steps=steps, warmup_steps=20, eval_samples=20,
                      max_new_tokens=12, eval_fraction=0.01, dtype="fp32", seed=0, output_dir=str(work), save_every=0)
    s = Trainer(cfg, model=model, tokenizer=tok).fit(progress=False)
    return {k: s.get(k) for k in ("eval_loss_before", "eval_loss_after", "eval_accuracy_after", "train_seconds")}


def expert_load(model, tok, prompts) -> float | None:
    "The busiest expert's share of the routed tokens x n_experts on `prompts`, averaged over the MoE layers (1.0 = even)."
    import torch
    from tunebook.moe import moe_blocks
    blocks = moe_blocks(model)
    if not blocks: return None
    was, tot = model.training, None
    model.eval()
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([tok.encode(p)]))
            c = [torch.bincount(b.router_logits.topk(b.gate.k, -1)[1].reshape(-1), minlength=b.router_logits.shape[-1]) for b in blocks]
            tot = c if tot is None else [x + y for x, y in zip(tot, c)]
    model.train(was)
    shares = [float(c.max()) / float(c.sum()) * len(c) for c in tot]
    return round(sum(shares) / len(shares), 3)


def one_run(arm: str, base, tok, lr: float, steps: int, warmup: int, batch: int, work: Path) -> dict:
    from tunebook.config import TrainConfig
    from tunebook.tasks import make_task
    from tunebook.train import Trainer
    kind, targets = ARMS[arm]
    model = copy.deepcopy(base)
    cfg = TrainConfig(task="reverse", n_train=2000, method="lora", lora_rank=16, lora_alpha=32.0, lora_targets=targets, lr=lr,
                      batch_size=batch, max_steps=steps, warmup_steps=warmup, eval_samples=50, max_new_tokens=12, dtype="fp32",
                      seed=0, output_dir=str(work / f"{arm}-{lr:g}"), save_every=0)
    t0 = time.time()
    tr = Trainer(cfg, model=model, tokenizer=tok)
    s = tr.fit(progress=False)
    held = make_task("reverse", 50, seed=0, split="eval")["prompt"]
    out = dict(sweep="moe-lora", arm=arm, model=kind, targets=list(targets), lr=lr, batch_size=batch, steps=steps, warmup_steps=warmup,
               wall_seconds=round(time.time() - t0, 1), **{k: s[k] for k in ("eval_loss_before", "eval_loss_after", "eval_accuracy_before",
                                                                                  "eval_accuracy_after", "final_loss") if k in s})
    if kind == "moe":
        out["expert_load_after"] = expert_load(tr.model, tok, held)
        with open(Path(cfg.output_dir) / "metrics.csv") as f: rows = list(csv.DictReader(f))
        aux = [float(r["router_aux_loss"]) for r in rows if r.get("router_aux_loss")]
        if aux: out["router_aux_loss_first_last"] = [round(aux[0], 5), round(aux[-1], 5)]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in LRS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pre-steps", type=int, default=300, help="full fine-tuning steps (batch 32) on the task mixture first")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "defaults_moe-lora.json"))
    a = ap.parse_args(argv)
    import torch
    from tunebook.embedded import EMBEDDED_DIR
    from tunebook.tasks import make_mixture
    from tunebook.tokenizer import load_tokenizer
    arms = [x for x in a.arms.split(",") if x]
    if bad := [x for x in arms if x not in ARMS]: raise SystemExit(f"unknown arm(s) {bad}; known: {', '.join(ARMS)}")
    lrs = [float(x) for x in a.lrs.split(",")]
    work = Path(a.work or tempfile.mkdtemp(prefix="moe_defaults_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "mixture.jsonl"
    mix = make_mixture(list(PRE_TASKS), 1500, seed=0)
    data.write_text("".join(json.dumps(dict(prompt=r["prompt"], response=r["response"])) + "\n" for r in mix))
    tok = load_tokenizer(EMBEDDED_DIR)
    torch.manual_seed(0)
    bases = models(tok)
    print(f"load average at start {os.getloadavg()}, torch threads {torch.get_num_threads()}", flush=True)
    for kind in sorted({ARMS[x][0] for x in arms}):
        pre = pretrain(bases[kind], tok, data, work / f"pre-{kind}", a.pre_steps)
        print(json.dumps(dict(pretrain=kind, steps=a.pre_steps, **pre)), flush=True)
        with open(a.out, "a") as f: f.write(json.dumps(dict(sweep="moe-lora", pretrain=kind, steps=a.pre_steps, **pre)) + "\n")
    for arm in arms:
        for lr in lrs:
            r = one_run(arm, bases[ARMS[arm][0]], tok, lr, a.steps, a.warmup, a.batch, work)
            print(json.dumps(r), flush=True)
            with open(a.out, "a") as f: f.write(json.dumps(r) + "\n")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
