"""Every flag of every subcommand's --help is honoured or refused.

For each training subcommand the test walks the flags its parser shows, and for each one sets a
non-default value the way a user would (argv -> parser -> `config_from_args`), builds the trainer on a
tiny model and checks the effect the flag claims against the same trainer without it. Flags an
objective does not use are hidden from its --help, and setting one is refused by validation, naming
the flag and the reason; config.json does not list them. A flag with no entry in the tables below
fails the test, so a new option cannot be added without saying how it is honoured."""
import argparse
import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

from tunebook.checkpoint import save_hf
from tunebook.cli import _parse, build_parser, config_from_args, main
from tunebook.data import make_task
from tunebook.model import build_model, pico
from tunebook.objectives import OBJECTIVES, commands
from tunebook.tokenizer import train_tokenizer

LM_TASKS = []   # filled by the env fixture
COMMANDS = commands()   # every objective's subcommand (the table of objectives), estimate and compare
PASSTHROUGH = ("generate", "chat", "eval", "push")   # their own parsers (tunebook.chat, tunebook.lmeval, tunebook.push) and tests (test_chat, test_lmeval, test_push)


def _sub(cmd):
    return build_parser()._subparsers._group_actions[0].choices[cmd]


def _flags(cmd, hidden=False):
    "dest -> action of the flags `cmd --help` shows (hidden=True: those it hides)."
    return {a.dest: a for a in _sub(cmd)._actions
            if a.option_strings and a.dest != "help" and (a.help == argparse.SUPPRESS) == hidden}


# ---------------------------------------------------------------- --help
@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_help_prints(cmd):
    """O28: `dpo --help` and `grpo --help` crashed on a '%' in a comment."""
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", cmd, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    for dest, a in _flags(cmd).items():
        assert a.option_strings[0] in out.stdout, (cmd, a.option_strings[0])


