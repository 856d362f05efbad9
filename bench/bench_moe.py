"""An MoE LoRA training step: tunebook against transformers+peft, in one process, on the same weights and batches.

A Qwen3-30B-A3B-like MoE layer shape scaled down for a 2-core CPU (default: dim 512, 64 experts, top-8, moe_hidden 128,
2 layers, 8 heads / 4 KV heads of 64, vocab 2048, batch 2 x 256, fp32, one thread). LoRA rank 16 (alpha 32) on
q/k/v/o_proj and on every expert: tunebook's `apply_lora(targets=(..., "experts"))` (per-expert adapters inside the
grouped product) and peft 0.18's `target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]` (its
ParamWrapper), the peft model loaded from tunebook's `save_adapter` folder so both start from the same adapter.
The step: forward, cross-entropy on the shifted tokens (no router loss on either side: the router is frozen), backward,
AdamW, zero_grad. The first step's losses must agree (1e-4).

The peer's best setting: every transformers experts implementation (eager, grouped_mm, batched_mm), with and without
torch.nn.utils.parametrize.cached() around the step (peft rebuilds W + delta on every access of the parametrized
tensor otherwise), one timed step each after a warm-up; the fastest is the peer. Then `--rounds` rounds alternate
tunebook and the peer (order swapped each round); the speed ratio is the median of the rounds' paired ratios, step time
the median. Peak memory: tunebook.memory.MemoryTracker's live tensor bytes over one more step of each, weights and
optimizer state included (as bench_device.peak_cpu / bench_finetune). Prints the CPU model and the load average.

A gpt-oss-shaped row (`--arch gpt_oss`): the same step on transformers' `GptOssForCausalLM` (attention sinks, a
biased router with softmax over the top-k logits, biased experts with the clamped SwiGLU, sliding and full attention
alternating) against tunebook's gpt-oss built from the same checkpoint; gpt-oss-20b's proportions scaled down (default:
dim 512, 32 experts top-4, moe_hidden 512 = dim, 8 heads / 1 KV head of 64, window 128, 2 layers). Sinks and biases
are drawn non-zero (std 0.1) so that every quirk is on the path; the experts' gate_up_proj is scaled up so that the clamp
(limit 7) is reached.

    python bench/bench_moe.py                 # the default shape (Qwen3-30B-A3B-like)
    python bench/bench_moe.py --arch gpt_oss  # the gpt-oss-20b-like row
    python bench/bench_moe.py --experts 8 --dim 128 --moe-hidden 64 --rounds 2   # a quick smoke
"""
import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"): return line.split(":", 1)[1].strip()
    return "unknown CPU"


def hf_class(a):
    import transformers
    return transformers.GptOssForCausalLM if a.arch == "gpt_oss" else transformers.Qwen3MoeForCausalLM


def hf_config(a):
    "transformers' config of the benchmarked shape (`a.arch`)."
    import transformers
    common = dict(vocab_size=a.vocab, hidden_size=a.dim, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, head_dim=a.dim // a.heads, num_experts_per_tok=a.topk, pad_token_id=0,
                  max_position_embeddings=max(512, a.seq))
    if a.arch == "gpt_oss":   # gpt-oss-20b's own rope (yarn), window, clamp and router: only the sizes are scaled down
        return transformers.GptOssConfig(**common, intermediate_size=a.moe_hidden, num_local_experts=a.experts, sliding_window=a.window,
                                         rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                              original_max_position_embeddings=4096, rope_theta=150000.0))
    return transformers.Qwen3MoeConfig(**common, intermediate_size=4 * a.dim, num_experts=a.experts, moe_intermediate_size=a.moe_hidden,
                                       norm_topk_prob=True)


