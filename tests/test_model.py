"""The model against transformers' own classes (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3) on the same random weights."""
import pytest
import torch
import transformers

from conftest import LLAMA3_ROPE
from tunebook.checkpoint import load_hf
from tunebook.core import count_params
from tunebook.model import BUILDERS, build_model

TOL = 1e-4  # max abs difference of fp32 logits

CONFIGS = {
    "llama-gqa": ("llama", dict()),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama3-rope-scaling": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-head-dim": ("llama", dict(head_dim=32)),
    "llama-qkv-bias": ("llama", dict(attention_bias=True)),
    "qwen2-bias": ("qwen2", dict(rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    # Qwen3: q/k RMSNorm per head, no bias, explicit head_dim (32 with 4 heads of a 64-wide model)
    "qwen3-head-dim": ("qwen3", dict(head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen3-tied-mqa": ("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3-mha-bias": ("qwen3", dict(num_key_value_heads=4, attention_bias=True)),
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    # Mistral: Llama plus a sliding window (5 < T for T = 7, 33)
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "mistral-nowindow-mqa": ("mistral", dict(sliding_window=None, num_key_value_heads=1, head_dim=32)),
    # Gemma 3: local (window 5, RoPE base 1e4) and global layers, query_pre_attn_scalar, (1+w) norms, sqrt(dim) embedding
    "gemma3-tied": ("gemma3_text", dict(sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, num_key_value_heads=1)),
    "gemma3-untied-softcap": ("gemma3_text", dict(sliding_window=4, tie_word_embeddings=False, final_logit_softcapping=3.0,
                                                  layer_types=["full_attention", "sliding_attention"])),
    "gemma3-linear-rope": ("gemma3_text", dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # Phi-3: fused qkv_proj / gate_up_proj, sliding window; Phi-4-mini's partial RoPE and tied embeddings
    "phi3-window": ("phi3", dict(sliding_window=6)),
    "phi4-partial-tied": ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True, num_key_value_heads=1)),
    # SmolLM3: NoPE on every 4th layer (here layer 3 of 4; and an explicit pattern), sliding window on the NoPE layers
    "smollm3-nope": ("smollm3", dict(num_hidden_layers=4, tie_word_embeddings=False)),
    "smollm3-pattern-window": ("smollm3", dict(num_hidden_layers=3, no_rope_layers=[1, 0, 0], use_sliding_window=True, sliding_window=5)),
}
FAMILIES = ["llama-gqa", "qwen2-bias", "qwen3-sliding", "mistral-window", "gemma3-tied", "gemma3-untied-softcap",
            "phi3-window", "phi4-partial-tied", "smollm3-nope", "smollm3-pattern-window"]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 33])
def test_logits_match(make_hf, name, T):
    arch, kw = CONFIGS[name]
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    tokens = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= TOL, f"{name} T={T}: max abs diff {diff}"


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", FAMILIES)
def test_padded_batch(make_hf, name, side):
    arch, kw = CONFIGS[name]
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    tokens = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 11, dtype=torch.long)
    lengths = [11, 6, 3]
    for i, n in enumerate(lengths):
        if side == "right": mask[i, n:] = 0
        else: mask[i, :11 - n] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(tokens, positions=positions, attn_mask=mask)
        b = hf(tokens, attention_mask=mask, position_ids=positions).logits
        # padded queries are never used; compare every real position, and each row against it alone
        real = mask.bool()
        assert (a[real] - b[real]).abs().max().item() <= TOL
        for i, n in enumerate(lengths):
            alone = ours(tokens[i:i + 1][mask[i:i + 1].bool()].view(1, -1))
            assert (a[i][real[i]] - alone[0]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents(make_hf, name):
    """Three documents packed in one row (positions restart, doc_ids mask) = each run alone through transformers."""
    arch, kw = CONFIGS[name]
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 256, (1, n), generator=g) for n in (9, 4, 12)]
    packed = torch.cat(docs, 1)
    doc_ids = torch.cat([torch.full((1, x.shape[1]), i) for i, x in enumerate(docs)], 1)
    positions = torch.cat([torch.arange(x.shape[1])[None] for x in docs], 1)
    with torch.no_grad():
        out = ours(packed, positions=positions, doc_ids=doc_ids)
        ref = torch.cat([hf(x).logits for x in docs], 1)
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window", "gemma3-tied"])
def test_packed_rows_attend_by_document(make_hf, name, monkeypatch):
    """Two packed rows with a padding tail: the model attends document by document (DocumentSpans), and its logits and
    gradients equal those of the dense document mask (within 1e-5, fp32)."""
    from tunebook.attention import DocumentSpans, build_mask
    arch, kw = CONFIGS[name]
    _, d = make_hf(arch, **kw)
    ours = load_hf(d)
    g = torch.Generator().manual_seed(3)
    lens = [[9, 4, 12, 7], [20, 6, 6]]   # the last run of each row is its padding
    doc_ids = torch.tensor([[i if i < len(r) - 1 else -1 for i, n in enumerate(r) for _ in range(n)] for r in lens])
    positions = torch.tensor([[p for n in r for p in range(n)] for r in lens])
    tokens = torch.randint(0, 256, doc_ids.shape, generator=g)
    calls = []
    attend = DocumentSpans.attend
    monkeypatch.setattr(DocumentSpans, "attend", lambda self, *a, **k: calls.append(1) or attend(self, *a, **k))
    def run(**kw):
        ours.zero_grad()
        out = ours(tokens, positions=positions, **kw)
        out[doc_ids >= 0].square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}
    out, grads = run(doc_ids=doc_ids)
    assert len(calls) == ours.config.n_layers, "packed rows did not attend document by document"
    ref, ref_grads = run(mask=build_mask(tokens.shape[1], doc_ids=doc_ids))
    assert len(calls) == ours.config.n_layers   # the dense path does not
    real = doc_ids >= 0
    assert (out[real] - ref[real]).abs().max().item() <= 1e-5
    for n in grads: assert (grads[n] - ref_grads[n]).abs().max().item() <= 1e-5, n


