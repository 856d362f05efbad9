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
    .venv/bin/python bench/bench_step.py --compile --threads 1 --layers 6   # eager vs inductor (compile_model), alternating

--compile: for each configuration an eager and a compiled (tunebook.compile.compile_model: every block and the loss)
copy of the same model, in one process. The compiled copy's first step (the compile) is reported on its own; then
`--rounds` rounds alternate the two (order swapped every round), each timed step between two short bf16 matmul peak
bursts (bench/peers.py's bf16_matmul_peaks), its share of peak taken against the mean of those two adjacent peaks
(and, as before, against the higher of the peaks measured at the start and end of the run: "whole-run"). Peak memory
of a step: VmHWM during the step minus VmRSS before it (after malloc_trim and a reset of VmHWM), so the step's own
activations, gradients and temporaries, not the weights both copies hold. Inductor's cache is a fresh temporary
directory per run (a cold compile) unless --cache-dir names one (run twice with it for the warm-cache compile time).
"""
import argparse
import contextlib
import ctypes
import os
import resource
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import bf16_matmul_peaks, make_batch, train_flops_per_token  # noqa: E402

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


def build(method, layers, rank=16, precision="bf16"):
    "bf16: bf16 weights and optimizer state; bf16-mixed: fp32 weights (LoRA: frozen ones stored in bf16), bf16 autocast."
    from tunebook.lora import apply_lora
    from tunebook.model import build_model, smollm2_135m
    from tunebook.precision import resolve_precision, store_frozen_
    torch.manual_seed(0)
    model = build_model(smollm2_135m(n_layers=layers), dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    if method == "lora":
        apply_lora(model, rank=rank, alpha=2 * rank, targets=TARGETS)
        if precision == "bf16-mixed": store_frozen_(model, resolve_precision("bf16-mixed"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)


def step(model, opt, loss_fn, batch, precision="bf16"):
    rf = torch.profiler.record_function
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    with amp:
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


def _mem():
    "(VmRSS, VmHWM) of this process in bytes."
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(d[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def _reset_hwm():
    "Give freed heap back to the OS, then restart VmHWM at VmRSS: the next VmHWM is this step's own high-water mark."
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def timed(fn):
    "fn() -> (result, dict of cpu_s, wall_s, children_cpu_s, peak_step_mib); children: finished subprocesses only."
    _reset_hwm()
    rss0 = _mem()[0]
    ch0, c0, w0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time(), time.perf_counter()
    out = fn()
    c1, w1, ch1 = time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    return out, dict(cpu_s=c1 - c0, wall_s=w1 - w0, children_cpu_s=(ch1.ru_utime + ch1.ru_stime) - (ch0.ru_utime + ch0.ru_stime),
                     peak_step_mib=(_mem()[1] - rss0) / 2 ** 20)


COMPILED_CATEGORIES = [  # compiled step: (category, name fragments); inductor's own kernels are cpp_fused_* (enable_kernel_profile)
    ("attention", ("scaled_dot_product", "flash_attention", "_sdpa")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int", "mkldnn", "aten::linear")),
    ("generated kernels", ("cpp_fused", "cpp_kernel")),
    ("optimizer", ("adam", "_foreach")),
]


def profile_compiled_step(v, batch, precision):
    "One profiled step: self CPU time by category, split into loss (its forward range, the first backward graph) and the rest."
    from tunebook.compile import is_compiled
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(v["model"], v["opt"], v["loss_fn"], batch, precision)
    evs = [e for e in prof.events()]
    graph_calls = sorted((e for e in evs if e.name.startswith("## Call CompiledFxGraph")), key=lambda e: e.time_range.start)
    fwd_end = max((e.time_range.end for e in evs if e.name == "## loss ##"), default=0)
    bw = [e for e in graph_calls if e.time_range.start >= fwd_end]
    loss_ranges = [(e.time_range.start, e.time_range.end) for e in evs if e.name == "## loss ##"] + \
                  ([(bw[0].time_range.start, bw[0].time_range.end)] if bw and is_compiled(v["loss_fn"]) else [])
    def in_loss(e):
        return any(a <= e.time_range.start and e.time_range.end <= b for a, b in loss_ranges) or \
               (not is_compiled(v["loss_fn"]) and scope(e) == "loss")
    by, names = {}, {}
    for e in evs:
        if e.name.startswith("## ") or e.name.startswith("autograd::") or "Backward" in e.name and not e.name.startswith("aten::"):
            continue
        cat = next((c for c, frags in COMPILED_CATEGORIES if any(f in e.name for f in frags)), None)
        if cat is None:
            if not e.name.startswith("aten::"): continue
            cat = "eager elementwise/copies/other"
        if scope(e) == "optimizer": cat = "optimizer"
        elif in_loss(e): cat = "loss/" + ("matmul" if cat == "matmul" else "other")
        by[cat] = by.get(cat, 0.0) + e.self_cpu_time_total / 1e6
        k = (cat, e.name[:60]); names[k] = names.get(k, 0.0) + e.self_cpu_time_total / 1e6
    total = sum(by.values()) or 1.0
    return dict(profile_self_cpu_s=total, by_category={k: v / total for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
                top=[(c, n, round(s, 4)) for (c, n), s in sorted(names.items(), key=lambda kv: -kv[1])[:15]])


def compiled_config(method, B, T, layers, precision, rounds, peak_s=0.3, profile=False):
    "Eager and compiled copies of one configuration, alternating; the compiled copy's first step timed on its own."
    from tunebook.compile import compile_model
    from tunebook.loss import ChunkedCrossEntropy
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    batch, runs = None, {}
    for name in ("eager", "compiled"):
        model, opt = build(method, layers, precision=precision)
        loss_fn = ChunkedCrossEntropy(num_chunks=8)
        if name == "compiled": compile_model(model, loss_fn)
        batch = batch or make_batch(B, T, model.config.vocab_size)
        loss, first = timed(lambda: step(model, opt, loss_fn, batch, precision))  # eager: warm-up; compiled: the compile
        runs[name] = dict(model=model, opt=opt, loss_fn=loss_fn, first=first, losses=[float(loss)], steps=[])
        print(f"  {name} first step: {first['wall_s']:.1f} s wall, {first['cpu_s']:.1f} s CPU", flush=True)
    graphs = {k: dict(v) for k, v in counters.items() if k in ("stats", "aot_autograd", "inductor", "recompiles", "graph_break")}
    flops = train_flops_per_token(hf_cfg(runs["eager"]["model"].config), T, method) * B * T
    for r in range(rounds):
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            v = runs[name]
            before = bf16_matmul_peaks(seconds=peak_s)
            loss, t = timed(lambda: step(v["model"], v["opt"], v["loss_fn"], batch, precision))
            after = bf16_matmul_peaks(seconds=peak_s)
            t.update(peak_before=before, peak_after=after, share_adjacent_cpu=flops / t["cpu_s"] / ((before[1] + after[1]) / 2),
                     share_adjacent_wall=flops / t["wall_s"] / ((before[0] + after[0]) / 2))
            v["steps"].append(t); v["losses"].append(float(loss))
    prof = {name: profile_compiled_step(v, batch, precision) for name, v in runs.items()} if profile else {}
    for name, p in prof.items():
        print(f"  {name} profile: " + ", ".join(f"{k} {x:.1%}" for k, x in p["by_category"].items()), flush=True)
        print("    top: " + "; ".join(f"{n} {t}" for c, n, t in p["top"][:10]), flush=True)
    out = []
    for name, v in runs.items():
        st = v["steps"]
        med = lambda k: statistics.median(s[k] for s in st)  # noqa: E731
        cpu = med("cpu_s")
        out.append(dict(method=method, batch=f"{B}x{T}", layers=layers, precision=precision, variant=name, model_flop=flops,
                        cpu_s=cpu, cpu_s_min=min(s["cpu_s"] for s in st), wall_s=med("wall_s"), tok_per_cpu_s=B * T / cpu,
                        share_adjacent_cpu=med("share_adjacent_cpu"), share_adjacent_wall=med("share_adjacent_wall"),
                        share_adjacent_cpu_best=max(s["share_adjacent_cpu"] for s in st),
                        peak_step_mib=max(s["peak_step_mib"] for s in st), first_step=v["first"],
                        compile_wall_s=v["first"]["wall_s"] - med("wall_s") if name == "compiled" else None,
                        losses=v["losses"], steps=st, dynamo=graphs if name == "compiled" else None, profile=prof.get(name)))
    e, c = out
    print(f"{method} {precision} {B}x{T} ({layers} layers), median of {rounds}: eager {e['cpu_s']:.2f} CPU-s "
          f"({e['tok_per_cpu_s']:.0f} tok/CPU-s, {e['share_adjacent_cpu']:.1%} of adjacent peak, step peak {e['peak_step_mib']:.0f} MiB); "
          f"compiled {c['cpu_s']:.2f} CPU-s ({c['tok_per_cpu_s']:.0f} tok/CPU-s, {c['share_adjacent_cpu']:.1%}, "
          f"{c['peak_step_mib']:.0f} MiB); compiled/eager speed {e['cpu_s'] / c['cpu_s']:.2f}x; compile {c['compile_wall_s']:.0f} s wall; "
          f"graphs {graphs.get('stats', {}).get('unique_graphs')}; losses eager {e['losses']} compiled {c['losses']}", flush=True)
    return out


def provenance() -> dict:
    "Which code ran: the commit, and a hash of each tunebook module (the tree moves while benchmarks run)."
    import hashlib
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try: head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError: head = None
    files = sorted((root / "tunebook").rglob("*.py"))
    return dict(commit=head, tunebook_sha256=hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16],
                modules={str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in files
                         if f.stem in ("loss", "compile", "layers", "attention", "model")})


def compiled_main(a):
    "--compile: every configuration eager and compiled, alternating; results as JSON."
    if a.cache_dir: os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
    elif "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tunebook_inductor_")
    print(f"inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']}", flush=True)
    import torch._inductor.config
    if a.profile: torch._inductor.config.cpp.enable_kernel_profile = True   # each generated kernel a profiler event
    start, prov = bf16_matmul_peaks(seconds=1.5), provenance()
    out = []
    for precision in a.precisions.split(","):
        for method in a.methods.split(","):
            for shape in a.shapes.split(","):
                B, T = map(int, shape.split("x"))
                out += compiled_config(method, B, T, a.layers, precision, a.rounds, profile=a.profile)
                if a.json: Path(a.json).write_text(json.dumps(dict(peak_start=start, code=prov, runs=out), indent=1))
    end = bf16_matmul_peaks(seconds=1.5)
    whole_w, whole_c = max(start[0], end[0]), max(start[1], end[1])
    print(f"\nbf16 2048^3 matmul peak at start {start[1] / 1e12:.2f}, end {end[1] / 1e12:.2f} TFLOP per CPU-s; whole-run shares use the higher")
    for r in out:
        r.update(share_whole_run_cpu=r["model_flop"] / r["cpu_s"] / whole_c, share_whole_run_wall=r["model_flop"] / r["wall_s"] / whole_w)
        print(f"  {r['method']:4s} {r['precision']:10s} {r['batch']:6s} {r['variant']:8s} {r['cpu_s']:6.2f} CPU-s  "
              f"{r['tok_per_cpu_s']:6.0f} tok/CPU-s  adjacent {r['share_adjacent_cpu']:.1%}  whole-run {r['share_whole_run_cpu']:.1%}  "
              f"step peak {r['peak_step_mib']:.0f} MiB" + (f"  compile {r['compile_wall_s']:.0f} s wall" if r["compile_wall_s"] else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(peak_start=start, peak_end=end, code=prov, cache_dir=os.environ["TORCHINDUCTOR_CACHE_DIR"],
                                                threads=a.threads, torch=torch.__version__, runs=out), indent=1))


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
    ap.add_argument("--compile", action="store_true", help="eager vs compiled (inductor), alternating rounds")
    ap.add_argument("--precisions", default="bf16", help="--compile: bf16 and/or bf16-mixed (fp32 weights, bf16 autocast)")
    ap.add_argument("--rounds", type=int, default=3, help="--compile: timed steps of each variant")
    ap.add_argument("--profile", action="store_true", help="--compile: one profiled step of each variant, by category")
    ap.add_argument("--cache-dir", default=None, help="--compile: inductor's cache (default: a fresh temporary one, a cold compile)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.compile: return compiled_main(a)
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
