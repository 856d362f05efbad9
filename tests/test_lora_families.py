"""LoRA's "all-linear" on Qwen3.5 leaves out DeltaNet's per-head scalar gates in_proj_a / in_proj_b (one output per value
head), so a default rank above the head count adapts every other linear; naming them still adapts them."""
import torch

from tunebook.lora import apply_lora, lora_modules
from tunebook.model import ModelConfig, build_model

CFG = ModelConfig(arch="qwen3_5_text", vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, head_dim=16,
                  layer_types=["linear_attention", "full_attention"], linear_key_heads=2, linear_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16)


def test_all_linear_skips_deltanet_scalar_gates():
    model = apply_lora(build_model(CFG), rank=16, alpha=32, targets="all-linear")
    names = {n.rsplit(".", 1)[-1] for n in lora_modules(model)}
    assert names == {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                     "gate_proj", "up_proj", "down_proj"}
    assert all(min(m.in_features, m.out_features) >= 16 for m in lora_modules(model).values())
    tokens = torch.randint(0, 128, (2, 8))
    model(tokens).float().logsumexp(-1).mean().backward()
    assert all(m.lora_A.weight.grad is not None for m in lora_modules(model).values())
    named = apply_lora(build_model(CFG), rank=2, targets=("in_proj_a", "in_proj_b"))
    assert sorted(lora_modules(named)) == ["layers.0.linear_attn.in_proj_a", "layers.0.linear_attn.in_proj_b"]
