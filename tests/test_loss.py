"""ChunkedCrossEntropy and chunked_logprobs against full-logit F.cross_entropy: values, gradients, dtypes, edge cases, memory."""
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tunebook.loss import ChunkedCrossEntropy, chunked_logprobs, cross_entropy_loss, num_loss_tokens, projection_weight

FP32_TOL = 1e-6             # max abs, loss and both gradients
BF16_LOSS_TOL, BF16_GRAD_TOL = 1e-3, 2e-2


def make_inputs(B=2, T=37, D=32, V=500, dtype=torch.float32, n_ignored=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * D**-0.5).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :n_ignored] = -100
    return hidden, weight, labels


def run(fn, hidden, weight, labels):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def reference(h, w, y):
    return F.cross_entropy((h @ w.t()).float().flatten(0, 1), y.flatten(), ignore_index=-100)


def errors(hidden, weight, labels, loss_fn, ref=reference):
    a, b = run(ref, hidden, weight, labels), run(loss_fn, hidden, weight, labels)
    return [(x.float() - y.float()).abs().max().item() for x, y in zip(a, b)]


@pytest.mark.parametrize("num_chunks", [1, 3, 8, 64])
@pytest.mark.parametrize("shape", [dict(T=37), dict(T=64, n_ignored=0), dict(T=5), dict(B=1, T=129, V=1000),
                                   dict(B=3, T=16, D=48, V=300, n_ignored=16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_full_logits_fp32(num_chunks, shape, seed):
    errs = errors(*make_inputs(seed=seed, **shape), ChunkedCrossEntropy(num_chunks))
    assert max(errs) <= FP32_TOL, errs


def test_ignored_tokens_are_ignored():
    h, w, y = make_inputs()
    y2 = y.clone(); y2[1, ::3] = -100
    loss = ChunkedCrossEntropy(4)(h, w, y2)
    assert torch.allclose(loss, reference(h, w, y2), atol=FP32_TOL, rtol=0)
    assert not torch.allclose(loss, reference(h, w, y), atol=1e-3)
    # the gradient of hidden is exactly zero at ignored positions
    _, gh, _ = run(ChunkedCrossEntropy(4), h, w, y2)
    assert gh[y2 == -100].abs().max() == 0


def test_custom_ignore_index():
    h, w, y = make_inputs(V=50)
    y[1, :7] = 0
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten().masked_fill(y.flatten() == -100, 0), ignore_index=0)
    y0 = y.masked_fill(y == -100, 0)
    assert torch.allclose(ChunkedCrossEntropy(3, ignore_index=0)(h, w, y0), ref, atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("T", [5, 45])
def test_bf16(T):
    hidden, weight, labels = make_inputs(T=T, dtype=torch.bfloat16)
    errs = errors(hidden, weight, labels, ChunkedCrossEntropy(8))
    assert errs[0] <= BF16_LOSS_TOL and max(errs[1:]) <= BF16_GRAD_TOL, errs
    loss, gh, gw = run(ChunkedCrossEntropy(8), hidden, weight, labels)
    assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16


def test_all_ignored_is_zero_with_zero_grads():
    h, w, _ = make_inputs()
    y = torch.full((2, 37), -100)
    for reduction in ("mean", "sum"):
        loss, gh, gw = run(ChunkedCrossEntropy(8, reduction=reduction), h, w, y)
        assert loss.item() == 0.0 and not loss.isnan()
        assert gh.abs().max() == 0 and gw.abs().max() == 0
    assert cross_entropy_loss(h @ w.t(), y).item() == 0.0


def test_frozen_weight_gets_no_grad():
    h, w, y = make_inputs()
    h.requires_grad_()
    ChunkedCrossEntropy(8)(h, w, y).backward()
    assert w.grad is None and h.grad is not None


def test_gradcheck_fp64():
    h, w, y = make_inputs(B=2, T=5, D=4, V=7, dtype=torch.float64, n_ignored=2)
    h.requires_grad_(); w.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, w: ChunkedCrossEntropy(3)(h, w, y), (h, w))
    assert torch.autograd.gradcheck(lambda h, w: ChunkedCrossEntropy(2, reduction="sum")(h, w, y), (h, w))


def test_upstream_gradient_is_scaled():
    h, w, y = make_inputs()
    a = run(lambda h, w, y: 2.5 * ChunkedCrossEntropy(4)(h, w, y), h, w, y)
    b = run(lambda h, w, y: 2.5 * reference(h, w, y), h, w, y)
    assert all((x - z).abs().max() <= 3e-6 for x, z in zip(a, b))


def test_sum_reduction_and_gradient_accumulation():
    h, w, y = make_inputs(B=4, T=20)
    y[1, :15] = -100
    total = ChunkedCrossEntropy(4, reduction="sum")(h, w, y)
    assert torch.allclose(total, cross_entropy_loss(h @ w.t(), y, reduction="sum"), rtol=1e-6, atol=0)
    n = num_loss_tokens(y)
    assert n.item() == 4 * 20 - 5 - 15
    acc = sum(ChunkedCrossEntropy(4, reduction="sum")(h[i:i + 2], w, y[i:i + 2]) / n for i in (0, 2))
    assert torch.allclose(acc, ChunkedCrossEntropy(4)(h, w, y), atol=FP32_TOL, rtol=0)


def test_int32_labels():
    h, w, y = make_inputs()
    assert torch.allclose(ChunkedCrossEntropy(4)(h, w, y.int()), reference(h, w, y), atol=FP32_TOL, rtol=0)


def test_bad_input():
    with pytest.raises(ValueError, match="num_chunks must be an integer >= 1"): ChunkedCrossEntropy(0)
    with pytest.raises(ValueError, match="num_chunks"): ChunkedCrossEntropy(-3)
    with pytest.raises(ValueError, match="num_chunks"): ChunkedCrossEntropy(2.0)
    with pytest.raises(ValueError, match="reduction"): ChunkedCrossEntropy(reduction="max")
    h, w, y = make_inputs()
    ce = ChunkedCrossEntropy()
    with pytest.raises(ValueError, match=r"output_weight \(500, 16\)"): ce(h, w[:, :16], y)
    with pytest.raises(ValueError, match=r"labels \(2, 36\)"): ce(h, w, y[:, :36])
    with pytest.raises(ValueError, match=r"hidden \(37, 32\)"): ce(h[0], w, y)
    with pytest.raises(TypeError, match="integer"): ce(h, w, y.float())
    with pytest.raises(TypeError, match="must share a dtype"): ce(h, w.bfloat16(), y)
    with pytest.raises(ValueError, match=r"\(2, 37, 500\)"): cross_entropy_loss(h @ w.t(), y[:, :5])


class TinyLM(nn.Module):
    "Embedding -> Linear -> tanh -> output head, optionally tied: enough to train end to end."
    def __init__(self, V=97, D=24, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tied: self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids): return torch.tanh(self.proj(self.embed_tokens(ids)))   # (B, T, D) hidden


@pytest.mark.parametrize("tied", [False, True])
def test_training_matches_full_logits(tied):
    "A few SGD steps of a tiny LM: same parameters with the chunked loss as with full logits."
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], 1)
    labels[0, :6] = -100
    models = []
    for chunked in (False, True):
        m = TinyLM(tied=tied)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        ce = ChunkedCrossEntropy(4)
        for _ in range(5):
            hidden = m(ids)
            loss = ce(hidden, m.lm_head.weight, labels) if chunked else cross_entropy_loss(m.lm_head(hidden), labels)
            loss.backward(); opt.step(); opt.zero_grad()
        models.append(m)
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert (a - b).abs().max() <= 1e-6, n


