"""Regional compilation: a block is one graph with no breaks, sequence lengths do not recompile, inductor's compiled
training steps give the eager losses, generation stays eager. (Every precision x compile through the trainer, with
aot_eager, and exact resume in each: tests/test_modes.py.)"""
import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from tunebook.attention import build_mask
from tunebook.compile import compile_block, compile_loss, compile_model, is_compiled, uncompile_block
from tunebook.lora import apply_lora
from tunebook.loss import ChunkedCrossEntropy
from tunebook.model import build_model, get_config, pico
from tunebook.precision import resolve_precision

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def small(lora=True, n_layers=3, **kw):
    torch.manual_seed(0)
    m = build_model(pico(n_layers=n_layers, **kw))
    if lora: apply_lora(m, rank=4, targets=TARGETS)
    return m


def block_inputs(m, T=16, masked=True):
    x = torch.randn(2, T, m.config.dim, requires_grad=True)
    cos, sin = m.rope(torch.arange(T)[None].expand(2, T))
    return x, cos, sin, (build_mask(T, attn_mask=torch.ones(2, T)) if masked else None)


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_block_is_one_graph_without_breaks(masked, checkpointed):
    m = small()
    if checkpointed:
        from tunebook.memory import apply_activation_checkpointing
        apply_activation_checkpointing(m)
    m.train()
    b = m.layers[0]
    ex = torch._dynamo.explain(b)(*block_inputs(m, masked=masked))
    if masked or checkpointed:   # the eager block itself with an explicit mask traces whole
        assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    # compile_block's wrapper: fullgraph=True refuses any break, so running it is the proof (also for mask=None)
    compile_block(b, backend="eager")
    out = b(*block_inputs(m, masked=masked))
    assert out.shape == (2, 16, m.config.dim)


def test_loss_is_one_graph_without_breaks():
    h, w, y = torch.randn(2, 12, 64, requires_grad=True), torch.randn(512, 64), torch.randint(0, 512, (2, 12))
    ex = torch._dynamo.explain(ChunkedCrossEntropy(4))(h, w, y)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons


@pytest.mark.parametrize("lora,want", [(True, 2), (False, 1)])
def test_no_recompile_across_sequence_lengths(lora, want):
    "LoRA: the first block's input needs no grad (frozen embedding), the others' do: 2 graphs; full fine-tune: 1."
    m = small(lora)
    cnt = CompileCounter()
    compile_model(m, backend=cnt)
    lens = (16, 17, 40, 9, 33, 64)
    for T in lens:
        m(torch.randint(0, 512, (2, T)), return_hidden=True).sum().backward()
    assert cnt.frame_count == want, cnt.frame_count
    # padded batches (a real attention mask): one more graph per variant, then none per length
    for T in (21, 50, 13):
        am = torch.ones(2, T, dtype=torch.long); am[1, T // 2:] = 0
        m(torch.randint(0, 512, (2, T)), attn_mask=am, return_hidden=True).sum().backward()
    assert cnt.frame_count <= 2 * want, cnt.frame_count


def test_loss_no_recompile_across_token_counts():
    cnt = CompileCounter()
    lf = compile_loss(ChunkedCrossEntropy(4), backend=cnt)
    w = torch.randn(512, 64, requires_grad=True)
    for T in (16, 23, 40, 57):
        lf(torch.randn(2, T, 64, requires_grad=True), w, torch.randint(0, 512, (2, T))).backward()
    assert cnt.frame_count <= 2, cnt.frame_count   # forward graph; dynamo sees the backward through aot, not as frames


def _train(m, lf, steps, precision="fp32", lengths=(24, 31, 24)):
    p = resolve_precision(precision)
    opt = torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=1e-2)
    losses = []
    for i in range(steps):
        T = lengths[i % len(lengths)]
        g = torch.Generator().manual_seed(i)
        tok, y = torch.randint(0, 512, (2, T), generator=g), torch.randint(0, 512, (2, T), generator=g)
        with p.autocast():
            loss = lf(m(tok, return_hidden=True), m.output_weight, y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_compiled_training_matches_eager_inductor():
    "Inductor's generated code (fp32): LoRA training losses agree with eager to 1e-4 relative over 3 steps of varying length."
    m = small(lora=True, n_layers=2)
    ref = _train(copy.deepcopy(m), ChunkedCrossEntropy(4), 3)
    got = _train(compile_model(copy.deepcopy(m), lf := ChunkedCrossEntropy(4)), lf, 3)
    assert max(abs(a - b) for a, b in zip(ref, got)) <= 1e-4 * max(ref), (ref, got)


def test_sliding_window_block_keeps_its_window():
    "mask=None on a sliding-window block: the wrapper's explicit mask has the window, as eager attention builds it."
    cfg = get_config("gemma3_270m", vocab_size=512, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=128, head_dim=32,
                     sliding_window=4)
    torch.manual_seed(0)
    m = build_model(cfg)
    tok = torch.randint(0, 512, (1, 12))
    ref = m(tok)
    mc = compile_model(copy.deepcopy(m), backend="eager")
    torch.testing.assert_close(mc(tok), ref, atol=1e-5, rtol=1e-5)


def test_uncompile_and_refusals():
    m = small()
    compile_model(m, backend="eager")
    assert all(is_compiled(b) for b in m.layers)
    for b in m.layers: uncompile_block(b)
    assert not any(is_compiled(b) for b in m.layers)
    assert set(m.state_dict()) == set(small().state_dict())   # compiling leaves the checkpoint keys alone
    with pytest.raises(TypeError, match="needs a model with `layers`"): compile_model(torch.nn.Linear(2, 2))


def test_deepcopy_runs_its_own_weights():
    "A deep copy of a compiled model (DPO's frozen reference) computes with its own weights, through the shared compiled code."
    m = small(lora=False)
    cnt = CompileCounter()
    compile_model(m, backend=cnt)
    tok = torch.randint(0, 512, (2, 10))
    ref = copy.deepcopy(m)
    before = ref(tok).detach()
    with torch.no_grad():
        for p in m.parameters(): p.add_(0.1)   # train the live model: the copy must not move
    torch.testing.assert_close(ref(tok).detach(), before)
    assert not torch.allclose(m(tok).detach(), before)
    assert all(b.forward.module is b for b in ref.layers) and cnt.frame_count == 1


def test_generation_runs_the_blocks_eagerly():
    "A compiled model generates (the eval of a compiled run): the KV cache's fill level would recompile every token."
    from tunebook.generate import generate
    m = small(lora=True, n_layers=2)
    want = generate(m, prompt := torch.randint(0, 512, (2, 5)), max_new_tokens=12)
    cnt = CompileCounter()
    compile_model(m, backend=cnt)
    m(torch.randint(0, 512, (2, 9)), return_hidden=True).sum().backward()   # a training forward compiles
    n = cnt.frame_count
    assert generate(m, prompt, max_new_tokens=12) == want   # past the recompile limit (8) if decoding were compiled
    assert cnt.frame_count == n and n >= 1
