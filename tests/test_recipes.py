"""Recipes as files (issue 15): the recipes shipped for each model family and method resolve and validate;
`tunebook config list | show | cp`; a recipe's round trip copy -> edit -> run -> rerun from the run folder's
config.yaml with bitwise-equal losses; flags over the file; unknown keys and wrong types named with their line;
`--config` on every subcommand; `finetune --eval-tasks` scored with lm_eval into summary.json."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tunebook.objectives import commands, config_class
from tunebook.config.files import read_yaml
from tunebook.model import BUILDERS
from tunebook.recipes import RECIPES_DIR, list_recipes, load_recipe, recipe_path

FAMILIES = ("llama3.2", "qwen2.5", "qwen3", "gemma3", "mistral", "phi3", "smollm2", "smollm3")
METHODS = ("full", "lora", "qlora", "dpo", "kto", "distill", "grpo")
HUB = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def cli(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "tunebook.cli", *map(str, argv)], capture_output=True, text=True, cwd=cwd, env=ENV)


def ok(*argv, cwd=None):
    r = cli(*argv, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


# ---------------------------------------------------------------- the shipped recipes
def test_every_recipe_resolves_validates_and_names_a_model():
    rs = list_recipes()
    assert len(rs) == len(list(RECIPES_DIR.glob("*.yaml"))) >= 40
    for r in rs:
        family, method = r["name"].rsplit("-", 1)
        assert method in METHODS, r
        assert family == "embedded" or family in BUILDERS, f"{r['name']}: its family {family!r} is no tunebook builder"
        cfg = load_recipe(r["name"])                      # unknown keys, wrong types and invalid values all raise
        assert type(cfg) is config_class(r["command"]), r
        assert r["command"] == {"full": "finetune", "lora": "finetune", "qlora": "finetune"}.get(method, method), r
        if method in ("full", "lora", "qlora"): assert cfg.method == method, r
        for k in ("model", "teacher"):
            v = getattr(cfg, k, None)
            if v is not None: assert v == "embedded" or v in BUILDERS or HUB.match(v), (r["name"], k, v)
        assert cfg.output_dir == f"runs/{r['name']}", r
    have = {(r["name"].rsplit("-", 1)[0], r["name"].rsplit("-", 1)[1]) for r in rs}
    assert {m for f, m in have if f == "embedded"} == set(METHODS)   # every method runs offline on the shipped model
    for fam in FAMILIES:
        got = {m for f, m in have if f.startswith(fam)}
        assert {"lora", "qlora", "dpo"} <= got, (fam, got)
    for m in METHODS:   # every method for several real families
        assert sum(m in {mm for f, mm in have if f.startswith(fam)} for fam in FAMILIES) >= (3 if m == "kto" else 4), m


MOE = {"qwen3-30b-a3b": {"lora", "qlora"}, "gpt-oss-20b": {"lora"}, "mixtral-8x7b": {"lora", "qlora"},
       "olmoe-1b-7b": {"lora", "qlora", "full"}}   # gpt-oss: no qlora (quantize_base refuses its experts); full only where it fits
GPU_GIB = 80   # what "fits one GPU" means for the recipes: an 80 GB card


def test_moe_recipes_adapt_every_expert_and_fit_one_80gb_gpu_per_process():
    """The mixture-of-experts recipes: LoRA and QLoRA for each MoE builder, full where it fits; adapters on attention and on every
    expert (per-expert LoRA inside the grouped product, peft's target_parameters format); what the recipe names applies to a
    shrunk model of the same family (targets resolve, experts adapted, NF4 experts for QLoRA); and the rough formula's peak
    for the recipe's shape stays under 80 GiB per process (the comment states tunebook estimate's number)."""
    from tunebook.lora import apply_lora, expert_lora_modules
    from tunebook.memory.formulas import rough_estimate
    from tunebook.model import build_model, get_config
    have = {r["name"] for r in list_recipes()}
    for fam, methods in MOE.items():
        assert {m for m in METHODS if f"{fam}-{m}" in have} == methods, fam
        for m in methods:
            name = f"{fam}-{m}"
            cfg = load_recipe(name)
            text = recipe_path(name).read_text()
            assert "tunebook estimate" in text and "GiB" in text, f"{name}: state the estimated peak in the comment"
            if m != "full":
                assert "experts" in cfg.lora_targets and {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(cfg.lora_targets), name
                small = build_model(get_config(fam, vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                               hidden_dim=32, moe_hidden_dim=32, n_experts=4, experts_per_token=2))
                apply_lora(small, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets, quantize_base=m == "qlora")
                ex = expert_lora_modules(small)
                assert len(ex) == 2 and all(set(e.adapters) == {"gate_up_proj", "down_proj"} for e in ex.values()), name
                assert all(e.quantized for e in ex.values()) == (m == "qlora"), name
            per_rank = cfg.batch_size // cfg.nproc
            r = rough_estimate(get_config(fam), method=m, batch_size=per_rank, seq_len=cfg.max_seq_len, dtype=cfg.dtype,
                               lora_rank=cfg.lora_rank, chunked_ce=cfg.chunked_ce, activation_checkpointing=cfg.activation_checkpointing,
                               nproc=cfg.nproc, lora_experts=m != "full")
            assert r.peak_bytes < GPU_GIB * 2**30, (name, r.peak_bytes / 2**30)


def test_config_list_show_cp(tmp_path):
    out = ok("config", "list").stdout
    for r in list_recipes():
        assert re.search(rf"^{re.escape(r['name'])}\s+{r['command']}\s", out, re.M), r["name"]
    # show: the resolved config, every option of the command, runnable as it is
    shown = ok("config", "show", "qwen2.5-0.5b-dpo").stdout
    (tmp_path / "shown.yaml").write_text(shown)
    cls = config_class("dpo")
    assert read_yaml(tmp_path / "shown.yaml", cls, "dpo") == {k: v for k, v in load_recipe("qwen2.5-0.5b-dpo").to_dict().items()}
    assert yaml.safe_load(shown)["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and yaml.safe_load(shown)["command"] == "dpo"
    # cp: the file itself, comments and all; never over an existing file
    ok("config", "cp", "smollm2-135m-lora", tmp_path / "mine.yaml")
    assert (tmp_path / "mine.yaml").read_bytes() == recipe_path("smollm2-135m-lora").read_bytes()
    (tmp_path / "taken.yaml").write_text("keep me\n")
    r = cli("config", "cp", "smollm2-135m-lora", tmp_path / "taken.yaml")
    assert r.returncode == 2 and "exists" in r.stderr and (tmp_path / "taken.yaml").read_text() == "keep me\n"
    r = cli("config", "show", "qwen2.5-0.5b-lorra")
    assert r.returncode == 2 and "did you mean qwen2.5-0.5b-lora" in r.stderr, r.stderr


# ---------------------------------------------------------------- the round trip
SMALL = {"max_steps": "4", "batch_size": "8", "warmup_steps": "1", "log_every": "1", "lr": "0.004", "lora_rank": "8"}   # edited in the copy
APPEND = "n_train: 64\neval_samples: 4\nmax_new_tokens: 4\nseed: 3\nlora_targets: [q_proj, v_proj]\n"   # added: none of these are defaults


def _edit(path: Path):
    "Edit a copied recipe as a user would: change values in place (comments kept), add lines."
    text = path.read_text()
    for k, v in SMALL.items():
        text, n = re.subn(rf"^{k}: \S+", f"{k}: {v}", text, flags=re.M)
        if not n: text += f"{k}: {v}\n"
    path.write_text(text + APPEND)


def _losses(run: Path) -> list[str]:
    "The loss column of metrics.csv as written (text: equal strings are equal floats, bit for bit)."
    lines = (run / "metrics.csv").read_text().splitlines()
    i = lines[0].split(",").index("loss")
    return [l.split(",")[i] for l in lines[1:]]


def test_round_trip_copy_edit_run_rerun(tmp_path):
    ok("config", "cp", "embedded-lora", "my.yaml", cwd=tmp_path)
    _edit(tmp_path / "my.yaml")
    ok("finetune", "--config", "my.yaml", "--output-dir", "A", "--quiet", cwd=tmp_path)
    a = tmp_path / "A"
    saved = read_yaml(a / "config.yaml", config_class("finetune"), "finetune")   # the resolved config, readable by the loader
    assert saved["max_steps"] == 4 and saved["n_train"] == 64 and saved["output_dir"] == "A" and saved["method"] == "lora"
    assert (saved["seed"], saved["lr"], saved["lora_rank"], saved["lora_targets"]) == (3, 0.004, 8, ("q_proj", "v_proj"))
    assert json.loads((a / "summary.json").read_text())["steps"] == 4
    ok("finetune", "--config", a / "config.yaml", "--output-dir", "B", "--quiet", cwd=tmp_path)
    b = tmp_path / "B"
    assert len(_losses(a)) == 4 and _losses(b) == _losses(a)                     # bitwise, on CPU
    assert len(set(_losses(a))) > 1                                              # it trained: the losses move
    ya, yb = (yaml.safe_load((d / "config.yaml").read_text()) for d in (a, b))
    assert ya.pop("output_dir") == "A" and yb.pop("output_dir") == "B" and ya == yb


def test_flags_override_the_file(tmp_path):
    ok("config", "cp", "embedded-lora", "my.yaml", cwd=tmp_path)
    _edit(tmp_path / "my.yaml")
    ok("finetune", "--config", "my.yaml", "--max-steps", "2", "--lr", "0.001", "--no-chat-template", "--output-dir", "C", "--quiet", cwd=tmp_path)
    saved = yaml.safe_load((tmp_path / "C" / "config.yaml").read_text())
    assert (saved["max_steps"], saved["lr"], saved["chat_template"], saved["n_train"]) == (2, 0.001, False, 64)
    assert json.loads((tmp_path / "C" / "summary.json").read_text())["steps"] == 2
    import csv
    assert [float(r["lr"]) for r in csv.DictReader(open(tmp_path / "C" / "metrics.csv"))][1] == 0.001


# ---------------------------------------------------------------- errors name the key, the file and the line
def test_unknown_key_and_wrong_type_name_key_and_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("# my run\nmodel: embedded\nlora_rnk: 8\nmax_steps: 10\nlr: fast\npacking: yes please\nmax_steps: 3\n")
    r = cli("finetune", "--config", f, "--output-dir", tmp_path / "never")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert str(f) in err[0]
    assert "line 3: unknown option 'lora_rnk'" in err[0] and "did you mean lora_rank" in err[0], err[0]
    assert "line 5: lr must be a number, not 'fast'" in err[0], err[0]
    assert "line 6: packing must be true or false" in err[0], err[0]
    assert "line 7: 'max_steps' is set twice (first on line 4)" in err[0], err[0]
    assert not (tmp_path / "never").exists()
    f.write_text("model: embedded\nlora_targets: [q_proj, 3]\nmax_steps: 2.5\n")
    r = cli("finetune", "--config", f)
    assert r.returncode == 2 and "line 2: lora_targets must be a list of names" in r.stderr and "line 3: max_steps must be a whole number" in r.stderr, r.stderr
    f.write_text("model: embedded\n  lr: [1\n")
    r = cli("finetune", "--config", f)
    assert r.returncode == 2 and "line 2" in r.stderr and "not valid YAML" in r.stderr, r.stderr
    r = cli("dpo", "--config", recipe_path("embedded-lora"))   # a finetune recipe given to dpo
    assert r.returncode == 2 and "this file is for `tunebook finetune`" in r.stderr, r.stderr
    r = cli("finetune", "--config", tmp_path / "missing.yaml")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_every_config_subcommand_reads_config(tmp_path):
    """--config is on every subcommand with a config, and what the file says is what runs: estimate's file sets the
    shape the estimate reports; dpo's file sets the steps and beta of the run."""
    for cmd in commands():
        assert "--config FILE.yaml" in ok(cmd, "--help").stdout, cmd
    (tmp_path / "e.yaml").write_text("command: estimate\nmodel: embedded\nbatch_size: 3\nmax_seq_len: 48\nmethod: dora\n")
    flag = json.loads(ok("estimate", "--model", "embedded", "--batch-size", "3", "--max-seq-len", "48", "--method", "dora", "--json").stdout)
    filed = json.loads(ok("estimate", "--config", tmp_path / "e.yaml", "--json").stdout)
    assert filed["settings"]["batch_size"] == 3 and filed["peak_bytes"] == flag["peak_bytes"] > 0, filed
    (tmp_path / "d.yaml").write_text("command: dpo\nmax_steps: 2\nn_pairs: 16\nn_eval_pairs: 4\neval_samples: 2\nbatch_size: 4\n"
                                     "beta: 0.25\nmax_new_tokens: 4\n")
    ok("dpo", "--config", tmp_path / "d.yaml", "--output-dir", tmp_path / "dpo", "--quiet")
    s = json.loads((tmp_path / "dpo" / "summary.json").read_text())
    assert s["steps"] == 2 and s["beta"] == 0.25, s
    assert yaml.safe_load((tmp_path / "dpo" / "config.yaml").read_text())["n_pairs"] == 16