def build(a, d):
    "(transformers model, tunebook model with LoRA, the adapter folder): same weights, same adapter."
    import transformers
    from tunebook.checkpoint import load_hf
    from tunebook.lora import apply_lora, save_adapter
    torch.manual_seed(0)
    hf = hf_class(a)(hf_config(a))
    if a.arch == "gpt_oss":   # sinks, attention and router biases, expert biases non-zero; the SwiGLU clamp reached
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith(("bias", "sinks")): p.normal_(0, 0.1)
                if n.endswith("experts.gate_up_proj"): p.mul_(8.0)
    hf.save_pretrained(d / "base")
    ours = apply_lora(load_hf(d / "base"), rank=a.rank, alpha=2 * a.rank, targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"))
    save_adapter(ours, d / "adapter", base_model_name_or_path=str(d / "base"))
    return ours, d / "adapter", d / "base"


class Run:
    def __init__(self, name, model, logits, cached=False):
        self.name, self.model, self.logits, self.cached = name, model.train(), logits, cached
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)

    def step(self, tokens):
        ctx = torch.nn.utils.parametrize.cached() if self.cached else contextlib.nullcontext()
        with ctx:
            logits = self.logits(self.model, tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
        self.optimizer.step(); self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def timed(self, tokens):
        t0 = time.perf_counter(); loss = self.step(tokens); return time.perf_counter() - t0, loss


def peak_bytes(run, tokens) -> int:
    from tunebook.memory import MemoryTracker
    tr = MemoryTracker("cpu").watch(run.model, run.optimizer)
    tr.track(tokens, "inputs")
    with tr: run.step(tokens)
    return int(tr.peak)


SHAPES = {   # --arch -> its default shape: a real model's proportions scaled down for a 2-core CPU
    "qwen3_moe": dict(dim=512, experts=64, topk=8, moe_hidden=128, layers=2, heads=8, kv_heads=4, window=0, vocab=2048, batch=2, seq=256,
                      rank=16, rounds=5, threads=1),
    "gpt_oss": dict(dim=512, experts=32, topk=4, moe_hidden=512, layers=2, heads=8, kv_heads=1, window=128, vocab=2048, batch=2, seq=256,
                    rank=16, rounds=5, threads=1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(SHAPES), default="qwen3_moe", help="the family whose layer shape is benchmarked")
    for k in SHAPES["qwen3_moe"]:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help="default: the --arch shape's")
    a = p.parse_args(argv)
    for k, v in SHAPES[a.arch].items():
        if getattr(a, k) is None: setattr(a, k, v)
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    import peft, transformers
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, torch threads {a.threads}; load average at start {os.getloadavg()}")
    print(f"shape ({a.arch}): dim {a.dim}, {a.experts} experts top-{a.topk}, moe_hidden {a.moe_hidden}, {a.layers} layers, "
          f"{a.heads} heads / {a.kv_heads} KV{f', window {a.window}, sinks' if a.arch == 'gpt_oss' else ''}, batch {a.batch} x {a.seq}, "
          f"fp32, LoRA r{a.rank} on q/k/v/o + experts; transformers {transformers.__version__}, peft {peft.__version__}")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, a.vocab, (a.batch, a.seq + 1), generator=g) for _ in range(a.rounds + 2)]
    with tempfile.TemporaryDirectory() as d:
        ours, adapter, base = build(a, Path(d))
        tb = Run("tunebook", ours, lambda m, t: m(t))
        peers = []
        for impl in ("eager", "grouped_mm", "batched_mm"):
            try:
                hf = hf_class(a).from_pretrained(base, experts_implementation=impl)
            except Exception as e:   # an implementation this torch or CPU lacks
                print(f"  transformers experts_implementation={impl}: unavailable ({type(e).__name__}: {str(e)[:80]})"); continue
            pm = peft.PeftModel.from_pretrained(hf, adapter, is_trainable=True)
            for cached in (False, True):
                peers.append(Run(f"transformers+peft {impl}{' +parametrize.cached' if cached else ''}",
                                 pm if not cached else copy.deepcopy(pm), lambda m, t: m(input_ids=t).logits, cached))
        # correctness: the first step's loss (same weights, same adapter, same batch)
        l0 = tb.step(batches[0])
        losses = {r.name: r.step(batches[0]) for r in peers}
        print(f"first-step loss: tunebook {l0:.6f}; " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
        bad = {k: v for k, v in losses.items() if abs(v - l0) > 1e-4}
        if bad: print(f"  LOSS MISMATCH (> 1e-4): {bad}")
        # the peer's best setting: one timed step each (after the warm-up above)
        trial = {r.name: r.timed(batches[1])[0] for r in peers}
        for k, v in trial.items(): print(f"  peer trial {k:45s} {v:7.3f} s")
        peer = min(peers, key=lambda r: trial[r.name])
        for r in peers:
            if r is not peer: r.model = r.optimizer = None
        del peers
        print(f"peer: {peer.name}")
        tb.timed(batches[1])
        times = {tb.name: [], peer.name: []}
        for i in range(a.rounds):
            order = (tb, peer) if i % 2 == 0 else (peer, tb)
            for r in order: times[r.name].append(r.timed(batches[2 + i])[0])
            print(f"  round {i}: tunebook {times[tb.name][-1]:.3f} s, peer {times[peer.name][-1]:.3f} s")
        paired = statistics.median(p_ / t for t, p_ in zip(times[tb.name], times[peer.name]))
        mem = {r.name: peak_bytes(r, batches[0]) for r in (tb, peer)}
    med = {k: statistics.median(v) for k, v in times.items()}
    tok = a.batch * a.seq
    print(f"\n{'':45s} {'step s (median)':>15s} {'tokens/s':>9s} {'peak MiB':>9s}")
    for k in (tb.name, peer.name):
        print(f"{k:45s} {med[k]:15.3f} {tok / med[k]:9.0f} {mem[k] / 2**20:9.1f}")
    print(f"\nspeed: tunebook {paired:.2f}x transformers+peft (median of {a.rounds} paired ratios; "
          f"medians {med[peer.name] / med[tb.name]:.2f}x); peak memory {mem[tb.name] / mem[peer.name]:.2f}x of the peer's")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