class LiveBytes(TorchDispatchMode):
    "Bytes of tensor storages created inside the block: `.live` now, `.peak` at most."
    def __init__(self):
        super().__init__(); self.live = self.peak = 0; self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor): continue
            st = t.untyped_storage(); key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in self._seen or key in inputs: continue
            self._seen.add(key); self.live += n; self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key, n)
        return out

    def _free(self, key, n): self._seen.discard(key); self.live -= n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_no_full_logits(dtype):
    B, T, D, V = 2, 512, 64, 8192
    h, w, y = make_inputs(B, T, D, V, dtype=dtype)
    h.requires_grad_(); w.requires_grad_()
    logits_fp32 = B * T * V * 4
    peaks = {}
    for name, fn in {"full": lambda: cross_entropy_loss(h @ w.t(), y), "chunked": lambda: ChunkedCrossEntropy(8)(h, w, y)}.items():
        with LiveBytes() as m:
            loss = fn(); kept = m.live
            loss.backward()
        peaks[name] = (m.peak, kept)
        h.grad = w.grad = None
    assert peaks["full"][1] >= logits_fp32                 # log-softmax kept for backward
    assert peaks["chunked"][1] < B * T * 4 + 64            # only the 0-dim loss, token count and N fp32 logsumexps
    chunk = logits_fp32 // 8
    grads = h.numel() * h.element_size() + V * D * 4       # dh (and its fp32 sum over slices), dW
    assert peaks["chunked"][0] <= 1.5 * chunk + 1.5 * grads + 2**16, peaks
    assert peaks["chunked"][0] < peaks["full"][0] / 8, peaks


