"""GRPO throughput: torch vs vllm generator backends, synchronous vs asynchronous, same model, same machine.

Runs each (backend, mode) for a fixed wall-clock budget of training (the vllm engine's start-up is excluded from
the budget and reported on its own), alternating, `--repeats` times; prints rollout samples per second, the
mean training reward, the held-out reward at the end, and ratios against torch-sync (medians).

    python bench/bench_grpo.py                                   # torch backend, sync and async, the embedded model
    .venv-vllm/bin/python bench/bench_grpo.py --backends torch,vllm --seconds 60
"""
import argparse
import statistics
import tempfile
import time

import torch

_cores = torch.get_num_threads()

from tunebook.grpo import GRPOConfig, GRPOTrainer


class _TimeBudget:
    "Stop the run after `seconds` of training, counted from its first step (engine start-up excluded)."
    def __init__(self, seconds): self.seconds, self.t0 = seconds, None
    def on_step(self, trainer, row):
        if self.t0 is None: self.t0 = time.perf_counter(); return
        if time.perf_counter() - self.t0 >= self.seconds: trainer.stop()


def run(backend: str, async_mode: bool, seconds: float, args) -> dict:
    given = {k: v for k, v in dict(tokenizer=args.tokenizer, task=args.task, lr=args.lr, max_staleness=args.max_staleness,
                                   queue_size=args.queue_size, learner_threads=args.learner_threads).items() if v is not None}
    cfg = GRPOConfig(model=args.model, async_mode=async_mode, generator=backend, max_steps=100_000, group_size=args.group_size,
                     prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens, eval_samples=args.eval_samples,
                     num_generators=args.generators, output_dir=tempfile.mkdtemp(prefix="bench-grpo-"), **given)
    torch.set_num_threads(args.sync_threads if not async_mode and args.sync_threads else _cores)
    t = GRPOTrainer(cfg, callbacks=[_TimeBudget(seconds)])
    s = t.fit(progress=False)
    m = t.metrics[1:]   # the first step waits for process / engine start-up: throughput from the second on
    per_step = cfg.grad_accum_steps * cfg.prompts_per_step * cfg.group_size
    secs = sum(r["seconds"] for r in m)
    return dict(samples_per_second=per_step * len(m) / secs if secs else float("nan"),
                step_ms=statistics.median(r["seconds"] for r in m) * 1e3 if m else float("nan"),
                sample_ms=statistics.median(r["sample_seconds"] for r in m) * 1e3 if m else float("nan"),
                steps=s["steps"], mean_reward=s["mean_train_reward"], reward_before=s["eval_reward_before"],
                reward_after=s["eval_reward_after"], dropped=s["dropped_stale"], max_staleness_used=s["max_staleness_used"],
                gap_max=max((r["logprob_gap_max"] for r in t.metrics), default=float("nan")),
                startup_seconds=s.get("generator_startup_seconds", 0.0))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded"); p.add_argument("--tokenizer", default=None)
    p.add_argument("--task", default=None, help="default: GRPOConfig's"); p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--backends", default="torch", help="comma-separated: torch, vllm (vllm needs .venv-vllm)")
    p.add_argument("--modes", default="sync,async"); p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4); p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=50); p.add_argument("--lr", type=float, default=None)
    p.add_argument("--max-staleness", type=int, default=None); p.add_argument("--generators", type=int, default=1)
    p.add_argument("--queue-size", type=int, default=None)
    p.add_argument("--sync-threads", type=int, default=None, help="default: all cores")
    p.add_argument("--learner-threads", type=int, default=None, help="default: the cores the generators leave")
    args = p.parse_args()
    combos = [(b, m == "async") for b in args.backends.split(",") for m in args.modes.split(",")]
    res = {c: [] for c in combos}
    for _ in range(args.repeats):
        for c in combos:
            r = run(*c, args.seconds, args); res[c].append(r)
            print(f"{c[0]:5s} {'async' if c[1] else 'sync ':5s}", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    med = {c: statistics.median(r["samples_per_second"] for r in res[c]) for c in combos}
    rew = {c: statistics.median(r["reward_after"] for r in res[c]) for c in combos}
    base = med.get(("torch", False))
    print(f"\nafter {args.seconds:.0f} s of training:")
    for c in combos:
        ratio = f"   x{med[c] / base:.2f} torch-sync" if base else ""
        up = statistics.median(r["startup_seconds"] for r in res[c])
        print(f"  {c[0]:5s} {'async' if c[1] else 'sync':5s} samples/s {med[c]:7.1f}{ratio}   held-out reward {rew[c]:.3f}"
              + (f"   engine start-up {up:.0f} s" if up else ""))


if __name__ == "__main__":
    main()
