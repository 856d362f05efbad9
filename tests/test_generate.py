"""Greedy generation with our KV cache against transformers' generate."""
import pytest
import torch

from tunebook.checkpoint import load_hf
from tunebook.generate import generate


# windows of 4-6 positions: the 10-token prompt and the 32 new tokens run well past them
FAMILIES = [("llama", dict()), ("qwen2", dict(tie_word_embeddings=True)),
            ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
            ("mistral", dict(sliding_window=5)),
            ("gemma3_text", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24)),
            ("gemma3_text", dict(sliding_window=5, final_logit_softcapping=2.0, tie_word_embeddings=False)),
            ("phi3", dict(sliding_window=6)),
            ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True, num_key_value_heads=1)),
            ("smollm3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=6))]


@pytest.mark.parametrize("arch,kw", FAMILIES)
def test_greedy_32_tokens_match_transformers(make_hf, arch, kw):
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = hf.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                      attention_mask=torch.ones_like(prompt), pad_token_id=0)[0, 10:].tolist()
    assert len(ref) == 32
    assert generate(ours, prompt, max_new_tokens=32) == [ref]


@pytest.mark.parametrize("arch,kw", [FAMILIES[0], FAMILIES[2], FAMILIES[3], FAMILIES[4], FAMILIES[6], FAMILIES[8]])
def test_left_padded_batch_matches_transformers(make_hf, arch, kw):
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 4, 6)]
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert generate(ours, prompts, max_new_tokens=16) == ref[:, L:].tolist()


def test_sliding_layers_cache_only_their_window(make_hf):
    """Gemma 3 layout: the sliding layers' caches hold window - 1 positions, the global layer all of them; the
    prompt prefill and every step still match transformers (and sampling several continuations per prompt works)."""
    hf, d = make_hf("gemma3_text", sliding_window=4, num_hidden_layers=3,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    ours = load_hf(d)
    ours.setup_cache(1, 64)
    assert [layer.self_attn.cache.k.shape[2] for layer in ours.layers] == [3, 64, 3]
    ours.clear_cache()
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(5))
    ref = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)[0, 10:].tolist()
    assert generate(ours, prompt, max_new_tokens=20) == [ref]
    a = generate(ours, prompt, max_new_tokens=12, temperature=1.0, num_samples=3, generator=torch.Generator().manual_seed(1))
    b = generate(ours, prompt.repeat(3, 1), max_new_tokens=12, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert a == b


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, None), (1.3, None, 0.8), (1.0, 8, 0.6), (0.5, None, 0.95)])
def test_sampling_follows_transformers_filtered_distribution(temperature, top_k, top_p):
    """The empirical distribution of `sample_next` equals transformers' temperature/top-k/top-p warped softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    from tunebook.generate import sample_next
    torch.manual_seed(3)
    logits = torch.randn(1, 40) * 2
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None: warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p is not None: warped = TopPLogitsWarper(top_p)(None, warped)
    want = warped.softmax(-1)[0]
    n = 40_000
    draws = sample_next(logits.expand(n, -1), temperature, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(0))
    got = torch.bincount(draws, minlength=40).double() / n
    assert set(draws.unique().tolist()) <= set(torch.nonzero(want > 0).flatten().tolist())   # nothing outside the kept set
    assert (want > 0).sum() == (got > 0).sum() or want[got == 0].max() < 1e-3                 # every kept token is drawn
    # 40k draws: the standard error of a frequency is <= 0.0025; 0.012 is ~5 of them
    assert (got - want.double()).abs().max() < 0.012, (got - want.double()).abs().max()
