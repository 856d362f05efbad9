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


def _chatml(messages):
    "ChatML written out by hand (the reference for the template path)."
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_too_long_rows_are_dropped_never_cut(plain_tok):
    rows = [{"prompt": "1+2+3+4+5+6+7+8+9+10=", "response": "55"}, {"prompt": "1+1=", "response": "2"},
            {"prompt": "2+2=", "response": "4444444444444"}]
    # by hand: BOS prompt response EOS
    n = [len(plain_tok.encode(r["prompt"]) + plain_tok.encode(r["response"], add_bos=False)) + 1 for r in rows]
    limit = sorted(n)[1]                                      # the middle length: one row is too long
    with pytest.warns(UserWarning, match=rf"1 of 3 examples are longer and are dropped whole.*max_seq_len={max(n)} keeps them"):
        ds = SFTDataset(rows, plain_tok, max_seq_len=limit)
    s = ds.stats
    assert (s.examples, s.too_long, s.dropped, len(ds), s.longest) == (3, 1, 0, 2, max(n))
    assert all(x["tokens"][-1] == plain_tok.eos_id for x in ds.examples)          # every kept row ends with its EOS
    kept = [r for r, k in zip(rows, n) if k <= limit]
    assert [plain_tok.decode(x["tokens"][1:]) for x in ds.examples] == [r["prompt"] + r["response"] + "<|end_of_text|>" for r in kept]
    assert s.tokens == sum(len(x["tokens"]) for x in ds.examples) == sum(k for k in n if k <= limit)
    assert s.trained_tokens == sum(l != IGNORE_INDEX for x in ds.examples for l in x["labels"])
    with pytest.raises(ValueError, match=rf"1 of 3 examples .* longer than max_seq_len={limit} .*Set max_seq_len={max(n)}"):
        SFTDataset(rows, plain_tok, max_seq_len=limit, too_long="error")
    with pytest.raises(ValueError, match=rf"every example .* longer than max_seq_len={min(n) - 1} .*set max_seq_len={max(n)} \(--max-seq-len {max(n)}\)"):
        SFTDataset(rows, plain_tok, max_seq_len=min(n) - 1)
    with pytest.raises(ValueError, match="no assistant turn|to learn"):
        SFTDataset([{"messages": [{"role": "user", "content": "hi"}]}], plain_tok, use_chat_template=False)
    with pytest.raises(ValueError, match="too_long='maybe'"):
        SFTDataset(rows, plain_tok, too_long="maybe")


def test_max_seq_len_from_the_data(tok):
    "None: the longest example as the template renders it (system prompt included), capped by the model's context."
    rows = [{"prompt": p, "response": r} for p, r in [("12+7=", "19"), ("reverse abcdefgh=", "hgfedcba"), ("1+1=", "2")]]
    sysmsg = "Answer with the number only."
    ref = [len(tok.encode(_chatml([{"role": "system", "content": sysmsg}, {"role": "user", "content": r["prompt"]},
                                    {"role": "assistant", "content": r["response"]}]), add_bos=False)) for r in rows]
    ds = SFTDataset(rows, tok, system_prompt=sysmsg)
    assert ds.lengths == ref and ds.max_seq_len == max(ref) and len(ds) == 3 and ds.stats.too_long == 0
    assert ds.length_report == f"max_seq_len={max(ref)} (the longest example): every one of the 3 examples fits"
    ctx = sorted(ref)[1]
    with pytest.warns(UserWarning, match=rf"max_seq_len={ctx} \(the model's context; the longest example has {max(ref)} tokens\)"):
        capped = SFTDataset(rows, tok, system_prompt=sysmsg, context=ctx)
    assert capped.max_seq_len == ctx and len(capped) == 2 and capped.stats.too_long == 1
    with pytest.raises(ValueError, match=rf"beyond the model's context of {ctx} positions: set max_seq_len={ctx} \(--max-seq-len {ctx}\) or less"):
        SFTDataset(rows, tok, system_prompt=sysmsg, max_seq_len=ctx + 1, context=ctx)
    text = SFTDataset([{"text": "1+1=2 " * 40}, {"text": "2+2=4"}], tok, context=16)   # plain text: windows, nothing dropped
    assert text.max_seq_len == 16 and "split into windows" in text.length_report
    assert sum(len(x["tokens"]) for x in text.examples) == sum(text.lengths)


