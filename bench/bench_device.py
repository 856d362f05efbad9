"""The device table: tokens/s, peak memory and MFU of tunebook, torchtune and transformers + peft, per configuration.

On a GPU it runs a Llama-3.2-1B-shaped model (random weights; tied embeddings and Llama 3 RoPE scaling as released) in bf16, eager and with per-block
torch.compile, with Liger kernels for transformers where they import; with `--smoke` it runs the same
configurations on the CPU with a tiny shape, few steps and compile's "eager" backend, so the script cannot rot.

Configurations run one at a time (built, warmed up, timed, freed), so the CUDA allocator's `max_memory_allocated`
belongs to the configuration being measured; on the CPU the peak is tunebook.memory.MemoryTracker's (live tensor
bytes) over one more step. MFU is model FLOPs/s (bench/peers.py: train_flops_per_token) over the GPU's published
dense bf16 peak (n/a for a device not in PEAK_BF16), and `mfu_measured` is the same over a 2048^3 bf16 matmul loop
timed in this run. Every method's first-step losses (same weights, same batch, same LoRA init) must agree.

    python bench/bench_device.py [--smoke] [--json out.json] [--budget-s 300]
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import HFRun, TorchtuneRun, TunebookRun, bf16_matmul_peak, copy_lora_A, finite, make_batch, train_flops_per_token  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
             "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12}  # dense, no sparsity
LLAMA3_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)  # Llama 3.2's
SHAPES = {  # Hugging Face config fields (rope_scaling: Llama 3 RoPE scaling; tie_word_embeddings: default untied)
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,  # as released:
                        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,  # tied, Llama 3 RoPE
                        tie_word_embeddings=True, max_position_embeddings=131072, rope_scaling=LLAMA3_ROPE),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # tied + Llama 3 RoPE like the 1B
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, max_position_embeddings=131072, rope_scaling=LLAMA3_ROPE),
    "tiny-untied": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # like SmolLM2's shape here
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5),
}
RUNS = {"tunebook": TunebookRun, "torchtune": TorchtuneRun, "transformers+peft": HFRun}


def published_peak(name: str):
    "The dense bf16 FLOP/s a device's maker publishes, by a name fragment; None if unknown."
    for k in sorted(PEAK_BF16, key=len, reverse=True):
        if k.lower() in name.lower(): return PEAK_BF16[k]
    return None


def make_checkpoint(d, shape: dict, seq: int, init_std: float, dtype=torch.float32, device="cpu"):
    "Random weights of `shape`, saved by transformers (made on `device`, stored in `dtype`); returns config.json."
    import transformers
    torch.manual_seed(0)
    shape = dict(shape)
    scaling = shape.pop("rope_scaling", None)
    if scaling: shape["rope_parameters"] = dict(rope_type="llama3", rope_theta=shape["rope_theta"], **scaling)
    shape.setdefault("tie_word_embeddings", False)
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 2048), seq)
    cfg = transformers.LlamaConfig(**shape, initializer_range=init_std)
    with torch.device(device):
        m = transformers.LlamaForCausalLM(cfg)
    m.to(dtype).save_pretrained(d)
    del m
    out = json.loads((Path(d) / "config.json").read_text())
    out.setdefault("rope_theta", shape["rope_theta"])
    return out


def configurations(a, have_liger):
    "Eager first, then compiled (a time budget cuts from the end); Liger last, as it patches transformers' classes."
    methods, fws = a.methods.split(","), a.frameworks.split(",")
    order = [(m, False) for m in methods] + [(m, True) for m in methods if m != "model"] + [(m, True) for m in methods if m == "model"]
    rows = [dict(framework=fw, method=m, compile=c, liger=False) for m, c in order for fw in fws]
    liger = [dict(framework="transformers+peft", method=m, compile=c, liger=True) for m, c in order]
    if have_liger is True: return rows + liger, []
    return rows, [{**r, "reason": have_liger} for r in liger]


def liger_available(device):
    if torch.device(device).type != "cuda": return "Liger kernels are Triton kernels for CUDA: not run on the CPU"
    try:
        import liger_kernel.transformers  # noqa: F401
        return True
    except Exception as e:
        return f"liger-kernel does not import here ({type(e).__name__}: {e})"


def peak_cpu(run, batch):
    from tunebook.memory import MemoryTracker
    tr = MemoryTracker("cpu").watch(run.model, *([run.optimizer] if run.optimizer else []))
    for k in ("tokens", "labels"): tr.track(batch[k], "inputs")
    with tr: run.step(batch)
    return int(tr.peak)


def run_one(c, d, cfg, a, device, batch, lora_ref, log):
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kw = dict(rank=a.rank, alpha=a.alpha, lr=a.lr, compile=c["compile"], compile_backend=a.compile_backend)
    if c["liger"]: kw["liger"] = True
    gc.collect()
    if cuda: torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    run = RUNS[c["framework"]](d, c["method"], a.precision, device, **kw)
    build_s = time.perf_counter() - t0
    if c["method"] == "lora":
        if lora_ref is None: lora_ref = {k: v.detach().clone() for k, v in run.lora_A().items()}
        copy_lora_A(lora_ref, run)
    losses, times = [], []
    for i in range(a.warmup + a.steps):
        sync(); t0 = time.perf_counter()
        losses.append(run.step(batch))
        sync(); times.append(time.perf_counter() - t0)
    losses = [float(x) for x in losses]
    t = statistics.median(times[a.warmup:])
    ntok = batch["tokens"].numel()
    flops = train_flops_per_token(cfg, a.seq, c["method"], a.rank) * ntok / t
    if cuda:
        peak, how = int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated (build, warm-up and timed steps)"
    else:
        peak, how = peak_cpu(run, batch), "tunebook.memory.MemoryTracker (live tensor bytes over one more step)"
    res = dict(c, precision=a.precision, tokens_per_s=ntok / t, median_step_s=t, first_step_s=times[0], build_s=build_s,
               peak_bytes=peak, peak_measured_by=how, model_flops_per_s=flops, loss_first=losses[0], loss_last=losses[-1],
               trainable_params=run.n_trainable())
    log(f"  {c['framework']:18s} {c['method']:5s} compile={c['compile']!s:5s} liger={c['liger']!s:5s} "
        f"{res['tokens_per_s']:9.0f} tok/s  first step {times[0]:.1f}s  loss {losses[0]:.5f}")
    del run
    return res, lora_ref


def print_table(rows, skipped, gpu_peak, measured_peak):
    print(f"\n  {'framework':18s} {'method':6s} {'compile':7s} {'liger':5s} {'tokens/s':>10s} {'peak MiB':>9s} "
          f"{'MFU':>6s} {'MFU*':>6s} {'1st step s':>10s} {'loss@1':>9s}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"  {r['framework']:18s} {r['method']:6s} {'yes' if r['compile'] else 'no':7s} {'yes' if r['liger'] else 'no':5s} "
              f"{r['tokens_per_s']:10.0f} {r['peak_bytes'] / 2**20:9.1f} {mfu:>6s} {r['mfu_measured']:6.1%} "
              f"{r['first_step_s']:10.1f} {r['loss_first']:9.5f}")
    for s in skipped: print(f"  skipped: {s['framework']} {s['method']} compile={s['compile']} liger={s['liger']}: {s['reason']}")
    print(f"  MFU: model FLOPs/s over the published bf16 peak ({'n/a' if gpu_peak is None else f'{gpu_peak / 1e12:.0f} TFLOP/s'}); "
          f"MFU*: over the bf16 matmul loop measured here ({measured_peak / 1e12:.2f} TFLOP/s)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few steps, compile backend 'eager'")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="default: llama3.2-1b (tiny with --smoke)")
    ap.add_argument("--layers", type=int, help="override the shape's layer count")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "bf16-mixed", "fp32"),
                    help="bf16: bf16 weights and AdamW state (all three); bf16-mixed: fp32 master weights + bf16 autocast "
                         "(tunebook and transformers+peft; torchtune has no autocast and is listed as skipped)")
    ap.add_argument("--methods", default="lora,full,model")
    ap.add_argument("--frameworks", default=",".join(RUNS))
    ap.add_argument("--compile-backend", help="default: inductor (eager with --smoke)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--budget-s", type=float, default=360.0, help="skip the configurations left after this many seconds")
    ap.add_argument("--json", type=Path, help="also write the result here")
    a = ap.parse_args(argv)
    device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    small = a.smoke or device == "cpu"
    for k, v in dict(shape="tiny" if small else "llama3.2-1b", batch=2 if small else 4, seq=64 if small else 2048,
                     warmup=1 if small else 3, steps=2 if small else 5, compile_backend="eager" if a.smoke else "inductor").items():
        if getattr(a, k) is None: setattr(a, k, v)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    import transformers
    transformers.logging.set_verbosity_error(); transformers.logging.disable_progress_bar()
    t_start = time.perf_counter()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    gpu_peak = published_peak(name) if device == "cuda" else None
    measured = bf16_matmul_peak(device, seconds=0.3 if a.smoke else 1.0)
    shape = dict(SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {}))
    rows, skipped = configurations(a, liger_available(device))
    print(f"device bench: {name}, {a.shape} ({shape['num_hidden_layers']} layers), {a.precision}, batch {a.batch} x seq {a.seq}, "
          f"{a.warmup} warm-up + {a.steps} timed steps, compile backend {a.compile_backend}; "
          f"bf16 matmul {measured / 1e12:.2f} TFLOP/s measured, published {'n/a' if gpu_peak is None else f'{gpu_peak / 1e12:.0f}'}", flush=True)
    done, lora_ref = [], None
    batch = make_batch(a.batch, a.seq, shape["vocab_size"], device=device)
    with tempfile.TemporaryDirectory() as d:
        cfg = make_checkpoint(d, shape, a.seq, a.init_std, dtype=torch.bfloat16 if a.precision == 'bf16' else torch.float32,
                              device=device)
        for c in rows:
            if time.perf_counter() - t_start > a.budget_s:
                skipped.append({**c, "reason": f"time budget of {a.budget_s:.0f} s spent"}); continue
            try:
                r, lora_ref = run_one(c, d, cfg, a, device, batch, lora_ref, lambda s: print(s, flush=True))
            except Exception as e:  # one framework failing must not lose the others' rows
                skipped.append({**c, "reason": f"failed: {type(e).__name__}: {str(e)[:300]}"}); print(f"  FAILED {c}: {e}"); continue
            r["mfu"] = r["model_flops_per_s"] / gpu_peak if gpu_peak else None
            r["mfu_measured"] = r["model_flops_per_s"] / measured
            done.append(r)
    tol = 1e-3 if a.precision == "fp32" else 2e-2
    spread = {m: max(x) - min(x) for m in a.methods.split(",") if (x := [r["loss_first"] for r in done if r["method"] == m])}
    print_table(done, skipped, gpu_peak, measured)
    failed = [s for s in skipped if s["reason"].startswith("failed")]
    ok = all(v <= tol for v in spread.values()) and all(finite(r["loss_first"]) for r in done) and not failed
    print("  first-step loss spread by method: " + ", ".join(f"{m} {v:.2e}" for m, v in spread.items())
          + f" ({'ok' if ok else 'MISMATCH' if not failed else f'{len(failed)} configuration(s) FAILED'}, tolerance {tol:g}); "
          f"{time.perf_counter() - t_start:.0f} s in all")
    res = dict(benchmark="device", device=device, device_name=name, published_bf16_peak=gpu_peak, measured_bf16_matmul=measured,
               config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, shape=shape,
               versions=_versions(), rows=done, skipped=skipped, loss_spread=spread, loss_tolerance=tol, ok=ok,
               wall_s=time.perf_counter() - t_start, loadavg=os.getloadavg())
    text = json.dumps(res, default=str)
    print("BENCH_JSON " + text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True); a.json.write_text(json.dumps(res, indent=2, default=str))
    return res


def _versions():
    out = {"torch": torch.__version__}
    for m in ("transformers", "peft", "torchtune", "torchao", "liger_kernel"):
        try: out[m] = __import__(m).__version__
        except Exception as e: out[m] = f"unavailable ({type(e).__name__})"
    return out


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:])["ok"] else 1)
