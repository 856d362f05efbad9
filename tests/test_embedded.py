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
