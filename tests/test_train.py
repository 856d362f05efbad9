"""Trainer: exact resume, run folder, and bad input stopped before training."""
import json

import pytest
import torch

from tunebook.data import make_task
from tunebook.model import build_model, pico
from tunebook.tokenizer import train_tokenizer
from tunebook.train import TrainConfig, Trainer


@pytest.fixture(scope="module")
def tok():
    rows = make_task("reverse", 300, seed=0)
    return train_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=300)


def _trainer(tok, out, **kw):
    torch.manual_seed(0)
    model = build_model(pico(vocab_size=tok.vocab_size, dim=32, hidden_dim=64))
    kw = {"batch_size": 8, "max_steps": 6, "dtype": "fp32", **kw}   # exact comparisons: fp32 whatever the default
    cfg = TrainConfig(model="given", task="reverse", n_train=96, eval_samples=4, output_dir=str(out), **kw)
    return Trainer(cfg, model=model, tokenizer=tok)


@pytest.mark.parametrize("kw", [dict(method="full"),
                                dict(method="lora", grad_accum_steps=2),
                                dict(method="full", chunked_ce=3, optimizer_in_backward=True, max_grad_norm=None),
                                dict(method="dora", packing=True, max_seq_len=48),
                                dict(method="lora", padding_free=True, grad_accum_steps=2)],
                         ids=["full", "lora-accum", "chunked-oib", "dora-packed", "lora-padding-free"])
def test_resume_is_bit_exact(tok, tmp_path, kw):
    a = _trainer(tok, tmp_path / "a", **kw).setup()
    ref = [a.train_step()["loss"] for _ in range(6)]
    b = _trainer(tok, tmp_path / "b", **kw).setup()
    for _ in range(3): b.train_step()
    b.save_checkpoint()
    del b  # the "killed" run
    c = _trainer(tok, tmp_path / "b", resume=True, **kw).setup()
    assert c.step == 3
    got = [c.train_step()["loss"] for _ in range(3)]
    assert got == ref[3:]  # to the bit
    pa = dict(a.model.named_parameters()); pc = dict(c.model.named_parameters())
    assert all(torch.equal(pa[n], pc[n]) for n in pa)


def test_resume_refuses_changed_options(tok, tmp_path):
    b = _trainer(tok, tmp_path / "b").setup(); b.train_step(); b.save_checkpoint()
    with pytest.raises(ValueError, match="lr was"):
        _trainer(tok, tmp_path / "b", resume=True, lr=1e-4).setup()


def test_resume_refuses_a_checkpoint_past_max_steps(tok, tmp_path):
    """N5: resuming a 4-step checkpoint with --max-steps 2 ran no step and exported the 4-step model under a config saying 2."""
    b = _trainer(tok, tmp_path / "b").setup()
    for _ in range(4): b.train_step()
    b.save_checkpoint()
    with pytest.raises(ValueError, match="it is at step 4, past --max-steps 2. Raise --max-steps"):
        _trainer(tok, tmp_path / "b", resume=True, max_steps=2).setup()
    assert _trainer(tok, tmp_path / "b", resume=True, max_steps=4).setup().step == 4   # equal: nothing left, nothing wrong


def test_grad_accumulation_equals_big_batch(tok, tmp_path):
    """Two micro-batches of 4 give the same step as one batch of 8 (loss normalised over all tokens)."""
    a = _trainer(tok, tmp_path / "a", method="full", batch_size=8).setup()
    b = _trainer(tok, tmp_path / "b", method="full", batch_size=4, grad_accum_steps=2).setup()
    # the order is one permutation per epoch, so b's micro-batches 0 and 1 hold a's batch 0
    la, lb = a.train_step()["loss"], b.train_step()["loss"]
    assert abs(la - lb) < 1e-5
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) < 1e-6


