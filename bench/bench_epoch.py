"""One epoch over a JSONL of ragged real rows: tunebook (`tunebook:default`, what a bare `tunebook finetune` decides:
padding-free batches of a ragged file; or packed, padded, padding_free as asked), TRL's SFTTrainer and torchtune 0.6.1's
packed recipe, each fine-tuning SmolLM2-135M-Instruct (LoRA rank 16 on all seven projections, and full), each in its
own process, alone on the CPU, one after another (the order alternates between LoRA and full).

The data is made here with no network: prompts that ask what a public function of an installed library does, and
responses that are that function's docstring (real English and code, a few tokens to about a thousand), chosen by a
seed; a held-out split. Every framework trains on the same rows rendered by the same chat template.

Printed per framework and mode: time for the epoch (the training steps), label tokens trained per second, padding
waste (padded positions / computed positions), the peak resident memory of its process (getrusage's high-water mark),
and the held-out loss of its merged weights measured by ONE evaluator (transformers, fp32, the mean cross-entropy of
every response token of the held-out rows), then each one's epoch time over tunebook's (its default row where it ran,
else its packed row).

    python bench/bench_epoch.py [--rows 16] [--max-seq-len 1024] [--methods lora,full] [--json PATH]
    python bench/bench_epoch.py --smoke      # a tiny subset, seconds per run: the rows exist and run everywhere

Needs the bench venv (torchtune 0.6.1, trl, transformers, peft) with tunebook on PYTHONPATH, and the SmolLM2 folder
that tests/realckpt.py builds (or --model DIR).
"""
import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = -100
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULES = ("os", "os.path", "json", "re", "collections", "itertools", "functools", "textwrap", "shutil", "pathlib",
           "inspect", "typing", "string", "random", "statistics", "math", "datetime", "argparse", "subprocess", "tempfile",
           "glob", "fnmatch", "csv", "zipfile", "tarfile", "urllib.parse", "logging", "threading", "asyncio", "heapq",
           "bisect", "copy", "pickle", "base64", "hashlib", "difflib", "numpy", "numpy.linalg", "torch", "torch.nn.functional",
           "safetensors.torch", "tokenizers", "datasets", "huggingface_hub")
QUESTIONS = ("What does `{q}` do?", "Explain the Python function `{q}`.", "How do I use `{q}`, and what does it return?",
             "Describe `{q}` from the `{m}` module.")


# ---------------------------------------------------------------- the data
def docstring_rows(seed: int) -> list[dict]:
    "Every public function/class of MODULES with a docstring, as {prompt, response}, in a seeded order."
    import importlib
    import inspect
    seen, rows = set(), []
    for m in MODULES:
        try: mod = importlib.import_module(m)
        except Exception: continue
        for name in sorted(dir(mod)):
            if name.startswith("_"): continue
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)): continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 12 or doc in seen: continue
            seen.add(doc)
            rows.append((f"{m}.{name}", m, doc.strip()))
    rng = random.Random(seed)
    rng.shuffle(rows)
    return [dict(prompt=rng.choice(QUESTIONS).format(q=q, m=m), response=d) for q, m, d in rows]


def render(tok, row) -> tuple[list[int], int]:
    "Token ids of the row under the chat template, and where the response starts (the labels are the ids after it)."
    user = [{"role": "user", "content": row["prompt"]}]
    p = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": row["response"]}], tokenize=True, return_dict=False)
    p, full = list(p["input_ids"] if isinstance(p, dict) else p), list(full["input_ids"] if isinstance(full, dict) else full)
    if full[:len(p)] != p: raise RuntimeError("the chat template's prompt is not a prefix of the whole conversation")
    return full, len(p)