# ---------------------------------------------------------------- --eval-tasks
def test_finetune_eval_tasks_scores_into_summary(tmp_path):
    """lm_eval on a local task written in the test, before (the shipped model) and after (the run folder): the
    numbers in summary.json are lm_eval's own for those two models."""
    from tunebook.embedded import EMBEDDED_DIR
    from tunebook.lmeval import run_eval, write_synthetic_tasks
    from tunebook.tokenizer import load_tokenizer
    tasks = tmp_path / "tasks"
    names = write_synthetic_tasks(tasks, load_tokenizer(EMBEDDED_DIR), task="reverse", n=12, max_gen_toks=8)
    run = tmp_path / "run"
    r = ok("finetune", "--task", "reverse", "--n-train", "64", "--max-steps", "6", "--batch-size", "8", "--eval-samples", "4",
           "--eval-tasks", ",".join(names), "--eval-include-path", tasks, "--eval-limit", "6", "--output-dir", run, "--quiet")
    s = json.loads((run / "summary.json").read_text())
    assert s["lm_eval_tasks"] == ",".join(names) and "lm_eval after" in r.stdout
    for when, model in (("before", EMBEDDED_DIR), ("after", run)):
        want = run_eval(str(model), names, include_path=tasks, limit=6)["results"]
        for t in names:
            got = s[f"lm_eval_{when}"][t]
            metric = "acc,none" if t.endswith("_mc") else "exact_match,none"
            assert metric in got and got[metric] == want[t][metric], (when, t, got, want[t])
    r = cli("finetune", "--eval-tasks", "no_such_task_h2", "--eval-include-path", tasks, "--output-dir", tmp_path / "never")
    assert r.returncode == 2 and "no_such_task_h2" in r.stderr and not (tmp_path / "never").exists(), r.stderr