@pytest.mark.parametrize("cmd", PASSTHROUGH)
def test_passthrough_help_prints(cmd):
    """`tunebook --help` lists generate/chat/eval, and `tunebook CMD --help` is that command's own parser's."""
    top = subprocess.run([sys.executable, "-m", "tunebook.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and f"    {cmd} " in top.stdout, top.stdout
    out = subprocess.run([sys.executable, "-m", "tunebook.cli", cmd, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: tunebook {cmd}") and "--help" in out.stdout, out.stdout[:500]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("opts")
    texts = [f"{r['prompt']} {r['answer']}" for t in ("reverse", "copy", "add", "count") for r in make_task(t, 200, seed=0)]
    tok = train_tokenizer(texts, vocab_size=300)
    for name, dim, tk in (("tiny", 32, tok), ("wide", 48, tok)):
        torch.manual_seed(0)
        save_hf(build_model(pico(vocab_size=tok.vocab_size, dim=dim, hidden_dim=2 * dim, n_heads=4, n_kv_heads=2)), root / name)
        tk.save(root / name)
    small = train_tokenizer(texts, vocab_size=280); small.save(root / "tok280")
    rows = [dict(prompt=f"reverse {w}=", response=w[::-1]) for w in ("abc", "hello", "xyz", "tune", "book") * 8]
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "q.jsonl").write_text("\n".join(json.dumps(dict(question=r["prompt"], answer=r["response"])) for r in rows))
    (root / "c.jsonl").write_text("\n".join(json.dumps(dict(conv=[dict(role="user", content=r["prompt"]),
                                                               dict(role="assistant", content=r["response"])])) for r in rows))
    (root / "mt.jsonl").write_text("\n".join(json.dumps(dict(messages=[dict(role="user", content=r["prompt"]), dict(role="assistant", content="ok"),
                                                                    dict(role="user", content="again"), dict(role="assistant", content=r["response"])]))
                                             for r in rows))   # two assistant turns: --train-on last learns fewer tokens
    pairs = [dict(prompt=r["prompt"], chosen=r["response"], rejected=r["response"][1:] or "x") for r in rows]
    (root / "p.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    (root / "pg.jsonl").write_text("\n".join(json.dumps(dict(prompt=p["prompt"], good=p["chosen"], bad=p["rejected"])) for p in pairs))
    kto = [dict(prompt=r["prompt"], completion=r["response"] if i % 2 else r["response"][1:] or "x", label=bool(i % 2)) for i, r in enumerate(rows)]
    (root / "k.jsonl").write_text("\n".join(json.dumps(k) for k in kto))
    (root / "kq.jsonl").write_text("\n".join(json.dumps(dict(question=k["prompt"], answer=k["completion"], good=k["label"])) for k in kto))
    (root / "kc.jsonl").write_text("\n".join(json.dumps(dict(conv=[dict(role="user", content=k["prompt"])], completion=k["completion"], label=k["label"])) for k in kto))
    (root / "pq.jsonl").write_text("\n".join(json.dumps(dict(question=p["prompt"], chosen=p["chosen"], rejected=p["rejected"])) for p in pairs))
    (root / "ga.jsonl").write_text("\n".join(json.dumps(dict(prompt=r["prompt"], target=r["response"])) for r in rows))
    (root / "gd.jsonl").write_text("\n".join(json.dumps(dict(prompt=r["prompt"], answer=r["response"])) for r in rows))
    import datasets   # --data-split: a saved DatasetDict per kind of row, its "few" split shorter than "train"
    for cmd, f in (("finetune", "d"), ("distill", "d"), ("dpo", "p"), ("kto", "k"), ("grpo", "gd")):
        rs = [json.loads(l) for l in (root / f"{f}.jsonl").read_text().splitlines()]
        datasets.DatasetDict(train=datasets.Dataset.from_list(rs), few=datasets.Dataset.from_list(rs[:16])).save_to_disk(root / f"dd-{cmd}")
    (root / "opts.yaml").write_text("seed: 7\nmax_steps: 99\n")
    from tunebook.lmeval import write_synthetic_tasks   # local lm_eval tasks for finetune --eval-tasks
    LM_TASKS[:] = write_synthetic_tasks(root / "lm_tasks", tok, task="reverse", n=8, max_gen_toks=4)
    (root / "reward_mod.py").write_text("def length(completion, row):\n    return float(len(completion))\n")
    sys.path.insert(0, str(root))
    return root


BASE = {
    "finetune": ["--task", "reverse", "--n-train", "32", "--eval-samples", "2", "--max-new-tokens", "4", "--batch-size", "8",
                 "--max-steps", "4", "--warmup-steps", "0", "--lora-rank", "4"],
    "dpo": ["--task", "count", "--n-pairs", "16", "--n-eval-pairs", "4", "--eval-samples", "2", "--max-new-tokens", "4",
            "--batch-size", "4", "--max-steps", "2", "--warmup-steps", "0", "--lora-rank", "4"],
    "kto": ["--task", "count", "--n-examples", "16", "--n-eval-pairs", "4", "--eval-samples", "2", "--max-new-tokens", "4",
            "--batch-size", "4", "--max-steps", "2", "--warmup-steps", "0", "--lora-rank", "4"],
    "distill": ["--task", "reverse", "--n-train", "32", "--eval-samples", "2", "--max-new-tokens", "4", "--batch-size", "8",
                "--max-steps", "2", "--warmup-steps", "0", "--max-seq-len", "48"],
    "grpo": ["--task", "add", "--n-train", "24", "--eval-samples", "2", "--max-new-tokens", "4", "--group-size", "2",
             "--prompts-per-step", "2", "--max-steps", "1", "--lora-rank", "4"],
}


def _trainer(env, cmd, *argv, out="run"):
    """The trainer `tunebook CMD BASE... ARGV` would run, set up (not trained)."""
    model_flag = ["--teacher", str(env / "tiny")] if cmd == "distill" else ["--model", str(env / "tiny")]
    args = _parse(build_parser(), [cmd, *model_flag, *BASE[cmd], "--output-dir", str(env / "out" / out), *argv])   # --config read as main does
    spec = OBJECTIVES[cmd]   # the config class and trainer the subcommand uses
    torch.manual_seed(0)
    return spec.trainer(config_from_args(args, spec.config)).setup()


# ---------------------------------------------------------------- what each flag claims
def _lr(t): return t.scheduler.get_last_lr()[0]
def _steps(t, n):
    for _ in range(n): t.scheduler.step()
    return _lr(t)
def _lora(t):
    from tunebook.lora import lora_modules
    return lora_modules(t.model)
def _delta(t):
    before = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    t.train_step()
    return max((p - before[n]).abs().max().item() for n, p in t.model.named_parameters() if p.requires_grad)
def _grpo(t): return t.objective.name == "grpo"   # GRPO keeps its eval prompts on its objective
def _rows(t): return t.train_data   # the training data as the objective read it: rows, pairs, KTO rows or prompts
def _evals(t): return t.objective.eval_prompts if _grpo(t) else t.eval_data
def _held(t):
    if _grpo(t): return _evals(t)
    if t.objective.name == "kto": return t.objective.held if t.objective.held is not None else t.objective.eval_pairs
    return t.objective.eval_pairs if t.objective.name == "dpo" else t.eval_data
def _labelled(t): return sum(sum(l != -100 for l in t.train_data[i]["labels"]) for i in range(len(t.train_data)))
def _max_len(t):
    if t.objective.name == "dpo": return max(len(p[s]["tokens"]) for p in t.train_data.pairs for s in ("chosen", "rejected"))
    return max(len(t.rows[i]["tokens"]) for i in range(len(t.rows)))
def _batch(t): return t.micro_batch(0)
def _ckpt(t): return any(getattr(b, "checkpoint_fn", None) is not None for b in t.model.modules())
def _dpo_loss(t):
    with torch.no_grad():
        for n, p in t.model.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        return t.loss_sum(t.micro_batch(0)).item()   # the loss summed over the batch's pairs
def _sliced(t):
    "(vocabulary slices one loss of the first micro-batch projects, that loss): 0 slices means full logits."
    import tunebook.distill as D, tunebook.loss as L
    calls, real = [], L._slice_logits
    def spy(*a, **k): calls.append(1); return real(*a, **k)
    L._slice_logits = D._slice_logits = spy   # the one slice helper of the sliced cross-entropy, log-probs and KL
    try:
        with torch.no_grad(): loss = t.loss_sum(t.micro_batch(0)).item()
    finally: L._slice_logits = D._slice_logits = real
    return len(calls), loss
def _chunked(t, d):
    "chunked_ce's one meaning, for every objective: its loss goes through vocabulary slices, and equals the full-logits loss."
    (n, loss), (n0, loss0) = _sliced(t), _sliced(d)
    return n > 0 == n0 and abs(loss - loss0) <= 1e-4 * max(abs(loss0), 1.0)
def _distill_loss(t):
    with torch.no_grad(): return t.loss_sum(t.micro_batch(0)).item()


def _compiled(t):
    from tunebook.compile import is_compiled
    return all(is_compiled(b) for b in t.model.layers)


def _device():
    if torch.cuda.is_available(): return ("cpu", lambda t, d: t.model.embed_tokens.weight.device.type == "cpu")
    return ("cuda:0", "CUDA is not available")   # honoured: asked for, it is checked and refused here


def _loads(t, d): return d is None and len(_rows(t)) > 0   # the default names a column the file lacks: only the flag loads it


# dest -> (value, check). value None: a switch. check: fn(trainer, default trainer) -> bool (the default trainer is None
# when it cannot be built); a string the refusal must contain; ("run", fn(summary, trainer)) for what only a run shows;
# ("spy", name, fn(recorded call)) for what reaches the function that implements it; "cli" for --quiet.
SHARED = {
    "model": lambda env: (str(env / "wide"), lambda t, d: t.model.config.dim == 48 != d.model.config.dim),
    "tokenizer": lambda env: (str(env / "tok280"), lambda t, d: len(t.tokenizer) == 280 != len(d.tokenizer)),
    "data": lambda env: (str(env / "d.jsonl"), lambda t, d: _evals(t)[0]["messages"][-1]["content"].startswith("reverse ")
                         and len(_rows(t)) != len(_rows(d))),
    "task": lambda env: ("copy", lambda t, d: _evals(t)[0]["messages"][-1]["content"].startswith("copy")),
    # a hub dataset's subset and streaming: refused without --data ORG/NAME here (tests/test_hub_data.py trains both from a hub cache)
    "data_subset": lambda env: ("main", "a subset belongs to a hub dataset; give --data ORG/NAME"),
    "data_streaming": lambda env: (None, "streaming reads a hub dataset; give --data ORG/NAME"),
    "data_split": lambda env: ("few", lambda t, d: len(_rows(t)) < len(_rows(d))),   # the folder's "few" split, not its "train"
    "n_train": lambda env: ("16", lambda t, d: len(_rows(t)) == 16 != len(_rows(d))),
    "system_prompt": lambda env: ("Be terse.", lambda t, d: _evals(t)[0]["messages"][0] == {"role": "system", "content": "Be terse."}),
    # a tracker beside metrics.csv: TensorBoard event files in the run folder, for every trainer (same callback hooks)
    "loggers": lambda env: ("tensorboard", ("run", lambda s, t: any((t.out / "tensorboard").glob("events.out.tfevents.*")))),
    # a revision with a local folder is refused (tests/test_cli.py trains a pinned hub revision from a local cache)
    "revision": lambda env: ("v1", "a revision pins a hub repo"),
    "train_on": lambda env: ("last", lambda t, d: t.train_data.stats.trained_tokens < d.train_data.stats.trained_tokens),
    # the tokenizer has a chat template: used by default; with the flag, the documented plain layout (other tokens)
    "chat_template": lambda env: ("--no", lambda t, d: t.train_data.use_chat_template is False and d.train_data.use_chat_template is True
                                  and _rows(t)[0]["tokens"] != _rows(d)[0]["tokens"]),
    "format": lambda env: ("chat", "messages"),   # an instruct file read as chat: refused, naming the missing column
    "prompt_field": lambda env: ("question", _loads),
    "response_field": lambda env: ("answer", _loads),
    "messages_field": lambda env: ("conv", _loads),
    "eval_fraction": lambda env: ("0.5", lambda t, d: len(_held(t)) > len(_held(d)) and len(_rows(t)) < len(_rows(d))),
    "method": lambda env: ("full", lambda t, d: t.n_trainable == sum(p.numel() for p in t.model.parameters()) > d.n_trainable),
    "lora_rank": lambda env: ("2", lambda t, d: {m.rank for m in _lora(t).values()} == {2} and t.n_trainable < d.n_trainable),
    "lora_alpha": lambda env: ("8", lambda t, d: {m.alpha for m in _lora(t).values()} == {8.0} != {m.alpha for m in _lora(d).values()}),
    "lora_targets": lambda env: ("q_proj", lambda t, d: 0 < len(_lora(t)) < len(_lora(d)) and all("q_proj" in n for n in _lora(t))),
    "lora_dropout": lambda env: ("0.25", lambda t, d: {m.dropout_p for m in _lora(t).values()} == {0.25}),
    "max_steps": lambda env: ("3", ("run", lambda s, t: s["steps"] == 3)),
    "batch_size": lambda env: ("2", lambda t, d: _batch(t)["tokens"].shape[0] < _batch(d)["tokens"].shape[0]),
    # the steps follow from the data (capped here by BASE's --max-steps); tests/test_epochs.py checks each row is trained once an epoch
    # evaluating at each epoch's end: refused without --epochs (BASE gives --max-steps); tests/test_epochs.py runs it
    "eval_each_epoch": lambda env: (None, "evaluates where an epoch ends: give --epochs N"),
    "epochs": lambda env: ("1", lambda t, d: t.choices["epochs_report"].startswith(f"1 epoch(s) of {len(t.rows)} rows") and "epochs_report" not in d.choices),
    "grad_accum_steps": lambda env: ("2", lambda t, d: t.train_step()["tokens"] > d.train_step()["tokens"]),
    "lr": lambda env: ("0.0123", lambda t, d: t.optimizer.param_groups[0]["initial_lr"] == 0.0123),
    "weight_decay": lambda env: ("0.3", lambda t, d: t.optimizer.param_groups[0]["weight_decay"] == 0.3 != d.optimizer.param_groups[0]["weight_decay"]),
    "warmup_steps": lambda env: ("3", lambda t, d: _lr(t) < _lr(d)),
    "schedule": lambda env: ("linear", lambda t, d: _steps(t, 1) != _steps(d, 1)),
    "min_lr_ratio": lambda env: ("0.5", lambda t, d: abs(_steps(t, t.config.max_steps) - 0.5 * t.config.lr) < 1e-12),
    "max_grad_norm": lambda env: ("1e-12", lambda t, d: _delta(t) < 0.01 * _delta(d)),   # clipped to ~0: Adam's eps dominates
    "max_seq_len": lambda env: ("30", lambda t, d: _max_len(t) <= 30 < _max_len(d)),
    "packing": lambda env: (None, lambda t, d: len(t.rows) < len(d.rows)),
    "padding_free": lambda env: (None, lambda t, d: _batch(t)["tokens"].shape[0] == 1 < _batch(d)["tokens"].shape[0] and "attn_mask" not in _batch(t)),
    "dtype": lambda env: ("bf16", lambda t, d: t.model.embed_tokens.weight.dtype == torch.bfloat16),
    "device": lambda env: _device(),
    "seed": lambda env: ("7", lambda t, d: not torch.equal(_batch(t)["tokens"], _batch(d)["tokens"])),
    "chunked_ce": lambda env: ("3", _chunked),
    "activation_checkpointing": lambda env: (None, lambda t, d: _ckpt(t) and not _ckpt(d)),
    "activation_offloading": lambda env: (None, lambda t, d: t.offload is not None and d.offload is None),
    "optimizer_in_backward": lambda env: (None, lambda t, d: not isinstance(t.optimizer, torch.optim.AdamW) and isinstance(d.optimizer, torch.optim.AdamW)),
    "profile_memory": lambda env: (None, lambda t, d: "peak_bytes" in [t.train_step() for _ in range(3)][-1]
                                   and "peak_bytes" not in [d.train_step() for _ in range(3)][-1]),
    "compile": lambda env: (None, lambda t, d: _compiled(t) and not _compiled(d)),   # every block runs compiled code
    "nproc": lambda env: ("2", "nproc=2"),   # one process here: refused, naming the launcher (tests/test_finetune_nproc runs it)
    # several machines and meshes: refused in one process, naming what is missing (tests/test_multinode.py runs them)
    "nnodes": lambda env: ("2", "needs --rdzv-endpoint HOST:PORT"),
    "rdzv_endpoint": lambda env: ("node001:29500", "set --nnodes too"),
    "rdzv_id": lambda env: ("myjob", "set --nnodes too"),
    "mesh": lambda env: ("dp_replicate=2,dp_shard=1", "has 2 ranks but the run starts 1 process(es)"),
    "eval_samples": lambda env: ("1", lambda t, d: len(_evals(t)) == 1 < len(_evals(d))),
    "eval_every": lambda env: ("1", ("run", lambda s, t: [r.get("eval_accuracy") is not None for r in t.metrics] == [True] * t.step)),
    "max_new_tokens": lambda env: ("3", ("spy", "generate", lambda k: k["max_new_tokens"] == 3)),
    "log_every": lambda env: ("1", ("run", lambda s, t: sum(re.match(r"step \d+/\d+ loss ", l) is not None for l in (t.out / "log.txt").read_text().splitlines()) == t.step)),
    "save_every": lambda env: ("1", ("run", lambda s, t: len(list((t.out / "checkpoints").glob("step_*"))) == 2)),
    "output_dir": lambda env: (str(env / "out" / "elsewhere"), ("run", lambda s, t: (env / "out" / "elsewhere" / "summary.json").exists())),
    "resume": lambda env: (None, "resume"),
    "quiet": lambda env: (None, "cli"),
    # a YAML file's options are the defaults (seed 7 here), and the flags given beside it win (BASE's --max-steps over its 99)
    "config": lambda env: (str(env / "opts.yaml"), lambda t, d: t.config.seed == 7 != d.config.seed
                           and t.config.max_steps == d.config.max_steps != 99),
}

PER_COMMAND = {
    "finetune": {
        "quantize_base": lambda env: (None, lambda t, d: t.config.method == "qlora" and d.config.method == "lora"),
        # lm-evaluation-harness after training, on task YAMLs written by the fixture: only a run of the CLI shows them
        "eval_tasks": lambda env: (",".join(LM_TASKS), ("main", lambda s: set(s["lm_eval_after"]) == set(LM_TASKS)
                                                           and set(s["lm_eval_before"]) == set(LM_TASKS))),
        "eval_include_path": lambda env: (str(env / "lm_tasks"), ("main", lambda s: set(s["lm_eval_after"]) == set(LM_TASKS))),
        "eval_limit": lambda env: ("3", ("main", lambda s: set(s["lm_eval_samples"].values()) == {3})),
    },
    "dpo": {
        "data": lambda env: (str(env / "p.jsonl"), lambda t, d: len(_rows(t)) != len(_rows(d))),
        "beta": lambda env: ("0.5", lambda t, d: abs(_dpo_loss(t) - _dpo_loss(d)) > 1e-6),
        "label_smoothing": lambda env: ("0.2", lambda t, d: abs(_dpo_loss(t) - _dpo_loss(d)) > 1e-6),
        "n_pairs": lambda env: ("8", lambda t, d: len(_rows(t)) == 8 < len(_rows(d))),
        "n_eval_pairs": lambda env: ("2", lambda t, d: len(_held(t)) == 2 < len(_held(d))),
        "chosen_field": lambda env: ("good", _loads), "rejected_field": lambda env: ("bad", _loads),
        "loss": lambda env: ("simpo", lambda t, d: abs(_dpo_loss(t) - _dpo_loss(d)) > 1e-6),
        # the tokenizer has a chat template: pairs rendered with it by default, the plain layout with the flag (other tokens)
        "chat_template": lambda env: ("--no", lambda t, d: _rows(t).use_chat_template is False and _rows(d).use_chat_template is True
                                      and not torch.equal(t.micro_batch(0)["tokens"], d.micro_batch(0)["tokens"])),
        "simpo_gamma": lambda env: ("1.0", lambda t, d: abs(_dpo_loss(t) - _dpo_loss(d)) > 1e-6),   # both with --loss simpo
    },
    "kto": {
        "data": lambda env: (str(env / "k.jsonl"), lambda t, d: len(_rows(t)) != len(_rows(d)) and t.objective.held is not None),
        "beta": lambda env: ("0.5", lambda t, d: abs(_dpo_loss(t) - _dpo_loss(d)) > 1e-6),
        "desirable_weight": lambda env: ("2", lambda t, d: abs(_dpo_loss(t) - _dpo_loss(d)) > 1e-6),
        "undesirable_weight": lambda env: ("2", lambda t, d: abs(_dpo_loss(t) - _dpo_loss(d)) > 1e-6),
        "n_examples": lambda env: ("8", lambda t, d: len(_rows(t)) == 8 < len(_rows(d))),
        "n_eval_pairs": lambda env: ("2", lambda t, d: len(_held(t)) == 2 < len(_held(d))),
        "completion_field": lambda env: ("answer", _loads), "label_field": lambda env: ("good", _loads),
        "chat_template": lambda env: ("--no", lambda t, d: _rows(t).use_chat_template is False and _rows(d).use_chat_template is True
                                      and not torch.equal(t.micro_batch(0)["tokens"], d.micro_batch(0)["tokens"])),
    },
    "distill": {
        "teacher": lambda env: (str(env / "wide"), lambda t, d: t.objective.teacher.config.dim == 48 and t.model.config.dim == 24),
        "model": lambda env: (str(env / "wide"), lambda t, d: t.model.config.dim == 48 and d.model.config.dim == 16),
        "student_layers": lambda env: ("2", lambda t, d: t.model.config.n_layers == 2 > d.model.config.n_layers),
        "student_dim": lambda env: ("24", lambda t, d: t.model.config.dim == 24 != d.model.config.dim),
        "kl_weight": lambda env: ("2", lambda t, d: abs(_distill_loss(t) - 2 * _distill_loss(d)) < 1e-4 * abs(_distill_loss(d))),
        "ce_weight": lambda env: ("1", lambda t, d: _distill_loss(t) > _distill_loss(d) + 1),
        "temperature": lambda env: ("2", lambda t, d: t.objective.kl_fn.temperature == 2.0 and abs(_distill_loss(t) - _distill_loss(d)) > 1e-6),
        "kl_chunks": lambda env: ("2", "replaced by chunked_ce"),   # refused: --chunked-ce governs the KL's vocabulary slices
        "distill_on_prompt": lambda env: ("--no", lambda t, d: _labelled(t) < _labelled(d)),
        "method": lambda env: ("lora", lambda t, d: t.n_trainable < d.n_trainable),
        "lora_rank": lambda env: ("2", lambda t, d: {m.rank for m in _lora(t).values()} == {2}),   # the default 16 is wider than the student
    },
    "grpo": {
        "n_train": lambda env: ("8", lambda t, d: len(_rows(t)) == 8 != len(_rows(d))),
        "seed": lambda env: ("7", lambda t, d: _rows(t)[0] != _rows(d)[0]),
        "max_seq_len": lambda env: ("4", "leaves no room for a prompt"),   # prompt + max_new_tokens must fit: 4 new tokens in 4 refused
        "eval_every": lambda env: ("1", ("run", lambda s, t: [r.get("eval_reward") is not None for r in t.metrics] == [True] * t.step)),
        "save_every": lambda env: ("1", ("run", lambda s, t: len(list((t.out / "checkpoints").glob("step_*"))) == 2)),
        "max_grad_norm": lambda env: ("1e-12", ("spy", "clip", lambda k: k["max_norm"] == 1e-12)),
        "group_size": lambda env: ("3", ("run", lambda s, t: s["samples"] == 3 * 2)),
        "prompts_per_step": lambda env: ("3", ("run", lambda s, t: s["samples"] == 2 * 3)),
        "temperature": lambda env: ("0.3", ("spy", "sample", lambda k: k["temperature"] == 0.3)),
        "top_k": lambda env: ("5", ("spy", "sample", lambda k: k["top_k"] == 5)),
        "max_new_tokens": lambda env: ("2", ("spy", "sample", lambda k: k["max_new_tokens"] == 2)),
        "beta": lambda env: ("0.5", ("spy", "loss", lambda k: k["beta"] == 0.5)),
        "clip_eps": lambda env: ("0.3", ("spy", "loss", lambda k: k["clip_eps"] == 0.3)),
        "clip_eps_high": lambda env: ("0.28", ("spy", "loss", lambda k: k["clip_eps_high"] == 0.28)),
        "loss_type": lambda env: ("dr_grpo", ("spy", "loss", lambda k: k["loss_type"] == "dr_grpo")),
        "offpolicy": lambda env: ("tis", ("spy", "loss", lambda k: k.get("weights") is not None)),   # tis: importance weights reach the loss
        "tis_cap": lambda env: ("0.5", "tis_cap"),   # a cap below 1 is refused (the sync run's weights are ~1, so a valid cap does not show)
        "answer_field": lambda env: ("target", _loads),
        "data": lambda env: (str(env / "gd.jsonl"), lambda t, d: _evals(t)[0]["messages"][-1]["content"].startswith("reverse ")
                             and len(_rows(t)) != len(_rows(d))),
        "chat_template": lambda env: ("--no", ("spy", "sample", lambda k: k.get("use_chat_template") is False)),
        "generator": lambda env: ("vllm", "needs the vllm package"),   # this environment has no vLLM: refused, naming the install
        "generator_dtype": lambda env: ("bf16", "use it with --generator vllm"),
        "reward": lambda env: ("reward_mod:length", lambda t, d: t.objective.reward_fn("abc", {}) == 3.0 != d.objective.reward_fn("abc", {"answer": "x"})),
        # the asynchronous engine (each of these runs with --async)
        "async_mode": lambda env: (None, ("run", lambda s, t: s["async_mode"] and len(t.workers) == 1)),
        "num_generators": lambda env: ("2", ("run", lambda s, t: len(t.workers) == 2)),
        "queue_size": lambda env: ("1", ("run", lambda s, t: t.objective.pool.queue_size == 1 and len(t.metrics) == 2)),
        "max_staleness": lambda env: ("0", ("run", lambda s, t: s["max_staleness"] == 0 and all(r["staleness"] == 0 for r in t.metrics))),
        "sync_every": lambda env: ("2", ("run", lambda s, t: t._pushes == 1)),   # 3 steps: a push at step 2 only (sync_every 1: at 1 and 2)
        "generator_threads": lambda env: ("2", ("run", lambda s, t: t.objective.pool.opts["threads"] == 2)),
        "learner_threads": lambda env: ("3", ("spy", "threads", lambda k: 3 in k["calls"])),
        "worker_timeout": lambda env: ("0.001", TimeoutError),
    },
}
ASYNC = {"async_mode", "num_generators", "queue_size", "max_staleness", "sync_every", "generator_threads", "learner_threads", "worker_timeout"}
DATA_FOR = {"answer_field": "ga.jsonl", "prompt_field": "q.jsonl", "response_field": "q.jsonl", "messages_field": "c.jsonl", "eval_fraction": "d.jsonl",
            "format": "d.jsonl", "train_on": "mt.jsonl", "chat_template": "c.jsonl", "chosen_field": "pg.jsonl", "rejected_field": "pg.jsonl"}


def _entry(cmd, dest, env):
    f = PER_COMMAND[cmd].get(dest) or SHARED.get(dest)
    return None if f is None else f(env)


def _split_argv(cmd, dest, value, env):
    "(the flag as a user types it, the other flags its check needs: given to both the trainer and the default)."
    a = _flags(cmd)[dest]
    flag = ["--no-" + a.option_strings[0][2:]] if value == "--no" else [a.option_strings[0]] if value is None else [a.option_strings[0], value]
    ctx = []
    if dest in DATA_FOR:
        ctx += ["--data", str(env / ("p.jsonl" if cmd == "dpo" and DATA_FOR[dest] == "d.jsonl" else DATA_FOR[dest]))]
        if dest == "prompt_field": ctx += ["--response-field", "answer"]
        if dest == "response_field": ctx += ["--prompt-field", "question"]
        if dest == "chosen_field": ctx += ["--rejected-field", "bad"]
        if dest == "rejected_field": ctx += ["--chosen-field", "good"]
        if dest == "eval_fraction": ctx += ["--eval-samples", "30"]
        if dest == "chat_template": ctx += ["--messages-field", "conv"]
        if dest == "train_on": ctx += ["--no-chat-template"] + (["--no-distill-on-prompt"] if cmd == "distill" else [])  # else every token
    if cmd == "distill" and (dest.startswith("lora_") or dest == "method"):   # the student is 16 wide: rank 4
        ctx += ["--method", "lora"] * (dest != "method") + ["--lora-rank", "4"] * (dest != "lora_rank")
    if dest == "schedule": ctx += ["--max-steps", "4"]
    if cmd == "dpo" and dest == "prompt_field": ctx = ["--data", str(env / "pq.jsonl")]
    if cmd == "dpo" and dest == "simpo_gamma": ctx += ["--loss", "simpo"]
    if cmd == "dpo" and dest == "chat_template": ctx = ["--data", str(env / "p.jsonl")]
    if cmd == "kto" and dest in ("prompt_field", "completion_field", "label_field"):   # kq.jsonl: question, answer, good
        ctx = ["--data", str(env / "kq.jsonl")] + [x for k, f in (("prompt_field", "question"), ("completion_field", "answer"), ("label_field", "good"))
                                                   if k != dest for x in ("--" + k.replace("_", "-"), f)]
    if cmd == "kto" and dest in ("chat_template", "eval_fraction"): ctx = ["--data", str(env / "k.jsonl")] + ["--eval-samples", "30"] * (dest == "eval_fraction")
    if dest == "packing": ctx += ["--max-seq-len", "128"]   # room for several rows per sequence
    if cmd == "grpo" and dest in DATA_FOR:   # GRPO reads prompts and the answers its reward checks
        ctx = ["--data", str(env / {"answer_field": "ga.jsonl", "prompt_field": "q.jsonl"}.get(dest, "gd.jsonl"))] + \
              ["--eval-samples", "30"] * (dest == "eval_fraction")
    if cmd == "grpo" and dest == "tis_cap": ctx += ["--offpolicy", "tis"]
    if dest in ("eval_tasks", "eval_include_path", "eval_limit"):
        ctx += {"eval_tasks": ["--eval-include-path", str(env / "lm_tasks")], "eval_include_path": ["--eval-tasks", ",".join(LM_TASKS)],
                "eval_limit": ["--eval-tasks", ",".join(LM_TASKS), "--eval-include-path", str(env / "lm_tasks")]}[dest]
        if dest != "eval_limit": ctx += ["--eval-limit", "2"]
    if dest == "optimizer_in_backward": ctx += ["--max-grad-norm", "0"]
    if dest == "min_lr_ratio": ctx += ["--schedule", "cosine"]
    if cmd == "grpo" and dest in ASYNC | {"save_every"}: ctx += ["--max-steps", "3" if dest == "sync_every" else "2"] + (["--async"] if dest in ASYNC - {"async_mode"} else [])
    if dest == "data_split": ctx = ["--data", str(env / f"dd-{cmd}")] + ["--eval-fraction", "0.25"] * (cmd == "kto")   # held-out KTO rows of both kinds
    return flag, ctx


def _cases():
    for cmd in PER_COMMAND:
        for dest in _flags(cmd):
            yield pytest.param(cmd, dest, id=f"{cmd}-{dest}")


def test_every_visible_flag_has_an_entry():
    """A new flag must say how it is honoured: the tables above (or be hidden and refused)."""
    missing = [(cmd, d) for cmd in PER_COMMAND for d in _flags(cmd) if d not in PER_COMMAND[cmd] and d not in SHARED]
    assert not missing, missing


def _spy(monkeypatch, what):
    import tunebook.grpo.objective as G   # the module that calls sample_groups / grpo_loss
    seen = {"calls": []}
    if what == "threads":
        real = torch.set_num_threads
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen["calls"].append(n), real(n))[1])
        return seen
    name, fields = {"sample": ("sample_groups", ("model", "tokenizer", "rows", "group_size", "reward_fn", "max_new_tokens",
                                                 "temperature", "top_k", "generator")),
                    "loss": ("grpo_loss", ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "mask", "clip_eps", "beta",
                                           "loss_type", "clip_eps_high", "max_new_tokens", "weights")),
                    "clip": (None, ("parameters", "max_norm")), "generate": (None, ())}[what]
    if what == "generate":
        import tunebook.train.evaluate as T   # evaluate_accuracy's module
        real = T.generate
        def gen(*a, **k): seen.update(dict(zip(("model", "prompts", "max_new_tokens"), a)), **k); return real(*a, **k)
        monkeypatch.setattr(T, "generate", gen)
        return seen
    if what == "clip":
        real = torch.nn.utils.clip_grad_norm_
        def clip(*a, **k): seen.update(dict(zip(fields, a)), **k); return real(*a, **k)
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
        return seen
    real = getattr(G, name)
    def spy(*a, **k): seen.update(dict(zip(fields, a)), **k); return real(*a, **k)
    monkeypatch.setattr(G, name, spy)
    return seen


@pytest.mark.parametrize("cmd,dest", list(_cases()))
def test_flag_is_honoured(env, cmd, dest, monkeypatch, capsys):
    value, check = _entry(cmd, dest, env)
    flag, ctx = _split_argv(cmd, dest, value, env)
    out = f"{cmd}-{dest}"
    if check == "cli":   # --quiet: the progress bar is gone from stderr
        model = ["--teacher" if cmd == "distill" else "--model", str(env / "tiny")]
        for extra, want_bar in (([], True), (flag, False)):
            assert main([cmd, *model, *BASE[cmd], "--max-steps", "1", "--output-dir", str(env / "out" / f"{out}-{want_bar}"), *extra]) == 0
            assert ("1/1" in capsys.readouterr().err) == want_bar
        return
    if dest == "resume":   # continues from the checkpoint an earlier run left
        t = _trainer(env, cmd, out=out); t.fit(progress=False)
        r = _trainer(env, cmd, *flag, "--max-steps", str(t.step + 1), out=out)
        assert r.step == t.step > 0
        return
    if check is TimeoutError:
        with pytest.raises(TimeoutError, match="no rollout from the generators"):
            _trainer(env, cmd, *flag, *ctx, out=out).fit(progress=False)
        return
    if isinstance(check, str):   # honoured by refusing a value that cannot work here, naming why
        with pytest.raises((ValueError, OSError)) as e:
            _trainer(env, cmd, *flag, *ctx, out=out)
        assert check in str(e.value), str(e.value)
        return
    if isinstance(check, tuple) and check[0] == "main":   # what only the CLI does: run it, read summary.json
        import json as _json
        model = ["--teacher" if cmd == "distill" else "--model", str(env / "tiny")]
        assert main([cmd, *model, *BASE[cmd], "--output-dir", str(env / "out" / out), *flag, *ctx]) == 0, capsys.readouterr().err[-2000:]
        s = _json.loads((env / "out" / out / "summary.json").read_text())
        assert check[1](s), s
        return
    if isinstance(check, tuple) and check[0] == "spy":
        seen = _spy(monkeypatch, check[1])
        _trainer(env, cmd, *flag, *ctx, out=out).fit(progress=False)
        assert check[2](seen), {k: v for k, v in seen.items() if isinstance(v, (int, float, str, list))}
        return
    if isinstance(check, tuple):   # ("run", fn)
        t = _trainer(env, cmd, *flag, *ctx, out=out)
        if cmd == "grpo" and dest == "sync_every":   # count the weight pushes: wrap the pool's publish once it exists
            t._pushes, start = 0, t.objective.start_pool
            def start_pool(tr):
                start(tr)
                pub = t.objective.pool.publish
                t.objective.pool.publish = lambda v: (setattr(t, "_pushes", t._pushes + 1), pub(v))[1]
            t.objective.start_pool = start_pool
        s = t.fit(progress=False)
        assert check[1](s, t), s
        return
    t = _trainer(env, cmd, *flag, *ctx, out=out)
    try: d = _trainer(env, cmd, *ctx, out=out + "-default")
    except ValueError: d = None
    assert check(t, d), (cmd, dest, value)


# ---------------------------------------------------------------- no hidden flags: a config's fields are its flags
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c in OBJECTIVES])
def test_no_flag_is_hidden(cmd):
    """An objective's subcommand shows every field of its config as a flag, and has no flag that is not one (or a CLI switch)."""
    spec = OBJECTIVES[cmd]
    fields = {f.name for f in dataclasses.fields(spec.config)}
    assert not _flags(cmd, hidden=True), _flags(cmd, hidden=True)
    cli_only = {"quiet", "config", "quantize_base", "eval_tasks", "eval_include_path", "eval_limit"}
    assert set(_flags(cmd)) - cli_only == fields, set(_flags(cmd)) ^ fields


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c in OBJECTIVES])
def test_config_json_lists_the_config(env, cmd):
    """A run's config.json records exactly the options of its config class: each one it honours, no other."""
    spec = OBJECTIVES[cmd]
    t = _trainer(env, cmd, "--max-steps", "1", out=f"{cmd}-config")
    t.fit(progress=False)
    saved = json.loads((t.out / "config.json").read_text())
    assert set(saved) == {f.name for f in dataclasses.fields(spec.config)}, set(saved) ^ {f.name for f in dataclasses.fields(spec.config)}