def test_run_folder(tok, tmp_path):
    t = _trainer(tok, tmp_path / "run", method="lora", max_steps=3)
    s = t.fit(progress=False)
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["README.md", "adapter", "checkpoints", "config.json", "config.yaml", "log.txt", "loss.png", "metrics.csv", "model", "samples.jsonl", "summary.json"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for k in ("eval_accuracy_before", "eval_accuracy_after", "tokens_per_second", "peak_memory_bytes"):
        assert summary[k] is not None
    from tunebook.checkpoint import load_hf
    from tunebook.lora import merge_lora
    merged = load_hf(tmp_path / "run" / "model")
    x = torch.randint(0, tok.vocab_size, (1, 7))
    with torch.no_grad():
        assert (merged(x) - t.model(x)).abs().max() < 1e-5  # merged weights = adapted model


# ---- bad input stops before training, naming the problem and the fix ----

def _cli(*argv):
    from tunebook.cli import main
    return main(["finetune", "--quiet", "--max-steps", "1", *argv])


def test_missing_data_file(tmp_path, capsys):
    assert _cli("--data", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path / "o")) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_rows_missing_fields(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"question": "q", "answer": "a"}) for _ in range(10)))
    assert _cli("--data", str(f), "--output-dir", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    # names the missing column, the columns the file has, and the flag that picks another one
    assert "prompt" in err and "question" in err and ("--prompt-field" in err or "prompt_field" in err), err


def test_empty_dataset(tmp_path, capsys):
    f = tmp_path / "d.jsonl"; f.write_text("")
    assert _cli("--data", str(f), "--output-dir", str(tmp_path / "o")) == 2
    assert "empty" in capsys.readouterr().err


def test_every_example_too_long(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": "word " * 200, "response": "yes"}) for _ in range(10)))
    assert _cli("--data", str(f), "--max-seq-len", "16", "--output-dir", str(tmp_path / "o")) == 2
    assert "--max-seq-len 16" in capsys.readouterr().err


def test_model_folder_not_a_model(tmp_path, capsys):
    (tmp_path / "m").mkdir(); (tmp_path / "m" / "notes.txt").write_text("hi")
    assert _cli("--model", str(tmp_path / "m"), "--output-dir", str(tmp_path / "o")) == 2
    assert "config.json" in capsys.readouterr().err


def test_model_folder_carries_the_sources_inference_files(tok, tmp_path):
    """model/ holds the source folder's tokenizer files, chat template and generation_config.json byte for byte, and
    samples.jsonl holds a few generations per eval."""
    from tunebook.checkpoint import save_hf
    src = tmp_path / "src"
    torch.manual_seed(0)
    save_hf(build_model(pico(vocab_size=tok.vocab_size, dim=32, hidden_dim=64)), src); tok.save(src)
    (src / "generation_config.json").write_text('{"do_sample": false, "max_new_tokens": 7, "eos_token_id": 1}\n')
    (src / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text() + "\n")  # the source's own bytes
    cfg = TrainConfig(model=str(src), task="reverse", n_train=32, eval_samples=4, batch_size=8, max_steps=2, eval_every=1,
                      output_dir=str(tmp_path / "run"))
    Trainer(cfg).fit(progress=False)
    for name in ("generation_config.json", "tokenizer_config.json", "tokenizer.json") + (("chat_template.jinja",) * (src / "chat_template.jinja").exists()):
        assert (tmp_path / "run" / "model" / name).read_bytes() == (src / name).read_bytes(), name
    samples = [json.loads(l) for l in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 3 + [1] * 3 + [2] * 3   # before, every eval_every, after
    assert all(s["prompt"].startswith("reverse") and isinstance(s["completion"], str) for s in samples)


# ---- eval during training (issue 13): held-out loss beside exact match, the lead metric, the lengths chosen

def _reference_loss(model, rows):
    """Mean cross-entropy per labelled token of `rows`, one row at a time (no batching, no padding)."""
    tot, n = 0.0, 0
    with torch.no_grad():
        for r in rows:
            logits = model(torch.tensor([r["tokens"]]))[0]
            labels = torch.tensor(r["labels"])
            tot += torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            n += int((labels != -100).sum())
    return tot / n


def test_data_file_leads_with_eval_loss(tok, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"reverse {w}", "response": w[::-1]})
                           for w in ["abc", "hello", "tune", "book", "loop", "step", "model", "data"] * 5))
    t = _trainer(tok, tmp_path / "run", method="full", max_steps=4, eval_every=2, data=str(f), eval_fraction=0.2, max_seq_len=40)
    t.setup()
    before = _reference_loss(t.model, t.held_out)
    s = t.fit(progress=False)
    assert s["lead_metric"] == "eval_loss" and list(s)[:2] == ["eval_loss_before", "eval_loss_after"], list(s)[:4]
    assert abs(s["eval_loss_before"] - before) < 1e-5, (s["eval_loss_before"], before)
    assert abs(s["eval_loss_after"] - _reference_loss(t.model, t.held_out)) < 1e-5
    assert s["eval_loss_after"] < s["eval_loss_before"]
    assert len(t.held_out) == 4 and "eval_accuracy_after" in s   # exact match is still measured beside it
    assert [r.get("eval_loss") is not None for r in t.metrics] == [False, True, False, True]   # every eval_every, and the end
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "max_seq_len: max_seq_len=40 (as set)" in log and "max_new_tokens: max_new_tokens=" in log, log
    assert s["max_seq_len"] == 40 and "max_new_tokens_report" in s


