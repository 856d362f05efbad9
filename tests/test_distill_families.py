"""A student of a Qwen3.5 (hybrid DeltaNet / attention) or Qwen3-MoE teacher: `student_config` resizes the per-layer
lists with the depth (layer_types, mlp_only_layers), the student builds, and distillation runs a few steps."""
import pytest
import torch

from tunebook.checkpoint import save_hf
from tunebook.data import make_task
from tunebook.distill import DistillConfig, DistillTrainer, student_config
from tunebook.model import ModelConfig, build_model, qwen3_30b_a3b
from tunebook.tokenizer import train_tokenizer

TEACHERS = {
    "qwen3_5": lambda V: ModelConfig(arch="qwen3_5_text", vocab_size=V, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                     hidden_dim=128, head_dim=16, qk_norm=True, attn_output_gate=True, linear_key_heads=2,
                                     linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3_moe": lambda V: qwen3_30b_a3b(vocab_size=V, n_layers=3, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                                         moe_hidden_dim=32, n_experts=4, experts_per_token=2, mlp_only_layers=[2]),
}


def test_student_config_resizes_per_layer_lists():
    s = student_config(TEACHERS["qwen3_5"](64))     # teacher: 3 DeltaNet + 1 attention; half: 2 layers
    assert s.n_layers == 2 and s.layer_types == ["linear_attention", "full_attention"]
    s = student_config(TEACHERS["qwen3_5"](64), n_layers=6)
    assert s.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    s = student_config(TEACHERS["qwen3_moe"](64))   # layer 2 dense in the teacher: the 1-layer student has no layer 2
    assert s.n_layers == 1 and s.mlp_only_layers == [] and s.is_moe(0) and s.moe_hidden_dim == 16
    for name, t in TEACHERS.items(): build_model(student_config(t(64), n_layers=3), device="meta", init=False)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{r['prompt']} {r['answer']}" for r in make_task("add", 500)], vocab_size=300)


@pytest.mark.parametrize("name", list(TEACHERS))
def test_distill_from_new_family_teacher(tok, tmp_path, name):
    torch.manual_seed(0)
    teacher = tmp_path / "teacher"
    save_hf(build_model(TEACHERS[name](len(tok))), teacher); tok.save(teacher)
    cfg = DistillConfig(teacher=str(teacher), task="add", n_train=32, eval_samples=4, max_steps=3, batch_size=8, lr=3e-3,
                        max_seq_len=32, output_dir=str(tmp_path / "out"))
    t = DistillTrainer(cfg)
    s = t.fit(progress=False)
    assert t.model.config.arch == TEACHERS[name](1).arch and t.model.config.n_layers < TEACHERS[name](1).n_layers
    assert s["student_params"] < s["teacher_params"]
    assert all(v == v for k, v in s.items() if k.startswith("held_out") and isinstance(v, float))   # finite, not NaN
    assert s["held_out_kl_after"] < s["held_out_kl_before"]
    assert (tmp_path / "out" / "model" / "config.json").exists()
