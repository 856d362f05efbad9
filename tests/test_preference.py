"""IPO, SimPO, ORPO and KTO: each loss against its formula written out by hand, the trainers' losses against
log-probabilities computed token by token, and each objective measurably learning on the embedded model."""
import json
import math

import pytest
import torch

from tunebook.dpo import DPOConfig, DPOTrainer
from tunebook.kto import KTOConfig, KTODataset, KTOTrainer, kto_batch, kto_rows
from tunebook.preference import ipo_loss, kto_examples, kto_loss, kto_reference_point, orpo_loss, simpo_loss


def _floats(n, seed, scale=3.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return [float(x) for x in torch.randn(n, generator=g, dtype=torch.float64) * scale + shift]

def _t(v): return torch.tensor(v, dtype=torch.float64)
def _sig(x): return 1 / (1 + math.exp(-x))
def _softplus(x): return math.log1p(math.exp(x))


# ---------------------------------------------------------------- the formulas, by hand
def test_ipo_loss_by_hand():
    pc, pr, rc, rr = (_floats(12, s) for s in range(4))
    for beta in (0.1, 0.5):
        got, st = ipo_loss(*(_t(v) for v in (pc, pr, rc, rr)), beta=beta)
        want = [((a - c) - (b - d) - 1 / (2 * beta)) ** 2 for a, b, c, d in zip(pc, pr, rc, rr)]
        assert torch.allclose(got, _t(want), rtol=1e-12, atol=1e-12)
        assert st["accuracy"].tolist() == [float((a - c) > (b - d)) for a, b, c, d in zip(pc, pr, rc, rr)]


def test_simpo_loss_by_hand():
    pc, pr = _floats(12, 0, 5, -20), _floats(12, 1, 5, -20)
    nc, nr = [1 + i % 5 for i in range(12)], [2 + i % 7 for i in range(12)]
    for beta, gamma, eps in ((2.0, 0.5, 0.0), (2.5, 1.2, 0.1)):
        got, st = simpo_loss(_t(pc), _t(pr), torch.tensor(nc), torch.tensor(nr), beta, gamma, eps)
        z = [beta * a / n - beta * b / m - gamma for a, b, n, m in zip(pc, pr, nc, nr)]
        want = [(1 - eps) * _softplus(-x) + eps * _softplus(x) for x in z]   # -log sigmoid(x) = log(1 + e^-x)
        assert torch.allclose(got, _t(want), rtol=1e-10, atol=1e-12)
        assert torch.allclose(st["chosen_reward"], _t([beta * a / n for a, n in zip(pc, nc)]))


def test_orpo_loss_by_hand():
    pc, pr = _floats(12, 2, 1.0, -4.0), _floats(12, 3, 1.0, -6.0)
    pc, pr = [min(v, -0.1) for v in pc], [min(v, -0.1) for v in pr]   # log-probs of whole answers are negative
    nc, nr = [1 + i % 4 for i in range(12)], [1 + i % 3 for i in range(12)]
    for lam in (0.1, 1.0):
        got, st = orpo_loss(_t(pc), _t(pr), torch.tensor(nc), torch.tensor(nr), lam)
        want = []
        for a, b, n, m in zip(pc, pr, nc, nr):
            p_w, p_l = math.exp(a / n), math.exp(b / m)            # length-normalised probabilities
            ratio = math.log(p_w / (1 - p_w)) - math.log(p_l / (1 - p_l))
            want.append(-a / n + lam * -math.log(_sig(ratio)))     # chosen's mean NLL + lambda * odds-ratio loss
        assert torch.allclose(got, _t(want), rtol=1e-10, atol=1e-12)


def test_kto_loss_by_hand():
    pol, ref = _floats(10, 4, 2, -8), _floats(10, 5, 2, -8)
    good = [i % 3 != 0 for i in range(10)]
    pk, rk = _floats(10, 6, 2, -9), _floats(10, 7, 2, -9.5)
    z0 = max(0.0, sum(a - b for a, b in zip(pk, rk)) / 10)
    assert z0 > 0
    got_z0 = kto_reference_point(_t(pk), _t(rk))
    assert abs(float(got_z0) - z0) < 1e-12 and not got_z0.requires_grad
    assert float(kto_reference_point(torch.tensor([-5.0]), torch.tensor([-4.0]))) == 0.0   # clipped at 0
    for beta, ld, lu in ((0.1, 1.0, 1.0), (0.5, 1.0, 1.33)):
        got, st = kto_loss(_t(pol), _t(ref), torch.tensor(good), _t(z0), beta, ld, lu)
        want = [ld * (1 - _sig(beta * ((a - b) - z0))) if d else lu * (1 - _sig(beta * (z0 - (a - b)))) for a, b, d in zip(pol, ref, good)]
        assert torch.allclose(got, _t(want), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the trainers' losses, token by token
def _seq_lp(model, batch, pre=""):
    """Summed log-prob of each row's labelled tokens, one token at a time in fp64, and each row's length."""
    lp = model(batch[pre + "tokens"], attn_mask=batch[pre + "attn_mask"]).double().log_softmax(-1)
    out, n = [], []
    for b in range(batch[pre + "tokens"].shape[0]):
        ys = [(i, int(y)) for i, y in enumerate(batch[pre + "labels"][b]) if y != -100]
        out.append(sum(float(lp[b, i, y]) for i, y in ys)); n.append(len(ys))
    return out, n


def _perturb(t):
    with torch.no_grad():   # make the policy differ from the reference
        for name, p in t.model.named_parameters():
            if "lora_B" in name: p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_pair_trainer_losses_equal_hand_computed_logprobs(tiny, tmp_path, loss):
    path, task = tiny
    cfg = DPOConfig(model=path, task=task, n_pairs=16, n_eval_pairs=4, eval_samples=2, max_steps=1, batch_size=4, loss=loss,
                    beta=0.7, output_dir=str(tmp_path))
    t = DPOTrainer(cfg).setup()
    _perturb(t)
    batch = t.objective.batch(t, 0)
    got, _ = t.objective.loss(t, batch)
    from tunebook.lora import disable_adapters
    with torch.no_grad():
        pol, n = _seq_lp(t.model, batch)
        with disable_adapters(t.model): ref, _ = _seq_lp(t.model, batch)
    B, beta = len(pol) // 2, 0.7
    want = 0.0
    for i in range(B):
        (pc, pr), (rc, rr), (nc, nr) = (pol[i], pol[B + i]), (ref[i], ref[B + i]), (n[i], n[B + i])
        if loss == "ipo": want += ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2
        elif loss == "simpo": want += _softplus(-(beta * pc / nc - beta * pr / nr - 0.5))
        else:
            ow, ol = math.exp(pc / nc), math.exp(pr / nr)
            want += -pc / nc + beta * _softplus(-(math.log(ow / (1 - ow)) - math.log(ol / (1 - ol))))
    assert t.objective.weight(t, batch) == B == 4
    assert abs(got.item() - want) < 1e-5 * max(1.0, abs(want)), (got.item(), want)
    assert (t.objective.reference is None) == (loss in ("simpo", "orpo"))   # reference-free losses build no reference


def test_kto_trainer_loss_equals_hand_computed_logprobs(tiny, tmp_path):
    path, task = tiny
    cfg = KTOConfig(model=path, task=task, n_examples=16, n_eval_pairs=4, eval_samples=2, max_steps=1, batch_size=6, beta=0.5,
                    desirable_weight=1.0, undesirable_weight=1.5, output_dir=str(tmp_path))
    t = KTOTrainer(cfg).setup()
    _perturb(t)
    batch = t.objective.batch(t, 0)
    got, stats = t.objective.loss(t, batch)
    from tunebook.lora import disable_adapters
    with torch.no_grad():
        pol, _ = _seq_lp(t.model, batch); pk, _ = _seq_lp(t.model, batch, "kl_")
        with disable_adapters(t.model): ref, _ = _seq_lp(t.model, batch); rk, _ = _seq_lp(t.model, batch, "kl_")
    z0 = max(0.0, sum(a - b for a, b in zip(pk, rk)) / len(pk))
    good = batch["desirable"].tolist()
    assert 0 < sum(good) < len(good)
    want = sum(1.0 * (1 - _sig(0.5 * ((a - b) - z0))) if d else 1.5 * (1 - _sig(0.5 * (z0 - (a - b)))) for a, b, d in zip(pol, ref, good))
    assert t.objective.weight(t, batch) == 6
    assert abs(got.item() - want) < 1e-5 * max(1.0, want), (got.item(), want)
    assert abs(stats["kl"][0].item() - z0) < 1e-5


def test_kto_batch_pairs_each_prompt_with_the_previous_answer(tiny):
    from tunebook.data import encode_conversation, make_preference_pairs, shift_labels
    from tunebook.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny[0])
    rows = kto_rows(make_preference_pairs("add", 5, seed=0))
    assert [r["label"] for r in rows] == [True, False, True, False, True] and len({r["prompt"] for r in rows}) == 5
    ds = KTODataset(rows, tok)
    b = kto_batch(ds, [ds[3], ds[0], ds[4]], "cpu")
    for k, (i, j) in enumerate([(3, 4), (0, 3), (4, 0)]):   # rotated by one: prompt i with answer j
        ids, mask = encode_conversation(tok, [{"role": "user", "content": rows[i]["prompt"]},
                                              {"role": "assistant", "content": rows[j]["completion"]}], train_on="last")
        n = len(ids)
        assert b["kl_tokens"][k, :n].tolist() == ids and b["kl_labels"][k, :n].tolist() == shift_labels(ids, mask)
        assert int(b["kl_attn_mask"][k].sum()) == n
    assert b["desirable"].tolist() == [False, True, True]


def test_kto_data_file_rows_and_refusals(tmp_path):
    f = tmp_path / "k.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "2+2=", "completion": "4", "label": True},
        {"prompt": [{"role": "user", "content": "3+3="}], "completion": "7", "label": False},
        {"completion": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], "label": "true"}]))
    ex = kto_examples(str(f), system_prompt="Be exact.")
    assert [(m[-1]["content"], c, d) for m, c, d, _ in ex] == [("2+2=", "4", True), ("3+3=", "7", False), ("1+1=", "2", True)]
    assert all(m[0] == {"role": "system", "content": "Be exact."} for m, *_ in ex)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "c", "label": False}) + "\n" + json.dumps({"prompt": "a", "completion": "b", "label": 3}))
    with pytest.raises(ValueError, match="line 2, column 'label': expected a boolean label .* got 3; write true/false"):
        kto_examples(str(bad))
    with pytest.raises(ValueError, match=r"needs columns \['answer'\]"):
        kto_examples(str(f), completion_field="answer")
    with pytest.raises(ValueError, match="raise --batch-size"):
        KTOConfig(batch_size=3, nproc=2).validate()


