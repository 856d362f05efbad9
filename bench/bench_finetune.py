"""Fine-tuning steps/s and peak memory: tunebook against torchtune 0.6.1 and transformers + peft.

One small Llama (random weights made by transformers, saved once, loaded by all three), the same token
batches, the same number of optimizer steps, for (a) LoRA (rank 16, alpha 32 on q/k/v/o) and (b) full
fine-tuning: eager, AdamW (no weight decay, no clipping, constant lr), fp32 on CPU, bf16 on CUDA.

  tunebook      `Trainer(TrainConfig(...), model=load_hf(dir), train_data=rows).train_step()`
  torchtune     `llama3` / `lora_llama3` component builders, weights via `convert_weights.hf_to_tune`,
                adapters made trainable with `get_adapter_params` + `set_trainable_params`,
                cross-entropy on the fp32 logits, as its single-device recipes do without chunked loss
  transformers  `LlamaForCausalLM.from_pretrained(dir)` (+ `peft.get_peft_model` for LoRA), loss from
                `labels=` (the model shifts them itself)

Every step (forward, loss, backward, AdamW step, zero_grad) is timed from outside; the three programs
alternate step by step in one process, with the order rotated, and tokens/s is batch x seq over the
median step time after warm-up. The speed ratio is the median over rounds of each round's paired ratio
(peer step time / tunebook step time), which resists load spikes on a shared machine; the ratio of the
medians is printed beside it. Peak memory is measured on one more step per framework with
`tunebook.memory.MemoryTracker` (a dispatch mode that counts every live tensor storage: parameters,
buffers, gradients, optimizer state, activations, temporaries) and, on CUDA, also the allocator's peak.
Each run also checks that the first-step losses agree (same weights, same batch) and reports the
losses after the last step.

    python bench/bench_finetune.py [--dim 256 --layers 4 --seq 256 --batch 4 --steps 6 --json out.json]
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

FRAMEWORKS = ("tunebook", "torchtune", "transformers+peft")
IGNORE = -100


# ---------------------------------------------------------------- data
def make_rows(n: int, seq: int, vocab: int, prompt_frac: float, seed: int = 0) -> list[dict]:
    "Random token rows with tunebook's already-shifted labels; the first `prompt_frac` of each row is masked."
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    labels = torch.full_like(tokens, IGNORE)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, : int(seq * prompt_frac)] = IGNORE
    return [dict(tokens=t.tolist(), labels=l.tolist()) for t, l in zip(tokens, labels)]


def hf_labels(labels: torch.Tensor) -> torch.Tensor:
    "transformers shifts `labels` inside the model: give it the unshifted form of the same targets."
    out = torch.full_like(labels, IGNORE)
    out[:, 1:] = labels[:, :-1]
    return out


# ---------------------------------------------------------------- the three programs
class TunebookRun:
    name = "tunebook"

    def __init__(self, d, method, a, dtype, device, rows, out_dir):
        from tunebook.checkpoint import load_hf
        from tunebook.train import Trainer, TrainConfig
        cfg = TrainConfig(model=str(d), method=method, lora_rank=a.rank, lora_alpha=a.alpha,
                          lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), lr=a.lr, weight_decay=0.0,
                          warmup_steps=0, schedule="constant", max_grad_norm=None, max_steps=10**6,
                          batch_size=a.batch, max_seq_len=a.seq, dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                          device=device, seed=0, output_dir=str(out_dir),
                          **({"profile_memory": False} if "profile_memory" in TrainConfig.__dataclass_fields__ else {}))
        model = load_hf(d, dtype=dtype, device=device)
        # the Trainer only needs a tokenizer for eval and saving, which this benchmark does not do
        self.trainer = Trainer(cfg, model=model, tokenizer=SimpleNamespace(pad_id=0), train_data=rows).setup()
        self.model, self.optimizer = self.trainer.model, self.trainer.optimizer

    def batches(self, n):  # the Trainer's own deterministic batch order; the others get the same tensors
        return [self.trainer.micro_batch(g) for g in range(n)]

    def step(self, batch):  # `batch` is what the Trainer builds itself for this step
        return self.trainer.train_step()["loss"]

    def lora_A(self):
        return {n.split(".lora_A")[0]: m for n, m in self.model.named_parameters() if ".lora_A." in n}


class TorchtuneRun:
    name = "torchtune"

    def __init__(self, d, method, a, dtype, device, cfg):
        from safetensors.torch import load_file
        from torchtune.models.convert_weights import hf_to_tune
        from torchtune.models.llama3 import llama3, lora_llama3
        from torchtune.modules.peft import get_adapter_params, set_trainable_params
        kw = dict(vocab_size=cfg.vocab_size, num_layers=cfg.n_layers, num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads,
                  embed_dim=cfg.dim, max_seq_len=cfg.max_seq_len, intermediate_dim=cfg.hidden_dim, norm_eps=cfg.norm_eps,
                  rope_base=cfg.rope_theta)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                if method == "lora":
                    model = lora_llama3(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=False,
                                        apply_lora_to_output=False, lora_rank=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, **kw)
                else:
                    model = llama3(**kw)
        finally:
            torch.set_default_dtype(old)
        sd = {}
        for f in sorted(Path(d).glob("*.safetensors")): sd.update(load_file(str(f)))
        sd = hf_to_tune(sd, num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads, dim=cfg.dim, head_dim=cfg.head_dim)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        bad = [k for k in missing if "lora" not in k] + list(unexpected)
        if bad: raise RuntimeError(f"torchtune: checkpoint keys do not match the model: {bad[:5]}")
        if method == "lora":
            set_trainable_params(model, get_adapter_params(model))
        self.model = model.train()
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)

    def step(self, batch):
        logits = self.model(batch["tokens"])  # (B, T, V), fp32 (torchtune upcasts the output)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE)
        del logits
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def lora_A(self):
        return {n.split(".lora_a")[0].replace(".attn.", ".self_attn.").replace("output_proj", "o_proj"): p
                for n, p in self.model.named_parameters() if ".lora_a." in n}


class HFRun:
    name = "transformers+peft"

    def __init__(self, d, method, a, dtype, device):
        import transformers
        model = transformers.LlamaForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa").to(device)
        if method == "lora":
            import peft
            lc = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
            # keep the adapters in the base dtype, as tunebook and torchtune do (peft would upcast them to fp32)
            model = peft.get_peft_model(model, lc, autocast_adapter_dtype=False)
        else:
            for p in model.parameters(): p.requires_grad_(True)
        self.model = model.train()
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)

    def step(self, batch):
        out = self.model(input_ids=batch["tokens"], attention_mask=batch["attn_mask"], labels=batch["hf_labels"])
        loss = out.loss
        del out
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def lora_A(self):
        return {"layers." + n.split(".lora_A")[0].split(".layers.", 1)[1]: p
                for n, p in self.model.named_parameters() if ".lora_A." in n}


# ---------------------------------------------------------------- measurement
def measure_peak(run, batch, device) -> dict:
    "Peak live tensor bytes over one training step (and the CUDA allocator's peak on CUDA)."
    from tunebook.memory import MemoryTracker
    if device == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    tr = MemoryTracker(device).watch(run.model, run.optimizer)  # parameters, buffers, gradients, optimizer state
    for v in batch.values(): tr.track(v, "inputs")
    with tr:  # and every tensor the step creates
        run.step(batch)
    res = dict(peak_bytes=int(tr.peak), peak_phase=tr.peak_phase,
               measured_by="tunebook.memory.MemoryTracker: peak of live tensor storages during one training step")
    if device == "cuda":
        torch.cuda.synchronize()
        res["cuda_max_memory_allocated"] = int(torch.cuda.max_memory_allocated())
    return res


def n_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def bench_method(method, d, cfg, a, dtype, device, log=print) -> dict:
    n_steps = a.warmup + a.steps
    rows = make_rows(a.batch * max(1, n_steps + 1), a.seq, cfg.vocab_size, a.prompt_frac)
    with tempfile.TemporaryDirectory() as out_dir:
        tb = TunebookRun(d, method, a, dtype, device, rows, out_dir)
        tt = TorchtuneRun(d, method, a, dtype, device, cfg)
        hf = HFRun(d, method, a, dtype, device)
        runs = [tb, tt, hf]
        if method == "lora":  # same adapter init everywhere (B is zero in all three), so the losses stay comparable
            src = tb.lora_A()
            with torch.no_grad():
                for r in (tt, hf):
                    dst = r.lora_A()
                    if set(dst) != set(src): raise RuntimeError(f"{r.name}: LoRA modules {sorted(dst)[:3]} != {sorted(src)[:3]}")
                    for k, p in dst.items(): p.copy_(src[k])
        batches = tb.batches(n_steps + 1)
        for b in batches: b["hf_labels"] = hf_labels(b["labels"])
        counts = {r.name: n_trainable(r.model) for r in runs}
        times = {r.name: [] for r in runs}
        losses = {r.name: [] for r in runs}
        for i in range(n_steps):
            order = runs[i % 3:] + runs[:i % 3]  # rotate who goes first
            for r in order:
                if device == "cuda": torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = r.step(batches[i])
                if device == "cuda": torch.cuda.synchronize()
                times[r.name].append(time.perf_counter() - t0)
                losses[r.name].append(loss)
            log(f"  {method} step {i + 1}/{n_steps}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in times))
        mem = {r.name: measure_peak(r, batches[n_steps], device) for r in runs}
    ntok = a.batch * a.seq
    res = {}
    for r in runs:
        t = times[r.name][a.warmup:]
        res[r.name] = dict(tokens_per_s=ntok / statistics.median(t), median_step_s=statistics.median(t),
                           step_s=[round(x, 4) for x in times[r.name]], trainable_params=counts[r.name],
                           losses=losses[r.name], **mem[r.name])
    first = [res[k]["losses"][0] for k in FRAMEWORKS]
    last = [res[k]["losses"][-1] for k in FRAMEWORKS]
    tbr = res["tunebook"]
    # the three run back to back in each round, so one round's ratio sees one machine state: the median of
    # these paired ratios resists load spikes better than the ratio of the medians (also given)
    tb_t = times["tunebook"][a.warmup:]
    ratios = {f"tunebook/{k}": dict(tokens_per_s=statistics.median(p / t for p, t in zip(times[k][a.warmup:], tb_t)),
                                    tokens_per_s_ratio_of_medians=tbr["tokens_per_s"] / res[k]["tokens_per_s"],
                                    peak_memory=tbr["peak_bytes"] / res[k]["peak_bytes"]) for k in FRAMEWORKS[1:]}
    return dict(frameworks=res, ratios=ratios, first_step_loss_spread=max(first) - min(first),
                last_step_loss_spread=max(last) - min(last), trainable_params_equal=len(set(counts.values())) == 1)


def print_table(method, r, a, loss_tol):
    print(f"\n== {method}: {a.steps} timed steps after {a.warmup} warm-up, batch {a.batch} x seq {a.seq} ==")
    print(f"  {'framework':18s} {'tokens/s':>10s} {'step s':>8s} {'peak MiB':>9s} {'trainable':>11s} {'loss@1':>11s} {'loss@last':>11s}")
    for k in FRAMEWORKS:
        f = r["frameworks"][k]
        print(f"  {k:18s} {f['tokens_per_s']:10.0f} {f['median_step_s']:8.3f} {f['peak_bytes'] / 2**20:9.1f} "
              f"{f['trainable_params']:11,d} {f['losses'][0]:11.6f} {f['losses'][-1]:11.6f}")
    for k, v in r["ratios"].items():
        print(f"  ratio {k:28s} tokens/s {v['tokens_per_s']:.2f}x (ratio of medians {v['tokens_per_s_ratio_of_medians']:.2f}x)"
              f"   peak memory {v['peak_memory']:.2f}x")
    ok = r["first_step_loss_spread"] <= loss_tol
    print(f"  first-step loss spread {r['first_step_loss_spread']:.2e} ({'ok' if ok else 'MISMATCH'}, tolerance {loss_tol:g}); "
          f"after the last step {r['last_step_loss_spread']:.2e}"
          + ("" if r["trainable_params_equal"] else "; WARNING: trainable parameter counts differ"))
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-frac", type=float, default=0.25, help="share of each row masked out of the loss")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per framework (at least 2)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per framework")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--init-std", type=float, default=0.1,
                    help="std of the random weights; larger than Llama's 0.02 so that attention is far from uniform "
                         "and a wrong RoPE layout or weight mapping shows up in the first-step loss")
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    a = ap.parse_args(argv)
    if a.warmup < 2:  # tunebook's Trainer profiles memory (a dispatch mode, slower) in its first two steps
        ap.error("--warmup must be at least 2: tunebook's Trainer profiles memory during its first two steps")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft asks transformers 5 an old name
    import transformers
    from tunebook.checkpoint import read_hf_config
    transformers.logging.set_verbosity_error(); transformers.logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loss_tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    torch.manual_seed(0)
    hcfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=int(a.dim * 8 / 3) // 64 * 64,
                                    num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                    max_position_embeddings=max(2048, a.seq), tie_word_embeddings=False,
                                    initializer_range=a.init_std)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        transformers.LlamaForCausalLM(hcfg).save_pretrained(d)
        cfg = read_hf_config(d)
        print(f"fine-tune benchmark: {device} {str(dtype).removeprefix('torch.')}, dim {a.dim}, {a.layers} layers, "
              f"{a.heads}/{a.kv_heads} heads, vocab {a.vocab}, {torch.get_num_threads()} threads, load average {load0[0]:.1f}")
        log = (lambda *_: None) if a.quiet else (lambda s: print(s, flush=True))
        for method in a.methods.split(","):
            results[method] = bench_method(method, d, cfg, a, dtype, device, log)
    ok = all([print_table(m, r, a, loss_tol) for m, r in results.items()])
    load1 = os.getloadavg()
    mb = next(iter(results.values()))["frameworks"]["tunebook"]["measured_by"] if results else ""
    print(f"\npeak memory: {mb}{' (+ CUDA max_memory_allocated in the JSON)' if device == 'cuda' else ''}")
    print(f"ratios: tokens/s > 1 means tunebook is faster; peak memory < 1 means tunebook needs less. "
          f"Load average {load0[0]:.1f} -> {load1[0]:.1f} on {os.cpu_count()} cores; {time.perf_counter() - t_start:.0f} s in all.")
    res = dict(benchmark="finetune", device=device, dtype=str(dtype), config={k: v for k, v in vars(a).items() if k != "json"},
               versions=dict(torch=torch.__version__, transformers=transformers.__version__, **_versions()),
               machine=dict(cpu_count=os.cpu_count(), threads=torch.get_num_threads(), loadavg_start=load0, loadavg_end=load1),
               loss_tolerance=loss_tol, losses_agree=ok, results=results)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2))
    return res


def _versions():
    out = {}
    for m in ("torchtune", "peft", "torchao"):
        try: out[m] = __import__(m).__version__
        except Exception as e: out[m] = f"unavailable ({type(e).__name__})"
    return out


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:])["losses_agree"] else 1)