def _hf_config(cfg):
    from tunebook.checkpoint import config_to_hf
    hf = config_to_hf(cfg)
    return transformers.AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})


@pytest.mark.parametrize("name", [n for n in BUILDERS if n != "pico"])
def test_param_counts_match_transformers(name):
    ours = build_model(name, device="meta")
    cfg = _hf_config(ours.config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                                 "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                                 "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "mixtral": "MixtralForCausalLM",
                                 "olmoe": "OlmoeForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}[ours.config.arch]
    n_hf = sum(p.numel() for p in hf.parameters())
    assert count_params(ours) == n_hf


# published figures: exact where the model card or checkpoint index gives them, else the card's rounding
PUBLISHED = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9, "gemma3-270m": 268_098_176,
             "gemma3-1b": 999_885_952, "gemma3-4b": 3.88e9, "mistral-7b-v0.3": 7_248_023_552, "phi3-mini": 3_821_079_552,
             "phi4-mini": 3_836_021_760, "smollm3-3b": 3.08e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_param_counts_match_published(name):
    n, want = count_params(build_model(name, device="meta")), PUBLISHED[name]
    if isinstance(want, int): assert n == want
    else: assert abs(n - want) <= 0.05e9, f"{name}: {n:,} vs the card's {want / 1e9}B"


def test_bf16_close(make_hf):
    hf, d = make_hf("llama")
    ours = load_hf(d, dtype="bf16")
    hf = hf.to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens).float(), hf(tokens).logits.float()
    # same operations in the same order: bf16 logits agree to bf16 rounding
    assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()


def _longrope(partial=1.0):
    g = torch.Generator().manual_seed(5)
    n = int(16 * partial) // 2
    return dict(max_position_embeddings=256, original_max_position_embeddings=32, partial_rotary_factor=partial,
                rope_scaling={"rope_type": "longrope", "short_factor": (1 + torch.rand(n, generator=g)).tolist(),
                              "long_factor": (1 + 8 * torch.rand(n, generator=g)).tolist()})


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("T", [20, 50])   # inside, and past, the original context of 32: short and long factors
def test_phi_longrope_logits(make_hf, partial, T):
    hf, d = make_hf("phi3", **_longrope(partial))
    ours = load_hf(d)
    assert ours.config.rope_scaling["rope_type"] == "longrope"
    tokens = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= TOL


def test_phi_longrope_generation_across_the_original_context(make_hf):
    """A 20-token prompt and 32 new tokens cross position 32, where transformers switches to the long factors."""
    from tunebook.generate import generate
    hf, d = make_hf("phi3", **_longrope(0.75))
    ours = load_hf(d)
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(9))
    ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)[0, 20:].tolist()
    assert generate(ours, prompt, max_new_tokens=32) == [ref]


@pytest.mark.parametrize("name", ["gemma3-tied", "phi4-partial-tied", "qwen3-sliding", "smollm3-nope"])
def test_bf16_close_families(make_hf, name):
    """bf16 weights on both sides: Gemma's embedding scale rounded to bf16 and its norms rounded once, as transformers does."""
    arch, kw = CONFIGS[name]
    hf, d = make_hf(arch, **kw)
    ours, hf = load_hf(d, dtype="bf16"), hf.to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens).float(), hf(tokens).logits.float()
    assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()


def test_gemma_bf16_embedding_and_norms_bitwise(make_hf):
    """sqrt(80) = 8.944 is 8.9375 in bf16: the scaled embedding and the (1 + w) norms round exactly as transformers does."""
    hf, d = make_hf("gemma3_text", hidden_size=80, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    ours, hf = load_hf(d, dtype="bf16"), hf.to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 9, 80, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours.embed_tokens(tokens), hf.model.embed_tokens(tokens))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            assert torch.equal(getattr(ours.layers[1], name)(x), getattr(hf.model.layers[1], name)(x)), name
        assert torch.equal(ours.layers[0].self_attn.q_norm(x[..., :16]), hf.model.layers[0].self_attn.q_norm(x[..., :16]))
        assert torch.equal(ours.norm(x), hf.model.norm(x))


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3", "smollm3"])
def test_new_blocks_under_activation_checkpointing(arch):
    """The memory module's hook (block.checkpoint_fn) works for the sandwich, fused and NoPE blocks: same gradients."""
    from functools import partial
    from torch.utils.checkpoint import checkpoint
    from tunebook.model import gemma3_layer_types, pico
    kw = {"gemma3_text": dict(qk_norm=True, hidden_act="gelu_pytorch_tanh", sliding_window=3, layer_types=gemma3_layer_types(2, 2),
                              rope_local_theta=100.0, query_pre_attn_scalar=8),
          "phi3": dict(sliding_window=3, partial_rotary_factor=0.5), "smollm3": dict(no_rope_layers=[1, 0])}[arch]
    torch.manual_seed(0)
    model = build_model(pico(arch=arch, **kw)).train()
    tokens = torch.randint(0, 512, (2, 9))
    def grads():
        model.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = grads()
    for b in model.layers: b.checkpoint_fn = partial(checkpoint, use_reentrant=False)
    got = grads()
    assert all(torch.allclose(ref[n], got[n], atol=1e-6) for n in ref)
