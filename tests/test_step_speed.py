"""The training step's speed work (issue 18) keeps its numbers: one host transfer per optimizer step, losses and
weights bitwise those of the plain per-micro-batch `.item()` step."""
import math
import sys
import tempfile

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tunebook.data import IGNORE_INDEX
from tunebook.embedded import EMBEDDED_DIR
from tunebook.model import build_model, pico
from tunebook.tokenizer import load_tokenizer
from tunebook.train import TrainConfig, Trainer
from tunebook.train.objective import SFT

SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__"}
HOST_SIDE = {"batch", "rows_of", "micro_batch", "_mean_stats"}   # CPU-side data building and the host stats' mean


class CountSyncs(TorchFunctionMode):
    "Count tensor -> Python transfers (`.item()`, `.tolist()`, `float(t)`...) outside batch building."
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            f, names = sys._getframe(1), set()
            while f is not None: names.add(f.f_code.co_name); f = f.f_back
            if not names & HOST_SIDE: self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


class WithStats(SFT):
    "SFT plus a tensor stat, a float stat and a max stat: each used to cost a transfer per micro-batch."
    def loss(self, tr, b):
        l, _ = super().loss(tr, b)
        per_row = (b["labels"] != IGNORE_INDEX).sum(1).float()
        return l, dict(per_row=per_row, token_loss=l.detach(), per_row_max=per_row)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(EMBEDDED_DIR)   # the embedded tokenizer alone (ms)


def _trainer(tok, out=None, **kw):
    torch.manual_seed(0)
    cfg = TrainConfig(model="given", method="full", dtype="fp32", n_train=32, eval_samples=0, batch_size=4, max_steps=4,
                      output_dir=str(out or tempfile.mkdtemp()), **kw)
    return Trainer(cfg, model=build_model(pico(vocab_size=len(tok), dim=32, hidden_dim=64)), tokenizer=tok,
                   objective=WithStats()).setup()


@pytest.mark.parametrize("accum", [1, 3])
def test_one_transfer_per_step(tok, accum):
    "~2 s. Beyond batch building: the objective's weight per micro-batch (needed before backward) and one transfer."
    tr = _trainer(tok, grad_accum_steps=accum)
    for _ in range(2): tr.train_step()   # the memory-tracked first steps
    with CountSyncs() as c: row = tr.train_step()
    assert c.calls.count("tolist") == 1, c.calls          # losses, stats, grad norm, token counts: one .tolist()
    assert len(c.calls) == accum + 1, c.calls             # + int(weight) per micro-batch
    assert math.isfinite(row["per_row"]) and row["per_row_max"] >= row["per_row"]


def test_losses_bitwise_the_per_micro_batch_step(tok):
    "~2 s. Reference: the step written out with a `.item()` per micro-batch and float(norm), as the step was before."
    a, b = _trainer(tok, grad_accum_steps=2), _trainer(tok, grad_accum_steps=2)
    got = [a.train_step() for _ in range(3)]
    for s in range(3):
        bs = [b.micro_batch(s * 2 + k) for k in range(2)]
        n = sum(int((x["labels"] != IGNORE_INDEX).sum()) for x in bs)
        sums = []
        for x in bs:
            with b.forward_context(): l = b.loss_sum(x)
            sums.append(l.item()); (l / n).backward()
        params = [p for p in b.model.parameters() if p.requires_grad]
        norm = float(torch.nn.utils.clip_grad_norm_(params, b.config.max_grad_norm or math.inf))
        b.optimizer.step(); b.optimizer.zero_grad(set_to_none=True); b.scheduler.step(); b.step += 1
        assert got[s]["loss"] == sum(sums) / n and got[s]["grad_norm"] == norm, (s, got[s]["loss"], sum(sums) / n)
        assert got[s]["tokens"] == n
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_prefetch_same_losses_and_resume_bitwise(tok, tmp_path):
    "~3 s. Batches built one step ahead on a thread: the losses of a plain run, and a resumed run continues to the bit."
    def steps(tr, n, prefetch):
        tr.prefetch = prefetch
        out = [tr.train_step()["loss"] for _ in range(n)]
        return out
    plain = steps(_trainer(tok, grad_accum_steps=2), 4, False)
    a = _trainer(tok, tmp_path / "a", grad_accum_steps=2)
    assert steps(a, 4, True) == plain
    assert a._ahead is None and a._prefetcher is not None   # max_steps reached: nothing built past the end
    a.stop_prefetch()
    b = _trainer(tok, tmp_path / "b", grad_accum_steps=2)
    first = steps(b, 2, True)
    b.save_checkpoint(); b.stop_prefetch(); del b
    c = _trainer(tok, tmp_path / "b", grad_accum_steps=2, resume=True)
    assert c.step == 2 and first + steps(c, 2, True) == plain
