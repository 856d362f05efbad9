"""Fuzz of the command line: every flag of every subcommand, given a wrong value, ends in one `error:` line on stderr
and a non-zero exit before any work, never a traceback and never a silent success.

The cases are generated from the parsers themselves (`tunebook.cli.build_parser()` and the own parsers of the
pass-through subcommands), so a new flag is fuzzed without touching this file: for an int flag text, a fraction, an
empty value, 0 and -1; for a float flag also nan and inf; for a flag with choices a value outside them; for a boolean
switch a value it does not take. 0 and -1 may be accepted only where the flag's help says what they mean (ACCEPTED).
Hand-written cases below add what a type cannot say: a device this machine lacks, files that do not exist.
Everything runs in-process through `cli.main`: the work a command would start (training, loading a model) is replaced
by a sentinel, so an accepted value is seen as reaching it."""
import argparse
import math

import pytest

from tunebook import cli
from tunebook.chat import chat_parser, generate_parser
from tunebook.core import EMBEDDED_DIR
from tunebook.lmeval import eval_parser
from tunebook.export import export_parser
from tunebook.push import push_parser

PARSERS = {name: p for name, p in cli.build_parser().subcommands.items() if name not in cli.PASSTHROUGH}
PARSERS.update(generate=generate_parser(), chat=chat_parser(), eval=eval_parser(), push=push_parser(), export=export_parser())
REQUIRED = {"generate": [str(EMBEDDED_DIR), "--prompt", "hi"], "chat": [str(EMBEDDED_DIR)],
            "eval": [str(EMBEDDED_DIR), "--tasks", "hellaswag"], "push": ["/nonexistent/run", "me/model"],
            "export": [str(EMBEDDED_DIR), "--to", "gguf"],
            "distill": ["--method", "lora"], "estimate": ["--method", "lora"]}   # positionals and required flags; distill and estimate
# default to full fine-tuning, where the LoRA flags are unused (and unchecked)

# (command or "*", dest) -> the values 0 / -1 a flag takes, each meaning what its help says; an empty value is
# taken where the default is None (it means: leave the option unset)
ACCEPTED = {
    ("*", "seed"): {"0"}, ("*", "eval_every"): {"0"}, ("*", "save_every"): {"0"}, ("*", "eval_samples"): {"0"},
    ("*", "chunked_ce"): {"0"}, ("*", "warmup_steps"): {"0"}, ("*", "weight_decay"): {"0"}, ("*", "min_lr_ratio"): {"0"},
    ("*", "eval_fraction"): {"0"}, ("*", "max_grad_norm"): {"0", ""}, ("*", "lora_dropout"): {"0"}, ("*", "temperature"): {"0"},
    ("*", "num_fewshot"): {"0"}, ("*", "label_smoothing"): {"0"}, ("*", "ce_weight"): {"0"}, ("grpo", "beta"): {"0"},
    ("*", "max_staleness"): {"0"},
}


class Reached(Exception):
    "The command got past every check to its work."


@pytest.fixture
def no_work(monkeypatch):
    "Replace the work of every command by raising Reached."
    def reached(*a, **k): raise Reached()
    import tunebook.chat, tunebook.lmeval, tunebook.memory, tunebook.live, tunebook.push, tunebook.export
    monkeypatch.setattr(cli, "_launch_torchrun", reached)   # training commands: right after their options are validated
    monkeypatch.setattr(tunebook.chat, "load_for_chat", reached)
    monkeypatch.setattr(tunebook.lmeval, "TunebookLM", reached)
    monkeypatch.setattr(tunebook.memory, "estimate", reached)
    monkeypatch.setattr(tunebook.live, "compare_techniques", reached)
    monkeypatch.setattr(tunebook.push, "push_plan", reached)
    monkeypatch.setattr(tunebook.export, "convert", reached)        # export: after its checks, where llama.cpp's converter starts
    monkeypatch.setattr(tunebook.export, "write_merged", reached)


def _kind(a: argparse.Action) -> str | None:
    "int, float, choice, switch or str: what an action's values are."
    if a.nargs == 0: return "switch"
    if a.choices or (a.metavar or "").startswith("{"): return "choice"
    name = getattr(a.type, "__name__", "")
    return name if name in ("int", "float") else "str"


def _cases():
    for cmd, p in PARSERS.items():
        for a in p._actions:
            if not a.option_strings or a.dest in ("help", "config") or a.help == argparse.SUPPRESS: continue
            flag, kind = a.option_strings[-1], _kind(a)
            if kind == "switch":
                if flag.startswith("--") and not isinstance(a, argparse._HelpAction): yield cmd, a.dest, [f"{flag}=maybe"], "refuse"
                continue
            bad = {"int": ["abc", "1.5", "0", "-1", ""], "float": ["abc", "nan", "inf", "-inf", "0", "-1", ""],
                   "choice": ["no-such-choice", ""], "str": []}[kind]
            for v in bad:
                ok = v in ACCEPTED.get((cmd, a.dest), ACCEPTED.get(("*", a.dest), set())) or (v == "" and a.default is None)
                yield cmd, a.dest, [flag, v], ("accept" if ok else "refuse")


