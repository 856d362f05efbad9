"""Model cards: the README.md every finished run folder gets, read back with huggingface_hub's own parsers (ModelCard,
metadata_load, the model-index <-> EvalResult conversions), checked against the run's summary.json and config.json, and
its usage snippets run: peft's on the run's own adapter and transformers' on its model, logits equal to tunebook's."""
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from hub_cache import lay  # noqa: E402

from tunebook.core import EMBEDDED_DIR

# the model card metadata keys the hub documents (hub-docs modelcard.md), and the relations it knows
HUB_KEYS = {"language", "license", "license_name", "license_link", "library_name", "tags", "datasets", "metrics",
            "base_model", "base_model_relation", "pipeline_tag", "model-index", "new_version", "thumbnail", "inference", "widget"}
RELATIONS = {"adapter", "merge", "quantized", "finetune"}
HUB_NAME = "acme/embedded-copy"   # the embedded model laid into a temp hub cache under this name: a run by hub name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "Four finished runs, a few steps each: SFT-LoRA, full SFT by hub name, DPO (LoRA), GRPO (LoRA)."
    from huggingface_hub import constants
    from tunebook.config import TrainConfig
    from tunebook.dpo import DPOConfig, DPOTrainer
    from tunebook.grpo import GRPOConfig, GRPOTrainer
    from tunebook.train import Trainer
    tmp = tmp_path_factory.mktemp("runs")
    old = constants.HF_HUB_CACHE
    constants.HF_HUB_CACHE = str(tmp / "hub")   # read at call time by snapshot_download: the run resolves HUB_NAME here
    try:
        lay(Path(EMBEDDED_DIR), tmp / "hub", HUB_NAME)
        small = dict(max_steps=2, eval_samples=4, batch_size=4)
        Trainer(TrainConfig(**small, n_train=64, output_dir=str(tmp / "lora"))).fit(progress=False)
        Trainer(TrainConfig(**small, n_train=64, model=HUB_NAME, method="full", output_dir=str(tmp / "full"))).fit(progress=False)
        DPOTrainer(DPOConfig(**small, n_pairs=16, n_eval_pairs=4, output_dir=str(tmp / "dpo"))).fit(progress=False)
        GRPOTrainer(GRPOConfig(task="add", max_steps=1, eval_samples=4, group_size=4, prompts_per_step=2, max_new_tokens=8,
                               output_dir=str(tmp / "grpo"))).fit(progress=False)
    finally:
        constants.HF_HUB_CACHE = old
    return {k: tmp / k for k in ("lora", "full", "dpo", "grpo")}


def _read(run):
    return (json.loads((run / "config.json").read_text()), json.loads((run / "summary.json").read_text()),
            ModelCard.load(run / "README.md"))