def make_data(model_dir, out: Path, n_train: int, n_eval: int, max_seq_len: int, seed: int) -> dict:
    "Write train.jsonl / eval.jsonl (text) and train_tok.json / eval_tok.json (ids + prompt length); return the length stats."
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    kept = []
    for r in docstring_rows(seed):
        ids, np_ = render(tok, r)
        if len(ids) <= max_seq_len and len(ids) > np_: kept.append((r, ids, np_))
        if len(kept) == n_train + n_eval: break
    if len(kept) < n_train + n_eval: raise SystemExit(f"bench_epoch: only {len(kept)} rows fit {max_seq_len} tokens; ask for fewer")
    out.mkdir(parents=True, exist_ok=True)
    parts = dict(train=kept[:n_train], eval=kept[n_train:])
    for name, rows in parts.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r, _, _ in rows))
        (out / f"{name}_tok.json").write_text(json.dumps([dict(ids=ids, prompt_len=np_) for _, ids, np_ in rows]))
    lens = sorted(len(ids) for _, ids, _ in parts["train"])
    q = lambda f: lens[min(len(lens) - 1, int(f * len(lens)))]
    return dict(rows=len(lens), eval_rows=n_eval, min=lens[0], median=q(0.5), p90=q(0.9), max=lens[-1], tokens=sum(lens),
                label_tokens=sum(len(ids) - np_ for _, ids, np_ in parts["train"]))


# ---------------------------------------------------------------- one framework, in a child process
def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def cosine(step, total, warmup, lr):
    import math
    if step < warmup: return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def run_tunebook(a, data: Path, out: Path) -> dict:
    "The CLI, as a user runs it: the training file, the held-out rows scored by the common evaluator afterwards."
    packed = a["mode"] == "packed"
    # packed: --packing, pack_batch sequences of max_seq_len a step; padded: batch rows a step, padded; padding_free: batch
    # rows a step end to end; default: left unset, what a bare finetune does (a ragged file: padding-free)
    packing = {"packed": ["--packing"], "padded": ["--no-packing", "--no-padding-free"], "padding_free": ["--padding-free"],
               "default": []}[a["mode"]]
    args = ["finetune", "--model", a["model"], "--data", str(data / "train.jsonl"), "--format", "instruct",
            "--method", a["method"], "--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", ",".join(TARGETS),
            "--lr", str(a["lr"]), "--warmup-steps", str(a["warmup"]), "--schedule", "cosine", "--epochs", "1",
            "--max-seq-len", str(a["max_seq_len"]), "--batch-size", str(a["pack_batch"] if packed else a["batch"]),
            *packing, "--dtype", a["dtype"], "--eval-fraction", "0", "--eval-samples", "0",
            "--output-dir", str(out / "run"), "--quiet", "--seed", str(a["train_seed"]), "--device", a["device"]]
    if a["chunked_ce"]: args += ["--chunked-ce", str(a["chunked_ce"])]
    if a["compile"]: args.append("--compile")
    import tunebook.cli as cli
    t0 = time.perf_counter()
    rc = cli.main(args)
    if rc: raise SystemExit(f"tunebook finetune exited {rc}")
    wall = time.perf_counter() - t0
    s = json.loads((out / "run" / "summary.json").read_text())
    trained = s["trained_tokens_per_second"] * s["train_seconds"]
    import csv
    m = list(csv.DictReader((out / "run" / "metrics.csv").open()))
    per_step = dict(losses=[float(r["loss"]) for r in m if r.get("loss")], grad_norms=[float(r["grad_norm"]) for r in m if r.get("grad_norm")],
                    lrs=[float(r["lr"]) for r in m if r.get("lr")])
    return dict(epoch_s=s["train_seconds"], cpu_s=s["train_cpu_seconds"], **per_step, job_s=wall, steps=s["steps"], trained_tokens=round(trained),
                padding_waste=s.get("padding_share"), computed_tokens=round(s["tokens_per_second"] * s["train_seconds"]),
                precision=s["precision"], model_dir=str(out / "run" / "model"), rows_per_step=s.get("rows_per_step"),
                packing=next((l.strip() for l in (out / "run" / "log.txt").read_text().splitlines()
                              if l.strip().startswith(("packing:", "padding_free:"))), None))


def _tok_rows(data, name):
    return json.loads((data / f"{name}_tok.json").read_text())