def test_max_new_tokens_from_the_held_out_answers(tok, plain_tok):
    from tunebook.data import fit_max_new_tokens, sft_split
    rows = [{"prompt": f"reverse {w}=", "response": w[::-1]} for w in ["ab", "abcdefghij", "abc", "abcdef", "a", "ba"]]
    for t in (tok, plain_tok):                                # ChatML ends the turn with <|im_end|>, the plain layout with EOS
        train, evals = sft_split(rows, t, eval_samples=3, seed=0, use_chat_template=t is tok)
        ref = max(len(t.encode(e["answer"], add_bos=False)) + 1 for e in evals)     # by hand: answer tokens + end of turn
        n, report = fit_max_new_tokens(t, evals, train.use_chat_template)
        assert n == ref and report.startswith(f"max_new_tokens={ref}: the longest held-out answer (row ")
        short, report = fit_max_new_tokens(t, evals, train.use_chat_template, max_new_tokens=ref - 1)
        assert short == ref - 1 and f"set max_new_tokens={ref}" in report
    assert tok.stop_ids == sorted({tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|im_end|>")})
    assert fit_max_new_tokens(tok, []) == (None, "max_new_tokens: no held-out answers, nothing is generated")


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
    assert "'prompt'" in msg and "prompt_field=" in msg and "['question', 'answer']" in msg
    with pytest.raises(ValueError, match="response_field="):
        SFTDataset(rows, tok, prompt_field="question")
    assert len(SFTDataset(rows, tok, prompt_field="question", response_field="answer")) == 1
    with pytest.warns(FutureWarning, match="prompt_column= is now prompt_field="):   # the old spelling, for one release
        assert len(SFTDataset(rows, tok, prompt_column="question", response_field="answer")) == 1
    with pytest.raises(ValueError, match="messages_field="):
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


# ---- real data exactly as written (issue 13) ----
from datetime import datetime

from tunebook.data import eval_examples, sft_split
from tunebook.records import detect_format, preference_example

LOOKS = ["2021-03-05", "1e5", "1.50", "true", "null", "007", "NA", "12345678901234567890", "café ☕", "  two  spaces\n"]
END = "<|im_end|>\n"   # what the ChatML template puts after each assistant turn (trained: the model learns to stop)


def _chatml(msgs, gen=False):
    "Hand-built ChatML rendering, the reference the template path must match token for token."
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}{END}" for m in msgs) + ("<|im_start|>assistant\n" if gen else "")


def _trained(t, ex):
    "The text of the labelled (non -100) tokens of one example."
    return t.decode([l for l in ex["labels"] if l != IGNORE_INDEX])


def _instruct_rows():
    return [{"prompt": f"what is {v!r}? {i}", "response": v} for i, v in enumerate(LOOKS)]


def _check_instruct(ds, t, rows, system=None):
    assert len(ds) == len(rows)
    for ex, r in zip(ds.examples, rows):
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
        assert ex["tokens"] == t.encode(_chatml(msgs), add_bos=False)
        assert _trained(t, ex) == r["response"] + END       # byte for byte, nothing re-typed


def test_every_format_trains_the_text_as_written(tmp_path, tok):
    rows = _instruct_rows()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    pd.DataFrame(rows).to_csv(tmp_path / "a.csv", index=False)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "a.csv").read_bytes())   # Excel's "CSV UTF-8"
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    sources = [tmp_path / f for f in ("a.jsonl", "a.json", "a.csv", "bom.csv", "a.parquet", "disk")]
    sources += sorted((tmp_path / "disk").glob("*.arrow"))   # one Arrow file of that folder, read by itself
    dd = datasets.DatasetDict(train=datasets.Dataset.from_list(rows), test=datasets.Dataset.from_list(rows[:2]))
    for src in sources + [datasets.Dataset.from_list(rows), dd, rows]:
        ds = SFTDataset(src, tok, max_seq_len=None)
        assert ds.format == "instruct" and "detected" in ds.format_report
        _check_instruct(ds, tok, rows)
    # the pyarrow JSON loader this replaces re-typed an all-dates column as timestamps; the text must not change
    dates = [{"prompt": f"day {i}", "response": f"2021-03-0{i}"} for i in range(1, 6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dates))
    _check_instruct(SFTDataset(tmp_path / "d.jsonl", tok), tok, dates)


