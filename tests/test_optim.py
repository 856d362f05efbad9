"""optimizer_in_backward against a normal optimizer step; schedules against their closed forms."""
import io
import math

import pytest
import torch
from torch import nn

from tunebook.optim import (InBackwardOptimizer, SchedulerGroup, adamw, check_compatible, decay_groups, get_constant_schedule_with_warmup,
                            get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup, get_schedule,
                            in_backward_problems, optimizer_in_backward)

HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
BATCHES = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(10)]


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def make_opt(model, in_backward, schedule, cls=torch.optim.AdamW, hp=HP):
    opt = (optimizer_in_backward(model, cls, **hp) if in_backward
           else cls(decay_groups(model.parameters(), hp.get("weight_decay")), **hp))   # the same groups: matrices decay
    sched = get_cosine_schedule_with_warmup(opt, 3, 10, min_lr_ratio=0.1) if schedule else None
    return opt, sched


def run(model, opt, sched, steps, check_grads=False):
    for i in steps:
        model(BATCHES[i]).pow(2).mean().backward()
        if check_grads: assert all(p.grad is None for p in model.parameters())
        opt.step(); opt.zero_grad()
        if sched: sched.step()
    return model


def train(in_backward, schedule=True, steps=range(10), **kw):
    model = mlp()
    return run(model, *make_opt(model, in_backward, schedule, **kw), steps, check_grads=in_backward)


def assert_identical(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), (n, (p - q).abs().max().item())


@pytest.mark.parametrize("schedule", [False, True])
def test_adamw_bit_identical(schedule):
    ref, fused = train(False, schedule), train(True, schedule)
    assert_identical(ref, fused)
    assert not torch.equal(ref[0].weight, mlp()[0].weight)


@pytest.mark.parametrize("cls,hp", [(torch.optim.Adam, dict(lr=1e-2)), (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0, amsgrad=True))])
def test_other_optimizers_bit_identical(cls, hp):
    assert_identical(train(False, True, cls=cls, hp=hp), train(True, True, cls=cls, hp=hp))


def test_frozen_parameters_untouched():
    model = mlp(); model[2].requires_grad_(False)
    frozen = model[2].weight.detach().clone()
    opt = optimizer_in_backward(model, **HP)
    assert "2.weight" not in opt.optimizers and len(opt.optimizers) == 4
    run(model, opt, None, range(3))
    assert torch.equal(model[2].weight, frozen)


def test_state_dict_resume_equals_uninterrupted():
    model = mlp()
    opt, sched = make_opt(model, True, True)
    run(model, opt, sched, range(4))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, buf)
    opt.remove()
    assert set(opt.state_dict()) == {n for n, _ in model.named_parameters()}
    buf.seek(0); ckpt = torch.load(buf)
    resumed = mlp(seed=3); resumed.load_state_dict(ckpt["model"])
    opt2, sched2 = make_opt(resumed, True, True)
    opt2.load_state_dict(ckpt["optim"]); sched2.load_state_dict(ckpt["sched"])
    run(resumed, opt2, sched2, range(4, 10))
    assert_identical(resumed, train(True, True))
    assert_identical(resumed, train(False, True))


def test_state_dict_mismatch_names_keys():
    sd = optimizer_in_backward(mlp(), **HP).state_dict()
    with pytest.raises(ValueError, match=r"missing \[\].*unexpected \['2.bias'"):
        optimizer_in_backward(nn.Sequential(nn.Linear(8, 32)), **HP).load_state_dict(sd)


def test_refusals():
    with pytest.raises(ValueError, match="cannot accumulate gradients"): check_compatible(grad_accum_steps=2)
    with pytest.raises(ValueError, match="cannot clip by global norm"): check_compatible(max_grad_norm=1.0)
    check_compatible(1, None); check_compatible(1, 0)
    assert in_backward_problems() == [] and in_backward_problems(1, 0) == []
    both = in_backward_problems(3, 0.5)
    assert len(both) == 2 and "grad_accum_steps=3" in both[0] and "max_grad_norm=0.5" in both[1]
    assert all("; set " in b for b in both)                # each names its fix
    model = mlp()
    with pytest.raises(ValueError, match="grad_accum_steps=8"): optimizer_in_backward(model, lr=1e-3, grad_accum_steps=8)
    with pytest.raises(ValueError, match="max_grad_norm=1.0"): optimizer_in_backward(model, lr=1e-3, max_grad_norm=1.0)
    # a refused construction registered no hooks: backward still leaves gradients
    model(BATCHES[0]).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="no parameters"): optimizer_in_backward(mlp().requires_grad_(False))