def test_synthetic_task_leads_with_exact_match_and_resume_keeps_the_baseline(tok, tmp_path):
    a = _trainer(tok, tmp_path / "run", method="full", max_steps=4, save_every=2)
    a.fit(progress=False)
    first = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert first["lead_metric"] == "eval_accuracy" and list(first)[:2] == ["eval_accuracy_before", "eval_accuracy_after"]
    b = _trainer(tok, tmp_path / "run2", method="full", max_steps=4, save_every=2).setup()   # a run killed after step 2
    b.baseline.update({f"{k}_before": v for k, v in b.evaluate().items()})   # as fit() measures it, before step 1
    for _ in range(2): b.train_step()
    b.save_checkpoint(); del b
    c = _trainer(tok, tmp_path / "run2", method="full", max_steps=4, save_every=2, resume=True)   # resumed from its checkpoint
    s = c.fit(progress=False)
    assert s["steps"] == 4
    for k in ("eval_accuracy_before", "eval_loss_before"):   # the true baseline, measured before step 1, not at the resume
        assert s[k] == first[k], (k, s[k], first[k])
    assert s["eval_loss_after"] == first["eval_loss_after"]   # and the same run: bitwise the same weights at the end


# ---- precision (tunebook.precision): the step's forward and loss under the policy's autocast, master weights as it says

def test_bf16_mixed_autocasts_the_step_with_fp32_master_weights(tok, tmp_path):
    fp32 = _trainer(tok, tmp_path / "a", method="full").setup()
    mixed = _trainer(tok, tmp_path / "b", method="full", dtype="bf16-mixed").setup()
    seen = []
    hook = mixed.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    la, lb = fp32.train_step()["loss"], mixed.train_step()["loss"]
    hook.remove()
    assert seen == [torch.bfloat16]                              # the matmuls ran in bf16 ...
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())   # ... on fp32 master weights
    assert la != lb and abs(la - lb) / la < 1e-2, (la, lb)       # the same loss to bf16's precision, not bitwise
    s = mixed.evaluate()
    assert abs(s["eval_loss"] - fp32.evaluate()["eval_loss"]) / s["eval_loss"] < 2e-2


def test_bf16_loads_bf16_weights(tok, tmp_path):
    from tunebook.checkpoint import save_hf
    torch.manual_seed(0)
    save_hf(build_model(pico(vocab_size=tok.vocab_size, dim=32, hidden_dim=64)), tmp_path / "m"); tok.save(tmp_path / "m")
    cfg = TrainConfig(model=str(tmp_path / "m"), task="reverse", n_train=16, eval_samples=2, batch_size=8, max_steps=1,
                      dtype="bf16", output_dir=str(tmp_path / "run"))
    t = Trainer(cfg)
    s = t.fit(progress=False)
    assert t.model.embed_tokens.weight.dtype == torch.bfloat16 and s["precision"] == "bf16"
    assert "precision bf16" in (tmp_path / "run" / "log.txt").read_text()