def test_chat_sharegpt_alpaca_text_formats(tmp_path, tok):
    sysmsg = "Answer with the value only."
    chat = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": v}]},
                          {"role": "assistant", "content": v}]} for v in LOOKS]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    ds = SFTDataset(tmp_path / "c.jsonl", tok, system_prompt=sysmsg)     # D32: the system prompt applies to chat too
    assert ds.format == "chat"
    for ex, v in zip(ds.examples, LOOKS):
        msgs = [{"role": "system", "content": sysmsg}, {"role": "user", "content": "hi " + v}, {"role": "assistant", "content": v}]
        assert ex["tokens"] == tok.encode(_chatml(msgs), add_bos=False) and _trained(tok, ex) == v + END
    sg = [{"conversations": [{"from": "system", "value": "own"}, {"from": "human", "value": "q" + v}, {"from": "gpt", "value": v}]}
          for v in LOOKS]
    (tmp_path / "s.json").write_text(json.dumps(sg))
    ds = SFTDataset(tmp_path / "s.json", tok, system_prompt=sysmsg)      # a row's own system message wins
    assert ds.format == "sharegpt"
    for ex, v in zip(ds.examples, LOOKS):
        msgs = [{"role": "system", "content": "own"}, {"role": "user", "content": "q" + v}, {"role": "assistant", "content": v}]
        assert ex["tokens"] == tok.encode(_chatml(msgs), add_bos=False) and _trained(tok, ex) == v + END
    al = [{"instruction": "Repeat", "input": v if i % 2 else "", "output": v} for i, v in enumerate(LOOKS)]
    pd.DataFrame(al).to_csv(tmp_path / "al.csv", index=False)
    ds = SFTDataset(tmp_path / "al.csv", tok, system_prompt=sysmsg)
    assert ds.format == "alpaca"
    for ex, r in zip(ds.examples, al):
        user = r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")
        msgs = [{"role": "system", "content": sysmsg}, {"role": "user", "content": user}, {"role": "assistant", "content": r["output"]}]
        assert ex["tokens"] == tok.encode(_chatml(msgs), add_bos=False) and _trained(tok, ex) == r["output"] + END
    texts = [{"text": "On 2021-03-05 the value was 1e5 and " + v} for v in LOOKS]
    pd.DataFrame(texts).to_parquet(tmp_path / "t.parquet")
    ds = SFTDataset(tmp_path / "t.parquet", tok)
    assert ds.format == "text"
    for ex, r in zip(ds.examples, texts):   # every token after BOS is trained: the text, then EOS
        assert ex["tokens"] == tok.encode(r["text"], add_bos=True, add_eos=True)
        assert _trained(tok, ex) == r["text"] + tok.eos_token
    long = SFTDataset([{"text": " ".join(LOOKS * 4)}], tok, max_seq_len=16)   # long text: windows, nothing lost
    assert sum(len(x["tokens"]) for x in long.examples) == len(tok.encode(" ".join(LOOKS * 4), add_eos=True))
    assert SFTDataset(rows := _instruct_rows(), tok, format="chat" if False else "instruct").format_report.endswith(
        f"{len(rows)} rows from the given list")


