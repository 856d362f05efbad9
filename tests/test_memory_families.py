"""The rough memory formula on the newer families: Qwen3.5's Gated DeltaNet layers (their parameters; activations with no
KV, one (k_dim, v_dim) state per head and chunk, the chunked rule's fp32 buffers) and Qwen3-MoE's routed activations
(router logits, k copies of each token through an expert's intermediate), against the measured peak of a real step."""
import pytest
from torch import nn

from tunebook.core import count_params
from tunebook.memory import estimate, rough_estimate
from tunebook.memory.formulas import _n_params
from tunebook.model import ModelConfig, build_model, pico

FAMILIES = {
    # 4 layers: 3 DeltaNet, 1 gated attention; value heads twice the key heads
    "qwen3_5": ModelConfig(arch="qwen3_5_text", vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=128,
                           head_dim=16, qk_norm=True, attn_output_gate=True, linear_key_heads=2, linear_value_heads=4,
                           linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3_moe": pico(arch="qwen3_moe", qk_norm=True, head_dim=32, n_layers=3, n_experts=4, experts_per_token=2,
                      moe_hidden_dim=32, mlp_only_layers=[1]),
}
# rough / measured peak (batch 2 x 128, fp32, LoRA rank 4); without the DeltaNet and MoE terms: 0.49 / 0.41 and 0.79 / 0.81.
# Both sides are deterministic (the tracker counts tensor bytes), so the ratio is pinned to +-0.02.
RATIO = {("qwen3_5", "full"): 0.836, ("qwen3_5", "lora"): 0.845, ("qwen3_moe", "full"): 0.842, ("qwen3_moe", "lora"): 0.890}


def test_rough_parameter_count_is_the_model():
    for name, cfg in FAMILIES.items():
        m = build_model(cfg, device="meta", init=False)
        tensors = list({id(p): p for p in m.parameters()}.values())
        block_w = sum(mod.weight.numel() for layer in m.layers for mod in layer.modules() if isinstance(mod, nn.Linear))
        assert _n_params(cfg) == (block_w, count_params(m), len(tensors)), name


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rough_formula_against_measured_step(family, method):
    cfg = FAMILIES[family]
    kw = dict(method=method, batch_size=2, seq_len=128, dtype="fp32", lora_rank=4)
    rough, est = rough_estimate(cfg, **kw), estimate(cfg, measure=True, **kw)
    assert rough.categories["parameters"] == est.categories["parameters"]
    assert rough.categories["optimizer"] == est.categories["optimizer"]
    ratio = rough.peak_bytes / est.measured_peak_bytes
    assert 0.75 <= ratio <= 1.25 and abs(ratio - RATIO[family, method]) < 0.02, ratio


def test_deltanet_activations_have_no_kv_and_grow_linearly():
    "DeltaNet layers keep no KV: doubling the sequence doubles their activations (chunk-aligned lengths)."
    from tunebook.memory.formulas import _deltanet_acts
    cfg = FAMILIES["qwen3_5"]
    assert _deltanet_acts(cfg, 2 * 256, 4) == 2 * _deltanet_acts(cfg, 256, 4)
