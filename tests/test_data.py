"""tunebook.data: packing equals padding through the real model, masks, errors, synthetic tasks, file formats."""
import copy
import json
import warnings

import datasets
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from tunebook.data import (IGNORE_INDEX, TASKS, SFTDataset, check_answer, collate_fn, encode_conversation, load_records,
                           make_loader, make_mixture, make_preference_pairs, make_task, pack, shift_labels)
from tunebook.model import build_model, pico
from tunebook.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    texts = [r["prompt"] + r["response"] for name in TASKS for r in make_task(name, 200, seed=0).to_list()]
    return train_tokenizer(texts, vocab_size=400)


@pytest.fixture(scope="module")
def plain_tok(tok):
    t = copy.copy(tok)
    t.chat_template = None
    return t


def _rows(n=12, seed=0):
    "Examples of quite different lengths from several tasks."
    return make_mixture(["add", "reverse", "lookup", "count"], n // 4, seed=seed,
                        difficulty={"reverse": dict(min_len=2, max_len=12), "lookup": dict(n_keys=6)}).to_list()


def _token_losses(model, batch):
    "Per-token CE at the trained positions, in batch order (row by row, left to right)."
    batch = dict(batch)
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch)
    keep = labels != IGNORE_INDEX
    return F.cross_entropy(logits[keep].float(), labels[keep], reduction="none")


@pytest.mark.parametrize("chat", [False, True])
def test_packed_equals_unpacked_losses(tok, plain_tok, chat):
    t = tok if chat else plain_tok
    ds = SFTDataset(_rows(24), t, max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(pico(vocab_size=len(tok)), dtype=torch.float32).eval()
    unpacked = _token_losses(model, collate_fn([ds[i] for i in range(len(ds))], pad_id=ds.pad_id))
    pk = pack(ds, max_seq_len=128)
    assert len(pk) < len(ds)                                 # several documents per row
    assert max(max(r["doc_ids"]) for r in pk.rows) >= 2
    packed = _token_losses(model, collate_fn([pk[i] for i in range(len(pk))]))
    # greedy packing keeps the order, so trained positions come in the same order in both
    assert packed.shape == unpacked.shape and packed.numel() == ds.stats.trained_tokens
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=0)
    # and without the document mask/positions the losses do differ: the test has teeth
    b = collate_fn([pk[i] for i in range(len(pk))])
    leaky = _token_losses(model, {"tokens": b["tokens"], "labels": b["labels"]})
    assert (leaky - unpacked).abs().max() > 1e-3


def test_labels_shifted_and_masked_plain(plain_tok):
    rows = _rows(16)
    ds = SFTDataset(rows, plain_tok, max_seq_len=64)
    for r, ex in zip(rows, ds.examples):
        p = plain_tok.encode(r["prompt"])                       # BOS + prompt
        a = plain_tok.encode(r["response"], add_bos=False) + [plain_tok.eos_id]
        assert ex["tokens"] == p + a
        want = [IGNORE_INDEX] * (len(p) - 1) + a + [IGNORE_INDEX]  # position t predicts token t+1
        assert ex["labels"] == want
        assert plain_tok.decode([l for l in ex["labels"] if l != IGNORE_INDEX], skip_special_tokens=True) == r["response"]
    on_prompt = SFTDataset(rows, plain_tok, max_seq_len=64, train_on_prompt=True)
    for ex in on_prompt.examples:
        assert ex["labels"] == ex["tokens"][1:] + [IGNORE_INDEX]


def test_labels_masked_chat_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+7="},
            {"role": "assistant", "content": "19"}, {"role": "user", "content": "reverse abc="},
            {"role": "assistant", "content": "cba"}]
    ds = SFTDataset([{"messages": msgs}], tok)
    ex = ds[0]
    text = tok.apply_chat_template(msgs)
    assert ex["tokens"] == tok.encode(text, add_bos=False)
    # independent: the trained targets are the tokens of each reply and its end-of-turn, found by string search
    trained = [i + 1 for i, l in enumerate(ex["labels"]) if l != IGNORE_INDEX]
    spans, pos = [], 0
    for reply in ("19", "cba"):
        head = "<|im_start|>assistant\n"
        start = text.index(head, pos) + len(head)
        end = start + len(reply + "<|im_end|>\n")
        spans.append((len(tok.encode(text[:start], add_bos=False)), len(tok.encode(text[:end], add_bos=False))))
        pos = end
    assert trained == [t for s, e in spans for t in range(s, e)]
    assert all(ex["labels"][t - 1] == ex["tokens"][t] for t in trained)
    # an instruct row with a chat template is [system?, user, assistant]
    ids, mask = encode_conversation(tok, msgs[:3])
    assert SFTDataset([{"prompt": "12+7=", "response": "19"}], tok, system_prompt="be brief")[0]["tokens"] == ids


