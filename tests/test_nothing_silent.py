"""Nothing silent: a user's mistake ends in one line naming the problem and its fix, before any work is lost; never a
traceback, never a quiet wrong result. One test (or a few) per mistake."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tunebook import cli
from tunebook.checkpoint import save_hf
from tunebook.config import TrainConfig
from tunebook.config.commands import CompareConfig, EstimateConfig
from tunebook.data import make_task
from tunebook.model import build_model, pico
from tunebook.objectives import OBJECTIVES
from tunebook.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    texts = [f"{r['prompt']} {r['answer']}" for t in ("reverse", "copy", "add") for r in make_task(t, 150, seed=0)]
    return train_tokenizer(texts, vocab_size=300)


def tiny(folder, tok, dim=32, vocab=None, nan=False, **kw):
    "A tiny random model with `tok`'s vocabulary (or `vocab`), saved as a Hugging Face folder."
    torch.manual_seed(0)
    m = build_model(pico(vocab_size=vocab or tok.vocab_size, dim=dim, hidden_dim=2 * dim, n_heads=4, n_kv_heads=2, **kw))
    if nan:
        with torch.no_grad(): m.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    save_hf(m, folder)
    tok.save(folder)
    return m


def errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [l for l in err.splitlines() if "error:" in l]


# ---------------------------------------------------------------- 1. Python API: wrong types
@pytest.mark.parametrize("kw,want", [
    (dict(max_steps="10"), "option max_steps: expected an int, got str '10': write max_steps=10"),
    (dict(lr="1e-4"), "option lr: expected a float or None, got str '1e-4': write lr=0.0001"),
    (dict(batch_size=2.5), "option batch_size: expected an int or None, got float 2.5: give a whole number (batch_size=2 or 3)"),
    (dict(max_steps=None), "option max_steps: expected an int, got None: give one like the default, max_steps=300"),
    (dict(lr={"a": 1}), "option lr: expected a float or None, got dict {'a': 1}"),
    (dict(packing="yes"), "option packing: expected a bool or None, got str 'yes': write packing=True"),
    (dict(lora_targets=5), "option lora_targets: expected a tuple of str"),
    (dict(seed=True), "option seed: expected an int, got bool True"),
    (dict(model=3), "option model: expected a str, got int 3: write model='3'"),
])
def test_wrong_type_is_one_line_naming_the_option(kw, want):
    with pytest.raises(ValueError, match=re.escape(want)):
        TrainConfig(**kw).validate()


@pytest.mark.parametrize("cls", [*(s.config for s in OBJECTIVES.values()), EstimateConfig, CompareConfig],
                         ids=lambda c: c.__name__)
def test_every_field_of_every_config_checks_its_type(cls):
    "Each config's own fields too (DPO's beta, GRPO's group_size, distill's teacher...): a dict where a value is expected."
    for f in dataclasses.fields(cls):
        with pytest.raises(ValueError, match=re.escape(f"option {f.name}: expected ")):
            cls(**{f.name: {"oops": 1}}).validate()


def test_a_path_is_taken_wherever_a_path_string_is(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    cfg = TrainConfig(data=tmp_path / "d.jsonl", output_dir=tmp_path / "run", tokenizer=tmp_path).validate()
    assert (cfg.data, cfg.output_dir, cfg.tokenizer) == (str(tmp_path / "d.jsonl"), str(tmp_path / "run"), str(tmp_path))
    import numpy as np
    assert TrainConfig(max_steps=np.int64(3)).validate().max_steps == 3


def test_a_missing_data_file_is_refused_by_validation(tmp_path):
    "Before any run folder, lock or model: the config names the file that is not there."
    with pytest.raises(ValueError, match=re.escape(f"data='{tmp_path}/nope.jsonl' (--data): no such file or folder")):
        TrainConfig(data=str(tmp_path / "nope.jsonl")).validate()


def test_wrong_type_stops_the_trainer_before_its_folder(tmp_path):
    from tunebook.train import Trainer
    with pytest.raises(ValueError, match="option max_steps"):
        Trainer(TrainConfig(max_steps="10", output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- 3. generate on a model with NaN weights
def test_generate_refuses_nan_weights(tmp_path, tok, capsys):
    tiny(tmp_path / "m", tok, nan=True)
    rc = cli.main(["generate", str(tmp_path / "m"), "--prompt", "reverse abc="])
    err = errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert str(tmp_path / "m") in err[0] and "NaN" in err[0] and "q_proj" in err[0], err


def test_generate_caps_a_huge_max_new_tokens_at_the_context(tmp_path, tok, capsys):
    tiny(tmp_path / "m", tok, max_seq_len=64)
    rc = cli.main(["generate", str(tmp_path / "m"), "--prompt", "reverse abc=", "--max-new-tokens", "1000000"])
    err = capsys.readouterr().err
    assert rc == 0 and "capped at" in err and "context is 64" in err, err


# ---------------------------------------------------------------- 4. a saved DatasetDict without a train split
def test_datasetdict_without_train_names_its_splits_and_the_flag(tmp_path, capsys):
    import datasets
    rows = [dict(prompt=f"reverse {w}=", response=w[::-1]) for w in ("abc", "hello", "xyz", "tune", "book") * 8]
    datasets.DatasetDict(validation=datasets.Dataset.from_list(rows), test=datasets.Dataset.from_list(rows[:10])).save_to_disk(tmp_path / "dd")
    common = ["--max-steps", "1", "--eval-samples", "0", "--quiet", "--batch-size", "4"]
    rc = cli.main(["finetune", "--data", str(tmp_path / "dd"), "--output-dir", str(tmp_path / "run"), *common])
    err = errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert "no split 'train'" in err[0] and "'validation', 'test'" in err[0] and "--data-split" in err[0], err
    assert cli.main(["finetune", "--data", str(tmp_path / "dd"), "--data-split", "test", "--output-dir", str(tmp_path / "run2"), *common]) == 0
    assert json.loads((tmp_path / "run2" / "config.json").read_text())["data_split"] == "test"
    datasets.DatasetDict(dev=datasets.Dataset.from_list(rows)).save_to_disk(tmp_path / "one")   # the only split: read without asking
    assert cli.main(["finetune", "--data", str(tmp_path / "one"), "--output-dir", str(tmp_path / "run3"), *common]) == 0
    capsys.readouterr()
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))   # a file has one split: a name for another is refused
    rc = cli.main(["finetune", "--data", str(tmp_path / "d.jsonl"), "--data-split", "test", "--output-dir", str(tmp_path / "run4"), *common])
    err = errors(capsys)
    assert rc == 2 and len(err) == 1 and "one split, 'train'" in err[0], err


# ---------------------------------------------------------------- 5. distill: teacher and student of other vocabularies
@pytest.mark.parametrize("other", ["smaller", "same-size"])
def test_distill_refuses_a_teacher_of_another_vocabulary(tmp_path, tok, other, capsys):
    tiny(tmp_path / "teacher", tok)
    texts = [f"{r['prompt']} {r['answer']}" for r in make_task("add" if other == "same-size" else "reverse", 150, seed=1)]
    other_tok = train_tokenizer(texts, vocab_size=tok.vocab_size if other == "same-size" else 200)
    tiny(tmp_path / "student", other_tok, dim=16)
    assert (len(other_tok) == len(tok)) == (other == "same-size")
    rc = cli.main(["distill", "--teacher", str(tmp_path / "teacher"), "--model", str(tmp_path / "student"), "--task", "reverse",
                   "--n-train", "16", "--max-steps", "1", "--eval-samples", "0", "--batch-size", "4", "--quiet",
                   "--output-dir", str(tmp_path / "run")])
    err = errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert "do not share a vocabulary" in err[0] and "--teacher" in err[0], err


# ---------------------------------------------------------------- 6. lm_eval offline, a task's data not cached
def _offline(tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home"),
           "OMP_NUM_THREADS": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    return env


def test_eval_offline_names_the_missing_task_data_and_how_to_get_it(tmp_path):
    from tunebook.core import EMBEDDED_DIR
    r = subprocess.run([sys.executable, "-m", "tunebook.cli", "eval", str(EMBEDDED_DIR), "--tasks", "hellaswag", "--limit", "2"],
                       capture_output=True, text=True, env=_offline(tmp_path), timeout=300)
    err = [l for l in r.stderr.splitlines() if "error:" in l]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(err) == 1, r.stderr[-3000:]
    for want in ("hellaswag", "Rowan/hellaswag", "HF_DATASETS_OFFLINE", "network access", "HF_HOME"):
        assert want in err[0], err[0]


def test_finetune_eval_tasks_offline_says_the_model_is_saved(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--max-steps", "1", "--n-train", "32", "--eval-samples", "0",
                        "--batch-size", "4", "--quiet", "--output-dir", str(out), "--eval-tasks", "hellaswag", "--eval-limit", "2"],
                       capture_output=True, text=True, env=_offline(tmp_path), timeout=300)
    err = [l for l in r.stderr.splitlines() if "error:" in l]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(err) == 1, r.stderr[-3000:]
    assert "Rowan/hellaswag" in err[0] and f"the model is saved in {out}/model" in err[0] and "tunebook eval" in err[0], err[0]
    assert (out / "model" / "config.json").is_file()


# ---------------------------------------------------------------- 7. grpo: the answer column and --reward files
GRPO_FAST = ["--max-steps", "1", "--eval-samples", "2", "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "4", "--quiet"]


def _sums(path, field="answer"):
    path.write_text("\n".join(json.dumps({"prompt": f"{a}+{b}=", field: str(a + b)}) for a in range(5) for b in range(5)))
    return str(path)


def test_grpo_task_checker_reads_the_answer_field(tmp_path, capsys):
    "--task add scores a file's rows by its checker: on the column --answer-field names (it read 'answer' and stopped: KeyError)."
    data = _sums(tmp_path / "g.jsonl", "response")
    assert cli.main(["grpo", "--data", data, "--task", "add", "--answer-field", "response", "--output-dir", str(tmp_path / "run"), *GRPO_FAST]) == 0, \
        capsys.readouterr().err[-2000:]


def test_grpo_missing_answer_field_names_the_field_the_file_and_its_columns(tmp_path, capsys):
    data = _sums(tmp_path / "g.jsonl")
    rc = cli.main(["grpo", "--data", data, "--answer-field", "response", "--output-dir", str(tmp_path / "run"), *GRPO_FAST])
    err = errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert "'response'" in err[0] and data in err[0] and "'answer', 'prompt'" in err[0] and "--answer-field" in err[0], err


def test_grpo_reward_file_path_with_its_own_imports(tmp_path, capsys, monkeypatch):
    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "sn_helper.py").write_text("def same(c, r):\n    return float(c.strip() == r['answer'])\n")
    (tmp_path / "rw" / "sn_reward.py").write_text("from sn_helper import same\ndef score(completion, row):\n    return same(completion, row)\n")
    (tmp_path / "rw" / "sn_broken.py").write_text("import sn_no_such_package\ndef score(c, r):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)   # not the file's folder: the path alone must do
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = ["--output-dir", str(tmp_path / "run"), *GRPO_FAST]
    assert cli.main(["grpo", "--reward", "rw/sn_reward.py:score", *out]) == 0, capsys.readouterr().err[-2000:]
    capsys.readouterr()
    for spec, want in (("rw/sn_nofile.py:score", "no such file"), ("rw/sn_broken.py:score", "No module named 'sn_no_such_package'"),
                       ("sn_absent_module:score", "give its file's path (--reward path/to/sn_absent_module.py:score)")):
        rc = cli.main(["grpo", "--reward", spec, "--output-dir", str(tmp_path / "bad"), *GRPO_FAST])
        err = errors(capsys)
        assert rc == 2 and len(err) == 1 and want in err[0], (spec, err)
        assert "run from its folder" not in err[0]


def test_reward_keyerror_lists_the_row_fields():
    from tunebook.grpo.rollout import call_reward
    from tunebook.rundir import UserCodeError
    def reads_answer(completion, row): return float(row["answer"] == completion)
    with pytest.raises(UserCodeError, match=r"no 'answer' field; its fields are 'prompt', 'response'"):
        call_reward(reads_answer, "5", {"prompt": "2+3=", "response": "5", "messages": []})


# ---------------------------------------------------------------- 8. every row longer than the model's context
@pytest.mark.parametrize("cmd", ["finetune", "dpo", "kto"])
def test_rows_past_the_context_are_advised_truly(tmp_path, tok, cmd, capsys):
    "The advice was 'set max_seq_len=<longest>', which is refused above the model's context: now it says to shorten the rows."
    tiny(tmp_path / "m", tok, max_seq_len=64)
    long = lambda i: "reverse " + "abc " * (60 + i)   # ~120+ tokens each: past the 64-token context
    rows = {"finetune": [dict(prompt=long(i), response="cba") for i in range(12)],
            "dpo": [dict(prompt=long(i), chosen="cba", rejected="abc") for i in range(12)],
            "kto": [dict(prompt=long(i), completion="cba", label=bool(i % 2)) for i in range(12)]}[cmd]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    rc = cli.main([cmd, "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--max-steps", "1", "--eval-samples", "0",
                   "--batch-size", "2", "--quiet", "--output-dir", str(tmp_path / "run")])
    err = errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert "context of 64 tokens" in err[0] and "shorten or remove those rows" in err[0], err
    assert "--max-seq-len" not in err[0].split("longer than")[-1], err   # no advice to set a value that would be refused


def test_grpo_prompts_past_the_context_are_refused_not_trained_on(tmp_path, tok, capsys):
    "With --max-seq-len unset, GRPO sampled past the model's context without a word (and trained on it): the context bounds the prompts."
    tiny(tmp_path / "m", tok, max_seq_len=64)
    (tmp_path / "g.jsonl").write_text("\n".join(json.dumps(dict(prompt="reverse " + "abc " * (60 + i), answer="cba")) for i in range(12)))
    rc = cli.main(["grpo", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "g.jsonl"), "--output-dir", str(tmp_path / "run"),
                   *GRPO_FAST])
    err = errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert "the model's context of 64 tokens" in err[0] and "shorten the prompts" in err[0], err
