"""Objective x memory technique x nproc: every combination trains two steps on a pico model through the one loop
(`Trainer.train_step`), or is one of the refusals listed here by name, each with (a part of) its own message.
A refusal that is not listed fails the test, and so does a listed one that starts to train."""
import dataclasses
import math

import pytest
import torch

from conftest import HANG

TECHNIQUES = {"plain": {}, "chunked_ce": dict(chunked_ce=2), "activation_checkpointing": dict(activation_checkpointing=True),
              "activation_offloading": dict(activation_offloading=True),
              "optimizer_in_backward": dict(optimizer_in_backward=True, max_grad_norm=None),
              "profile_memory": dict(profile_memory=True), "qlora": dict(method="qlora")}
COMMON = dict(max_steps=3, eval_samples=2, max_new_tokens=4, lr=1e-3, warmup_steps=0, dtype="fp32", lora_rank=4)


def varied_reward(completion: str, row) -> float:
    "A reward that differs within a group (a random pico model never answers right), so GRPO's advantages are not all 0."
    return float(len(completion) % 3)


def _objectives(model, task):
    """objective name -> (trainer class, config) for the pico model folder `model`."""
    from tunebook.distill import DistillConfig, DistillTrainer
    from tunebook.dpo import DPOConfig, DPOTrainer
    from tunebook.grpo import GRPOConfig, GRPOTrainer
    from tunebook.kto import KTOConfig, KTOTrainer
    from tunebook.train import TrainConfig, Trainer
    pairs = dict(model=model, task=task, n_pairs=8, n_eval_pairs=2, batch_size=4)
    return {"sft": (Trainer, TrainConfig(model=model, task=task, n_train=16, batch_size=4, **COMMON)),
            "distill": (DistillTrainer, DistillConfig(teacher=model, model=None, task=task, n_train=16, batch_size=4, **COMMON)),
            **{loss: (DPOTrainer, DPOConfig(loss=loss, **pairs, **COMMON)) for loss in ("dpo", "ipo", "simpo", "orpo")},
            "kto": (KTOTrainer, KTOConfig(model=model, task=task, n_examples=8, n_eval_pairs=2, batch_size=4, **COMMON)),
            "grpo": (GRPOTrainer, GRPOConfig(model=model, task=task, n_train=8, group_size=4, prompts_per_step=2,
                                             reward=f"{__name__}:varied_reward", temperature=1.0, **COMMON))}


def _build(cls, cfg, technique, out):
    """The trainer for `cfg` with `technique` on, set up; or the ValueError that refuses it."""
    cfg = dataclasses.replace(cfg, **TECHNIQUES[technique], output_dir=str(out))
    try: return cls(cfg.validate()).setup()
    except ValueError as e: return e


# (objective, technique) -> a substring of the ValueError that refuses it; every other combination must train
REFUSED = {("grpo", "qlora"): "GRPO supports method full, lora and dora (generators merge the adapters into plain weights)"}


def _check_honoured(tr, technique, before):
    """The technique really is on in the trainer, and the steps changed the trainable weights."""
    if technique == "activation_checkpointing":
        assert any(getattr(b, "checkpoint_fn", None) is not None for b in tr.model.layers)
    if technique == "activation_offloading": assert tr.offload is not None
    if technique == "optimizer_in_backward": assert not isinstance(tr.optimizer, torch.optim.AdamW)
    if technique == "profile_memory": assert tr.metrics[-1].get("peak_bytes"), tr.metrics[-1]   # step 3: only when asked
    if technique == "qlora":   # the frozen base weights are stored in NF4
        from tunebook.lora import lora_modules
        assert lora_modules(tr.model) and all(m.quantized for m in lora_modules(tr.model).values())
    after = {n: p.detach() for n, p in tr.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(before[n], after[n]) for n in before), "no trainable weight changed"


OBJECTIVE_NAMES = ["sft", "distill", "dpo", "ipo", "simpo", "orpo", "kto", "grpo"]


def test_every_objective_is_in_the_matrix():
    """Each entry of the table of objectives has a row here (its trainer and config), so a new objective cannot skip the matrix."""
    from tunebook.objectives import OBJECTIVES
    rows = {(cls, type(cfg)) for cls, cfg in _objectives("model", "add").values()}
    missing = [s.name for s in OBJECTIVES.values() if (s.trainer, s.config) not in rows]
    assert not missing, f"add {missing} to _objectives"


@pytest.mark.parametrize("technique", list(TECHNIQUES))
@pytest.mark.parametrize("objective", OBJECTIVE_NAMES)
def test_one_process(tiny, tmp_path, objective, technique):
    model, task = tiny
    cls, cfg = _objectives(model, task)[objective]
    torch.manual_seed(0)
    tr = _build(cls, cfg, technique, tmp_path / "run")
    if (objective, technique) in REFUSED:
        assert isinstance(tr, ValueError), f"{objective} + {technique} is listed in REFUSED but was accepted"
        assert REFUSED[objective, technique] in str(tr), str(tr)
        return
    assert not isinstance(tr, ValueError), f"{objective} + {technique} was refused, and is not in REFUSED: {tr}"
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    rows = [tr.train_step() for _ in range(3 if technique == "profile_memory" else 2)]
    assert all(math.isfinite(r["loss"]) for r in rows), rows
    _check_honoured(tr, technique, before)


# ---------------------------------------------------------------- two processes (gloo, FSDP2)
def _two_rank_steps(model, task, objective, technique, out):
    """On each rank: the trainer of `objective` + `technique` (nproc=2), two steps; the losses, or the refusal."""
    cls, cfg = _objectives(model, task)[objective]
    cfg = dataclasses.replace(cfg, nproc=2)
    torch.manual_seed(0)
    tr = _build(cls, cfg, technique, out)
    if isinstance(tr, ValueError): return str(tr)
    return [tr.train_step()["loss"] for _ in range(2)]


# where two processes are refused by validation alone (no processes needed), each with its message; and the cheap ones that train
REFUSED_AT_TWO = {("sft", "activation_offloading"): "activation_offloading is not supported with nproc > 1",
                  ("sft", "qlora"): "qlora is not supported with nproc > 1 (NF4 weights do not shard)",
                  ("grpo", "plain"): "nproc=2 (--nproc): GRPO's learner runs in one process"}
TRAINED_AT_TWO = [("sft", "chunked_ce"), ("sft", "activation_checkpointing"), ("dpo", "plain")]


@pytest.mark.parametrize("objective,technique", list(REFUSED_AT_TWO))
def test_two_processes_refused_by_validation(tiny, tmp_path, objective, technique):
    model, task = tiny
    cls, cfg = _objectives(model, task)[objective]
    cfg = dataclasses.replace(cfg, nproc=2, **TECHNIQUES[technique], output_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError) as e: cls(cfg.validate())
    assert REFUSED_AT_TWO[objective, technique] in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("objective,technique", TRAINED_AT_TWO)
def test_two_processes_train_as_one(tiny, tmp_path, objective, technique):
    """Two gloo ranks train the same steps as one process (same global batch, losses within 1e-5)."""
    from tunebook.launch import launch
    model, task = tiny
    got = launch(_two_rank_steps, nproc=2, args=(model, task, objective, technique, str(tmp_path / "two")), verbose=False, timeout=HANG)
    assert all(isinstance(g, list) for g in got), got
    cls, cfg = _objectives(model, task)[objective]
    torch.manual_seed(0)
    one = _build(cls, cfg, technique, tmp_path / "one")
    ref = [one.train_step()["loss"] for _ in range(2)]
    assert max(abs(a - b) for a, b in zip(ref, got[0])) < 1e-5, (ref, got[0])
