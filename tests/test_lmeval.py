"""lm-eval through tunebook (`TunebookLM`) against lm_eval's own transformers backend (`HFLM`) on the same checkpoint
and the same local tasks: per-request log-likelihoods within 1e-4 (fp32, batched differently), generated texts and
task scores equal."""
import json
import math

import pytest
import torch

from conftest import need   # a dev dependency: missing is a failure, never a skip
lm_eval = need("lm_eval")
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from tunebook.checkpoint import load_hf, save_hf
from tunebook.embedded import EMBEDDED_DIR
from tunebook.lmeval import TunebookLM, eval_main, run_eval, write_synthetic_tasks
from tunebook.lora import apply_lora, save_adapter
from tunebook.tokenizer import load_tokenizer

ROLLING_YAML = """task: tunebook_rolling
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{prompt}}}}{{{{answer}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    names = write_synthetic_tasks(d, load_tokenizer(EMBEDDED_DIR), task="add", n=16, max_gen_toks=8)
    (d / "tunebook_rolling.yaml").write_text(ROLLING_YAML.format(data=json.dumps(str(d / "tunebook_add.jsonl"))))
    return d, names + ["tunebook_rolling"]


def _scores(out, names):
    return {t: {k: v for k, v in out["results"][t].items() if "," in k and "stderr" not in k} for t in names}


def _answers(out, name):
    return [s["resps"] for s in sorted(out["samples"][name], key=lambda s: s["doc_id"])]


def _compare(ours, theirs, names, tol=1e-4):
    mc, gen, roll = names
    for a, b in zip(_answers(ours, mc), _answers(theirs, mc), strict=True):
        for (x,), (y,) in zip(a, b, strict=True):
            assert abs(x[0] - y[0]) <= tol and x[1] == y[1], (x, y)
    assert _answers(ours, gen) == _answers(theirs, gen)
    for (a,), (b,) in zip(_answers(ours, roll), _answers(theirs, roll), strict=True): assert abs(a[0] - b[0]) <= tol, (a, b)
    sa, sb = _scores(ours, names), _scores(theirs, names)
    for t in names:
        for k in sb[t]: assert math.isclose(sa[t][k], sb[t][k], rel_tol=1e-5), (t, k, sa[t][k], sb[t][k])


def _both(pretrained, tasks, max_length=None, adapter=None, peft=None, hf_dir=None):
    d, names = tasks
    kw = {} if max_length is None else dict(max_length=max_length)
    ours = run_eval(TunebookLM(pretrained=pretrained, adapter=adapter, batch_size=5, stop_check=3, **kw), names,
                    include_path=d, log_samples=True)
    hf = HFLM(pretrained=str(hf_dir or pretrained), peft=peft, batch_size=4, device="cpu", dtype="float32", **kw)
    # lm_eval's own index of the folder alone (its ~14,000 built-in tasks are not needed here and take ~20 s to index)
    theirs = lm_eval.simple_evaluate(model=hf, tasks=names, task_manager=TaskManager(include_path=str(d), include_defaults=False),
                                     log_samples=True)
    return ours, theirs, names


def test_task_manager_indexes_the_folder_alone_when_it_defines_every_task(tasks, tmp_path, monkeypatch):
    """Indexing lm_eval's built-in tasks takes ~20 s: a folder defining every task asked for is indexed alone, and once per
    process; a name it lacks, or a group of it (which may name built-in tasks), takes the whole index; an edit re-indexes."""
    import tunebook.lmeval as le
    d, names = tasks
    tm = le.task_manager(names, d)
    assert sorted(tm.all_tasks) == sorted(names) and le.task_manager(names[:1], d) is tm
    (tmp_path / "g.yaml").write_text("group: tunebook_group\ntask:\n  - arc_easy\n")
    asked = []
    monkeypatch.setattr(le, "_index", lambda path, defaults, yamls: asked.append(defaults) or TaskManager(include_path=path, include_defaults=False))
    le.task_manager(["tunebook_group"], tmp_path); le.task_manager(["hellaswag"], d)
    assert asked == [False, True, False, True]   # the folder first, then the whole index, for both
    monkeypatch.undo()
    (d / "tunebook_extra.yaml").write_text((d / f"{names[0]}.yaml").read_text().replace(f"task: {names[0]}", "task: tunebook_extra"))
    try: assert "tunebook_extra" in le.task_manager(["tunebook_extra"], d).all_tasks   # written after the first index
    finally: (d / "tunebook_extra.yaml").unlink()


def test_embedded_matches_hflm(tasks):
    ours, theirs, names = _both(EMBEDDED_DIR, tasks)
    _compare(ours, theirs, names)
    assert _scores(ours, names)[names[0]]["acc,none"] > 0.25    # the embedded model learned addition: above chance


@pytest.mark.slow
def test_short_context_windows_match_hflm(tasks):
    "max_length 24: contexts are truncated from the left and texts are scored in several rolling windows."
    ours, theirs, names = _both(EMBEDDED_DIR, tasks, max_length=24)
    _compare(ours, theirs, names)


@pytest.mark.slow
def test_adapter_matches_peft(tasks, tmp_path):
    "A LoRA adapter applied unmerged by tunebook against HFLM(peft=...) loading the same adapter with peft."
    torch.manual_seed(0)
    model = apply_lora(load_hf(EMBEDDED_DIR), rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.05)
    save_adapter(model, tmp_path / "adapter")
    ours, theirs, names = _both(EMBEDDED_DIR, tasks, adapter=tmp_path / "adapter", peft=str(tmp_path / "adapter"))
    _compare(ours, theirs, names)
    base, _, _ = _both(EMBEDDED_DIR, tasks)   # the adapter changes the scores: the test sees it
    assert any(abs(a[0][0][0] - b[0][0][0]) > 1e-3 for a, b in zip(_answers(ours, names[0]), _answers(base, names[0])))


@pytest.mark.slow
def test_finetuned_run_matches_hflm(tasks, tmp_path):
    "After a real fine-tune (LoRA, merged into the run's model/): tunebook reads the run folder, HFLM its model/."
    from tunebook.train import TrainConfig, Trainer
    cfg = TrainConfig(model="embedded", task="add", n_train=64, eval_samples=4, batch_size=8, max_steps=3, lr=1e-2,
                      output_dir=str(tmp_path / "run"))
    Trainer(cfg).fit(progress=False)
    ours, theirs, names = _both(tmp_path / "run", tasks, hf_dir=tmp_path / "run" / "model")
    _compare(ours, theirs, names)
    before = run_eval(TunebookLM(pretrained=EMBEDDED_DIR, batch_size=5), names[:1], include_path=tasks[0], log_samples=True)
    assert any(abs(a[0][0][0] - b[0][0][0]) > 1e-4 for a, b in zip(_answers(ours, names[0]), _answers(before, names[0])))


def test_stop_strings_match_hflm():
    "Stop strings cut the text where HFLM cuts it, in every round size."
    tok = load_tokenizer(EMBEDDED_DIR)
    ctxs = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in ("reverse hello=", "upper abc=", "12+30=", "copy banana=")]
    reqs = [Instance("generate_until", {}, (c, {"until": until, "max_gen_toks": 10}), i)
            for i, (c, until) in enumerate(zip(ctxs, (["l"], ["B", "C"], ["<|end|>"], ["an"])))]
    hf = HFLM(pretrained=str(EMBEDDED_DIR), batch_size=4, device="cpu", dtype="float32").generate_until(reqs)
    for stop_check in (1, 3, 32):
        assert TunebookLM(pretrained=EMBEDDED_DIR, batch_size=2, stop_check=stop_check).generate_until(reqs) == hf


def test_eval_main_writes_results(tasks, tmp_path, capsys):
    d, names = tasks
    save_hf(load_hf(EMBEDDED_DIR), tmp_path / "run" / "model")
    load_tokenizer(EMBEDDED_DIR).save(tmp_path / "run" / "model")
    assert eval_main([str(tmp_path / "run"), "--tasks", names[0], "--include-path", str(d), "--limit", "6"]) == 0
    res = json.loads((tmp_path / "run" / "lm_eval.json").read_text())["results"][names[0]]
    ref = TunebookLM(pretrained=EMBEDDED_DIR).loglikelihood   # the same six first documents, scored directly
    docs = [json.loads(l) for l in open(d / "tunebook_add.jsonl")][:6]
    got = ref([Instance("loglikelihood", {}, (doc["prompt"], c), 0) for doc in docs for c in doc["choices"]])
    acc = sum(max(range(4), key=lambda j: got[4 * i + j][0]) == doc["label"] for i, doc in enumerate(docs)) / 6
    assert res["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert "tunebook_add_mc" in capsys.readouterr().out
    assert eval_main([str(tmp_path / "nowhere"), "--tasks", names[0]]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert eval_main([str(tmp_path / "run"), "--tasks", "no_such_task", "--include-path", str(d)]) == 2
    assert "unknown lm_eval task" in capsys.readouterr().err


def test_eval_of_a_run_that_wrote_no_model_says_so(tmp_path):
    """N11: `eval` on a failed run's folder read the run's own config.json as a model's: "unsupported architecture [None]"."""
    import json
    from tunebook.lmeval import model_folder
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.1, "max_steps": 5}))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    with pytest.raises(FileNotFoundError, match="is a run folder without model/ .* resume this one with --resume"):
        model_folder(tmp_path)