def test_config_cp_into_a_missing_folder_and_list_into_a_closed_pipe(tmp_path, capsys):
    """N9: `config cp` into a missing folder printed a raw errno; `config list | head` could end in a broken-pipe traceback."""
    import subprocess, sys
    from tunebook.recipes import config_main
    assert config_main(["cp", "embedded-lora", str(tmp_path / "no" / "such" / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist: create it first (mkdir -p" in err[0] and "Errno" not in err[0], err
    many = ("import tunebook.recipes as R; R.list_recipes = lambda: [dict(name=f'r{i}', command='finetune', model='m') "
            "for i in range(100000)]; raise SystemExit(R.config_main(['list']))")
    r = subprocess.run(f'{sys.executable} -c "{many}" | head -1', shell=True, capture_output=True, text=True)
    assert r.stdout.strip() and "Broken pipe" not in r.stderr and "BrokenPipe" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("text,want", [
    ("base: &b {lr: 0.001}\n<<: *b\n", "line 2: merge keys (<<) are not read"),
    ("? [a, b]\n: 1\n", "line 1: a key must be an option name, not a list"),
    ("lr: 0.001\nlora_targets: &t [q_proj, v_proj]\nmax_steps: 5\n" + "".join(
        f"x{i}: &x{i} [" + ", ".join([f"*x{i-1}" if i else "q"] * 9) + "]\n" for i in range(8)) + "eval_every: *x7\n",
     "anchors and aliases (&name, *name) are not read"),
])
def test_yaml_merge_keys_complex_keys_and_alias_bombs_are_one_line(tmp_path, capsys, text, want):
    """N10: merge keys and complex keys were tracebacks; an alias bomb as a value expanded to hundreds of millions of
    strings in the error message. Now each is a problem naming its line, found without expanding anything."""
    from tunebook.cli import main
    (tmp_path / "c.yaml").write_text(text)
    assert main(["finetune", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert want in err and len(err) < 2000 and "Traceback" not in err, err[:2000]