@pytest.mark.slow
def test_compile_runs_the_blocks_compiled_with_the_same_loss(tok, tmp_path):
    """compile=True (tunebook.compile, regional): the blocks run compiled and the step's loss is eager's."""
    if "compile" not in TrainConfig.__dataclass_fields__: pytest.fail("TrainConfig has no compile field yet (tunebook.config)")
    from tunebook.compile import is_compiled
    eager = _trainer(tok, tmp_path / "a", method="lora").setup()
    comp = _trainer(tok, tmp_path / "b", method="lora", compile=True).setup()
    assert all(is_compiled(b) for b in comp.model.layers) and not any(is_compiled(b) for b in eager.model.layers)
    la, lb = eager.train_step()["loss"], comp.train_step()["loss"]
    assert abs(la - lb) < 1e-4, (la, lb)


def test_padding_and_trained_shares_are_reported(tok, tmp_path):
    """summary.json says what share of the computed positions was padding and what share was trained: packed rows for one
    epoch pad exactly what the packer left empty (PackedDataset.fill); one row per batch pads nothing."""
    a = _trainer(tok, tmp_path / "packed", packing=True, max_seq_len=64, epochs=1, batch_size=4,
                 max_steps=TrainConfig.max_steps).setup()   # the default: the epoch decides the steps
    s = a.fit(progress=False)
    rows = a.rows
    positions = len(rows) * rows.max_seq_len
    assert s["padding_share"] == pytest.approx(1 - rows.fill, abs=1e-12)
    trained = sum(sum(l != -100 for l in r["labels"]) for r in rows.rows)
    assert s["trained_share"] == pytest.approx(trained / positions, abs=1e-12)
    assert 0 < s["padding_share"] < 0.5
    b = _trainer(tok, tmp_path / "single", batch_size=1, max_steps=4).setup()
    s = b.fit(progress=False)
    assert s["padding_share"] == 0.0 and 0 < s["trained_share"] < 1
    c = _trainer(tok, tmp_path / "padding-free", padding_free=True, max_steps=4).setup()   # 8 rows a step, end to end
    s = c.fit(progress=False)
    assert s["padding_share"] == 0.0 and 0 < s["trained_share"] < 1


def _big_vocab_trainer(tok, out, vocab=40_000, **kw):
    "A run whose model has a real model's vocabulary (ids past the tokenizer's are never seen, only scored)."
    torch.manual_seed(0)
    model = build_model(pico(vocab_size=vocab, dim=32, hidden_dim=64))
    cfg = TrainConfig(model="given", task="reverse", n_train=64, eval_samples=0, batch_size=8, max_steps=2, dtype="fp32",
                      output_dir=str(out), **kw)
    return Trainer(cfg, model=model, tokenizer=tok)


def test_chunked_ce_left_unset_slices_a_large_vocabulary_only(tok, tmp_path):
    """chunked_ce left unset: 8 vocabulary slices for a vocabulary of 32,768 or more (the loss the same as full logits, in
    fp32 to 1e-5), full logits for a small one or where the sliced loss cannot hold the output projection; the log says which."""
    from tunebook.loss import ChunkedCrossEntropy
    auto = _big_vocab_trainer(tok, tmp_path / "auto").setup()
    assert auto.config.chunked_ce == 8 and isinstance(auto.loss_fn, ChunkedCrossEntropy)
    assert auto.choices["loss_report"].startswith("by 8 vocabulary slices (chunked_ce left unset: full fp32 logits of the 40,000-token")
    full = _big_vocab_trainer(tok, tmp_path / "full", chunked_ce=0).setup()
    assert full.loss_fn is None and "loss_report" not in full.choices   # a value given is kept, and not reported as chosen
    a, b = auto.train_step()["loss"], full.train_step()["loss"]
    assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    small = _trainer(tok, tmp_path / "small").setup()   # 300 tokens
    assert small.config.chunked_ce == 0 and small.loss_fn is None and "300-token vocabulary" in small.choices["loss_report"]
    head = _big_vocab_trainer(tok, tmp_path / "head", lora_targets=("q_proj", "lm_head")).setup()
    assert head.config.chunked_ce == 0 and "lm_head carries a LoRA adapter" in head.choices["loss_report"]
    auto.claim_output()
    assert "loss: by 8 vocabulary slices" in (tmp_path / "auto" / "log.txt").read_text()


