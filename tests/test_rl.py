"""DPO, distillation and GRPO (sync and async): formulas checked by hand, and each method measurably learning."""
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tunebook.data import make_preference_pairs
from tunebook.distill import ChunkedKLDiv, DistillConfig, DistillTrainer, kl_div_loss
from tunebook.dpo import DPOConfig, DPOTrainer, PreferenceDataset, collate_pairs, dpo_loss
from tunebook.grpo import GRPOConfig, GRPOTrainer, WorkerDied, group_advantages, grpo_loss


def _embedded():
    from tunebook.embedded import EMBEDDED_DIR, FINETUNE_TASK
    return (str(EMBEDDED_DIR), FINETUNE_TASK)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(model folder, task): a random-weight pico model and a small tokenizer: for mechanics, not learning."""
    from tunebook.checkpoint import save_hf
    from tunebook.data import make_task
    from tunebook.model import build_model, pico
    from tunebook.tokenizer import train_tokenizer
    tok = train_tokenizer([f"{r['prompt']} {r['answer']}" for r in make_task("add", 1000)], vocab_size=300)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny")
    save_hf(build_model(pico(vocab_size=len(tok))), out); tok.save(out)
    return str(out), "add"


@pytest.fixture(scope="session")
def policy(tiny):
    """(model folder, task) of a model that already half-solves its task: the embedded default. Learning tests need it."""
    found = _embedded()   # shipped with the package: a missing model is a failure, never a skip
    assert (Path(found[0]) / "config.json").exists(), f"the embedded model is missing from {found[0]}"
    return found


# ---------------------------------------------------------------- DPO
def test_dpo_loss_matches_formula_by_hand():
    torch.manual_seed(0)
    pc, pr, rc, rr = (torch.randn(16) * 3 for _ in range(4))
    for beta, eps in ((0.1, 0.0), (0.5, 0.2)):
        loss, st = dpo_loss(pc, pr, rc, rr, beta, eps)
        m = (pc - rc) - (pr - rr)
        sig = lambda x: 1 / (1 + torch.exp(-x))
        want = ((1 - eps) * -torch.log(sig(beta * m)) + eps * -torch.log(sig(-beta * m))).mean()
        assert torch.allclose(loss, want, atol=1e-6)
        assert torch.equal(st["accuracy"], (m > 0).float())
        assert torch.allclose(st["margin"], beta * m, atol=1e-6)


def test_dpo_trainer_loss_equals_hand_computed_logprobs(tiny, tmp_path):
    path, task = tiny
    cfg = DPOConfig(model=path, task=task, n_pairs=16, n_eval_pairs=4, eval_samples=2, max_steps=1, batch_size=4,
                    beta=0.3, label_smoothing=0.1, output_dir=str(tmp_path))
    t = DPOTrainer(cfg).setup()
    with torch.no_grad():   # make the policy differ from the reference
        for n, p in t.model.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.05)
    batch = t.pair_batch(0)
    loss, _ = t.dpo_loss(batch)

    def seq_lp(model):
        lp = model(batch["tokens"], attn_mask=batch["attn_mask"]).double().log_softmax(-1)
        out = []
        for b in range(batch["tokens"].shape[0]):
            out.append(sum(lp[b, i, int(y)] for i, y in enumerate(batch["labels"][b]) if y != -100))
        return torch.stack(out)
    from tunebook.lora import disable_adapters
    with torch.no_grad():
        pol = seq_lp(t.model)
        with disable_adapters(t.model): ref = seq_lp(t.model)
    B = len(pol) // 2
    m = (pol[:B] - ref[:B]) - (pol[B:] - ref[B:])
    want = (0.9 * F.softplus(-0.3 * m) + 0.1 * F.softplus(0.3 * m)).mean()
    assert abs(loss.item() - want.item()) < 1e-4


def test_dpo_raises_held_out_preference_accuracy(policy, tmp_path):
    path, _ = policy   # count: the embedded model answers half right, so its preferences carry signal (reverse: 0%)
    cfg = DPOConfig(model=path, task="count", n_pairs=400, n_eval_pairs=100, eval_samples=10, max_steps=25, batch_size=16,
                    lr=1e-3, beta=0.1, output_dir=str(tmp_path))
    s = DPOTrainer(cfg).fit(progress=False)
    print({k: v for k, v in s.items() if "preference" in k or "ranks" in k})
    # at the start the policy is the reference, so every implicit-reward margin is 0 and "preference accuracy"
    # (margin > 0) is 0 by construction: the real before/after is how often the policy alone ranks chosen first.
    # Measured (seed 0, 100 held-out pairs): ranks chosen 0.84 -> 0.91, implicit-reward accuracy 0.91.
    assert s["mean_margin_before"] == 0.0
    assert s["preference_accuracy_after"] > 0.8
    assert s["policy_ranks_chosen_after"] >= s["policy_ranks_chosen_before"] + 0.04, s
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "summary.json").exists()


# ---------------------------------------------------------------- distillation
def test_chunked_kl_equals_unchunked_fp32():
    torch.manual_seed(0)
    B, T, Ds, Dt, V = 3, 37, 32, 48, 301
    hs = torch.randn(B, T, Ds, requires_grad=True)
    ws = (torch.randn(V, Ds) * 0.2).requires_grad_()
    ht, wt = torch.randn(B, T, Dt), torch.randn(V, Dt) * 0.2
    labels = torch.randint(0, V, (B, T)); labels[:, :5] = -100; labels[1, -3:] = -100
    for tau, red in ((1.0, "mean"), (2.0, "sum")):
        ref = kl_div_loss(hs @ ws.T, ht @ wt.T, labels != -100, tau, red)
        g_ref = torch.autograd.grad(ref, (hs, ws))
        for n in (1, 4, 8, 64):
            got = ChunkedKLDiv(n, reduction=red, temperature=tau)(hs, ws, ht, wt, labels)
            g = torch.autograd.grad(got, (hs, ws))
            scale = max(1.0, abs(ref.item()))
            assert abs(got.item() - ref.item()) <= 1e-6 * scale, (n, got.item(), ref.item())
            for a, b in zip(g, g_ref):
                assert (a - b).abs().max().item() <= 1e-6 * max(1.0, b.abs().max().item()), (n, (a - b).abs().max())


def test_student_held_out_loss_falls(tiny, tmp_path):
    path, task = _embedded()
    cfg = DistillConfig(teacher=path, task=task, n_train=256, eval_samples=4, max_steps=25, batch_size=32, lr=3e-3,
                        max_seq_len=48, output_dir=str(tmp_path))
    s = DistillTrainer(cfg).fit(progress=False)
    print({k: v for k, v in s.items() if k.startswith("held_out") or k.endswith("params")})
    assert s["student_params"] < s["teacher_params"]
    assert s["held_out_kl_after"] < 0.7 * s["held_out_kl_before"]
    assert s["held_out_ce_after"] < s["held_out_ce_before"]   # a trained teacher's distributions also carry the answers


# ---------------------------------------------------------------- GRPO
def test_group_advantages_and_k3():
    r = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    a = group_advantages(r)
    g = r[0]
    assert torch.allclose(a[:4], (g - g.mean()) / (g.std() + 1e-4))
    assert torch.equal(a[4:], torch.zeros(4))
    lp, ref = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.2, -0.1]])
    loss, st = grpo_loss(lp, lp, ref, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), beta=1.0)
    k3 = (torch.exp(ref - lp) - (ref - lp) - 1).mean()
    assert torch.allclose(loss, k3)


def _grpo_cfg(path, task, out, **kw):
    base = dict(model=path, task=task, group_size=8, prompts_per_step=4, max_new_tokens=8, eval_samples=60,
                lora_rank=8, lr=3e-3, beta=0.02, output_dir=str(out))
    return GRPOConfig(**{**base, **kw})


@pytest.mark.slow
def test_grpo_sync_raises_held_out_reward(policy, tmp_path):
    path, _ = policy   # add: the embedded model solves ~45%, so rewards vary within a group (reverse: 0%, all zero)
    s = GRPOTrainer(_grpo_cfg(path, "add", tmp_path, max_steps=60, lora_rank=16, lr=5e-4, beta=0.04, temperature=0.7,
                              eval_samples=100)).fit(progress=False)
    print({k: s[k] for k in ("eval_reward_before", "eval_reward_after", "samples_per_second", "mean_train_reward")})
    # measured on 100 held-out prompts: 0.45 -> 0.53 (seed 0), 0.44 -> 0.53 (seed 1); half that gain is required
    assert s["eval_reward_after"] >= s["eval_reward_before"] + 0.04, s


class _StopAt:
    def __init__(self, step): self.step = step
    def on_step(self, trainer, row):
        if trainer.step >= self.step: raise KeyboardInterrupt


def test_grpo_async_staleness_bound_and_stop_ends_workers(tiny, tmp_path):
    path, task = tiny
    cfg = _grpo_cfg(path, task, tmp_path, async_mode=True, max_steps=50, max_staleness=1, queue_size=2, eval_samples=8)
    t = GRPOTrainer(cfg, callbacks=[_StopAt(5)])
    s = t.fit(progress=False)
    assert s["interrupted"] and s["steps"] == 5
    assert all(r["staleness"] <= 1 for r in t.metrics) and s["max_staleness_used"] <= 1
    assert t.workers and all(not w.is_alive() for w in t.workers)
    ck = tmp_path / "checkpoints" / "step_000005"
    assert (ck / "trainable.safetensors").exists() and (tmp_path / "model" / "config.json").exists()
    t2 = GRPOTrainer(_grpo_cfg(path, task, tmp_path, async_mode=True, max_steps=50, max_staleness=1, queue_size=2,
                               eval_samples=8)).setup()
    assert t2.load_checkpoint() == ck and t2.step == 5


def _die(completion, row):
    os._exit(3)


def test_grpo_dead_worker_is_reported(tiny, tmp_path):
    path, task = tiny
    cfg = _grpo_cfg(path, task, tmp_path, async_mode=True, max_steps=3, eval_samples=2, worker_timeout=60)
    t = GRPOTrainer(cfg, reward_fn=_die)
    with pytest.raises(WorkerDied, match="exit code 3"):   # reported as a death, not as the 60 s worker_timeout
        t.setup(); t._start = time.perf_counter(); t.run_async()
    assert all(not w.is_alive() for w in t.workers)


def _length(completion, row):
    return float(len(completion))   # varies within a group, so a random model gets a gradient


class _CheckedTrainer(GRPOTrainer):
    "Before each step, rescore the rollout with the learner's own policy and reference."
    def learn(self, ro, t0=None):
        from tunebook.grpo import group_logprobs
        b = {k: torch.as_tensor(ro[k]) for k in ("tokens", "positions", "segments", "index", "labels")}
        with torch.no_grad():
            self.diffs.append((ro["staleness"], (group_logprobs(self.model, b) - torch.as_tensor(ro["old_logprobs"])).abs().max().item(),
                               (self.reference(lambda m: group_logprobs(m, b)) - torch.as_tensor(ro["ref_logprobs"])).abs().max().item()))
        return super().learn(ro, t0)


@pytest.mark.parametrize("method", ["lora", "dora", "full"])
def test_grpo_async_generators_sample_the_learners_policy(tiny, tmp_path, method):
    """With max_staleness=0 every rollout the learner uses was sampled with its current weights: the generator's
    old log-probs (taken while sampling, with adapters merged in) and its reference log-probs equal the learner's
    own forward passes, step after step (fp32, 1e-4)."""
    path, task = tiny
    cfg = _grpo_cfg(path, task, tmp_path, async_mode=True, max_steps=4, max_staleness=0, queue_size=1, eval_samples=2,
                    method=method, lr=1e-2, group_size=4, prompts_per_step=2)
    t = _CheckedTrainer(cfg, reward_fn=_length); t.diffs = []
    s = t.fit(progress=False)
    assert s["steps"] == 4 and len(t.diffs) == 4
    assert all(st == 0 for st, _, _ in t.diffs)
    assert max(d for _, d, _ in t.diffs) < 1e-4, t.diffs
    assert max(r for _, _, r in t.diffs) < 1e-4, t.diffs
    assert t.metrics[-1]["kl"] > 0   # the policy did move away from the reference


def test_widget_stop_ends_an_async_grpo_run(tiny, tmp_path):
    """LiveRun (the run builder's engine) runs a GRPOConfig with GRPOTrainer; its Stop ends the generator
    processes and the run keeps a checkpoint and its outputs."""
    from tunebook.widgets import LiveRun
    path, task = tiny
    run = LiveRun(_grpo_cfg(path, task, tmp_path, async_mode=True, max_steps=10_000, eval_samples=4)).start()
    deadline = time.time() + 120
    while len(run.rows) < 2 and run.status != "failed" and time.time() < deadline: time.sleep(0.1)
    assert run.error is None and len(run.rows) >= 2, (run.status, run.error)
    run.stop(); run.thread.join(60)
    assert not run.thread.is_alive() and run.status == "stopped", (run.status, run.error)
    assert type(run.trainer).__name__ == "GRPOTrainer" and run.trainer.workers
    assert all(not w.is_alive() for w in run.trainer.workers)
    assert list((tmp_path / "checkpoints").glob("step_*")) and (tmp_path / "summary.json").exists()