def test_collate_unpacked(plain_tok):
    ds = SFTDataset(_rows(8), plain_tok, max_seq_len=64)
    b = collate_fn([ds[i] for i in range(4)], pad_id=ds.pad_id)
    lens = [len(ds[i]["tokens"]) for i in range(4)]
    assert set(b) == {"tokens", "labels", "attn_mask"}
    assert b["tokens"].shape == (4, max(lens)) and b["tokens"].dtype == torch.long
    assert b["attn_mask"].sum(1).tolist() == lens
    pad = b["attn_mask"] == 0
    assert (b["labels"][pad] == IGNORE_INDEX).all() and (b["tokens"][pad] == ds.pad_id).all()
    for i in range(4):   # each row ends its document with -100
        assert b["labels"][i, lens[i] - 1] == IGNORE_INDEX


def test_pack_layout(plain_tok):
    ds = SFTDataset(_rows(16), plain_tok, max_seq_len=48)
    pk = pack(ds)
    assert pk.max_seq_len == 48
    seen = []
    for r in pk.rows:
        assert all(len(r[k]) == 48 for k in ("tokens", "labels", "positions", "doc_ids"))
        for d in sorted(set(r["doc_ids"]) - {-1}):
            idx = [i for i, x in enumerate(r["doc_ids"]) if x == d]
            assert idx == list(range(idx[0], idx[0] + len(idx)))         # contiguous
            assert [r["positions"][i] for i in idx] == list(range(len(idx)))  # restart at 0
            assert r["labels"][idx[-1]] == IGNORE_INDEX                  # no cross-document target
            seen.append([r["tokens"][i] for i in idx])
    assert seen == [ex["tokens"] for ex in ds.examples]
    with pytest.raises(ValueError, match="max_seq_len=5"):
        pack(ds, max_seq_len=5)


def test_truncation_stats_and_errors(plain_tok):
    rows = [{"prompt": "1+2+3+4+5+6+7+8+9+10=", "response": "55"}, {"prompt": "1+1=", "response": "2"},
            {"prompt": "2+2=", "response": "4444444444444"}]
    with pytest.warns(UserWarning, match="max_seq_len=8"):
        ds = SFTDataset(rows, plain_tok, max_seq_len=8)
    s = ds.stats
    assert (s.examples, s.truncated, s.dropped, len(ds)) == (3, 2, 1, 2)
    assert s.tokens == sum(len(x["tokens"]) for x in ds.examples) and all(len(x["tokens"]) <= 8 for x in ds.examples)
    assert s.trained_tokens == sum(l != IGNORE_INDEX for x in ds.examples for l in x["labels"])
    with pytest.raises(ValueError, match=r"max_seq_len=8.*Raise max_seq_len"):
        SFTDataset(rows[:1], plain_tok, max_seq_len=8)
    with pytest.raises(ValueError, match="nothing|no message|to learn"):
        SFTDataset([{"messages": [{"role": "user", "content": "hi"}]}], plain_tok)


