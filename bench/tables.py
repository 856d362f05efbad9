"""Markdown tables from bench_finetune.py JSON files: one row per configuration, ratios to the fastest peer.

    python bench/tables.py bench/results/h2_*.json

Per configuration: tokens per CPU-second and per wall-second (median step after warm-up), the ratio to the fastest
peer configuration of the same file and method (by median CPU time; paired per round, as bench_finetune prints),
peak memory (tunebook.memory.MemoryTracker: live tensor bytes), MFU over the bf16 matmul peak measured in the same
run (per CPU-second when the file has it; "adjacent": each step over the peak measured right before and after it,
and the speed ratio with each step so scaled), the first-step loss's difference from the file's reference, and the
first step's time beyond the median (for `+compile` rows: the compile time, not in the timed rounds).
"""
import json
import statistics
import sys
from pathlib import Path


def paired(a, b, warmup):
    "Median over timed rounds of b / a (a: this configuration's step times, b: the peer's)."
    return statistics.median(y / x for x, y in zip(a[warmup:], b[warmup:]))


def paired_adjacent(a, b, warmup):
    "Median over timed rounds of b's CPU time over a's, each step's first scaled by the matmul peak (per CPU-s) next to it."
    return statistics.median((cb * pb["cpu"]) / (ca * pa["cpu"]) for ca, cb, pa, pb in
                             zip(a["cpu_s"][warmup:], b["cpu_s"][warmup:], a["matmul_peak_adjacent"][warmup:], b["matmul_peak_adjacent"][warmup:]))


def table(path: Path) -> str:
    d = json.loads(path.read_text())
    w = d["config"]["warmup"]
    ntok = d["config"]["batch"] * d["config"]["seq"]
    peak_cpu = d.get("bf16_matmul_peak_per_cpu_s")
    shape = d["model_shape"]
    out = []
    for method, r in d["results"].items():
        fw = r["frameworks"]
        peers = {k: v for k, v in fw.items() if not k.startswith("tunebook:")}
        fastest = min(peers, key=lambda k: peers[k]["median_cpu_s"]) if peers else None
        out.append(f"\n**{d['shape']}** ({shape['num_hidden_layers']} layers, vocab {shape['vocab_size']}"
                   f"{', tied' if shape.get('tie_word_embeddings') else ''}), {method}, batch {d['config']['batch']} x "
                   f"{d['config']['seq']}, {d['config']['steps']} timed rounds after {w} warm-up; fastest peer (CPU time): "
                   f"{fastest}; bf16 matmul {d['bf16_matmul_peak'] / 1e12:.2f} TFLOP/s (wall)"
                   + (f", {peak_cpu / 1e12:.2f} TFLOP per CPU-s" if peak_cpu else "") + f"; load {d['machine']['loadavg_start'][0]:.0f}"
                   f" -> {d['machine']['loadavg_end'][0]:.0f} on {d['machine']['cpu_count']} cores ({path.name})\n")
        adj = all("mfu_cpu_adjacent" in v for v in fw.values())  # each step over the matmul peak measured next to it
        if r.get("schedule") == "one at a time": out[-1] = out[-1].replace("; fastest", "; configurations one at a time (not alternating); fastest")
        out.append("| configuration | tokens/CPU-s | tokens/s | x fastest peer (CPU) | x fastest peer (wall) | "
                   + ("x fastest peer (CPU, over adjacent peak) | " if adj else "") + "peak MiB | x peer memory | MFU (CPU time) | "
                   + ("MFU (adjacent) | " if adj else "") + "loss@1 diff | first step − median (s) |")
        out.append("|---|---:|---:|---:|---:|" + ("---:|" if adj else "") + "---:|---:|---:|" + ("---:|" if adj else "") + "---:|---:|")
        for k, v in fw.items():
            rc = rw = rm = ra = ""
            if fastest and k != fastest:
                rc = f"{paired(v['cpu_s'], fw[fastest]['cpu_s'], w):.2f}x"
                rw = f"{paired(v['step_s'], fw[fastest]['step_s'], w):.2f}x"
                rm = f"{v['peak_bytes'] / fw[fastest]['peak_bytes']:.2f}x"
                if adj: ra = f"{paired_adjacent(v, fw[fastest], w):.2f}x"
            mfu = v["model_flops_per_cpu_s"] / peak_cpu if peak_cpu else v["model_flops_per_s"] / d["bf16_matmul_peak"]
            first = v["step_s"][0] - v["median_step_s"]
            out.append(f"| {k} | {ntok / v['median_cpu_s']:.0f} | {ntok / v['median_step_s']:.0f} | {rc or '—'} | {rw or '—'} | "
                       + (f"{ra or '—'} | " if adj else "") + f"{v['peak_bytes'] / 2**20:.0f} | {rm or '—'} | {mfu:.1%} | "
                       + (f"{v['mfu_cpu_adjacent']:.1%} | " if adj else "") + f"{v['loss_diff_vs_ref']:+.1e}"
                       f"{'' if v['loss_ok'] else ' MISMATCH'} | {first:.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]: print(table(Path(p)))
