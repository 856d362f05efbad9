"""The model against transformers' LlamaForCausalLM / Qwen2ForCausalLM on the same random weights."""
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
}


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
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
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


def _hf_config(cfg):
    from tunebook.checkpoint import config_to_hf
    hf = config_to_hf(cfg)
    cls = transformers.LlamaConfig if cfg.arch == "llama" else transformers.Qwen2Config
    return cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})


@pytest.mark.parametrize("name", [n for n in BUILDERS if n != "pico"])
def test_param_counts_match_transformers(name):
    ours = build_model(name, device="meta")
    cfg = _hf_config(ours.config)
    with torch.device("meta"):
        hf = (transformers.LlamaForCausalLM if ours.config.arch == "llama" else transformers.Qwen2ForCausalLM)(cfg)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert count_params(ours) == n_hf


def test_bf16_close(make_hf):
    hf, d = make_hf("llama")
    ours = load_hf(d, dtype="bf16")
    hf = hf.to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens).float(), hf(tokens).logits.float()
    # same operations in the same order: bf16 logits agree to bf16 rounding
    assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()