# ---------------------------------------------------------------- each one learns
# The embedded model half-solves `count`, so its preferences carry signal. Held-out pairs are never trained on.
# Measured (seed 0, 400 pairs / examples, 25 steps of 16, lr 1e-3, 100 held-out pairs): see each assertion.
LEARN = dict(task="count", n_eval_pairs=100, eval_samples=10, max_steps=25, batch_size=16, lr=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("loss,beta", [("simpo", 2.0), ("orpo", 1.0), ("ipo", None)])   # ORPO: lambda 1 (at 0.1 the NLL dominates: 0.84 -> 0.86)
def test_pair_losses_raise_held_out_preference(policy, tmp_path, loss, beta):
    s = DPOTrainer(DPOConfig(model=policy[0], loss=loss, beta=beta, n_pairs=400, output_dir=str(tmp_path), **LEARN)).fit(progress=False)
    print(loss, {k: round(v, 3) for k, v in s.items() if "preference" in k or "ranks" in k})
    assert s["pair_loss"] == loss
    # measured: simpo 0.84 -> 0.98, orpo 0.84 -> 0.92 (reference-free: the length-normalised log-prob already ranks
    # well at the start), ipo 0.5 (all ties) -> 0.92; the policy alone ranks chosen first 0.84 -> 0.98 / 0.92 / 0.92
    assert s["preference_accuracy_after"] >= s["preference_accuracy_before"] + 0.04, s
    assert s["policy_ranks_chosen_after"] >= s["policy_ranks_chosen_before"] + 0.04, s


@pytest.mark.slow
def test_kto_raises_held_out_preference(policy, tmp_path):
    s = KTOTrainer(KTOConfig(model=policy[0], n_examples=400, output_dir=str(tmp_path), **LEARN)).fit(progress=False)
    print({k: round(v, 3) for k, v in s.items() if "preference" in k or "ranks" in k or "margin" in k})
    assert s["preference_accuracy_before"] == 0.5 and s["mean_margin_before"] == 0.0   # policy == reference: all ties
    assert s["preference_accuracy_after"] > 0.75, s                                     # measured 0.86
    assert s["policy_ranks_chosen_after"] >= s["policy_ranks_chosen_before"] + 0.03, s  # measured 0.84 -> 0.89
    assert s["lead_metric"] == "preference_accuracy" and (tmp_path / "model" / "config.json").exists()


# ---------------------------------------------------------------- chat data, rendered as supervised fine-tuning renders it
def test_preference_chat_data_renders_like_sft(policy, tmp_path):
    """Issue 13: message-list pairs get the system prompt and the chat template exactly as SFT's chat rows do (only the
    final answer scored); --no-chat-template gives the plain layout; train_on is not an option of a preference run."""
    from tunebook.data import SFTDataset
    rows = [{"chosen": [{"role": "user", "content": f"count a in {w}"}, {"role": "assistant", "content": str(w.count("a"))}],
             "rejected": [{"role": "user", "content": f"count a in {w}"}, {"role": "assistant", "content": str(w.count("a") + 1)}]}
            for w in ("banana", "apple", "avocado", "papaya", "kiwi", "mango", "guava", "salad")]
    rows.append({"prompt": [{"role": "user", "content": "count b in abba"}, {"role": "assistant", "content": "2"},
                            {"role": "user", "content": "and a?"}], "chosen": "2", "rejected": "1"})
    f = tmp_path / "pairs.jsonl"; f.write_text("\n".join(json.dumps(r) for r in rows))
    sides = lambda ds: [(p[s], m + [{"role": "assistant", "content": a}]) for (m, c, r, _), p in zip(ds.examples, ds.pairs)
                        for s, a in (("chosen", c), ("rejected", r))]
    kw = dict(model=policy[0], data=str(f), system_prompt="Be exact.", eval_fraction=0.2, n_eval_pairs=2, eval_samples=2,
              batch_size=2, max_steps=1)
    seen = {}
    for template in (True, False):
        t = DPOTrainer(DPOConfig(output_dir=str(tmp_path / f"t{template}"), chat_template=template, **kw)).setup()
        assert len(t.objective.train_pairs) + len(t.objective.eval_pairs) == len(rows) and t.objective.train_pairs.use_chat_template is template
        for item, msgs in sides(t.objective.train_pairs) + sides(t.objective.eval_pairs):
            assert msgs[0] == {"role": "system", "content": "Be exact."}
            want = SFTDataset([{"messages": msgs}], t.tokenizer, train_on="last", use_chat_template=None if template else False)[0]
            assert item == want
            seen.setdefault(json.dumps(msgs), []).append(item["tokens"])
        assert t.eval_data and all(e["messages"][0]["role"] == "system" for e in t.eval_data)
    assert all(a != b for a, b in seen.values())   # the template changes the tokens
    with pytest.raises(TypeError, match="train_on"): DPOConfig(train_on="all")


def test_kto_on_a_data_file_raises_the_reward_gap(policy, tmp_path):
    """A KTO data file (prompt, completion, label): held-out rows are never trained on; the implicit reward of their
    desirable answers rises above the undesirable ones' (at the start every reward is 0: gap 0, sign accuracy a tie, 0.5)."""
    from tunebook.data import make_preference_pairs
    rows = kto_rows(make_preference_pairs("count", 240, seed=1))
    f = tmp_path / "kto.jsonl"; f.write_text("\n".join(json.dumps(r) for r in rows))
    t = KTOTrainer(KTOConfig(model=policy[0], data=str(f), eval_fraction=0.25, eval_samples=4, max_steps=15, batch_size=16,
                             lr=1e-3, output_dir=str(tmp_path / "run")))
    s = t.fit(progress=False)
    print({k: round(v, 3) for k, v in s.items() if "reward_gap" in k or "kto_accuracy" in k})
    held = {(m[-1]["content"], c) for m, c, _, _ in t.objective.held.examples}
    assert len(held) == 60 and not held & {(m[-1]["content"], c) for m, c, _, _ in t.rows.examples}
    assert s["lead_metric"] == "reward_gap" and s["reward_gap_before"] == 0.0 and s["kto_accuracy_before"] == 0.5
    assert s["reward_gap_after"] > 0.2 and s["kto_accuracy_after"] > 0.7, s   # measured (seed 0): 0.43 and 0.82


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_preference_batches_built_ahead_give_the_same_steps(tiny, tmp_path, kind):
    """~4 s. DPO's and KTO's batches depend on the step alone, so they may be built a step ahead on a thread (on by default
    on CUDA): forced on here, the losses equal a plain run's, accumulation included."""
    path, task = tiny
    def run(prefetch, sub):
        kw = dict(model=path, task=task, n_eval_pairs=4, eval_samples=2, max_steps=3, grad_accum_steps=2, output_dir=str(tmp_path / sub))
        t = (DPOTrainer(DPOConfig(n_pairs=24, batch_size=4, **kw)) if kind == "dpo" else
             KTOTrainer(KTOConfig(n_examples=24, batch_size=4, **kw))).setup()
        assert t.objective.pure_batches
        t.prefetch = prefetch
        out = [t.train_step()["loss"] for _ in range(3)]
        t.stop_prefetch()
        return out
    plain = run(False, "plain")
    assert run(True, "ahead") == plain and plain[-1] != plain[0]   # equal, and the policy moved (it starts at the reference)


def test_a_pair_with_one_answer_twice_is_refused_naming_its_line(tmp_path, capsys):
    """N4: a pair whose chosen and rejected answers are the same kept DPO's loss at ln 2 for the whole run, reported ok."""
    import json
    from tunebook.cli import main
    rows = [dict(prompt="2+2=", chosen="4", rejected="5"), dict(prompt="3+3=", chosen="6", rejected=" 6"), dict(prompt="1+1=", chosen="2", rejected="3")]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["dpo", "--data", str(tmp_path / "pairs.jsonl"), "--max-steps", "1", "--eval-samples", "0", "--output-dir", str(tmp_path / "run")])
    err = [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith("tunebook: warning")]
    assert rc == 2 and len(err) == 1, err
    assert "pairs.jsonl' line 2" in err[0] and "same answer" in err[0], err