def run_trl(a, data: Path, out: Path) -> dict:
    "TRL's SFTTrainer on the same ids (prompt masked by completion_mask), in the mode asked: padded, grouped, padding_free, packed."
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    rows = _tok_rows(data, "train")
    ds = Dataset.from_list([dict(input_ids=r["ids"], completion_mask=[0] * r["prompt_len"] + [1] * (len(r["ids"]) - r["prompt_len"]))
                            for r in rows])
    mode, bf16 = a["mode"], a["dtype"] in ("bf16-mixed", "auto-bf16")
    tok = AutoTokenizer.from_pretrained(a["model"])
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    peft_config = None
    if a["method"] == "lora":
        from peft import LoraConfig
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM")
    packed = mode == "packed"
    cfg = SFTConfig(output_dir=str(out / "trl"), num_train_epochs=1, learning_rate=a["lr"], lr_scheduler_type="cosine",
                    warmup_steps=a["warmup"], per_device_train_batch_size=a["pack_batch"] if packed else a["batch"],
                    max_grad_norm=1.0, weight_decay=0.0, logging_steps=1000, save_strategy="no", report_to=[], bf16=bf16,
                    use_cpu=a["device"] == "cpu", max_length=a["max_seq_len"], completion_only_loss=True, seed=a["train_seed"],
                    packing=packed, padding_free=mode == "padding_free", dataloader_num_workers=0,
                    train_sampling_strategy="group_by_length" if mode == "grouped" else "random", disable_tqdm=True)
    stats = dict(computed=0, real=0, steps=0)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_config)
    collate = trainer.data_collator

    def counting(batch):   # the positions each step computes, read from the batch the collator made
        b = collate(batch)
        stats["computed"] += b["input_ids"].numel()
        stats["real"] += int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
        stats["label"] = stats.get("label", 0) + int((b["labels"][:, 1:] != IGNORE).sum())
        return b
    trainer.data_collator = counting
    cpu0 = time.process_time()
    r = trainer.train()
    cpu = time.process_time() - cpu0
    m = trainer.model.merge_and_unload() if a["method"] == "lora" else trainer.model
    m.save_pretrained(out / "model", safe_serialization=True)
    return dict(epoch_s=r.metrics["train_runtime"], cpu_s=cpu, steps=r.global_step, trained_tokens=stats["label"],
                padding_waste=1 - stats["real"] / stats["computed"], computed_tokens=stats["computed"],
                precision="bf16-mixed (autocast)" if bf16 else "fp32", model_dir=str(out / "model"))


