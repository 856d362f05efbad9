"""Every subcommand end to end, as a user runs it (a subprocess), checked on what it wrote, not only its exit code."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


def test_help_lists_every_option():
    from dataclasses import fields
    from tunebook.train import TrainConfig
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for f in fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in out.stdout


def _parsers():
    from tunebook.cli import PASSTHROUGH, build_parser
    return {k: v for k, v in build_parser().subcommands.items() if k not in PASSTHROUGH}


def test_every_flag_of_every_subcommand_has_help():
    """Issue 12: every subcommand's flags come from its config class, each with help text (the field's comment)."""
    import argparse, re
    subs = _parsers()
    assert set(subs) == {"finetune", "estimate", "compare", "dpo", "kto", "distill", "grpo"}
    missing = []
    for cmd, p in subs.items():
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS: continue
            text = re.sub(r"\(default: [^)]*\)", "", a.help or "").strip()
            if len(text) < 8: missing.append((cmd, a.option_strings[0], a.help))
    assert not missing, missing


def test_one_spelling_per_concept_across_subcommands():
    """The same concept is the same flag everywhere (issue 12: --seq-len/--max-seq-len, gradient_accumulation_steps...),
    with the same default where the subcommands share a part (estimate's LoRA rank is finetune's)."""
    flags = {cmd: {o for a in p._actions for o in a.option_strings} for cmd, p in _parsers().items()}
    every = set().union(*flags.values())
    for bad in ("--seq-len", "--gradient-accumulation-steps", "--prompt-column", "--response-column", "--n-eval"):
        assert bad not in every, bad
    for cmd in ("finetune", "estimate", "compare"):
        assert "--max-seq-len" in flags[cmd], cmd
    default = lambda cmd, dest: next(a.default for a in _parsers()[cmd]._actions if a.dest == dest)
    assert default("estimate", "lora_rank") == default("finetune", "lora_rank") == 16
    assert default("estimate", "lora_targets") == default("finetune", "lora_targets")


@pytest.mark.slow
def test_finetune_default_end_to_end(tmp_path):
    """The embedded default: held-out exact match up by >= 50 points (its wall time is printed, never asserted:
    it swings with the machine's load; bench/ and the README quote it)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--output-dir", str(tmp_path / "run"), "--quiet"],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "2"})
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    for name in ("config.yaml", "config.json", "metrics.csv", "loss.png", "summary.json", "model/config.json", "model/model.safetensors",
                 "model/tokenizer.json", "adapter/adapter_config.json"):
        assert (run / name).exists(), name
    s = json.loads((run / "summary.json").read_text())
    print(json.dumps(s, indent=1), f"wall {wall:.0f} s", sep="\n")
    assert s["eval_accuracy_after"] - s["eval_accuracy_before"] >= 0.5, s
    for k in ("tokens_per_second", "peak_memory_bytes"):
        assert s[k] > 0


@pytest.mark.slow
def test_qlora_finetune_still_gains(tmp_path):
    """QLoRA (NF4 base, --quantize-base) on the embedded default still shows the accuracy gain."""
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--quantize-base", "--eval-samples", "100",
                          "--output-dir", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["method"] == "qlora"
    assert s["eval_accuracy_after"] - s["eval_accuracy_before"] >= 0.5, s


def _run(*argv, cwd=None):
    r = subprocess.run([sys.executable, "-m", "tunebook.cli", *argv], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_estimate_end_to_end():
    """The fake-tensor estimate of a step equals the same step run for real (--measure), and counts the bf16
    parameters at 2 bytes each."""
    out = json.loads(_run("estimate", "--model", "embedded", "--batch-size", "2", "--max-seq-len", "64", "--measure", "--json").stdout)
    assert out["peak_bytes"] > 0 and abs(out["error"]) <= 0.01, out
    assert out["categories"]["parameters"] == 2 * out["settings"]["params"]
    assert out["categories"]["optimizer"] >= 2 * 2 * out["settings"]["trainable_params"]   # AdamW: two moments, bf16 like the weights


def test_compare_end_to_end(tmp_path):
    """Two combinations, each trained for real: a row each with finite numbers and no error; checkpointing
    lowers the peak at this size (the activations of 2 blocks are recomputed, not kept)."""
    _run("compare", "--model", "embedded", "--combos", "baseline,checkpointing", "--steps", "2", "--batch-size", "4",
         "--max-seq-len", "256", "--output-dir", str(tmp_path / "cmp"), "--json", str(tmp_path / "c.json"))
    rows = {r["combination"]: r for r in json.loads((tmp_path / "c.json").read_text())}
    assert set(rows) == {"baseline", "checkpointing"}
    for r in rows.values():
        assert not r.get("error") and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 and 0 < r["final_loss"] < 20, r
    assert rows["checkpointing"]["peak_bytes"] < rows["baseline"]["peak_bytes"], rows


def _summary(r, out):
    s = json.loads(r.stdout[r.stdout.index("{"):])
    assert s == json.loads((out / "summary.json").read_text())
    return s


def test_dpo_end_to_end(tmp_path):
    out = tmp_path / "dpo"
    r = _run("dpo", "--quiet", "--max-steps", "4", "--n-pairs", "64", "--n-eval-pairs", "16", "--eval-samples", "4",
             "--batch-size", "8", "--output-dir", str(out))
    s = _summary(r, out)
    assert s["steps"] == 4 and s["status"] == "ok" and s["mean_margin_before"] == 0.0 and s["mean_margin_after"] != 0.0, s
    _merged_is_base_plus_adapter(out)


def _merged_is_base_plus_adapter(out):
    from tunebook.checkpoint import load_hf
    from tunebook.lora import load_adapter
    from tunebook.embedded import EMBEDDED_DIR
    merged, base = load_hf(out / "model"), load_hf(EMBEDDED_DIR)
    load_adapter(base, out / "adapter")
    x = torch.randint(0, merged.config.vocab_size, (1, 9))
    with torch.no_grad():
        assert (merged(x) - base(x)).abs().max() < 1e-4   # model/ is the base with adapter/ merged in


def test_kto_end_to_end(tmp_path):
    """KTO on unpaired answers: the held-out pairs' margin moves off 0 (the policy starts as its reference), the logged
    rows are KTO's, and model/ is the base with adapter/ merged in."""
    out = tmp_path / "kto"
    r = _run("kto", "--quiet", "--max-steps", "4", "--n-examples", "64", "--n-eval-pairs", "16", "--eval-samples", "4",
             "--batch-size", "8", "--output-dir", str(out))
    s = _summary(r, out)
    assert s["steps"] == 4 and s["status"] == "ok" and s["lead_metric"] == "preference_accuracy", s
    assert s["mean_margin_before"] == 0.0 and s["mean_margin_after"] != 0.0 and s["beta"] == 0.1, s
    import pandas as pd
    m = pd.read_csv(out / "metrics.csv")
    assert m["step"].tolist() == [1, 2, 3, 4] and m["reward_accuracy"].between(0, 1).all(), m.columns.tolist()
    _merged_is_base_plus_adapter(out)


def test_distill_end_to_end(tmp_path):
    out = tmp_path / "distill"
    r = _run("distill", "--quiet", "--max-steps", "8", "--n-train", "128", "--eval-samples", "4", "--batch-size", "16",
             "--max-seq-len", "48", "--output-dir", str(out))
    s = _summary(r, out)
    assert s["student_params"] < s["teacher_params"] and s["steps"] == 8
    assert s["held_out_kl_after"] < s["held_out_kl_before"], s
    from tunebook.checkpoint import load_hf
    assert sum(p.numel() for p in load_hf(out / "model").parameters()) == s["student_params"]


def test_grpo_end_to_end(tmp_path):
    out = tmp_path / "grpo"
    r = _run("grpo", "--quiet", "--max-steps", "2", "--n-train", "16", "--eval-samples", "4", "--group-size", "4",
             "--prompts-per-step", "2", "--save-every", "1", "--output-dir", str(out))
    s = _summary(r, out)
    assert s["steps"] == 2 and s["samples"] == 2 * 2 * 4 and 0 <= s["eval_reward_after"] <= 1, s
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    import pandas as pd
    m = pd.read_csv(out / "metrics.csv")
    assert m["step"].tolist() == [1, 2] and m["reward"].between(0, 1).all() and (m["grad_norm"] > 0).all()
    assert abs(m["reward"].mean() - s["mean_train_reward"]) < 1e-9, (m["reward"].tolist(), s)   # the summary is the rows' mean


def test_hub_name_resolves_offline_and_unknown_is_one_line(tmp_path):
    """--model ORG/NAME (and --revision) goes through tunebook.hub.resolve_model: a name in the local cache trains on
    that snapshot (the pinned revision's weights, not main's); a name that is not cached offline is one line, exit 2."""
    import shutil
    from test_hub import write_cache
    from tunebook.checkpoint import load_hf, save_hf
    from tunebook.embedded import EMBEDDED_DIR
    shutil.copytree(EMBEDDED_DIR, tmp_path / "v1")                 # tag v1: the shipped weights
    m = load_hf(EMBEDDED_DIR)                                       # main: other weights, the same tokenizer
    with torch.no_grad():
        for p in m.parameters(): p.mul_(0.5)
    save_hf(m, tmp_path / "main")
    for f in EMBEDDED_DIR.iterdir():
        if not (tmp_path / "main" / f.name).exists(): shutil.copy(f, tmp_path / "main" / f.name)
    write_cache(tmp_path / "home" / "hub", "acme/emb", {"1" * 40: tmp_path / "v1", "2" * 40: tmp_path / "main"},
                {"main": "2" * 40, "v1": "1" * 40})
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    def first_loss(*model):
        out = tmp_path / "run"
        r = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--quiet", *model, "--max-steps", "1", "--eval-samples", "0",
                            "--n-train", "16", "--batch-size", "8", "--output-dir", str(out)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads((out / "summary.json").read_text())["final_loss"]
    local = first_loss("--model", str(tmp_path / "v1"))
    assert first_loss("--model", "acme/emb", "--revision", "v1") == local      # the pinned snapshot, bit for bit
    assert first_loss("--model", "acme/emb") != local                          # main: the other weights
    r = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--model", "nobody-h8/no-such-model",
                        "--output-dir", str(tmp_path / "never")], capture_output=True, text=True, env=env)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "nobody-h8/no-such-model" in err[0] and "HF_HUB_OFFLINE" in err[0], r.stderr
    assert not (tmp_path / "never").exists()