def test_bad_inputs(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type '\.txt'"):
        load_records(tmp_path / "d.txt")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_records(tmp_path / "e.jsonl")
    (tmp_path / "h.csv").write_text("prompt,response\n")
    with pytest.raises(ValueError, match="no rows"):
        load_records(tmp_path / "h.csv")
    with pytest.raises(ValueError, match="empty"):
        load_records(datasets.Dataset.from_list([]))
    rows = [{"question": "1+1=", "answer": "2"}]
    with pytest.raises(ValueError) as e:
        SFTDataset(rows, tok)
    msg = str(e.value)
    assert "'prompt'" in msg and "prompt_column=" in msg and "['question', 'answer']" in msg
    with pytest.raises(ValueError, match="response_column="):
        SFTDataset(rows, tok, prompt_column="question")
    assert len(SFTDataset(rows, tok, prompt_column="question", response_column="answer")) == 1
    with pytest.raises(ValueError, match="messages_column="):
        SFTDataset(rows, tok, format="chat")
    with pytest.raises(ValueError, match="row 1"):
        SFTDataset([{"prompt": "a", "response": "b"}, {"prompt": "c", "response": None}], tok)
    with pytest.raises(ValueError, match="row 0"):
        SFTDataset([{"messages": ["hello"]}], tok)


def test_every_file_format_loads(tmp_path, tok):
    rows = make_task("add", 10, seed=0).to_list()
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pd.DataFrame(rows).to_csv(tmp_path / "a.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    ref = [ex["tokens"] for ex in SFTDataset(rows, tok).examples]
    for f in ("a.json", "a.jsonl", "a.csv", "a.parquet"):
        assert load_records(tmp_path / f).to_list() == rows, f
        assert [ex["tokens"] for ex in SFTDataset(tmp_path / f, tok).examples] == ref
    assert load_records(datasets.DatasetDict(eval=datasets.Dataset.from_list(rows)), split="eval").num_rows == 10
    assert load_records(str(tmp_path / "a.jsonl"), split="train[:3]").num_rows == 3
    chat = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]} for r in rows]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in chat))
    assert [ex["tokens"] for ex in SFTDataset(tmp_path / "c.jsonl", tok).examples] == ref


@pytest.mark.parametrize("name", list(TASKS))
def test_tasks_deterministic_disjoint_and_correct(name):
    a, b = make_task(name, 100, seed=7), make_task(name, 100, seed=7)
    assert a.to_list() == b.to_list()
    assert a["prompt"] != make_task(name, 100, seed=8)["prompt"]
    assert set(a.column_names) >= {"prompt", "response", "answer"}
    assert a["response"] == a["answer"]
    train = make_task(name, 1000, seed=0)
    ev = make_task(name, 200, seed=0, split="eval")
    assert not set(train["prompt"]) & set(ev["prompt"])
    assert not set(make_task(name, 1000, seed=3)["prompt"]) & set(ev["prompt"])   # any seeds
    for r in a.to_list():
        assert check_answer(name, r["answer"], r["answer"]) == 1.0
        assert 0 < len(r["answer"]) <= 12 and len(r["prompt"]) <= 40


def test_task_answers_are_right():
    for r in make_task("add", 50).to_list():
        x, y = r["prompt"][:-1].split("+"); assert int(x) + int(y) == int(r["answer"])
    for r in make_task("sub", 50).to_list():
        x, y = r["prompt"][:-1].split("-"); assert int(x) - int(y) == int(r["answer"]) >= 0
    for op, fn in [("reverse", lambda w: w[::-1]), ("upper", str.upper), ("sort", lambda w: "".join(sorted(w))),
                   ("copy", lambda w: w), ("devowel", lambda w: "".join(c for c in w if c not in "aeiou"))]:
        for r in make_task(op, 50).to_list():
            assert r["answer"] == fn(r["prompt"][len(op) + 1:-1])
    for r in make_task("count", 50).to_list():
        _, c, _, w = r["prompt"][:-1].split(); assert str(w.count(c)) == r["answer"]
    for r in make_task("lookup", 50).to_list():
        *kv, q = r["prompt"].split(); assert dict(x.split("=") for x in kv)[q[:-1]] == r["answer"]


def test_check_answer_and_preference_pairs():
    assert check_answer("add", " 68\n12+1=13", "68") == 1.0
    assert check_answer("add", "68<|im_end|>", "68") == 1.0
    assert check_answer("add", "6", "68") == 0.0 and check_answer("add", "", "68") == 0.0
    assert check_answer("reverse", "cba extra", "cba") == 0.0
    with pytest.raises(ValueError, match="unknown task"):
        check_answer("nope", "1", "1")
    for name in TASKS:
        p = make_preference_pairs(name, 40, seed=1)
        assert p.to_list() == make_preference_pairs(name, 40, seed=1).to_list()
        for r in p.to_list():
            assert r["chosen"] == r["answer"] != r["rejected"]
            assert check_answer(name, r["rejected"], r["answer"]) == 0.0


def test_loader_deterministic(plain_tok):
    ds = SFTDataset(make_task("copy", 40, seed=0), plain_tok, max_seq_len=32)
    order = lambda seed: [b["tokens"].tolist() for b in make_loader(ds, batch_size=8, seed=seed)]
    assert order(1) == order(1) and order(1) != order(2)
    b = next(iter(make_loader(pack(ds), batch_size=2)))
    assert set(b) == {"tokens", "labels", "positions", "doc_ids"} and b["tokens"].shape == (2, 32)