def run_torchtune(a, data: Path, out: Path) -> dict:
    """torchtune 0.6.1's packed recipe on the CPU: its PackedDataset (packed=True), padded_collate_packed (block-causal
    masks), its Llama 3.2 builders (tied embeddings), CEWithChunkedOutputLoss and its cosine schedule, in the loop of its
    single-device recipes (AdamW, gradient clipping); its checkpoint conversion and LoRA merge for the weights."""
    import torch
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader
    from torchtune.data import padded_collate_packed
    from torchtune.datasets import PackedDataset
    from torchtune.models.convert_weights import tune_to_hf
    from torchtune.modules.peft import get_merged_lora_ckpt
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup
    sys.path.insert(0, str(ROOT / "bench"))
    from peers import TorchtuneRun
    rows = _tok_rows(data, "train")
    samples = [dict(tokens=r["ids"], labels=[IGNORE] * r["prompt_len"] + r["ids"][r["prompt_len"]:]) for r in rows]
    from transformers import AutoTokenizer
    pad = AutoTokenizer.from_pretrained(a["model"]).pad_token_id or 0
    packs = PackedDataset(samples, max_seq_len=a["max_seq_len"], padding_idx=pad, split_across_pack=False)
    torch.manual_seed(a["train_seed"])   # the LoRA A draw (its recipes call training.set_seed)
    # the packs in tunebook's epoch order (a permutation drawn from the seed): the same batches in the same steps, so the
    # step-0 losses agree and the held-out losses differ only by what the frameworks do with them
    order = torch.randperm(len(packs), generator=torch.Generator().manual_seed(a["train_seed"])).tolist()
    dl = DataLoader(packs, batch_size=a["pack_batch"], sampler=order, collate_fn=padded_collate_packed)
    precision = "bf16" if a["dtype"] in ("bf16", "bf16-mixed", "auto-bf16") else "fp32"
    run = TorchtuneRun(a["model"], a["method"], precision, a["device"], rank=16, alpha=32.0, lr=a["lr"], num_chunks=1 if precision == "bf16" else 8)
    model, opt = run.model, run.optimizer
    total = len(dl)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=a["warmup"], num_training_steps=total)
    params = [p for p in model.parameters() if p.requires_grad]
    computed = real = label = 0
    losses, norms, lrs = [], [], []
    t0, cpu0 = time.perf_counter(), time.process_time()
    for b in dl:
        b = {k: v.to(a["device"]) for k, v in b.items()}
        labels = torch.hstack((b["labels"][..., 1:], torch.full_like(b["labels"][..., :1], IGNORE)))   # the recipe's shift
        logits = model(b["tokens"], mask=b["mask"], input_pos=b["input_pos"])
        loss = run.loss_fn(logits, labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        lrs.append(sched.get_last_lr()[0])
        opt.step(); opt.zero_grad(set_to_none=True); sched.step()
        losses.append(float(loss.detach())); norms.append(float(norm))
        computed += b["tokens"].numel(); label += int((labels != IGNORE).sum())
    epoch, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    real = sum(len(r["ids"]) for r in rows)
    sd = {k: v.float() for k, v in model.state_dict().items()}
    if a["method"] == "lora": sd = get_merged_lora_ckpt(sd, rank=16, alpha=32.0)
    cfg = json.loads((Path(a["model"]) / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    hf = tune_to_hf(sd, num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"], dim=cfg["hidden_size"], head_dim=hd)
    (out / "model").mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "model" / "model.safetensors"))
    (out / "model" / "config.json").write_text(json.dumps(cfg))
    return dict(epoch_s=epoch, cpu_s=cpu, losses=losses, grad_norms=norms, lrs=lrs, steps=total, trained_tokens=label, padding_waste=1 - real / computed, computed_tokens=computed,
                precision=precision, model_dir=str(out / "model"))


def evaluate(model_dir, base_dir, data: Path, device="cpu") -> float:
    "THE evaluator: transformers fp32, each held-out row alone, the mean cross-entropy over every response token."
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    base = json.loads((Path(base_dir) / "config.json").read_text())
    if base.get("tie_word_embeddings"): m.tie_weights()
    m.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for r in _tok_rows(data, "eval"):
            ids = torch.tensor([r["ids"]], device=device)
            logits = m(input_ids=ids).logits[0, :-1].float()
            tgt = ids[0, 1:].clone(); tgt[: r["prompt_len"] - 1] = IGNORE
            tot += float(torch.nn.functional.cross_entropy(logits, tgt, ignore_index=IGNORE, reduction="sum")); n += int((tgt != IGNORE).sum())
    return tot / n


def child(spec: dict) -> dict:
    import torch
    torch.set_num_threads(spec["threads"])
    data, out = Path(spec["data"]), Path(spec["out"])
    if spec["framework"] == "eval":   # every trained model and the untrained one, one after another in this process
        return dict(eval_loss={d: evaluate(d, spec["model"], data, spec.get("device", "cpu")) for d in spec["model_dirs"]})
    fn = dict(tunebook=run_tunebook, trl=run_trl, torchtune=run_torchtune)[spec["framework"]]
    res = fn(spec, data, out)
    res["peak_rss"] = peak_rss_bytes()
    if torch.cuda.is_available() and spec["device"].startswith("cuda"): res["peak_cuda"] = torch.cuda.max_memory_allocated()
    return res


def spawn(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", TRANSFORMERS_VERBOSITY="error")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env, timeout=timeout)
    line = [l for l in p.stdout.splitlines() if l.startswith("CHILD_JSON ")]
    if p.returncode or not line:
        return dict(error=(p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["?"])[-1][:300], process_s=time.perf_counter() - t0)
    return {**json.loads(line[-1].removeprefix("CHILD_JSON ")), "process_s": time.perf_counter() - t0}


# ---------------------------------------------------------------- the parent
def cpu_line() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name"))
        flags = set(next(l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")))
        have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
        from tunebook.precision import isa_limits   # an instruction set capped by hand (a proxy for a CPU without it)
        limits = [f"{k}={v}" for k, v in isa_limits().items()]
        return f"{name}, {os.cpu_count()} cores, flags: {' '.join(have)}" + (f"; limited by {' '.join(limits)}" if limits else "")
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def default_model() -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from realckpt import smollm2_dir
    return str(smollm2_dir())


ENTRIES = (("tunebook", "default"), ("tunebook", "packed"), ("tunebook", "padded"), ("trl", None), ("torchtune", "packed"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="Hugging Face folder (default: tests/realckpt.py's SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", type=int, default=16, help="training rows (16: about 20 minutes for the whole bench on 2 cores under load 8-12)")
    ap.add_argument("--eval-rows", type=int, default=12, help="held-out rows")
    ap.add_argument("--warmup", type=int, default=2, help="linear warmup steps, then cosine to 0 (every framework)")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="rows per step (padded modes)")
    ap.add_argument("--pack-batch", type=int, default=2, help="packed sequences of max-seq-len per step (packed modes)")
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--lr-lora", type=float, default=1e-3)
    ap.add_argument("--lr-full", type=float, default=5e-5)
    ap.add_argument("--trl-mode", default="grouped", help="padded, grouped (group_by_length), padding_free or packed (bfd)")
    ap.add_argument("--dtype", default="auto", help="tunebook's --dtype; TRL gets bf16 autocast when it resolves to bf16-mixed")
    ap.add_argument("--torchtune-dtype", default="bf16", help="bf16 (its recipes' default) or fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunked-ce", type=int, default=8, help="tunebook's --chunked-ce (vocabulary-sliced loss; 0: full logits)")
    ap.add_argument("--frameworks", default=",".join(f if m is None else f"{f}:{m}" for f, m in ENTRIES))
    ap.add_argument("--compile", action="store_true", help="also a tunebook packed row with --compile")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0, help="the data's seed (which rows, which held out)")
    ap.add_argument("--train-seed", type=int, default=0, help="every framework's training seed (LoRA init, row order)")
    ap.add_argument("--smoke", action="store_true", help="12 rows of at most 128 tokens, 4 held out: seconds per run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("CHILD_JSON " + json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    if a.smoke: a.rows, a.eval_rows, a.max_seq_len, a.batch, a.pack_batch = 12, 4, 128, 4, 1
    entries = []
    for e in a.frameworks.split(","):
        f, _, m = e.partition(":")
        if f not in ("tunebook", "trl", "torchtune"): raise SystemExit(f"bench_epoch: unknown framework {f!r} (tunebook, trl, torchtune)")
        entries.append((f, m or (a.trl_mode if f == "trl" else "packed")))
    if a.compile: entries.append(("tunebook", "packed+compile"))
    methods = a.methods.split(",")
    if set(methods) - {"lora", "full"}: raise SystemExit(f"bench_epoch: --methods takes lora and/or full, got {a.methods!r}")
    model = a.model or default_model()
    dtype = a.dtype
    if dtype == "auto":
        from tunebook.precision import resolve_precision
        width = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
        dtype = resolve_precision("auto", a.device, width=width).name   # what tunebook's --dtype auto picks for this model here
    t_start = time.perf_counter()
    print(f"CPU: {cpu_line()} | load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench_epoch_") as tmp:
        data = Path(tmp) / "data"
        st = make_data(model, data, a.rows, a.eval_rows, a.max_seq_len, a.seed)
        print(f"data: {st['rows']} training rows ({st['tokens']} tokens, {st['label_tokens']} response tokens), {st['eval_rows']} held out; "
              f"tokens per row min {st['min']} median {st['median']} p90 {st['p90']} max {st['max']}; max_seq_len {a.max_seq_len}; "
              f"dtype {dtype} (tunebook, TRL), torchtune {a.torchtune_dtype}; tunebook chunked_ce {a.chunked_ce}; {a.threads} thread(s)")
        results = []
        for i, method in enumerate(methods):
            order = entries if i % 2 == 0 else entries[::-1]   # alternate who runs first
            for f, mode in order:
                spec = dict(framework=f, mode=mode.replace("+compile", ""), compile="+compile" in mode, method=method, model=model,
                            data=str(data), out=str(Path(tmp) / f"{f}_{mode}_{method}"), threads=a.threads, device=a.device,
                            lr=a.lr_lora if method == "lora" else a.lr_full, warmup=1 if a.smoke else a.warmup,
                            batch=a.batch, pack_batch=a.pack_batch, chunked_ce=a.chunked_ce, max_seq_len=a.max_seq_len,
                            dtype=a.torchtune_dtype if f == "torchtune" else dtype, train_seed=a.train_seed)
                r = spawn(spec, timeout=1800)
                results.append(dict(framework=f, mode=mode, method=method, **r))
                print(f"  {method:4s} {f}:{mode}: " + (f"ERROR {r['error']}" if "error" in r else
                      f"{r['epoch_s']:.1f} s for the epoch, {r['process_s']:.1f} s the process"), "ROW_JSON", json.dumps(r), flush=True)
            # the method's models are scored at once (the untrained one with the first), so a cut-short run keeps them
            dirs = ([model] if i == 0 else []) + [r["model_dir"] for r in results if "model_dir" in r]
            ev = spawn(dict(framework="eval", model_dirs=dirs, model=model, data=str(data), out=tmp, threads=a.threads, device=a.device), timeout=1800)
            losses = ev.get("eval_loss") or {}
            if i == 0: base_ev = dict(eval_loss=losses.get(model), error=ev.get("error"))
            for r in results:
                if "model_dir" in r: r["eval_loss"] = losses.get(r.pop("model_dir"))
            print(f"  held-out losses ({method}): base {base_ev['eval_loss']}; " + "; ".join(
                f"{r['framework']}:{r['mode']} {r.get('eval_loss')}" for r in results if r["method"] == method), flush=True)
    total = time.perf_counter() - t_start
    out = dict(benchmark="epoch", cpu=cpu_line(), load_average=os.getloadavg(), data=st, dtype=dtype, threads=a.threads, smoke=a.smoke,
               eval_loss_base=base_ev.get("eval_loss"), eval_error=base_ev.get("error"), rows=results, bench_s=total)
    print_table(out)
    js = json.dumps(out)
    print("EPOCH_JSON " + js)
    if a.json:
        p = Path(a.json); p.parent.mkdir(parents=True, exist_ok=True)
        tmpf = p.with_suffix(".tmp"); tmpf.write_text(js); tmpf.replace(p)
    return 0 if all("error" not in r for r in results) else 1


def print_table(out):
    print(f"\nCPU: {out['cpu']}; load average at the end {out['load_average'][0]:.1f}; bench {out['bench_s']:.0f} s")
    print(f"held-out loss of the untrained model (same evaluator): {out['eval_loss_base']}")
    hdr = f"{'method':6s} {'framework:mode':26s} {'epoch s':>8s} {'CPU s':>7s} {'trained tok/s':>13s} {'computed tok/s':>14s} {'padding':>8s} {'steps':>5s} {'peak RSS MiB':>12s} {'held-out loss':>13s} {'x tunebook time':>16s}"
    print(hdr); print("-" * len(hdr))
    for m in dict.fromkeys(r["method"] for r in out["rows"]):
        rows = [r for r in out["rows"] if r["method"] == m]
        ref = next((r for mode in ("default", "packed") for r in rows if (r["framework"], r["mode"]) == ("tunebook", mode)
                    and "error" not in r), None)   # tunebook as a bare finetune runs it, else packed
        for r in rows:
            name = f"{r['framework']}:{r['mode']}"
            if "error" in r:
                print(f"{m:6s} {name:26s} ERROR: {r['error']}"); continue
            r["trained_tokens_per_s"] = r["trained_tokens"] / r["epoch_s"]
            ratio = (r["epoch_s"] / ref["epoch_s"]) if ref else float("nan")
            r["x_tunebook"], r["tunebook_ref"] = ratio, ref and ref["mode"]
            ev = f"{r['eval_loss']:.4f}" if r.get("eval_loss") is not None else "n/a"
            print(f"{m:6s} {name:26s} {r['epoch_s']:8.1f} {r.get('cpu_s', float('nan')):7.1f} {r['trained_tokens_per_s']:13.1f} {r['computed_tokens'] / r['epoch_s']:14.1f} {r['padding_waste']:8.1%} {r['steps']:5d} "
                  f"{r['peak_rss'] / 2**20:12.0f} {ev:>13s} {ratio:15.2f}x")


if __name__ == "__main__":
    sys.exit(main())