# final logit soft-cap: z' = c * tanh(z / c), as the model applies it (model.final_softcap)

def capped_reference(cap):
    def ref(h, w, y):
        z = (h @ w.t()).float()
        return F.cross_entropy((cap * torch.tanh(z / cap)).flatten(0, 1), y.flatten(), ignore_index=-100)
    return ref


@pytest.mark.parametrize("cap", [3.0, 30.0])
@pytest.mark.parametrize("num_chunks", [1, 5, 64])
def test_softcap_matches_capped_full_logits(cap, num_chunks):
    hidden, weight, labels = make_inputs(T=37, V=300)
    weight = weight * 8   # logits up to ~40: the tanh saturates at cap 3
    errs = errors(hidden, weight, labels, ChunkedCrossEntropy(num_chunks, softcap=cap), ref=capped_reference(cap))
    assert max(errs) <= FP32_TOL * 10, errs
    # and the cap matters: the uncapped loss is far off
    assert errors(hidden, weight, labels, ChunkedCrossEntropy(num_chunks, softcap=cap))[0] > 1e-2


def test_softcap_sum_reduction_and_bf16():
    hidden, weight, labels = make_inputs(T=29, V=200)
    weight = weight * 8
    ref = lambda h, w, y: capped_reference(5.0)(h, w, y) * num_loss_tokens(y)
    assert max(errors(hidden, weight, labels, ChunkedCrossEntropy(4, reduction="sum", softcap=5.0), ref=ref)) <= 1e-4
    errs = errors(hidden.bfloat16(), weight.bfloat16(), labels, ChunkedCrossEntropy(4, softcap=5.0), ref=capped_reference(5.0))
    assert errs[0] <= BF16_LOSS_TOL and max(errs[1:]) <= BF16_GRAD_TOL, errs


def test_softcap_gradcheck_fp64():
    h, w, y = make_inputs(B=2, T=5, D=4, V=7, dtype=torch.float64, n_ignored=2)
    assert torch.autograd.gradcheck(lambda h, w: ChunkedCrossEntropy(3, softcap=0.5)(h, w * 4, y),
                                    (h.requires_grad_(), w.requires_grad_()))


def test_softcap_is_the_models():
    "With the model's own final_softcap, the chunked loss on hidden states equals the loss on the model's logits."
    from tunebook.model import build_model, pico
    torch.manual_seed(0)
    model = build_model(pico(arch="gemma3_text", qk_norm=True, hidden_act="gelu_pytorch_tanh", tie_embeddings=True,
                             final_softcap=2.0))
    with torch.no_grad(): model.embed_tokens.weight.mul_(50)   # logits far past the cap
    tokens = torch.randint(0, 512, (2, 16))
    y = tokens.roll(-1, 1); y[:, -1] = -100
    ref = cross_entropy_loss(model(tokens), y)
    ours = ChunkedCrossEntropy(4, softcap=model.final_softcap)(model(tokens, return_hidden=True), model.output_weight, y)
    assert (ours - ref).abs().item() <= 1e-5
    plain = ChunkedCrossEntropy(4)(model(tokens, return_hidden=True), model.output_weight, y)
    assert (plain - ref).abs().item() > 1e-3


def test_softcap_bad_values():
    for bad in (0, -1.0, "30", True):
        with pytest.raises(ValueError, match="softcap must be a positive number"):
            ChunkedCrossEntropy(softcap=bad)


# bf16 autocast (fp32 master weights): both passes in bf16, the weight cast once per pass, fp32 softmax statistics

def autocast_bf16(fn):
    def f(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16): return fn(*args)
    return f