# ---------------------------------------------------------------- values refused before any work, naming the flag
BAD = [  # (argv, what the one-line error must contain)
    (["finetune", "--log-every", "0"], "--log-every"),                         # O12
    (["finetune", "--save-every", "-1"], "--save-every"),                      # O13
    (["finetune", "--eval-every", "-1"], "--eval-every"),                      # O14
    (["finetune", "--max-grad-norm", "-1"], "--max-grad-norm"),                # O15
    (["finetune", "--max-new-tokens", "0"], "--max-new-tokens"),               # O18
    (["finetune", "--n-train", "0"], "--n-train"),                             # O21
    (["finetune", "--device", "tpu"], "--device"),                             # O8
    (["finetune", "--dtype", "fp16", "--device", "cpu"], "bf16"),              # O5
    (["finetune", "--dtype", "fp8"], "--dtype"),
    (["finetune", "--schedule", "cosine_restarts"], "--schedule"),
    (["finetune", "--lora-dropout", "1.5"], "--lora-dropout"),
    (["finetune", "--lora-alpha", "0"], "--lora-alpha"),
    (["finetune", "--warmup-steps", "-3"], "--warmup-steps"),
    (["finetune", "--min-lr-ratio", "2"], "--min-lr-ratio"),
    (["finetune", "--eval-fraction", "1"], "--eval-fraction"),
    (["finetune", "--lora-rank", "4096"], "--lora-rank"),                      # O11: wider than the model
    (["finetune", "--max-grad-norm", "nan"], "--max-grad-norm"),               # N1: NaN passed every range check
    (["finetune", "--lora-alpha", "nan"], "--lora-alpha"),                     # N1
    (["finetune", "--lr", "inf"], "--lr"),                                     # N1
    (["dpo", "--beta", "nan"], "--beta"),                                      # N1
    (["distill", "--temperature", "nan"], "--temperature"),                    # N1
    (["grpo", "--temperature", "nan"], "--temperature"),                       # N1
    (["finetune", "--max-seq-len", "100000"], "--max-seq-len"),                # D36: beyond the model's context
    (["finetune", "--data", "{env}"], "folder"),                               # D4: a folder, not a file
    (["finetune", "--data", "{env}/nope.jsonl"], "nope.jsonl"),
    (["finetune", "--model", "{env}/nope"], "--model"),
    (["finetune", "--tokenizer", "{env}/big"], "embedding"),                   # M11: more tokens than the embedding
    (["distill", "--teacher", "/nonexistent"], "--teacher"),                  # O33
    (["distill", "--student-dim", "30"], "--student-dim"),   # 2 heads of 15: RoPE needs an even head size                   # O34
    (["distill", "--student-layers", "0"], "--student-layers"),
    (["dpo", "--beta", "0"], "--beta"),
    (["dpo", "--n-pairs", "0"], "--n-pairs"),
    (["grpo", "--reward", "nosuchmod:fn"], "--reward"),                       # O35
    (["grpo", "--reward", "os:getcwd"], "--reward"),                          # O36: wrong signature
    (["grpo", "--reward", "os"], "module:function"),
    (["grpo", "--group-size", "1"], "group_size"),
    (["estimate", "--batch-size", "0"], "--batch-size"),
    (["compare", "--combos", "baseline", "--steps", "0"], "--steps"),         # O31
    (["compare", "--combos", "baseline", "--batch-size", "-2"], "--batch-size"),  # O32
]


