"""GRPO with the vllm generator backend (runs where vllm is installed: `make vllm-env`, .venv-vllm/bin/python -m pytest).
The learner's weights reach the engine by version: with a large learning rate the policy moves every step, and the
engine's log-probs of its own samples still equal the learner's forward at the rollout's version (fp32)."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed in this environment (make vllm-env)")

from tunebook.grpo import GRPOConfig, GRPOTrainer


@pytest.mark.parametrize("async_mode", [False, True])
def test_vllm_generator_follows_the_learner(policy, tmp_path, async_mode):
    path, _ = policy
    cfg = GRPOConfig(model=path, task="add", generator="vllm", async_mode=async_mode, max_steps=4, group_size=4,
                     prompts_per_step=2, max_new_tokens=8, eval_samples=4, lr=2e-2, lora_rank=8, max_staleness=2,
                     output_dir=str(tmp_path))
    t = GRPOTrainer(cfg)   # the task's reward: the embedded model half-solves it, so groups vary and the policy moves
    s = t.fit(progress=False)
    gaps = [r["logprob_gap_max"] for r in t.metrics]
    print(async_mode, s["generator_startup_seconds"], gaps, [r["staleness"] for r in t.metrics], [r["kl"] for r in t.metrics])
    assert s["steps"] == 4 and s["generator_startup_seconds"] > 0
    assert max(gaps) < 2e-4, gaps                    # fp32 engine vs the learner's forward, at the rollout's version
    assert t.metrics[-1]["kl"] > 1e-3                # the policy did move: a stale engine would show in the gap
    assert all(not w.is_alive() for w in t.workers)