def _after(summary):
    return {k[:-6]: v for k, v in summary.items() if k.endswith("_after") and isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.parametrize("name, objective, method", [("lora", "sft", "lora"), ("full", "sft", "full"), ("dpo", "dpo", "lora"),
                                                     ("grpo", "grpo", "lora")])
def test_card_metadata(runs, name, objective, method):
    run = runs[name]
    config, summary, card = _read(run)
    meta = metadata_load(run / "README.md")   # the YAML header as huggingface_hub reads it
    assert set(meta) <= HUB_KEYS, set(meta) - HUB_KEYS
    assert meta == card.data.to_dict()       # ModelCardData parsed it (model-index into EvalResults) and writes it back the same
    assert summary["status"] == "ok" and summary["objective"] == objective and summary["method"] == method
    assert objective in meta["tags"] and method in meta["tags"] and "tunebook" in meta["tags"]
    assert meta["pipeline_tag"] == "text-generation"
    adapter = method != "full"
    assert meta["library_name"] == ("peft" if adapter else "transformers")
    if config["model"] == HUB_NAME:
        assert meta["base_model"] == HUB_NAME and meta["base_model_relation"] == "finetune"
    else:   # the embedded model is no hub repo: no base_model, said in words
        assert "base_model" not in meta and "base_model_relation" not in meta and "embedded model" in card.text
    assert meta.get("base_model_relation", "finetune") in RELATIONS
    # metrics: model-index holds every numeric X_after of summary.json, exactly, as huggingface_hub's EvalResults
    model_name, results = model_index_to_eval_results(meta["model-index"])
    assert model_name == run.name and eval_results_to_model_index(model_name, results) == meta["model-index"]
    assert {r.metric_type: r.metric_value for r in results} == _after(summary) and len(results) == len(_after(summary))
    assert results[0].metric_type == summary["lead_metric"]
    # the table of the body: before and after for each metric, as summary.json has them (to the 4 digits shown)
    rows = dict((m, (b, a)) for m, b, a in re.findall(r"^\| (\w+) \| ([^|]*) \| ([^|]*) \|$", card.text, re.M) if m != "metric")
    assert set(rows) == set(_after(summary))
    for m, (b, a) in rows.items():
        assert math.isclose(float(a), summary[f"{m}_after"], rel_tol=5e-4, abs_tol=1e-12)
        if f"{m}_before" in summary: assert math.isclose(float(b), summary[f"{m}_before"], rel_tol=5e-4, abs_tol=1e-12)
    # the loss plot, linked by a relative path that resolves in the run folder
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", card.text)
    assert links == ["loss.png"] and (run / links[0]).is_file()
    assert f"`{config['method']}`" in card.text and f"{summary['steps']} steps" in card.text
    assert f"tunebook export {config['output_dir']} --to gguf" in card.text


def _snippet(card) -> str:
    "The card's Python usage snippet, without its generate-and-print tail (the first three lines suffice to load)."
    code = re.search(r"```python\n(.*?)```", card.text, re.S).group(1)
    return code.split("messages =")[0]


def test_peft_snippet_loads_the_runs_adapter(runs):
    "The card's peft snippet, run as written: base + adapter in peft gives the logits of tunebook's model with the adapter."
    from tunebook.checkpoint import load_hf
    from tunebook.lora import load_adapter
    _, _, card = _read(runs["lora"])
    ns = {}
    exec(_snippet(card), ns)
    assert type(ns["model"]).__name__ == "PeftModelForCausalLM" or "Peft" in type(ns["model"]).__name__
    ours = load_hf(EMBEDDED_DIR)
    load_adapter(ours, runs["lora"] / "adapter")
    x = torch.tensor([ns["tokenizer"].encode("reverse: abcdef")])
    with torch.no_grad():
        theirs, mine = ns["model"](input_ids=x).logits, ours(x)
    assert (theirs - mine).abs().max() < 1e-5
    with torch.no_grad():   # the adapter changed something: it is not the base model
        assert (load_hf(EMBEDDED_DIR)(x) - mine).abs().max() > 1e-3


def test_transformers_snippet_loads_the_full_model(runs):
    from tunebook.checkpoint import load_hf
    _, _, card = _read(runs["full"])
    ns = {}
    exec(_snippet(card), ns)
    x = torch.tensor([ns["tokenizer"].encode("reverse: abcdef")])
    with torch.no_grad():
        assert (ns["model"](input_ids=x).logits - load_hf(runs["full"] / "model")(x)).abs().max() < 1e-5


def test_card_for_a_repo_names_the_repo(runs):
    "Rendered for a hub repo (as `tunebook push` does), the snippets load from the repo id."
    from tunebook.card import model_card
    config, summary, _ = _read(runs["lora"])
    text = str(model_card(config, summary, repo_id="me/reverse-lora"))
    assert "PeftModel.from_pretrained(base, 'me/reverse-lora')" in text and ModelCard(text).data.model_name == "reverse-lora"


def test_lm_eval_scores_join_the_card(runs):
    "--eval-tasks adds lm-evaluation-harness scores to summary.json; the card carries them as EvalResults, stderr left out."
    sys.path.insert(0, os.path.dirname(__file__))
    from hubserver import card_errors
    from tunebook.card import model_card
    config, summary, _ = _read(runs["lora"])
    import numpy as np   # lm_eval's scores are numpy scalars until summary.json is read back
    summary |= {"lm_eval_before": {"arc_easy": {"acc,none": np.float64(0.25), "acc_stderr,none": 0.01}},
                "lm_eval_after": {"arc_easy": {"acc,none": np.float32(0.3125), "acc_stderr,none": 0.01, "acc_norm,none": 0.375}}}
    text = str(model_card(config, summary))
    _, results = model_index_to_eval_results(ModelCard(text).data.to_dict()["model-index"])
    lm = {(r.dataset_type, r.metric_name): r.metric_value for r in results if r.source_name == "lm-evaluation-harness"}
    assert lm == {("arc_easy", "acc,none"): 0.3125, ("arc_easy", "acc_norm,none"): 0.375}
    assert "| arc_easy | acc,none | 0.25 | 0.3125 |" in text and card_errors(text) == []
