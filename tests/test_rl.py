"""DPO and distillation: formulas checked by hand, and each method measurably learning."""
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tunebook.data import make_preference_pairs
from tunebook.distill import ChunkedKLDiv, DistillConfig, DistillTrainer, kl_div_loss
from tunebook.dpo import DPOConfig, DPOTrainer, PreferenceDataset, collate_pairs, dpo_loss


# ---------------------------------------------------------------- DPO
def test_dpo_loss_matches_formula_by_hand():
    torch.manual_seed(0)
    pc, pr, rc, rr = (torch.randn(16) * 3 for _ in range(4))
    for beta, eps in ((0.1, 0.0), (0.5, 0.2)):
        losses, st = dpo_loss(pc, pr, rc, rr, beta, eps)   # one loss per pair: the loop sums them and divides by the pairs
        m = (pc - rc) - (pr - rr)
        sig = lambda x: 1 / (1 + torch.exp(-x))
        want = (1 - eps) * -torch.log(sig(beta * m)) + eps * -torch.log(sig(-beta * m))
        assert torch.allclose(losses, want, atol=1e-6)
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
    batch = t.objective.batch(t, 0)
    loss, _ = t.objective.loss(t, batch)   # summed over the pairs

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
    want = (0.9 * F.softplus(-0.3 * m) + 0.1 * F.softplus(0.3 * m)).sum()
    assert t.objective.weight(t, batch) == B == 4
    assert abs(loss.item() - want.item()) < 1e-5 * B


def test_dpo_raises_held_out_preference_accuracy(policy, tmp_path):
    path, _ = policy   # count: the embedded model answers half right, so its preferences carry signal (reverse: 0%)
    cfg = DPOConfig(model=path, task="count", n_pairs=400, n_eval_pairs=100, eval_samples=10, max_steps=25, batch_size=16,
                    lr=1e-3, beta=0.1, output_dir=str(tmp_path))
    s = DPOTrainer(cfg).fit(progress=False)
    print({k: v for k, v in s.items() if "preference" in k or "ranks" in k})
    # at the start the policy is the reference, so every implicit-reward margin is 0: a tie, counted half (chance);
    # the policy alone already ranks chosen first on most pairs, and must do so more often after.
    # Measured (seed 0, 100 held-out pairs): ranks chosen 0.84 -> 0.91, implicit-reward accuracy 0.5 -> 0.91.
    assert s["mean_margin_before"] == 0.0 and s["preference_accuracy_before"] == 0.5
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


def test_student_held_out_loss_falls(policy, tmp_path):
    path, task = policy
    cfg = DistillConfig(teacher=path, task=task, n_train=256, eval_samples=16, max_steps=25, batch_size=32, lr=3e-3,
                        max_seq_len=48, output_dir=str(tmp_path))
    s = DistillTrainer(cfg).fit(progress=False)
    print({k: v for k, v in s.items() if k.startswith("held_out") or k.endswith("params")})
    assert s["student_params"] < s["teacher_params"]
    assert s["held_out_kl_after"] < 0.7 * s["held_out_kl_before"]
    assert s["held_out_ce_after"] < s["held_out_ce_before"]   # a trained teacher's distributions also carry the answers
