"""The tensors GRPO hands a vLLM engine (`tunebook.vllmgen.engine.policy_tensors`) for the MoE families: named as each family's
checkpoints are (Qwen3-MoE and OLMoE one tensor per expert; Mixtral's block_sparse_moe and w1/w2/w3; gpt-oss's experts stacked,
with biases), per-expert LoRA merged in (NF4 experts dequantized), checked against transformers: its own class loads the tensors
with no key missing or left over and gives the logits of tunebook's model with its adapters on (fp32, 1e-4). The live reload into
vLLM of gpt-oss and Mixtral is refused (no vLLM-tier test checks it yet); that refusal comes before any vLLM call."""
import json

import pytest
import torch
import transformers

from tunebook.checkpoint import load_hf, save_hf
from tunebook.lora import apply_lora, expert_lora_modules, lora_modules
from tunebook.vllmgen.engine import UNVERIFIED_SYNC, VLLMGenerator, _write_weights, policy_tensors

TOL = 1e-4   # fp32 logits, tunebook with adapters vs transformers with the merged tensors

BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=128, pad_token_id=0)
FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                  dict(BASE, intermediate_size=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                dict(BASE, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2)),
    "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig,
              dict(BASE, intermediate_size=16, num_experts=6, num_experts_per_tok=2, tie_word_embeddings=True)),
    "gpt_oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig,
                dict(BASE, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


def hf_moe(arch, seed=0):
    "transformers' model of `arch`, fp32, eval; norms, biases, sinks and the router randomised so that each is seen."
    cls, cfg_cls, kw = FAMILIES[arch]
    torch.manual_seed(seed)
    hf = cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))
            if n.endswith(("bias", "sinks")): p.normal_(0, 0.3)
            if n.endswith(("mlp.gate.weight", "router.weight", "block_sparse_moe.gate.weight")): p.normal_(0, 0.3)
    return hf


def adapted(hf, tmp_path, qlora=False):
    "Ours from transformers' folder, LoRA on q/v and every expert, every B random (a non-zero update everywhere)."
    hf.save_pretrained(tmp_path / "base")
    ours = apply_lora(load_hf(tmp_path / "base"), rank=3, alpha=6, targets=("q_proj", "v_proj", "experts"), quantize_base=qlora).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return ours


def tokens(b=2, t=11, vocab=128):
    return torch.randint(1, vocab, (b, t), generator=torch.Generator().manual_seed(3))


def load_into_transformers(hf, tensors, folder):
    "transformers' class loading `tensors` as a checkpoint folder: no key missing (a tied lm_head aside), none left over."
    from safetensors.torch import save_file
    folder.mkdir()
    hf.config.save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    fresh, info = type(hf).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return fresh.eval()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_policy_tensors_are_the_family_checkpoint_with_expert_lora_merged(arch, tmp_path):
    hf = hf_moe(arch)
    ours = adapted(hf, tmp_path)
    n_ad, n_ex = len(lora_modules(ours)), len(expert_lora_modules(ours))
    pt = policy_tensors(ours)
    ids = tokens()
    with torch.no_grad():
        want = ours(ids)
        got = load_into_transformers(hf, pt, tmp_path / "pt")(ids).logits
        assert (got - want).abs().max().item() <= TOL
        assert (hf(ids).logits - want).abs().max().item() > 1e-3          # the adapters change the model: the merge is seen
    assert (len(lora_modules(ours)), len(expert_lora_modules(ours))) == (n_ad, n_ex) == (4, 2)   # the learner keeps its adapters
    # the names and shapes are exactly those of the family's checkpoint (save_hf of the merged model)
    from tunebook.lora import merge_lora
    from safetensors import safe_open
    save_hf(merge_lora(ours), tmp_path / "merged")
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == {k: tuple(v.shape) for k, v in pt.items()}
    spelled = {"mixtral": ".block_sparse_moe.experts.0.w1.weight", "gpt_oss": ".mlp.experts.gate_up_proj_bias",
               "qwen3_moe": ".mlp.experts.0.gate_proj.weight", "olmoe": ".mlp.experts.0.gate_proj.weight"}[arch]
    assert f"model.layers.1{spelled}" in pt


def test_policy_tensors_of_nf4_experts_dequantize_and_merge(tmp_path):
    "QLoRA: the experts held in NF4 reach the engine dequantized, their adapters merged (what ours computes, within 1e-4)."
    hf = hf_moe("qwen3_moe")
    ours = adapted(hf, tmp_path, qlora=True)
    assert all(m.quantized for m in expert_lora_modules(ours).values())
    pt = policy_tensors(ours)
    ids = tokens()
    with torch.no_grad():
        assert (load_into_transformers(hf, pt, tmp_path / "pt")(ids).logits - ours(ids)).abs().max().item() <= TOL


def test_a_state_dict_in_our_names_is_written_in_the_family_spelling(tmp_path):
    "update_weights' state-dict path: our names (stacked experts) become the family's checkpoint names, as policy_tensors'."
    from safetensors.torch import load_file
    for arch in ("mixtral", "gpt_oss", "qwen3_moe"):
        hf = hf_moe(arch)
        hf.save_pretrained(tmp_path / arch)
        ours = load_hf(tmp_path / arch)
        sd = {k: v for k, v in ours.state_dict().items() if not (ours.config.tie_embeddings and k == "lm_head.weight")}
        folder = _write_weights(sd, tmp_path / f"w-{arch}", None, arch)
        assert load_file(str(folder / "model.safetensors")).keys() == policy_tensors(ours).keys(), arch


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_update_weights_refuses_unverified_families_before_touching_vllm(arch, tmp_path):
    hf = hf_moe(arch)
    hf.save_pretrained(tmp_path / "m")
    gen = object.__new__(VLLMGenerator)          # no engine: the refusal must come first
    gen.model_dir, gen.dtype, gen._tmp = tmp_path / "m", "float32", tmp_path / "tmp"
    with pytest.raises(NotImplementedError, match="not verified for") as e:
        gen.update_weights(load_hf(tmp_path / "m"))
    assert "save_hf" in str(e.value) and UNVERIFIED_SYNC[arch].split(" ")[0] in str(e.value)
    assert not (tmp_path / "tmp").exists()        # nothing written