def test_remove_and_zero_grad():
    model = mlp()
    opt = optimizer_in_backward(model, **HP)
    opt.zero_grad()                                       # nothing to drop: fine
    opt.remove(); opt.remove()                            # idempotent
    before = [p.detach().clone() for p in model.parameters()]
    model(BATCHES[0]).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_lr_get_set():
    opt = optimizer_in_backward(mlp(), **HP)
    assert opt.lr == HP["lr"]
    opt.set_lr(1e-4)
    assert {g["lr"] for g in opt.param_groups} == {1e-4} and opt.lr == 1e-4
    assert "AdamW" in repr(opt) and isinstance(opt, InBackwardOptimizer)


def test_gradient_memory_is_one_tensor():
    params_seen = []
    model = mlp()
    params = list(model.parameters())
    def observe(_): params_seen.append(sum(p.grad.nbytes for p in params if p.grad is not None))
    for p in params: p.register_post_accumulate_grad_hook(observe)
    optimizer_in_backward(model, **HP)
    model(BATCHES[0]).pow(2).mean().backward()
    assert max(params_seen) == max(p.nbytes for p in params)


def cosine(step, w, total, r):
    if step < w: return step / w
    prog = min(1.0, (step - w) / (total - w))
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * prog))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("in_backward", [False, True])
def test_cosine_schedule_closed_form(in_backward):
    base = 2e-3
    model = mlp()
    opt = optimizer_in_backward(model, lr=base) if in_backward else torch.optim.AdamW(model.parameters(), lr=base)
    sched = get_cosine_schedule_with_warmup(opt, warmup_steps=5, total_steps=25, min_lr_ratio=0.2)
    assert isinstance(sched, SchedulerGroup) == in_backward
    lrs = []
    for _ in range(30):
        lrs.append(opt.param_groups[0]["lr"]); sched.step()
    for s in (0, 1, 5, 10, 15, 24, 25, 29):
        assert abs(lrs[s] - base * cosine(s, 5, 25, 0.2)) <= 1e-15, s
    assert abs(lrs[15] - base * 0.6) <= 1e-15                              # halfway: (1 + 0.2) / 2
    if in_backward: assert {g["lr"] for g in opt.param_groups} == {sched.get_last_lr()[0]}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_linear_and_constant_schedules():
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    lin = get_linear_schedule_with_warmup(opt, 2, 6)
    got = []
    for _ in range(8): got.append(opt.param_groups[0]["lr"]); lin.step()
    assert got == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    const = get_constant_schedule_with_warmup(opt, 4)
    got = []
    for _ in range(6): got.append(opt.param_groups[0]["lr"]); const.step()
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    get_schedule("constant", opt)
    assert opt.param_groups[0]["lr"] == 1.0


def test_schedule_errors():
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    with pytest.raises(ValueError, match="unknown schedule"): get_schedule("step", opt)
    with pytest.raises(ValueError, match="needs total_steps"): get_schedule("cosine", opt, 10)
    with pytest.raises(ValueError, match="total_steps"): get_cosine_schedule_with_warmup(opt, 10, 5)
    with pytest.raises(ValueError, match="warmup_steps"): get_cosine_schedule_with_warmup(opt, -1, 5)
    with pytest.raises(ValueError, match="min_lr_ratio"): get_cosine_schedule_with_warmup(opt, 0, 5, 1.5)


def test_with_chunked_loss_and_tied_weights():
    "optimizer_in_backward + ChunkedCrossEntropy on a tiny tied LM tracks AdamW + full logits."
    from tunebook.loss import ChunkedCrossEntropy, cross_entropy_loss

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(0)
            self.embed_tokens = nn.Embedding(61, 16); self.proj = nn.Linear(16, 16)
        def forward(self, ids): return torch.tanh(self.proj(self.embed_tokens(ids)))

    ids = torch.randint(0, 61, (2, 19), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    a, b = TinyLM(), TinyLM()
    opt_a = torch.optim.AdamW(decay_groups(a.parameters(), HP["weight_decay"]), **HP)
    optimizer_in_backward(b, **HP)
    ce = ChunkedCrossEntropy(4)
    for _ in range(5):
        cross_entropy_loss(a(ids) @ a.embed_tokens.weight.t(), labels).backward(); opt_a.step(); opt_a.zero_grad()
        ce(b(ids), b.embed_tokens.weight, labels).backward()
        assert all(p.grad is None for p in b.parameters())
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p - q).abs().max() <= 1e-6