@pytest.mark.parametrize("num_chunks", [1, 8, 64])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_autocast_matches_autocast_reference(num_chunks, cap):
    "Against F.cross_entropy on full logits computed under the same autocast: loss 1e-5, grads one bf16 step."
    hidden, weight, labels = make_inputs(T=37)
    if cap is not None: weight = weight * 8
    ref_fn = reference if cap is None else capped_reference(cap)
    ref = run(autocast_bf16(ref_fn), hidden, weight, labels)
    ours = run(autocast_bf16(ChunkedCrossEntropy(num_chunks, softcap=cap)), hidden, weight, labels)
    assert [t.dtype for t in ours] == [torch.float32] * 3
    assert (ours[0] - ref[0]).abs() <= 1e-5, (ours[0], ref[0])
    for a, b in zip(ours[1:], ref[1:]):
        assert (a - b).abs().max() <= 2**-7 * b.abs().max(), ((a - b).abs().max(), b.abs().max())
    # and autocast really applies: the fp32 loss is measurably different
    assert (run(ChunkedCrossEntropy(num_chunks, softcap=cap), hidden, weight, labels)[0] - ref[0]).abs() > 3e-5


class OpLog(TorchDispatchMode):
    "Record (op name, input dtypes, input shapes) of every aten op run inside the block."
    def __init__(self):
        super().__init__(); self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ts = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.ops.append((func.__name__.split(".")[0], [t.dtype for t in ts], [tuple(t.shape) for t in ts]))
        return func(*args, **(kwargs or {}))


def op_logs(fn, hidden, weight, labels):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with OpLog() as fwd: loss = fn(h, w, labels)
    with OpLog() as bwd: loss.backward()
    return fwd.ops, bwd.ops


MATMULS = ("mm", "addmm", "addmm_", "bmm", "matmul", "baddbmm")


def weight_copies(ops, V, D):
    return sum(op in ("_to_copy", "copy_", "clone", "contiguous") and ((V, D) in shapes or (D, V) in shapes)
               for op, _, shapes in ops)


