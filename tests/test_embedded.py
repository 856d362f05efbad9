"""The shipped embedded model: its files load, are the recorded ones, stay small, and know what they should."""
import hashlib

import pytest
import torch

from tunebook.checkpoint import load_hf
from tunebook.data import TASKS
from tunebook.embedded import (ASSET_SHA256, EMBEDDED_DIR, FINETUNE_TASK, HELD_OUT_TASKS, MAX_ASSET_BYTES, PRETRAIN_TASKS,
                               chat_prompt, load_embedded, task_accuracy)
from tunebook.tokenizer import load_tokenizer

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md")


@pytest.fixture(scope="module")
def embedded():
    return load_embedded()


def test_files_present_and_small():
    for f in FILES: assert (EMBEDDED_DIR / f).is_file(), f
    assert sum(f.stat().st_size for f in EMBEDDED_DIR.iterdir()) < MAX_ASSET_BYTES


def test_files_match_recorded_sha256():
    found = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in EMBEDDED_DIR.iterdir() if f.is_file()}
    assert found == ASSET_SHA256


def test_loads_with_the_generic_loaders():
    model, tok = load_hf(EMBEDDED_DIR), load_tokenizer(EMBEDDED_DIR)
    assert model.config.vocab_size == len(tok) and model.config.arch == "llama" and model.config.tie_embeddings
    assert model.config.eos_token_id == tok.eos_id and tok.chat_template
    assert model.embed_tokens.weight.dtype == torch.float32


def test_tokenizer_round_trips(embedded):
    _, tok = embedded
    for text in ["reverse abc=", "12+34=", "a=3 b=7 c=1 b?", "Ünïcödé ✓ \n\t end"]:
        assert tok.decode(tok.encode(text, add_bos=False)) == text
    ids = chat_prompt(tok, "copy abc=")
    assert tok.decode(ids) == "<|user|>\ncopy abc=<|end|>\n<|assistant|>\n"


def test_tasks_split():
    assert set(PRETRAIN_TASKS) | set(HELD_OUT_TASKS) == set(TASKS) and FINETUNE_TASK in HELD_OUT_TASKS
    assert not set(PRETRAIN_TASKS) & set(HELD_OUT_TASKS)


# measured on 100 held-out prompts (seed 0) when the assets were made: copy 100%, upper 99%, sort 84%, add 45%,
# reverse 0%. The thresholds leave a margin (the measurement is exact for these files: the sha256 test pins them).
@pytest.mark.parametrize("task,low", [("copy", 0.9), ("upper", 0.9), ("sort", 0.7), ("add", 0.3)])
def test_pretrain_task_is_answered(embedded, task, low):
    model, tok = embedded
    assert task_accuracy(model, tok, task, n=100) >= low


def test_finetune_task_is_not_answered(embedded):
    model, tok = embedded
    assert task_accuracy(model, tok, FINETUNE_TASK, n=100) <= 0.05


def _plain_fit(model, loader, steps, lr, warmup, weight_decay=0.1, min_lr_ratio=0.1, max_grad_norm=1.0):
    """The plain loop that made the shipped files (the recipe before it ran through Trainer): the reference."""
    import math
    from tunebook.loss import ChunkedCrossEntropy
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    def mult(s):
        if s < warmup: return s / warmup
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, mult)
    loss_fn, it, losses = ChunkedCrossEntropy(num_chunks=1), iter(loader), []
    model.train()
    while len(losses) < steps:
        b = next(it, None)
        if b is None: it = iter(loader); b = next(it)
        h = model(b["tokens"], positions=b.get("positions"), attn_mask=b.get("attn_mask"), doc_ids=b.get("doc_ids"), return_hidden=True)
        loss = loss_fn(h, model.output_weight, b["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step(); opt.zero_grad(set_to_none=True); sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("lora", [False, True])
def test_fit_runs_the_recipe_bit_for_bit(lora):
    """embedded.fit drives Trainer.train_step; it computes exactly what the plain loop that made the assets did, so
    make_embedded rebuilds the same bytes (a full rebuild is the notebook's `train` cell)."""
    from tunebook.core import seed_everything
    from tunebook.data import make_loader
    from tunebook.embedded import embedded_config, fit, make_tokenizer, pretrain_data
    from tunebook.lora import apply_lora
    from tunebook.model import build_model
    tok = make_tokenizer()
    data = pretrain_data(tok, n_per_task=6, seq_len=64)
    models = []
    for _ in range(2):
        seed_everything(0)
        m = build_model(embedded_config(tok, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=64))
        models.append(apply_lora(m, rank=4, targets="all-linear") if lora else m)
    loader = lambda: make_loader(data, batch_size=2, seed=0, drop_last=True)
    steps = len(loader()) + 3   # runs past the end of the data: the loader restarts
    ref = _plain_fit(models[0], loader(), steps, lr=1e-2, warmup=2)
    got = fit(models[1], loader(), steps, lr=1e-2, warmup=2)
    assert len(got) == steps and max(abs(a - b) for a, b in zip(ref, got)) < 1e-6
    pa, pb = dict(models[0].named_parameters()), dict(models[1].named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)   # to the bit
    assert all(pa[n].requires_grad == pb[n].requires_grad for n in pa)   # LoRA: the base stays frozen
