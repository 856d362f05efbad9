"""Forward+backward tokens/s of tunebook's Transformer against transformers' LlamaForCausalLM.

Same config, same weights, same batch, fp32 on this machine's CPU (or bf16 on CUDA when present).
The two programs alternate in one process and the medians are compared, because timings on shared
machines swing by several times between runs.

    python bench/bench_model.py [--dim 512 --layers 4 --seq 256 --batch 4 --repeats 7]
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from tunebook.checkpoint import load_hf


def step_time(model, tokens, hf: bool) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = model(tokens)
    logits = out.logits if hf else out
    logits.float().logsumexp(-1).mean().backward()
    if tokens.is_cuda: torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the result here")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=int(a.dim * 8 / 3) // 64 * 64,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   max_position_embeddings=max(2048, a.seq), attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_hf(d, dtype=dtype, device=device).train()
    hf = hf.to(device=device, dtype=dtype).train()
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    for m, is_hf in ((ours, False), (hf, True)):  # warm-up
        step_time(m, tokens, is_hf)
    times = {"tunebook": [], "transformers": []}
    for _ in range(a.repeats):
        times["tunebook"].append(step_time(ours, tokens, False))
        times["transformers"].append(step_time(hf, tokens, True))
    ntok = a.batch * a.seq
    tps = {k: ntok / statistics.median(v) for k, v in times.items()}
    res = {"device": device, "dtype": str(dtype), "config": vars(a) | {"json": None},
           "tokens_per_s": tps, "ratio_tunebook_over_transformers": tps["tunebook"] / tps["transformers"]}
    print(f"forward+backward, {device} {dtype}, batch {a.batch} x seq {a.seq}, dim {a.dim}, {a.layers} layers")
    for k, v in tps.items():
        print(f"  {k:13s} {v:10.0f} tokens/s   (median of {a.repeats})")
    print(f"  ratio tunebook / transformers: {res['ratio_tunebook_over_transformers']:.2f}x")
    if a.json: a.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