def _ragged_file(path, n=48, seed=0):
    "Rows of a few to about a hundred characters: padded batches would be mostly padding."
    import random
    rnd = random.Random(seed)
    words = ["abc", "hello", "tune", "book", "loop", "step", "model", "data"]
    rows = [{"prompt": "reverse " + " ".join(rnd.choice(words) for _ in range(rnd.choice([1, 1, 1, 2, 12, 24]))), "response": "x"}
            for _ in range(n)]
    for r in rows: r["response"] = r["prompt"][8:][::-1]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_padding_free_left_unset_lays_a_ragged_files_batches_end_to_end(tok, tmp_path):
    """padding_free left unset: a file whose padded batches would be mostly padding gets padding-free batches: each step
    holds the same batch_size rows a padded batch would (the steps an epoch unchanged), laid end to end in one sequence
    with no padding, every labelled token of the file trained once an epoch, each row's loss what it is alone; the
    choice is in the log and config.yaml (a resume finds it); a file of even rows, a synthetic task and a value given are
    left as they are."""
    import math
    import torch.nn.functional as F
    f = _ragged_file(tmp_path / "ragged.jsonl")
    t = _trainer(tok, tmp_path / "auto", data=str(f), eval_fraction=0.1, max_seq_len=256, batch_size=8, epochs=1,
                 max_steps=TrainConfig.max_steps).setup()
    assert (t.config.padding_free, t.config.packing, t.config.batch_size) == (True, False, 8), t.choices.get("padding_free_report")
    assert t.choices["padding_free_report"].startswith(f"on (left unset: {len(t.rows)} rows of ")
    assert t.n_batches == math.ceil(len(t.rows) / 8)   # as many steps as padded batches
    labelled, trained = sum(sum(l != -100 for l in r["labels"]) for r in t.rows), 0
    for g in range(t.n_batches):
        rows, b = t.objective.rows_of(t, g), t.micro_batch(g)
        assert b["tokens"].shape == (1, sum(len(r["tokens"]) for r in rows)) and (b["doc_ids"] >= 0).all()   # no padding
        assert b["doc_ids"].max() == len(rows) - 1 and "attn_mask" not in b
        trained += int((b["labels"] != -100).sum())
    assert trained == labelled   # one epoch: each row's labelled tokens exactly once
    # the reference: each row of the first batch alone through the model, F.cross_entropy summed
    rows, b = t.objective.rows_of(t, 0), t.micro_batch(0)
    with torch.no_grad():
        ref = sum(F.cross_entropy(t.model(torch.tensor([r["tokens"]]))[0], torch.tensor(r["labels"]), reduction="sum") for r in rows)
        got = F.cross_entropy(t.model(b["tokens"], positions=b["positions"], doc_ids=b["doc_ids"])[0], b["labels"][0], reduction="sum")
    assert abs(float(got) - float(ref)) <= 1e-5 * float(ref), (float(got), float(ref))
    t.claim_output()
    assert "padding_free: on (left unset" in (tmp_path / "auto" / "log.txt").read_text()
    again = _trainer(tok, tmp_path / "auto", data=str(f), eval_fraction=0.1, max_seq_len=256, batch_size=8, epochs=1,
                     max_steps=TrainConfig.max_steps).setup()
    assert again.config.padding_free is True   # the same choice every time: a resume finds it
    for kw in (dict(padding_free=False), dict(packing=False)):
        given = _trainer(tok, tmp_path / "given", data=str(f), eval_fraction=0.1, max_seq_len=256, **kw).setup()
        assert given.config.padding_free is False and "padding_free_report" not in given.choices and "attn_mask" in given.micro_batch(0)
    even = tmp_path / "even.jsonl"
    even.write_text("".join(json.dumps({"prompt": f"reverse {w}", "response": w[::-1]}) + "\n" for w in ["abcd", "hell", "tune", "book"] * 10))
    e = _trainer(tok, tmp_path / "even", data=str(even), eval_fraction=0.1, max_seq_len=40).setup()
    assert e.config.padding_free is False and e.choices["padding_free_report"].startswith("off (left unset: 36 rows of ")
    s = _trainer(tok, tmp_path / "task").setup()
    assert s.config.padding_free is False and "padding_free_report" not in s.choices
    with pytest.raises(ValueError, match="choose one"):
        TrainConfig(packing=True, padding_free=True).validate()