@pytest.mark.parametrize("B", [1, 3])
def test_autocast_bf16_matmuls_in_both_passes_weight_cast_once(B):
    hidden, weight, labels = make_inputs(B=B, T=24, D=32, V=500)
    fwd, bwd = op_logs(autocast_bf16(ChunkedCrossEntropy(8)), hidden, weight, labels)
    for ops in (fwd, bwd):
        mms = [(op, dts, shapes) for op, dts, shapes in ops if op in MATMULS]
        bf = [(op, dts) for op, dts, shapes in mms if torch.float32 not in dts]
        assert len(bf) >= 8 and all(op == "mm" and dt == torch.bfloat16 for op, dts in bf for dt in dts), mms   # logits, dh
        assert weight_copies(ops, 500, 32) == 1
    assert all(set(dts) == {torch.bfloat16} for op, dts, _ in fwd if op in MATMULS)   # operands (and out=) all bf16
    # backward: the only fp32 product is dW, one (v, N) x (N, D) mm per vocabulary slice, written into its rows (out=)
    dw = [shapes for op, dts, shapes in bwd if op in MATMULS and torch.float32 in dts]
    n = B * 24 - 5 if 5 >= B * 24 / 8 else B * 24            # the trained positions only, when at least an eighth are ignored
    assert len(dw) == 8 and all(s[0] == (s[2][0], n) and s[1] == (n, 32) for s in dw), dw
    assert sum(s[2][0] for s in dw) == 500 and not any(op == "addmm_" and (500, 32) in sh for op, _, sh in bwd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dw_by_vocabulary_slices_is_accurate(dtype):
    "dW slice by slice (one product over all N tokens each, no accumulator): as close to fp64 as one rounding of the result."
    hidden, weight, labels = make_inputs(B=2, T=40, D=32, V=500, dtype=dtype)
    ref = run(lambda h, w, y: reference(h.double(), w.double(), y), hidden.float(), weight.float(), labels)
    for k in (1, 3, 7):
        loss, gh, gw = run(ChunkedCrossEntropy(k), hidden, weight, labels)
        assert gw.dtype == dtype
        for g, r in ((gh, ref[1]), (gw, ref[2])):
            assert (g.double() - r).abs().max() <= (2**-7 if dtype == torch.bfloat16 else 1e-6) * r.abs().max(), (k, dtype)
    # the check can fail: a weight gradient off by one slice's rows is far outside it
    _, _, gw = run(ChunkedCrossEntropy(3), hidden, weight, labels)
    assert (gw[:100].double() - ref[2][100:200]).abs().max() > 2**-7 * ref[2].abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_chunks_are_plain_2d_matmuls(dtype):
    "B > 1: no batched product and no weight-sized copy in either pass."
    hidden, weight, labels = make_inputs(B=4, T=20, D=32, V=500, dtype=dtype)
    fwd, bwd = op_logs(ChunkedCrossEntropy(8), hidden, weight, labels)
    assert all(op == "mm" or op == "addmm_" for op, _, _ in fwd + bwd if op in MATMULS)
    assert not any(op == "expand" for op, _, _ in fwd + bwd)
    assert weight_copies(fwd, 500, 32) == 0 and weight_copies(bwd, 500, 32) == 0   # dW's slices go straight into its rows
    # every product takes all 80 flattened tokens as one row block (5 ignored: too few to gather), against one of 8 vocabulary slices
    mm = [shapes for op, _, shapes in fwd if op == "mm"]
    assert {s[0] for s in mm} == {(80, 32)} and len(mm) == 8 and sum(s[1][1] for s in mm) == 500


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_trained_positions_get_logits(reduction, dtype):
    "On a CPU the products take the positions that count and no others (prompts, padding); values and gradients as full logits."
    hidden, weight, labels = make_inputs(B=3, T=40, D=32, V=500, dtype=dtype, n_ignored=0, seed=5)
    labels[0, :30] = -100; labels[2, ::2] = -100                     # a prompt, and every other position of a row
    n = int((labels != -100).sum())
    ce = ChunkedCrossEntropy(4, reduction=reduction)
    fn = (lambda h, w, y: ce(h, w, y).sum()) if reduction == "none" else ce
    fwd, bwd = op_logs(fn, hidden, weight, labels)
    rows = {s[0][0] for op, _, s in fwd + bwd if op == "mm" and s[0][1] == 32}   # (rows, D) x (D, v): logits, recomputed
    assert rows == {n} and n < 3 * 40, (rows, n)
    def ref(h, w, y):
        per = F.cross_entropy((h @ w.t()).float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none")
        return per.sum() if reduction != "mean" else per.sum() / n
    errs = errors(hidden, weight, labels, fn, ref)
    tol = (BF16_LOSS_TOL * (n if reduction != "mean" else 1), BF16_GRAD_TOL) if dtype == torch.bfloat16 else (n * 1e-6, FP32_TOL)
    assert errs[0] <= tol[0] and max(errs[1:]) <= tol[1], errs
    _, gh, _ = run(fn, hidden, weight, labels)
    assert gh[labels == -100].abs().max() == 0 and gh[labels != -100].abs().min() > 0
    # with nothing ignored, or fewer than an eighth (14 of 120), every position is a row
    for k in (0, 14):
        fwd, _ = op_logs(ChunkedCrossEntropy(4), *make_inputs(B=3, T=40, D=32, V=500, dtype=dtype, n_ignored=k))
        assert {s[0][0] for op, _, s in fwd if op == "mm"} == {120}, k
    fwd, _ = op_logs(ChunkedCrossEntropy(4), *make_inputs(B=3, T=40, D=32, V=500, dtype=dtype, n_ignored=15))
    assert {s[0][0] for op, _, s in fwd if op == "mm"} == {105}   # an eighth: gathered


def test_cpu_vocabulary_slices_are_narrow_and_exact():
    "On a CPU no slice is wider than CPU_VOCAB_SLICE, whatever num_chunks; the logsumexp merged across slices is exact."
    from tunebook.loss import CPU_VOCAB_SLICE
    V = 2 * CPU_VOCAB_SLICE + 300
    hidden, weight, labels = make_inputs(B=2, T=24, D=16, V=V, seed=3)
    labels[1, :4] = torch.tensor([0, V - 1, CPU_VOCAB_SLICE - 1, CPU_VOCAB_SLICE])   # targets at the slice edges
    fwd, bwd = op_logs(ChunkedCrossEntropy(2), hidden, weight, labels)
    widths = [shapes[1][1] for op, _, shapes in fwd if op == "mm"]
    assert len(widths) == 3 and max(widths) <= CPU_VOCAB_SLICE and sum(widths) == V, widths
    assert len([1 for op, _, _ in bwd if op == "mm"]) == 6   # the recomputed logits and dW for each of the 3 slices (dh: addmm_)
    for k in (1, 2):
        errs = errors(hidden, weight, labels, ChunkedCrossEntropy(k))
        assert errs[0] <= 2e-6 and max(errs[1:]) <= 1e-6, (k, errs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_keeps_the_logits_and_skips_the_recompute(dtype):
    "num_chunks=1: backward reads the forward's logits (no h @ W.T again), to the bit what the recompute gives, twice over."
    from tunebook.loss import CPU_VOCAB_SLICE
    V = 2 * CPU_VOCAB_SLICE + 300   # 3 slices for num_chunks 1 and 2 alike: the two differ only in keeping the logits
    hidden, weight, labels = make_inputs(B=2, T=24, D=16, V=V, dtype=dtype, seed=4)
    _, bwd = op_logs(ChunkedCrossEntropy(1), hidden, weight, labels)
    assert not [s for op, _, s in bwd if op == "mm" and s[0] == (48, 16) and s[1][0] == 16]   # no (N, D) x (D, v) product
    kept, recomputed = run(ChunkedCrossEntropy(1), hidden, weight, labels), run(ChunkedCrossEntropy(2), hidden, weight, labels)
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = ChunkedCrossEntropy(1)(h, w, labels)
    loss.backward(retain_graph=True); g1 = h.grad.clone(); loss.backward()   # a second backward sees the same logits
    assert torch.equal(h.grad, 2 * g1) if dtype == torch.float32 else (h.grad.float() - 2 * g1.float()).abs().max() <= 2**-7 * g1.abs().max()


def test_labels_outside_the_vocabulary_fail_clearly():
    hidden, weight, labels = make_inputs(V=500)
    for bad in (500, 10_000, -5):
        y = labels.clone(); y[1, 3] = bad
        with pytest.raises(ValueError, match=rf"token ids in \[0, 500\).*\[{bad}\].*vocabulary"):
            ChunkedCrossEntropy(4)(hidden, weight, y)
    y = labels.clone(); y[1, 3] = -100   # ignore_index itself is fine
    assert torch.isfinite(ChunkedCrossEntropy(4)(hidden, weight, y))


def test_autocast_mixed_dtypes_and_fp64():
    hidden, weight, labels = make_inputs()
    hb, wf = hidden.bfloat16().requires_grad_(), weight.clone().requires_grad_()
    loss = autocast_bf16(ChunkedCrossEntropy(4))(hb, wf, labels)
    loss.backward()
    assert (loss.dtype, hb.grad.dtype, wf.grad.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    ref = run(autocast_bf16(reference), hidden.bfloat16().float(), weight, labels)[0]
    assert (loss - ref).abs() <= 1e-5
    with pytest.raises(TypeError, match="must share a dtype"): ChunkedCrossEntropy(4)(hb, wf, labels)
    # fp64 is never autocast: same as outside autocast, to fp64 precision
    h64, w64 = hidden.double(), weight.double()
    a = run(autocast_bf16(ChunkedCrossEntropy(4)), h64, w64, labels)
    b = run(lambda h, w, y: F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten()), h64, w64, labels)   # fp64 throughout
    assert a[0].dtype == torch.float64 and max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-12


# per-token log-probabilities (reduction="none"): what DPO, KTO and GRPO use, by the same vocabulary slices

def logprob_reference(cap=None):
    "Minus F.cross_entropy(reduction='none') on full logits (the product in the inputs' dtype, the softmax in fp32)."
    def ref(h, w, y):
        z = (h @ w.t()).float()
        if cap is not None: z = cap * torch.tanh(z / cap)
        return -F.cross_entropy(z.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none").view(y.shape)
    return ref


def logprob_errors(hidden, weight, labels, fn, ref, relative=False):
    """Max abs differences in values, d hidden, d weight, under a non-uniform per-token upstream gradient
    (relative=True: each gradient's over the reference's largest entry)."""
    up = torch.randn(labels.shape, generator=torch.Generator().manual_seed(7))
    out = []
    for f in (fn, ref):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp = f(h, w, labels)
        (lp * up).sum().backward()
        out.append((lp.detach(), h.grad, w.grad))
    errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*out)]
    return [errs[0]] + [e / b.abs().max().item() for e, b in zip(errs[1:], out[1][1:])] if relative else errs


@pytest.mark.parametrize("num_chunks", [1, 3, 8])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_token_logprobs_match_full_logits(num_chunks, cap):
    "Values and both gradients within 1e-5 of full logits; targets on both sides of the 1024-column CPU slice edges."
    hidden, weight, labels = make_inputs(T=37, V=2500)   # CPU slices 0:1024, 1024:2048, 2048:2500 (more with num_chunks=8)
    if cap is not None: weight = weight * 8           # logits far past the cap
    labels[1, :6] = torch.tensor([0, 1023, 1024, 2047, 2048, 2499])
    errs = logprob_errors(hidden, weight, labels, lambda h, w, y: chunked_logprobs(h, w, y, num_chunks, softcap=cap),
                          logprob_reference(cap))
    assert max(errs) <= 1e-5, errs
    lp = chunked_logprobs(hidden, weight, labels, num_chunks, softcap=cap)
    assert lp.shape == labels.shape and lp.dtype == torch.float32
    assert (lp[labels == -100] == 0).all() and (lp[labels != -100] < 0).all()


def test_token_logprobs_can_fail():
    "The check sees a wrong cap, and a backward that ignores the per-token gradient (same values, gradient of their sum)."
    hidden, weight, labels = make_inputs(T=21, V=300)
    assert logprob_errors(hidden, weight * 8, labels, lambda h, w, y: chunked_logprobs(h, w, y, 4), logprob_reference(3.0))[0] > 1e-2
    def one_gradient(h, w, y):
        v = chunked_logprobs(h, w, y, 4)
        return v.detach() + (v.sum() - v.sum().detach())
    errs = logprob_errors(hidden, weight, labels, one_gradient, logprob_reference())
    assert errs[0] <= 1e-5 and min(errs[1:]) > 1e-2, errs


def test_token_logprobs_bf16_and_autocast():
    hidden, weight, labels = make_inputs(T=45)
    errs = logprob_errors(hidden.bfloat16(), weight.bfloat16(), labels, lambda h, w, y: chunked_logprobs(h, w, y, 8),
                          logprob_reference())
    assert errs[0] <= BF16_LOSS_TOL and max(errs[1:]) <= BF16_GRAD_TOL, errs
    errs = logprob_errors(hidden, weight, labels, autocast_bf16(lambda h, w, y: chunked_logprobs(h, w, y, 8)),
                          autocast_bf16(logprob_reference()), relative=True)
    assert errs[0] <= 1e-5 and max(errs[1:]) <= 2**-7, errs   # fp32 gradients of bf16 products: one bf16 step


def test_token_logprobs_gradcheck_fp64():
    h, w, y = make_inputs(B=2, T=5, D=4, V=7, dtype=torch.float64, n_ignored=2)
    for cap in (None, 0.5):
        assert torch.autograd.gradcheck(lambda h, w: chunked_logprobs(h, w * 4, y, 3, softcap=cap),
                                        (h.clone().requires_grad_(), w.clone().requires_grad_()))


def test_token_logprobs_sum_is_the_summed_loss():
    "reduction='none' summed is reduction='sum' (and its gradient), to fp32 rounding."
    hidden, weight, labels = make_inputs(T=33)
    errs = errors(hidden, weight, labels, lambda h, w, y: -chunked_logprobs(h, w, y, 4).sum(),
                  ref=ChunkedCrossEntropy(4, reduction="sum"))
    assert max(errs) <= 1e-5, errs


def test_projection_weight_refuses_an_active_lm_head_adapter():
    import warnings
    from tunebook.lora import apply_lora, disable_adapters, merge_lora
    from tunebook.model import build_model, pico
    torch.manual_seed(0)
    m = build_model(pico(vocab_size=64))
    assert projection_weight(m) is m.output_weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_lora(m, rank=2, targets=("lm_head",))
    with pytest.raises(ValueError, match="remove lm_head from lora_targets, or set chunked_ce=0"): projection_weight(m)
    nn.init.normal_(m.lm_head.lora_B.weight)
    h = torch.randn(2, 3, m.config.dim)
    with disable_adapters(m): assert torch.allclose(h @ projection_weight(m).t(), m.lm_head(h), atol=1e-6)
    merge_lora(m, replace=False)
    assert torch.allclose(h @ projection_weight(m).t(), m.lm_head(h), atol=1e-5)
    m.lm_head = nn.Linear(m.config.dim, 64)
    with pytest.raises(ValueError, match="has a bias"): projection_weight(m)
