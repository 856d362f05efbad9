"""Generation for RL: tunebook's torch sampler (what GRPO's sample_groups calls) against one vLLM engine.

Same model folder, same prompts, same sampling settings (P prompts x G samples, up to T new tokens, stop tokens).
The two alternate round by round; medians of generated tokens/s and samples/s are printed with the vllm/torch
ratio. Also: the engine's start-up (vLLM import + `LLM(...)`), and the two policy-update paths: merged weights
reloaded in place (`update_weights`) against LoRA adapters swapped in (`update_adapter`, an engine started with
`lora_rank`), with the sampling speed each leaves. Run it in the vLLM environment (`make vllm-env`):

    .venv-vllm/bin/python bench/bench_vllm.py                          # the embedded model, then SmolLM2-135M
    .venv-vllm/bin/python bench/bench_vllm.py --models embedded --rounds 5 --json out.json
    .venv-vllm/bin/python bench/bench_vllm.py --models DIR --dtype bfloat16

Timings on shared machines swing by several times: quote the ratios and the load average printed with them.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def load_average() -> str:
    try: return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError: return "n/a"


def model_dir(name: str) -> Path:
    if name == "embedded":
        from tunebook.embedded import EMBEDDED_DIR
        return Path(EMBEDDED_DIR)
    if name == "smollm2":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from realckpt import smollm2_dir
        return smollm2_dir()
    return Path(name)


def prompts_for(folder: Path, n: int, task: str):
    from tunebook.data import make_task
    from tunebook.tokenizer import load_tokenizer
    from tunebook.train import encode_prompt, stop_ids
    tok = load_tokenizer(folder)
    rows = make_task(task, n, seed=0, split="eval")
    return [encode_prompt(tok, [{"role": "user", "content": str(r["prompt"])}]) for r in rows], stop_ids(tok), tok.pad_id or 0


def perturbed(model, seed: int):
    "The policy after a few steps, roughly: LoRA adapters with small random B on q/v."
    from tunebook.lora import apply_lora, lora_modules
    torch.manual_seed(seed)
    m = copy.deepcopy(model)
    apply_lora(m, rank=8, targets=("q_proj", "v_proj"))
    for mod in lora_modules(m).values(): torch.nn.init.normal_(mod.lora_B.weight, std=0.02)
    return m


def timed(fn):
    t0 = time.perf_counter()
    toks = fn()
    return sum(map(len, toks)), len(toks), time.perf_counter() - t0


def bench_model(name: str, args) -> dict:
    from tunebook.checkpoint import load_hf
    from tunebook.generate import generate
    folder = model_dir(name)
    prompts, stops, pad = prompts_for(folder, args.prompts, args.task)
    model = load_hf(folder).eval()
    torch.set_num_threads(args.torch_threads)
    g = torch.Generator().manual_seed(0)
    kw = dict(temperature=args.temperature, top_k=args.top_k)
    torch_fn = lambda: generate(model, prompts, args.max_new_tokens, eos_id=stops, pad_id=pad, generator=g, logprobs=True,
                                num_samples=args.group_size, **kw)[0]
    t0 = time.perf_counter()
    from tunebook.vllmgen import VLLMGenerator, require_vllm
    require_vllm()
    import_s = time.perf_counter() - t0
    res = dict(model=name, folder=str(folder), dtype=None, prompts=args.prompts, group_size=args.group_size,
               max_new_tokens=args.max_new_tokens, torch_threads=args.torch_threads, vllm_import_s=import_s)
    with VLLMGenerator(folder, dtype=args.dtype, seed=0, max_model_len=args.max_model_len) as gen:
        res.update(dtype=gen.dtype, vllm_startup_s=gen.startup_seconds)
        vllm_fn = lambda: gen.sample(prompts, n=args.group_size, max_tokens=args.max_new_tokens, stop_token_ids=stops, **kw)[0]
        torch_fn(); vllm_fn()                                   # warm-up
        runs = {"torch": [], "vllm": []}
        for r in range(args.rounds):
            for k in (("torch", "vllm") if r % 2 == 0 else ("vllm", "torch")):
                runs[k].append(timed(torch_fn if k == "torch" else vllm_fn))
        for k, rs in runs.items():
            res[f"{k}_tokens_per_s"] = statistics.median(t / s for t, _, s in rs)
            res[f"{k}_samples_per_s"] = statistics.median(n / s for _, n, s in rs)
            res[f"{k}_mean_tokens"] = statistics.mean(t / n for t, n, _ in rs)
        upd = []
        for i in range(3):
            gen.update_weights(perturbed(model, i), version=i + 1); upd.append(gen.last_update)
        for k in ("total", "write", "reload"): res[f"update_weights_{k}_ms"] = statistics.median(u[f"{k}_seconds"] for u in upd) * 1e3
    if args.lora_rank:
        with VLLMGenerator(folder, dtype=args.dtype, seed=0, max_model_len=args.max_model_len, lora_rank=args.lora_rank) as gen:
            vllm_fn = lambda: gen.sample(prompts, n=args.group_size, max_tokens=args.max_new_tokens, stop_token_ids=stops, **kw)[0]
            res["lora_engine_startup_s"] = gen.startup_seconds
            vllm_fn()
            base = [timed(vllm_fn) for _ in range(args.rounds)]
            swaps = [gen.update_adapter(perturbed(model, i), version=i + 1) for i in range(3)]
            vllm_fn()
            lora = [timed(vllm_fn) for _ in range(args.rounds)]
            res["lora_engine_no_adapter_tokens_per_s"] = statistics.median(t / s for t, _, s in base)
            res["lora_adapter_tokens_per_s"] = statistics.median(t / s for t, _, s in lora)
            res["update_adapter_ms"] = statistics.median(swaps) * 1e3
    return res


class _TimeBudget:
    "Stop a GRPO run `seconds` after its first step ended (so the generator's start-up is outside the budget)."
    def __init__(self, seconds): self.seconds, self.t0 = seconds, None
    def on_step(self, trainer, row):
        now = time.perf_counter()
        if self.t0 is None: self.t0 = now
        elif now - self.t0 >= self.seconds: trainer.stop()


def bench_grpo(generator: str, async_mode: bool, args) -> dict:
    "GRPO on the embedded model for a fixed training time with one generator backend; reward and samples/s."
    import tempfile
    from tunebook.grpo import GRPOConfig, GRPOTrainer
    cfg = GRPOConfig(generator=generator, async_mode=async_mode, max_steps=100_000, eval_samples=args.grpo_eval,
                     output_dir=tempfile.mkdtemp(prefix="bench-vllm-grpo-"))
    t = GRPOTrainer(cfg, callbacks=[_TimeBudget(args.grpo_seconds)])
    s = t.fit(progress=False)
    return dict(generator=generator, async_mode=async_mode, steps=s["steps"], samples=s["samples"],
                samples_per_second=s.get("samples_per_second") or float("nan"), reward_before=s["eval_reward_before"],
                reward_after=s["eval_reward_after"], startup_s=s.get("generator_startup_seconds"),
                dropped_stale=s.get("dropped_stale"))


def report(r: dict):
    print(f"\n== {r['model']} ({r['folder']}), vLLM {r['dtype']}, {r['prompts']} prompts x {r['group_size']} samples x "
          f"<= {r['max_new_tokens']} tokens; torch sampler fp32 on {r['torch_threads']} thread(s)")
    print(f"vLLM start-up: import {r['vllm_import_s']:.1f} s + engine {r['vllm_startup_s']:.1f} s")
    print(f"{'':8}{'tokens/s':>10}{'samples/s':>11}{'tokens/sample':>15}")
    for k in ("torch", "vllm"):
        print(f"{k:8}{r[k + '_tokens_per_s']:>10.0f}{r[k + '_samples_per_s']:>11.1f}{r[k + '_mean_tokens']:>15.1f}")
    print(f"vllm / torch: {r['vllm_tokens_per_s'] / r['torch_tokens_per_s']:.2f}x tokens/s, "
          f"{r['vllm_samples_per_s'] / r['torch_samples_per_s']:.2f}x samples/s")
    print(f"update_weights: {r['update_weights_total_ms']:.0f} ms (merge + write {r['update_weights_write_ms']:.0f}, "
          f"reload in place {r['update_weights_reload_ms']:.0f})")
    if "update_adapter_ms" in r:
        print(f"LoRA engine (start-up {r['lora_engine_startup_s']:.1f} s): update_adapter {r['update_adapter_ms']:.0f} ms; sampling "
              f"{r['lora_engine_no_adapter_tokens_per_s']:.0f} tokens/s without an adapter, {r['lora_adapter_tokens_per_s']:.0f} with "
              f"(merged weights on a plain engine: {r['vllm_tokens_per_s']:.0f})")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=["embedded", "smollm2"], help="embedded, smollm2 or model folders (none: GRPO only)")
    p.add_argument("--task", default="add"); p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8); p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7); p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3); p.add_argument("--dtype", default=None, help="vLLM's; default float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--lora-rank", type=int, default=8, help="0: skip the LoRA-path engine")
    p.add_argument("--torch-threads", type=int, default=1, help="vLLM's CPU worker binds one core by default here")
    p.add_argument("--grpo-seconds", type=float, default=0, help="> 0: also GRPO (embedded) for this long per backend x mode")
    p.add_argument("--grpo-eval", type=int, default=200, help="held-out prompts for GRPO's reward before/after")
    p.add_argument("--grpo-runs", default="torch:sync,vllm:sync,torch:async,vllm:async", help="generator:mode, comma-separated")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(f"load average at start: {load_average()}")
    results = []
    for m in args.models:
        results.append(bench_model(m, args)); report(results[-1])
        if args.json: Path(args.json).write_text(json.dumps(results, indent=2))
    if args.grpo_seconds > 0:
        runs = [bench_grpo(g, m == "async", args) for g, m in (r.split(":") for r in args.grpo_runs.split(","))]
        print(f"\n== GRPO, embedded model, {args.grpo_seconds:.0f} s of training each (GRPOConfig defaults)")
        print(f"{'generator':10}{'mode':7}{'steps':>6}{'samples/s':>11}{'reward before':>15}{'after':>7}{'start-up s':>12}")
        for r in runs:
            su = f"{r['startup_s']:.1f}" if r["startup_s"] else "-"
            print(f"{r['generator']:10}{'async' if r['async_mode'] else 'sync':7}{r['steps']:>6}{r['samples_per_second']:>11.1f}"
                  f"{r['reward_before']:>15.2f}{r['reward_after']:>7.2f}{su:>12}")
        results.append(dict(grpo=runs))
        if args.json: Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nload average at end: {load_average()}")


if __name__ == "__main__":
    main()