@pytest.mark.parametrize("argv,want", BAD, ids=[" ".join(a[:2] + a[2:3]) for a, _ in BAD])
def test_bad_value_is_one_clear_line_before_any_work(env, argv, want, capsys):
    if "{env}/big" in argv:
        big = train_tokenizer([f"{r['prompt']} {r['answer']}" for r in make_task("add", 300)] * 3, vocab_size=400)
        big.save(env / "big")
    argv = [a.replace("{env}", str(env)) for a in argv]
    cmd = argv[0]
    model = [] if cmd in ("estimate", "compare") or "--model" in argv else \
        (["--teacher", str(env / "tiny")] if cmd == "distill" and "--teacher" not in argv else
         [] if cmd == "distill" else ["--model", str(env / "tiny")])
    out = env / "out" / ("bad-" + "-".join(a.strip("-/").replace("/", "_")[:12] for a in argv))
    extra = BASE.get(cmd, []) + (["--output-dir", str(out)] if cmd not in ("estimate",) else [])
    if cmd == "estimate": extra = ["--model", "embedded"]
    if cmd == "compare": extra = ["--model", str(env / "tiny"), "--output-dir", str(out)]
    rc = main([cmd, *model, *extra, *argv[1:]])
    err = [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith("tunebook: warning")]
    assert rc == 2, err
    assert len(err) == 1 and want in err[0], err
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c in OBJECTIVES])
def test_every_float_option_must_be_finite(cmd):
    """N1: NaN or infinity in any float option of any objective's config is refused by name (a range check alone lets NaN by)."""
    spec = OBJECTIVES[cmd]
    floats = [f.name for f in dataclasses.fields(spec.config) if isinstance(getattr(spec.config(), f.name), float)
              or "float" in str(f.type)]
    assert floats, cmd
    for name in floats:
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=re.escape(f"{name}={bad!r}") + ".* must be a finite number"):
                spec.config(**{name: bad}).validate()


def test_compare_exits_nonzero_when_every_combination_fails(env, capsys, monkeypatch):
    """O32's other half: an error in every row is a failed command, and the table shows it on one line."""
    import pandas as pd
    import tunebook.live as W   # the CLI takes it from tunebook.live, so `tunebook compare` never imports ipywidgets
    monkeypatch.setattr(W, "compare_techniques", lambda base, names, steps: pd.DataFrame(
        [dict(combination=n, error="RuntimeError: boom\nsecond line") for n in names]))
    rc = main(["compare", "--model", str(env / "tiny"), "--combos", "baseline", "--steps", "1",
               "--output-dir", str(env / "out" / "cmp")])
    cap = capsys.readouterr()
    assert rc == 1 and "every combination failed" in cap.err
    assert "boom second line" in cap.out and "\\n" not in cap.out