def test_multi_turn_masking_matches_hand_built_reference(tok, plain_tok):
    msgs = [{"role": "system", "content": "S 1.50"}, {"role": "user", "content": "u1 true"}, {"role": "assistant", "content": "a1 007"},
            {"role": "user", "content": "u2 null"}, {"role": "assistant", "content": "a2 2021-03-05"}]
    ids, mask = encode_conversation(tok, msgs)
    ref_ids, ref_mask = [], []
    pieces = [(_chatml(msgs[:2], gen=True), 0), ("a1 007" + END, 1), (_chatml(msgs[3:4], gen=True), 0), ("a2 2021-03-05" + END, 1)]
    for text, m in pieces:
        p = tok.encode(text, add_bos=False); ref_ids += p; ref_mask += [m] * len(p)
    assert (ids, mask) == (ref_ids, ref_mask)
    _, last = encode_conversation(tok, msgs, train_on="last")
    assert last == [m if i >= len(ref_ids) - len(tok.encode("a2 2021-03-05" + END, add_bos=False)) else 0 for i, m in enumerate(ref_mask)]
    ds = SFTDataset([{"messages": msgs}], tok, train_on="last")
    assert _trained(tok, ds[0]) == "a2 2021-03-05" + END
    # D33: chat data and a tokenizer without a template: refused, or the documented plain layout when asked for
    with pytest.raises(ValueError, match="no chat template.*use_chat_template=False"):
        SFTDataset([{"messages": msgs}], plain_tok)
    ds = SFTDataset([{"messages": msgs}], plain_tok, use_chat_template=False)
    e = plain_tok.encode
    ref = e("S 1.50\n") + e("u1 true", add_bos=False) + e("a1 007", add_bos=False) + [plain_tok.eos_id] + \
        e("u2 null", add_bos=False) + e("a2 2021-03-05", add_bos=False) + [plain_tok.eos_id]
    assert ds[0]["tokens"] == ref
    assert _trained(plain_tok, ds[0]) == "a1 007" + plain_tok.eos_token + "a2 2021-03-05" + plain_tok.eos_token
    assert ds.encode_prompt(msgs[:4]) == ref[:len(ref) - len(e("a2 2021-03-05", add_bos=False)) - 1]   # eval = training


def _err(tmp_path, name, content, tok, **kw):
    p = tmp_path / name
    (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)
    with pytest.raises(ValueError) as e:
        SFTDataset(p, tok, **kw)
    return str(e.value)


@pytest.mark.parametrize("raw,desc", [("1e5", "a number (100000.0)"), ("1.50", "a number (1.5)"), ("true", "a boolean (true)"),
                                      ("100", "a number (100)"), ('{"q": "a", "ctx": [1, 2]}', 'an object ({"q": "a", "ctx": [1, 2]})'),
                                      ('["a", "b"]', 'a list (["a", "b"])'), ("null", "missing or null")])
def test_json_values_that_are_not_text_are_refused(tmp_path, tok, raw, desc):
    lines = [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(6)]
    lines[3] = '{"prompt": "p3", "response": ' + raw + '}'
    msg = _err(tmp_path, "d.jsonl", "\n".join(lines) + "\n", tok)
    assert f"d.jsonl' line 4, column 'response'" in msg and desc in msg, msg
    if raw != "null": assert 'write it as a JSON string in quotes (e.g. "1e5")' in msg


