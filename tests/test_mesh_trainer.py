"""The Trainer on an FSDP 2 x TP 2 mesh (`mesh="dp=2,tp=2"`: 4 gloo processes, on 2 cores oversubscribed; loss parallel,
sequence parallel on the norms) against one process on the same batches: SFT full (clipping that bites, held-out loss, generation eval, a DCP checkpoint resumed,
the exported Hugging Face folder), SFT LoRA with activation checkpointing, and DPO with LoRA (its reference through the split
model); KTO with LoRA on dp=1,tp=2; losses, gradient norms and weights within 1e-5. And what a tp mesh refuses, one line each."""
import time

import pytest
import torch

from conftest import HANG

from tunebook.launch import launch

TOL = 1e-5
MESH = "dp=2,tp=2"
COMMON = dict(dtype="fp32", device="cpu", warmup_steps=0, schedule="constant", eval_samples=2, max_new_tokens=4,
              batch_size=8, log_every=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An untied pico model (heads, kv heads, hidden size and vocabulary divide by 2) with a tokenizer for the add task."""
    from tunebook.checkpoint import save_hf
    from tunebook.data import make_task
    from tunebook.model import build_model, pico
    from tunebook.tokenizer import train_tokenizer
    tok = train_tokenizer([f"{r['prompt']} {r['answer']}" for r in make_task("add", 1000)], vocab_size=300)
    assert len(tok) % 2 == 0, len(tok)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tp") / "pico"
    save_hf(build_model(pico(vocab_size=len(tok), dim=32, hidden_dim=64, n_heads=4, n_kv_heads=2, tie_embeddings=False)), d)
    tok.save(d)
    return str(d)


def runs(model_dir, out):
    """The runs each side makes: (name, kind, options). SFT full stops at step 2 and a second run resumes it to step 3."""
    sft = dict(model=model_dir, task="add", n_train=48, lr=3e-3, max_grad_norm=0.05, **COMMON)   # clipping on every step
    return [("full", "sft", dict(sft, method="full", max_steps=2, output_dir=f"{out}/full")),
            ("full-resumed", "sft", dict(sft, method="full", max_steps=3, resume=True, output_dir=f"{out}/full")),
            ("lora", "sft", dict(sft, method="lora", lora_rank=4, lora_alpha=8.0, max_steps=2, activation_checkpointing=True,
                                 output_dir=f"{out}/lora")),
            ("dpo", "dpo", dict(model=model_dir, task="add", n_pairs=32, n_eval_pairs=4, method="lora", lora_rank=4,
                                lora_alpha=8.0, lr=3e-3, max_steps=2, beta=0.5, output_dir=f"{out}/dpo",
                                **{**COMMON, "batch_size": 4})),
            ("kto", "kto", dict(model=model_dir, task="add", n_examples=32, n_eval_pairs=4, method="lora", lora_rank=4,
                                lora_alpha=8.0, lr=3e-3, max_steps=2, beta=0.5, output_dir=f"{out}/kto",
                                **{**COMMON, "batch_size": 4}))]


def train_all(model_dir, out, mesh=None, nproc=1, only=("full", "full-resumed", "lora", "dpo")):
    """Every run of `runs` on `mesh` (None: one process); per run the step rows, the summary, the eval's completions and
    the whole weights (gathered from the shards)."""
    from tunebook.dpo import DPOConfig, DPOTrainer
    from tunebook.kto import KTOConfig, KTOTrainer
    from tunebook.train import Trainer
    from tunebook.config import TrainConfig
    kinds = dict(sft=(TrainConfig, Trainer), dpo=(DPOConfig, DPOTrainer), kto=(KTOConfig, KTOTrainer))
    res = {}
    for name, kind, opts in runs(model_dir, out):
        if name not in only: continue
        t0 = time.time()
        config, trainer = kinds[kind]
        tr = trainer(config(**opts, nproc=nproc, mesh=mesh))
        summary = tr.fit(progress=False)
        full = lambda v: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        res[name] = dict(rows=[{k: r[k] for k in ("step", "loss", "grad_norm")} for r in tr.metrics], summary=summary,
                         completions=[c for _, c, _, _ in tr.last_eval], seconds=time.time() - t0,
                         norm_mesh=getattr(getattr(tr.model.norm.weight, "device_mesh", None), "mesh_dim_names", None),
                         weights={k: full(v) for k, v in tr.model.state_dict().items()})
    return res


@pytest.fixture(scope="module")
def both(model_dir, tmp_path_factory):
    t0, one_dir = time.time(), tmp_path_factory.mktemp("one")
    one = train_all(model_dir, str(one_dir))
    t1 = time.time()
    four_dir = tmp_path_factory.mktemp("four")
    four = launch(train_all, nproc=4, args=(model_dir, str(four_dir), MESH, 4), oversubscribe=True, verbose=False, timeout=HANG)
    print(f"\none process: {t1 - t0:.0f} s; FSDP 2 x TP 2 on 4 processes: {time.time() - t1:.0f} s")
    return one, four, one_dir, four_dir


def _same_run(ref, got, name):
    "Steps, losses, gradient norms, weights, greedy answers and held-out metrics of one rank's run equal the one-process run's."
    assert [r["step"] for r in got["rows"]] == [r["step"] for r in ref["rows"]]
    for a, b in zip(got["rows"], ref["rows"]):
        assert abs(a["loss"] - b["loss"]) <= TOL and abs(a["grad_norm"] - b["grad_norm"]) <= TOL, (name, a, b)
    for k, v in ref["weights"].items(): torch.testing.assert_close(got["weights"][k], v, rtol=0, atol=TOL, msg=k)
    assert got["completions"] == ref["completions"]   # generation eval: the same greedy answers
    for k, v in ref["summary"].items():   # held-out loss, exact match, preference accuracy and margin, before and after
        if k.startswith(("eval_", "preference_", "mean_margin", "policy_ranks", "reward_")) and isinstance(v, float):
            assert abs(got["summary"][k] - v) <= TOL or (v != v and got["summary"][k] != got["summary"][k]), (name, k)


@pytest.mark.parametrize("name", ["full", "full-resumed", "lora", "dpo"])
def test_fsdp_x_tp_trainer_matches_one_process(both, name):
    one, four, _, _ = both
    ref = one[name]
    for rank in range(4):
        _same_run(ref, four[rank][name], name)
    assert "tp" in (four[0][name]["norm_mesh"] or ())   # sequence parallel: the final norm's weight is a DTensor over tp
    if name.startswith("full"):   # clipping acted: every step's norm was above max_grad_norm
        assert all(r["grad_norm"] > 0.05 for r in ref["rows"]), ref["rows"]
    if name == "full-resumed":    # it went on from the step-2 checkpoint: step 3 alone was trained by this run
        assert [r["step"] for r in ref["rows"]] == [1, 2, 3]
    print(f"{name}: losses {[round(r['loss'], 6) for r in four[0][name]['rows']]}, gradient norms "
          f"{[round(r['grad_norm'], 4) for r in four[0][name]['rows']]}, answers {four[0][name]['completions']} "
          f"in {four[0][name]['seconds']:.0f} s on 4 ranks; largest weight difference "
          f"{max((four[0][name]['weights'][k] - v).abs().max().item() for k, v in ref['weights'].items()):.1e}")


def test_kto_on_tensor_parallel_matches_one_process(model_dir, tmp_path):
    """KTO with LoRA on `dp=1,tp=2` (2 processes): the log-probabilities of its rows and of their mismatched pairs, policy
    and reference, on lm_head's vocabulary shards, and the reference point; losses, weights and metrics equal one process.
    One data-parallel rank: KTO forms its mismatched pairs inside each data-parallel rank's rows, so with dp > 1 the
    reference point is estimated from other pairs than one process forms (tests/test_rl.py runs KTO on 2 FSDP ranks)."""
    one = train_all(model_dir, str(tmp_path / "one"), only=("kto",))["kto"]
    two = launch(train_all, nproc=2, args=(model_dir, str(tmp_path / "two"), "dp=1,tp=2", 2, ("kto",)), verbose=False, timeout=HANG)
    assert one["rows"][-1]["loss"] != one["rows"][0]["loss"]   # it trained
    for rank in range(2): _same_run(one, two[rank]["kto"], "kto")
    print(f"kto: losses {[round(r['loss'], 6) for r in two[0]['kto']['rows']]} on dp=1,tp=2; largest weight difference "
          f"{max((two[0]['kto']['weights'][k] - v).abs().max().item() for k, v in one['weights'].items()):.1e}")


def test_exported_folder_does_not_depend_on_the_mesh(both):
    """The HF folder that rank 0 wrote from the FSDP x TP run's DCP checkpoint holds the one-process run's weights."""
    from tunebook.checkpoint import load_hf
    _, _, one_dir, four_dir = both
    for name in ("full", "lora"):
        a, b = load_hf(one_dir / name / "model"), load_hf(four_dir / name / "model")
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= TOL, name


# ---------------------------------------------------------------- refused up front, one line each (one process)

def _refusal(make):
    with pytest.raises(ValueError) as e: make()
    return str(e.value)


def test_tp_refuses_what_it_cannot_do(model_dir, tmp_path):
    from tunebook.config import TrainConfig
    from tunebook.distill import DistillConfig, DistillTrainer
    from tunebook.train import Trainer
    base = dict(model=model_dir, task="add", mesh=MESH, nproc=4, output_dir=str(tmp_path), batch_size=8)
    msg = _refusal(lambda: TrainConfig(**base, chunked_ce=4).validate())
    assert "chunked_ce=4 (--chunked-ce) with tp: lm_head is already split over the vocabulary" in msg, msg
    for opts, words in ((dict(compile=True), "compiled before the tensor-parallel split"), (dict(method="dora"), "use --method lora"),
                        (dict(optimizer_in_backward=True, max_grad_norm=None), "optimizer_in_backward"), (dict(batch_size=3), "dp=2 data-parallel ranks")):
        msg = _refusal(lambda: TrainConfig(**{**base, **opts}).validate())
        assert words in msg and msg.count("\n  - ") == 1, msg   # one line, naming the fix
    msg = _refusal(lambda: DistillTrainer(DistillConfig(**base, teacher=model_dir)))
    assert "Distill does not say what it computes on logits split over the vocabulary" in msg and "dp_replicate=R,dp_shard=S" in msg, msg
    # a model the split cannot cut: said by setup before the data is read (n_kv_heads=2 over tp=4)
    msg = _refusal(lambda: Trainer(TrainConfig(**{**base, "mesh": "dp=1,tp=4"})).setup())
    assert "tensor parallel over tp=4 cannot split this model: n_kv_heads=2 does not divide over tp=4" in msg, msg