CASES = list(_cases())

# hand-written: what the flag's type cannot tell
HAND = [
    ("finetune", ["--device", "cuda"]), ("dpo", ["--device", "cuda:0"]), ("grpo", ["--device", "cuda"]),
    ("generate", ["--device", "cuda"]), ("chat", ["--device", "cuda"]), ("eval", ["--device", "cuda"]),
    ("finetune", ["--device", "tpu"]), ("generate", ["--dtype", "fp12"]), ("eval", ["--dtype", "fp12"]),
    ("finetune", ["--dtype", "fp12"]), ("finetune", ["--method", "prefix"]), ("finetune", ["--schedule", "wavy"]),
    ("finetune", ["--logger", "neptune"]), ("finetune", ["--format", "yaml"]), ("finetune", ["--train-on", "first"]),
    ("finetune", ["--lora-targets", ","]), ("finetune", ["--eval-fraction", "1"]), ("finetune", ["--min-lr-ratio", "2"]),
    ("finetune", ["--lora-dropout", "1"]), ("finetune", ["--seed", "-5"]), ("dpo", ["--seed", "-1"]),
    ("finetune", ["--nproc", "3", "--batch-size", "4"]), ("finetune", ["--max-steps", "10", "--warmup-steps", "-2"]),
    ("finetune", ["--config", "/nonexistent/x.yaml"]), ("finetune", ["--eval-tasks", "no_such_task_xyz"]),
    ("finetune", ["--eval-limit", "0"]), ("finetune", ["--eval-limit", "nan"]), ("finetune", ["--eval-limit", "-3"]),
    ("finetune", ["--eval-include-path", "/nonexistent"]),
    ("generate", ["--prompt", ""]), ("generate", ["--max-new-tokens", "0"]), ("generate", ["--temperature", "-1"]),
    ("generate", ["--top-k", "0"]), ("generate", ["--top-p", "0"]), ("generate", ["--top-p", "1.5"]),
    ("chat", ["--system-prompt", " "]), ("eval", ["--limit", "0"]), ("eval", ["--tasks", ","]),
    ("estimate", ["--dtype", "fp16"]), ("estimate", ["--method", "prefix"]), ("compare", ["--combos", "nope"]),
    ("eval", ["--output", "/nonexistent/dir/results.json"]),                      # found before the scoring, not after
    ("compare", ["--combos", "baseline", "--json", "/nonexistent/dir/x.json"]),   # found before every combination ran
    ("grpo", ["--reward", "/nonexistent/reward.py:fn"]), ("finetune", ["--data", "/nonexistent/d.jsonl"]),
    ("push", ["--revision", ""]), ("push", ["--token", " "]),
    ("export", ["--quant", "q5_weird"]), ("export", ["--output", "/etc/hostname"]), ("export", ["--quant", "q8_0", "f16", "q8_0", "--to", "merged"]),
    ("config", ["show", "no-such-recipe"]), ("config", ["cp", "embedded-lora", "/nonexistent/dir/x.yaml"]), ("config", ["frobnicate"]),
]


def _run(cmd, argv, capsys):
    "(exit code or 'reached', stderr) of `tunebook CMD ...argv` in-process."
    try:
        rc = cli.main([cmd, *REQUIRED.get(cmd, []), *argv])
    except Reached:
        rc = "reached"
    except SystemExit as e:   # argparse: usage and one error line
        rc = e.code
    return rc, capsys.readouterr().err


def _one_error_line(err: str) -> list[str]:
    lines = [l for l in err.splitlines() if "error:" in l]
    assert "Traceback" not in err, err
    return lines


@pytest.mark.parametrize("cmd,dest,argv,want", CASES, ids=[f"{c}-{' '.join(a)}" for c, _, a, _ in CASES])
def test_generated_bad_value(cmd, dest, argv, want, no_work, capsys):
    rc, err = _run(cmd, argv, capsys)
    if want == "accept" and rc == "reached": return
    assert rc not in (0, None, "reached"), f"tunebook {cmd} {' '.join(argv)} was accepted; stderr: {err}"
    assert len(_one_error_line(err)) == 1, err


@pytest.mark.parametrize("cmd,argv", HAND, ids=[f"{c}-{' '.join(a)}" for c, a in HAND])
def test_hand_written_bad_value(cmd, argv, no_work, capsys):
    rc, err = _run(cmd, argv, capsys)
    assert rc not in (0, None, "reached"), f"tunebook {cmd} {' '.join(argv)} was accepted; stderr: {err}"
    assert len(_one_error_line(err)) == 1, err


def test_every_subcommand_is_fuzzed():
    "A new subcommand must be added to PARSERS (its parser) or to the hand-written cases."
    top = set(cli.build_parser().subcommands)
    assert top - {"config"} <= set(PARSERS), top - set(PARSERS)
    assert {c for c, *_ in CASES} == set(PARSERS)