def test_fused_adamw_close_to_loop_and_in_backward_bit_identical():
    "adamw() is fused on the CPU; the per-parameter fused step in backward equals a fused AdamW bitwise, and the loop to rounding."
    from tunebook.optim import adamw, fused_available
    assert fused_available("cpu")
    hp = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    fused = train(False, True, cls=lambda ps, **kw: adamw(ps, **kw), hp=hp)
    fused_ib = train(True, True, cls=torch.optim.AdamW, hp=dict(hp, fused=True))
    assert_identical(fused, fused_ib)
    loop = train(False, True, cls=torch.optim.AdamW, hp=dict(hp, foreach=False))
    for a, b in zip(fused.parameters(), loop.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    assert adamw([nn.Parameter(torch.zeros(2))]).defaults["fused"] is True
    assert not adamw([nn.Parameter(torch.zeros(2))], fused=False).defaults.get("fused")


def test_fused_resume_bitwise():
    "Checkpoint a fused AdamW mid-run, load it into a fresh one, continue: the same bits as the uninterrupted run."
    from tunebook.optim import adamw
    hp = dict(lr=3e-3, weight_decay=0.1)
    whole = mlp(); opt = adamw(whole.parameters(), **hp); run(whole, opt, None, range(6))
    half = mlp(); opt = adamw(half.parameters(), **hp); run(half, opt, None, range(3))
    buf = io.BytesIO(); torch.save({"m": half.state_dict(), "o": opt.state_dict()}, buf); buf.seek(0)
    ck = torch.load(buf)
    again = mlp(); again.load_state_dict(ck["m"]); opt2 = adamw(again.parameters(), **hp); opt2.load_state_dict(ck["o"])
    run(again, opt2, None, range(3, 6))
    assert_identical(whole, again)


def normed(seed=0):
    "Matrices, a LayerNorm's scale and shift, and biases."
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def by_hand(model, wd):
    "The weight-decay groups written out by parameter name, independently of decay_groups."
    named, mats = dict(model.named_parameters()), ("0.weight", "3.weight")
    return [{"params": [named[n] for n in mats], "weight_decay": wd},
            {"params": [p for n, p in named.items() if n not in mats], "weight_decay": 0.0}]


def test_decay_groups_matrices_only():
    model = normed()
    groups = decay_groups(model.parameters(), 0.1)
    ref = by_hand(model, 0.1)
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(p) for p in g["params"]] for g in ref]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert "weight_decay" not in decay_groups(model.parameters())[0]     # None: the optimizer's default for matrices
    with pytest.raises(TypeError, match="not param groups"): decay_groups(ref, 0.1)


@pytest.mark.parametrize("fused", [False, True])
def test_in_backward_decays_like_adamw_groups(fused):
    "Stepped in backward with weight_decay=0.1 == torch.optim.AdamW given the matrices-only groups by hand, bitwise."
    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    ref, everything, stepped = normed(), normed(), normed()
    opts = [torch.optim.AdamW(by_hand(ref, 0.1), **hp), torch.optim.AdamW(everything.parameters(), **hp)]
    optimizer_in_backward(stepped, **hp)
    for i in range(4):
        for m, o in zip((ref, everything), opts): m(BATCHES[i]).pow(2).mean().backward(); o.step(); o.zero_grad()
        stepped(BATCHES[i]).pow(2).mean().backward()
    got = dict(stepped.named_parameters())
    for n, p in ref.named_parameters(): torch.testing.assert_close(got[n], p, rtol=0, atol=0, msg=n)
    assert not torch.equal(everything[1].weight, ref[1].weight)      # decaying the norm too is a different step


def test_adamw_groups_bare_parameters():
    "adamw() on bare parameters decays the matrices only; given param groups, it takes them as they are."
    model = normed()
    opt = adamw(model.parameters(), lr=1e-3, weight_decay=0.1)
    assert [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == [(2, 0.1), (4, 0.0)]
    opt = adamw([{"params": list(model.parameters())}], lr=1e-3, weight_decay=0.1)
    assert [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == [(6, 0.1)]


def _embedded_full_step(tmp_path, in_backward):
    from tunebook.train import TrainConfig, Trainer
    cfg = TrainConfig(model="embedded", method="full", weight_decay=0.1, optimizer_in_backward=in_backward, max_grad_norm=None,
                      lr=1e-2, warmup_steps=0, schedule="constant", max_steps=1, batch_size=4, n_train=8, eval_samples=0,
                      dtype="fp32", output_dir=str(tmp_path / f"run-{in_backward}"))
    tr = Trainer(cfg).setup()
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train_step()
    return before, dict(tr.model.named_parameters())


def test_trainer_full_step_same_weights_either_way(tmp_path):
    "One full fine-tune step of the embedded model with weight_decay=0.1: stepped in backward == a normal AdamW step, bitwise."
    before, normal = _embedded_full_step(tmp_path, False)
    _, stepped = _embedded_full_step(tmp_path, True)
    norms = [n for n in normal if n.endswith("norm.weight")]
    assert norms and all(not torch.equal(normal[n], before[n]) for n in normal)    # every tensor moved, norms included
    for n, p in normal.items(): torch.testing.assert_close(stepped[n], p, rtol=0, atol=0, msg=n)
