"""Greedy generation with our KV cache against transformers' generate."""
import pytest
import torch

from tunebook.checkpoint import load_hf
from tunebook.generate import generate


@pytest.mark.parametrize("arch,kw", [("llama", dict()), ("qwen2", dict(tie_word_embeddings=True))])
def test_greedy_32_tokens_match_transformers(make_hf, arch, kw):
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = hf.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                      attention_mask=torch.ones_like(prompt), pad_token_id=0)[0, 10:].tolist()
    assert len(ref) == 32
    assert generate(ours, prompt, max_new_tokens=32) == [ref]


def test_left_padded_batch_matches_transformers(make_hf):
    hf, d = make_hf("llama")
    ours = load_hf(d)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 4, 6)]
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert generate(ours, prompts, max_new_tokens=16) == ref[:, L:].tolist()
