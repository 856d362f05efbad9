"""Where a bf16 training step's time goes on this CPU, and how much of the bf16 matmul peak it uses (H1, issue 18).

A SmolLM2-135M-shaped model (dim 576, 30 layers, 9 heads, 3 KV heads, ffn 1536, vocab 49152; random weights) in bf16
weights, a LoRA step (rank 16 on q, k, v, o, gate, up, down) and a full step, as bench/peers.py's TunebookRun does one:
forward to the hidden states, ChunkedCrossEntropy(8) with the output projection, backward, fused AdamW, zero_grad.
Each configuration: one warm-up step, `--steps` timed steps (CPU time and wall, median), then one step under
torch.profiler whose self time per op (the profiler's "CPU time" is the op's wall time on its thread) is summed by
category: everything inside the loss (its forward range and its backward node, output projection included) is
"loss", inside opt.step/zero_grad "optimizer", the rest by op name (matmul, attention, embedding, norms/elementwise). Model FLOPs per step: bench/peers.py's `train_flops_per_token`; the share of peak is the step's model
FLOP per CPU-second over the 2048^3 bf16 matmul's FLOP per CPU-second, measured in the same process and thread count
(and the same with wall seconds). The host is shared and noisy: CPU time is the steadier measure.

    .venv/bin/python bench/bench_step.py                     # lora and full, 4x128 and 8x256
    .venv/bin/python bench/bench_step.py --sdpa              # SDPA fwd+bwd, bf16 vs fp32 upcast, by sequence length
    .venv/bin/python bench/bench_step.py --before            # the step before H1's changes, for the before/after
    .venv/bin/python bench/bench_step.py --shapes 4x128 --methods lora --layers 6   # shorter
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import make_batch, train_flops_per_token  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CATEGORIES = [  # (category, op-name fragments), first match wins; self CPU time of each aten op
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "_sdpa")),
    ("optimizer", ("adam", "_foreach", "clip_grad", "norm_")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "_addmm")),
    ("embedding", ("embedding",)),
]


def category(name: str) -> str:
    for cat, frags in CATEGORIES:
        if any(f in name for f in frags): return cat
    return "norms/elementwise/copies"


def matmul_peak(n=2048, seconds=1.5):
    "bf16 n^3 matmul: (best FLOP per wall second, best FLOP per CPU second) over short bursts."
    a, b = (torch.randn(n, n, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    best_w = best_c = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(2): a @ b
        c1, w1 = time.process_time(), time.perf_counter()
        best_w, best_c = max(best_w, 4 * n ** 3 / (w1 - w0)), max(best_c, 4 * n ** 3 / max(c1 - c0, 1e-9))
    return best_w, best_c


def hf_cfg(c):
    return dict(hidden_size=c.dim, num_hidden_layers=c.n_layers, vocab_size=c.vocab_size, intermediate_size=c.hidden_dim,
                head_dim=c.head_dim, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads)


def build(method, layers, rank=16):
    from tunebook.lora import apply_lora
    from tunebook.model import build_model, smollm2_135m
    torch.manual_seed(0)
    model = build_model(smollm2_135m(n_layers=layers), dtype=torch.bfloat16)
    if method == "lora":
        apply_lora(model, rank=rank, alpha=2 * rank, targets=TARGETS)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)


def step(model, opt, loss_fn, batch):
    rf = torch.profiler.record_function
    h = model(batch["tokens"], return_hidden=True)
    with rf("## loss ##"): loss = loss_fn(h, model.output_weight, batch["labels"])
    loss.backward()
    with rf("## optimizer ##"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def scope(e) -> str | None:
    "loss / optimizer when the event runs inside those ranges (forward) or the loss's backward node; else None."
    while e is not None:
        if e.name in ("## loss ##", "## optimizer ##"): return e.name.strip("# ")
        if "_ChunkedLinearCEBackward" in e.name: return "loss"
        e = e.cpu_parent
    return None


def profile_config(method, B, T, layers, steps, profile=True):
    from tunebook.loss import ChunkedCrossEntropy
    model, opt = build(method, layers)
    loss_fn, batch = ChunkedCrossEntropy(num_chunks=8), make_batch(B, T, model.config.vocab_size)
    step(model, opt, loss_fn, batch)  # warm-up: optimizer state, kernels
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        step(model, opt, loss_fn, batch)
        cpu.append(time.process_time() - c0); wall.append(time.perf_counter() - w0)
    by_cat, ops = {}, []
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(model, opt, loss_fn, batch)
    for e in prof.events() if profile else []:  # self time of every op, by the phase it runs in (loss, optimizer) else by its name
        if not e.name.startswith("aten::"): continue
        sc, cat = scope(e), category(e.name)
        cat = cat if sc is None else f"{sc}/{cat if cat in ('matmul', 'optimizer') else 'other'}"
        by_cat[cat] = by_cat.get(cat, 0.0) + e.self_cpu_time_total / 1e6
    for e in prof.key_averages() if profile else []:
        if e.key.startswith("aten::"): ops.append((e.self_cpu_time_total / 1e6, e.key, e.count))
    total = sum(by_cat.values()) or 1.0
    flops = train_flops_per_token(hf_cfg(model.config), T, method) * B * T
    return dict(method=method, batch=f"{B}x{T}", layers=layers, cpu_s=statistics.median(cpu), wall_s=statistics.median(wall),
                model_flop=flops, profile_self_cpu_s=total,
                by_category={k: v / total for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
                top_ops=[(k, round(s, 4), n) for s, k, n in sorted(ops, reverse=True)[:12]])


def sdpa_table(threads):
    "fwd+bwd of one SmolLM2-shaped causal GQA attention: bf16 SDPA vs fp32 SDPA on upcast inputs (CPU time, median of 5)."
    def run(B, T, up, reps=5):
        q, k, v = (torch.randn(B, h, T, 64, dtype=torch.bfloat16, requires_grad=True) for h in (9, 3, 3))
        g, ts = torch.randn(B, 9, T, 64, dtype=torch.bfloat16), []
        for r in range(reps + 1):
            c0 = time.process_time()
            a = (q.float(), k.float(), v.float()) if up else (q, k, v)
            y = F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True)
            y.to(torch.bfloat16).backward(g)
            if r: ts.append(time.process_time() - c0)
        return statistics.median(ts)
    print(f"SDPA fwd+bwd, 9 q heads / 3 kv heads / head_dim 64, causal, {threads} thread(s), CPU ms (median of 5)")
    for B, T in [(4, 128), (4, 192), (8, 256), (4, 384), (4, 512), (1, 2048)]:
        a, b = run(B, T, False), run(B, T, True)
        print(f"  {B} x {T:5d}: bf16 {a * 1e3:7.1f}   fp32-upcast {b * 1e3:7.1f}   bf16/fp32 {a / b:.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--shapes", default="4x128,8x256")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sdpa", action="store_true", help="only the SDPA bf16/fp32 table")
    ap.add_argument("--before", action="store_true", help="the step before H1's changes: native bf16 SDPA, the 4-op RMSNorm")
    ap.add_argument("--no-profile", action="store_true", help="timings only (the profiler's events take GBs at 8x256)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.sdpa: return sdpa_table(a.threads)
    if a.before:
        import tunebook.attention as att
        att.CPU_FP32_ATTENTION_MAX_LEN = 0
        def rms_before(self, x):
            xf = x.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        att.RMSNorm.forward = rms_before
    peak_w, peak_c = matmul_peak()
    print(f"bf16 2048^3 matmul, {a.threads} threads: {peak_w / 1e12:.2f} TFLOP/s wall, {peak_c / 1e12:.2f} TFLOP per CPU-s", flush=True)
    out = []
    for method in a.methods.split(","):
        for shape in a.shapes.split(","):
            B, T = map(int, shape.split("x"))
            r = profile_config(method, B, T, a.layers, a.steps, profile=not a.no_profile)
            out.append(r)
            print(f"\n{method} {shape} ({a.layers} layers): step {r['cpu_s']:.2f} s CPU, {r['wall_s']:.2f} s wall; "
                  f"{B * T / r['wall_s']:.0f} tok/s wall; {r['model_flop'] / r['cpu_s'] / 1e12:.3f} model TFLOP per CPU-s "
                  f"({r['model_flop'] / r['cpu_s'] / peak_c:.1%} of the peak measured before it)")
            print("  self CPU by category: " + ", ".join(f"{k} {v:.1%}" for k, v in r["by_category"].items()))
            print("  top ops (self CPU s, calls): " + "; ".join(f"{k} {s} x{n}" for k, s, n in r["top_ops"]), flush=True)
    # peak again after: the host's load moves; report both
    peak_w2, peak_c2 = matmul_peak()
    print(f"\nbf16 matmul peak after: {peak_w2 / 1e12:.2f} TFLOP/s wall, {peak_c2 / 1e12:.2f} per CPU-s (before: "
          f"{peak_w / 1e12:.2f}, {peak_c / 1e12:.2f}); shares below use the higher of the two")
    peak_w, peak_c = max(peak_w, peak_w2), max(peak_c, peak_c2)
    for r in out:
        r.update(share_of_peak_cpu=r["model_flop"] / r["cpu_s"] / peak_c, share_of_peak_wall=r["model_flop"] / r["wall_s"] / peak_w)
        print(f"  {r['method']} {r['batch']}: model FLOPs {r['share_of_peak_cpu']:.1%} of the bf16 matmul peak per CPU-s, "
              f"{r['share_of_peak_wall']:.1%} per wall-s")
    if a.json: Path(a.json).write_text(json.dumps(dict(peak_wall=peak_w, peak_cpu=peak_c, peak_after=(peak_w2, peak_c2), runs=out), indent=1))


if __name__ == "__main__":
    main()
