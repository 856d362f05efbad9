"""GRPO throughput: synchronous vs asynchronous (generator processes + learner), same model, same machine.

Runs each mode for a fixed wall-clock budget (alternating, `--repeats` times) and prints rollout samples per
second, the mean training reward, the held-out reward at the end, and the async/sync ratio (medians).

    python bench/bench_grpo.py                       # the embedded model on its task
    python bench/bench_grpo.py --model DIR --task copy --seconds 60
"""
import argparse
import statistics
import tempfile
import time

import torch

_cores = torch.get_num_threads()

from tunebook.grpo import GRPOConfig, GRPOTrainer


class _TimeBudget:
    "Stop the run after `seconds` of training."
    def __init__(self, seconds): self.seconds = seconds
    def on_step(self, trainer, row):
        if row["time"] >= self.seconds: trainer.stop()


def run(async_mode: bool, seconds: float, args) -> dict:
    given = {k: v for k, v in dict(tokenizer=args.tokenizer, task=args.task, lr=args.lr, max_staleness=args.max_staleness,
                                   queue_size=args.queue_size, learner_threads=args.learner_threads).items() if v is not None}
    cfg = GRPOConfig(model=args.model, async_mode=async_mode, max_steps=10_000, group_size=args.group_size,
                     prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens, eval_samples=args.eval_samples,
                     num_generators=args.generators, output_dir=tempfile.mkdtemp(prefix="bench-grpo-"), **given)
    torch.set_num_threads(args.sync_threads if not async_mode and args.sync_threads else _cores)
    t = GRPOTrainer(cfg, callbacks=[_TimeBudget(seconds)])
    s = t.fit(progress=False)
    # the first rollout of an async run waits for process start-up: count throughput from the first step on
    m = t.metrics
    span = m[-1]["time"] - m[0]["time"] + m[0]["seconds"] if m else float("nan")
    steady = sum(r["samples"] for r in m) / span if m else float("nan")
    learn = statistics.median(r["learn_seconds"] for r in m) * 1e3 if m else float("nan")
    sample = statistics.median(r["sample_seconds"] for r in m) * 1e3 if m else float("nan")
    return dict(samples_per_second=steady, learn_ms=learn, sample_ms=sample, samples=s["samples"], steps=s["steps"], mean_reward=s["mean_train_reward"],
                reward_before=s["eval_reward_before"], reward_after=s["eval_reward_after"], dropped=s["dropped_stale"],
                max_staleness_used=s["max_staleness_used"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded"); p.add_argument("--tokenizer", default=None)
    p.add_argument("--task", default=None, help="default: GRPOConfig's"); p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--repeats", type=int, default=1); p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4); p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=50); p.add_argument("--lr", type=float, default=None)
    p.add_argument("--max-staleness", type=int, default=None); p.add_argument("--generators", type=int, default=1)
    p.add_argument("--queue-size", type=int, default=None)
    p.add_argument("--sync-threads", type=int, default=None, help="default: all cores")
    p.add_argument("--learner-threads", type=int, default=None, help="default: the cores the generators leave")
    args = p.parse_args()
    res = {False: [], True: []}
    for _ in range(args.repeats):
        for mode in (False, True):
            r = run(mode, args.seconds, args); res[mode].append(r)
            print(("async" if mode else "sync ").ljust(6), {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    med = {m: statistics.median(r["samples_per_second"] for r in res[m]) for m in res}
    rew = {m: statistics.median(r["reward_after"] for r in res[m]) for m in res}
    print(f"\nsamples/s   sync {med[False]:.1f}   async {med[True]:.1f}   ratio async/sync {med[True] / med[False]:.2f}x")
    print(f"held-out reward after {args.seconds:.0f} s   sync {rew[False]:.3f}   async {rew[True]:.3f}")


if __name__ == "__main__":
    main()