def test_refused_files_name_the_place(tmp_path, tok):
    # D9: a column mixing 7 and 7.5 is refused at the first number, not trained as 7.0
    msg = _err(tmp_path, "m.json", json.dumps([{"prompt": "a", "response": "x"}, {"prompt": "b", "response": 7},
                                               {"prompt": "c", "response": 7.5}], indent=0), tok)
    assert "m.json' line 6, column 'response': expected text but found a number (7)" in msg, msg
    # D34/D20: content parts that are not text
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "assistant", "content": "a"}]}
    assert "content parts of type ['image_url']" in _err(tmp_path, "img.jsonl", json.dumps(bad), tok)
    # D27: Parquet float and timestamp columns
    pd.DataFrame({"prompt": ["a", "b", "c"], "response": [0.0, 1.5, 2.0]}).to_parquet(tmp_path / "f.parquet")
    with pytest.raises(ValueError, match=r"f.parquet' row 0, column 'response': expected text but found a number \(0.0\); store the column as strings"):
        SFTDataset(tmp_path / "f.parquet", tok)
    pd.DataFrame({"prompt": ["a", "b"], "response": [datetime(2021, 3, 5)] * 2}).to_parquet(tmp_path / "ts.parquet")
    with pytest.raises(ValueError, match=r"ts.parquet' row 0, column 'response': expected text but found a datetime \(2021-03-05 00:00:00\)"):
        SFTDataset(tmp_path / "ts.parquet", tok)
    # D6: a broken JSONL line; D14: a non-UTF-8 byte; D25: a ragged CSV row: named before any training
    lines = [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(40)]
    lines[20] = '{"prompt": "p20", "response": "r20"'
    assert "malformed.jsonl' line 21: not valid JSON" in _err(tmp_path, "malformed.jsonl", "\n".join(lines), tok)
    raw = "\n".join(lines[:10]).encode() + b'\n{"prompt": "caf\xe9", "response": "x"}\n'
    assert "latin.jsonl' line 11: byte 0xe9 is not valid UTF-8" in _err(tmp_path, "latin.jsonl", raw, tok)
    csv_text = "prompt,response\n" + "".join(f"p{i},r{i}\n" for i in range(20)) + "a,b,c\n"
    assert "ragged.csv' line 22: 3 fields, but the header has 2" in _err(tmp_path, "ragged.csv", csv_text, tok)
    # CSV has no types: "NA", "null" and "" stay text
    (tmp_path / "na.csv").write_text('prompt,response\nNA,null\n"",x\n')
    assert load_records(tmp_path / "na.csv").to_list() == [{"prompt": "NA", "response": "null"}, {"prompt": "", "response": "x"}]


def test_empty_responses_and_eval_rows(tok):
    with pytest.raises(ValueError, match="every response in the given list is empty"):   # D30
        SFTDataset([{"prompt": f"p{i}", "response": ""} for i in range(5)], tok)
    with pytest.warns(UserWarning, match="2 of 5 rows of the given list have an empty response"):
        SFTDataset([{"prompt": f"p{i}", "response": "" if i < 2 else "x"} for i in range(5)], tok)
    # D16: held-out chat rows without an assistant turn are skipped and counted, not a crash
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}] + ([{"role": "assistant", "content": f"a{i}"}] if i % 2 else [])}
            for i in range(16)]
    with pytest.warns(UserWarning, match="have no assistant turn"):
        train, evals = sft_split(rows, tok, eval_samples=8, seed=1, system_prompt="S")
    assert all(e["answer"] == "a" + e["messages"][-1]["content"][1:] for e in evals) and evals
    assert all(e["messages"][0] == {"role": "system", "content": "S"} for e in evals)
    with pytest.raises(ValueError, match="DPO"):
        SFTDataset([{"prompt": "p", "chosen": "a", "rejected": "b"}], tok)


def test_preference_forms(tmp_path):
    conv = [{"chosen": [{"role": "user", "content": v}, {"role": "assistant", "content": "good " + v}],
             "rejected": [{"role": "user", "content": v}, {"role": "assistant", "content": "bad"}]} for v in LOOKS]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conv))
    recs = load_records(tmp_path / "p.jsonl")
    assert detect_format(recs.column_names) == "preference"
    for i, v in enumerate(LOOKS):
        assert preference_example(recs[i], recs.where(i)) == ([{"role": "user", "content": v}], "good " + v, "bad")
    assert preference_example({"prompt": "q", "chosen": "1e5", "rejected": "100000.0"}) == ([{"role": "user", "content": "q"}], "1e5", "100000.0")
    with pytest.raises(ValueError, match="different turns before the answer"):
        preference_example({"chosen": conv[0]["chosen"], "rejected": conv[1]["rejected"]})


def test_a_json_array_named_jsonl_says_rename_it(tmp_path):
    """N8: a JSON array saved as .jsonl was refused as 'not valid JSON' on line 1, with no word of the fix; the .json
    name loads it (the same rows)."""
    import json
    from tunebook.records import load_records
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    (tmp_path / "rows.jsonl").write_text(json.dumps(rows, indent=1))
    with pytest.raises(ValueError, match="holds one JSON array, not JSON Lines.*rename it to rows.json"):
        load_records(tmp_path / "rows.jsonl")
    (tmp_path / "rows.jsonl").rename(tmp_path / "rows.json")
    assert list(load_records(tmp_path / "rows.json")) == rows
