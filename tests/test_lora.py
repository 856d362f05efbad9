"""tunebook.lora against peft on small random Llama models (no hub): adapters in both directions,
DoRA, merging, trainable parameters, NF4 and bad input."""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tunebook.lora import (LoRALinear, apply_lora, load_adapter, lora_modules, lora_state_dict, merge_lora,
                           nf4_dequantize, nf4_quantize, quantize_base, save_adapter, FrozenLinear, NF4_LEVELS)

try:
    from tunebook.checkpoint import load_hf, save_hf
except ImportError:  # checkpoint not written yet: map the state dicts ourselves
    load_hf = save_hf = None

TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("base")
    hf.save_pretrained(path)
    return path


def hf_model(path):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def our_model(path):
    if load_hf is not None: return load_hf(path).eval()
    from tunebook.model import ModelConfig, build_model
    c = json.loads((path / "config.json").read_text())
    cfg = ModelConfig(vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
                      n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"],
                      hidden_dim=c["intermediate_size"], norm_eps=c["rms_norm_eps"], max_seq_len=c["max_position_embeddings"])
    model = build_model(cfg)
    sd = load_file(str(path / "model.safetensors"))
    model.load_state_dict({k.removeprefix("model."): v for k, v in sd.items()})
    return model.eval()


def our_state_as_hf(model, tmp):
    if save_hf is not None:
        save_hf(model, tmp)
        return load_file(str(tmp / "model.safetensors"))
    return {(k if k.startswith("lm_head") else "model." + k): v for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tokens():
    torch.manual_seed(1)
    return torch.randint(0, 128, (2, 12))


def randomize(model, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            if "lora_magnitude_vector" in n: p.mul_(1 + 0.2 * torch.rand(p.shape, generator=g))


def test_our_base_matches_hf(base_dir, tokens):
    with torch.no_grad():
        torch.testing.assert_close(our_model(base_dir)(tokens), hf_model(base_dir)(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dora", [False, True])
def test_our_adapter_loads_in_peft(base_dir, tokens, tmp_path, dora):
    model = our_model(base_dir)
    with pytest.warns(UserWarning, match="lm_head"):
        apply_lora(model, rank=4, alpha=8, targets=TARGETS, dora=dora)
    randomize(model)
    save_adapter(model, tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path / "adapter").eval()
    # every tensor we wrote was loaded by peft under the same name
    ours = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    theirs = peft.get_peft_model_state_dict(pm)
    assert set(ours) <= set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), pm(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dora,rslora", [(False, False), (True, False), (False, True)])
def test_peft_adapter_loads_in_ours(base_dir, tokens, tmp_path, dora, rslora):
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=dora, use_rslora=rslora,
                          task_type="CAUSAL_LM")
    pm = peft.get_peft_model(hf_model(base_dir), cfg)
    randomize(pm)
    pm.eval().save_pretrained(tmp_path / "adapter")
    model = load_adapter(our_model(base_dir), tmp_path / "adapter")
    assert sorted(n.rsplit(".", 1)[-1] for n in lora_modules(model)) == sorted(["q_proj", "v_proj", "down_proj"] * 2 + ["lm_head"])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), pm(tokens).logits, atol=1e-5, rtol=0)
    # our save_adapter writes peft's key names (peft also writes lm_head.base_layer.weight: the base, not an adapter)
    save_adapter(model, tmp_path / "ours")
    peft_keys = {k for k in load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")) if "base_layer" not in k}
    assert set(load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))) == peft_keys


@pytest.mark.parametrize("dora", [False, True])
def test_merge_matches_peft_merge_and_unload(base_dir, tmp_path, dora):
    torch.manual_seed(4)
    pm = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=dora))
    randomize(pm)
    pm.save_pretrained(tmp_path / "adapter")
    model = merge_lora(load_adapter(our_model(base_dir), tmp_path / "adapter"))
    assert not lora_modules(model)
    ours = our_state_as_hf(model, tmp_path / "merged")
    theirs = pm.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.parametrize("dora", [False, True])
def test_dropout_in_training_matches_peft(base_dir, tokens, tmp_path, dora):
    "Dropout acts on the adapter path's input, as in peft (same RNG draws, same logits)."
    torch.manual_seed(8)
    pm = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3,
                                                                  target_modules=["q_proj", "v_proj", "up_proj"], use_dora=dora))
    randomize(pm)
    pm.save_pretrained(tmp_path / "adapter")
    model = load_adapter(our_model(base_dir), tmp_path / "adapter").train()
    pm.train()
    torch.manual_seed(9); ours = model(tokens)
    torch.manual_seed(9); theirs = pm(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    with torch.no_grad(): assert not torch.allclose(model.eval()(tokens), ours, atol=1e-3)  # dropout did act


def test_only_adapters_train(base_dir, tokens):
    model = apply_lora(our_model(base_dir), rank=4, targets=["q_proj", "v_proj"], dora=True).train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model)) and len(trainable) == 2 * 2 * 3
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(tokens).logsumexp(-1).mean().backward()
    opt.step()
    params = dict(model.named_parameters())
    assert {id(p) for p in opt.state} == {id(params[n]) for n in trainable}
    assert all(params[n].grad is None and torch.equal(params[n], t) for n, t in frozen.items())
    assert all(params[n].grad is not None for n in trainable)


# -- NF4 --
# the QLoRA paper's NF4 levels as bitsandbytes ships them (fp32), independent of our derivation
QLORA_NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                          -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                          0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                          0.7229568362236023, 1.0])


def reference_nf4(w, block=64):
    b = w.reshape(-1, block)
    absmax = b.abs().amax(1, keepdim=True)
    idx = ((b / absmax)[..., None] - QLORA_NF4).abs().argmin(-1)
    return (QLORA_NF4[idx] * absmax).view(w.shape), absmax


def test_nf4_matches_reference():
    torch.manual_seed(5)
    w = torch.randn(256, 192) * 0.02
    torch.testing.assert_close(NF4_LEVELS, QLORA_NF4, atol=1e-6, rtol=0)
    ref, absmax = reference_nf4(w)
    ours = nf4_dequantize(nf4_quantize(w, double_quant=False), w.shape)
    torch.testing.assert_close(ours, ref, atol=1e-7, rtol=0)
    gap = (QLORA_NF4[1:] - QLORA_NF4[:-1]).max()
    q = nf4_quantize(w, double_quant=True)
    ours_dq = nf4_dequantize(q, w.shape)
    slack = q["absmax_scale"].max()  # one int8 step of the double-quantized scales
    assert ((ours_dq - w).view(-1, 64).abs() <= absmax * gap / 2 + slack + 1e-7).all()


def test_nf4_agrees_with_torchao():
    nf4tensor = pytest.importorskip("torchao.dtypes.nf4tensor")
    torch.manual_seed(6)
    w = torch.randn(256, 128)
    t = nf4tensor.to_nf4(w, 64, 256)
    theirs = torch.stack([(t.quantized_data >> 4), t.quantized_data & 15], -1).view(-1)
    ours = nf4_quantize(w, double_quant=False)["nf4"]
    ours = torch.stack([(ours >> 4), ours & 15], -1).view(-1)
    assert (ours == theirs).float().mean() > 0.999  # torchao rounds the levels to 4 decimals
    err_ours = (nf4_dequantize(nf4_quantize(w), w.shape) - w).abs().mean()
    err_theirs = (t.get_original_weight() - w).abs().mean()
    assert abs(err_ours - err_theirs) < 0.02 * err_theirs


def test_nf4_forward_matches_dequantized(base_dir, tokens):
    model = apply_lora(our_model(base_dir), rank=4, targets="all-linear", dora=True)
    randomize(model)
    quantize_base(model)
    deq = our_model(base_dir)
    apply_lora(deq, rank=4, targets="all-linear", dora=True)
    deq.load_state_dict(lora_state_dict(model), strict=False)
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, FrozenLinear):
                assert m.quantized or n == "lm_head"
                deq.get_submodule(n).weight.copy_(m.base_weight())
        torch.testing.assert_close(model(tokens), deq(tokens), atol=1e-5, rtol=0)
    nbytes = sum(m.base_nbytes for m in model.modules() if isinstance(m, FrozenLinear) and m.quantized)
    full = sum(m.in_features * m.out_features * 4 for m in model.modules() if isinstance(m, FrozenLinear) and m.quantized)
    assert nbytes < full / 7


# -- bad input --
def test_unknown_targets_lists_available(base_dir):
    with pytest.raises(ValueError, match=r"qkv_proj.*'down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'"):
        apply_lora(our_model(base_dir), targets=["q_proj", "qkv_proj"])


@pytest.mark.parametrize("rank", [0, -4])
def test_bad_rank(base_dir, rank):
    with pytest.raises(ValueError, match="rank"):
        apply_lora(our_model(base_dir), rank=rank)


def test_adapter_for_another_base(base_dir, tmp_path):
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    small = transformers.LlamaForCausalLM(cfg)
    peft.get_peft_model(small, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    model = our_model(base_dir)
    with pytest.raises(ValueError, match=r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight has shape \(4, 32\).*needs \(4, 64\)"):
        load_adapter(model, tmp_path / "a")
    assert not lora_modules(model)  # nothing was changed
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(model, tmp_path)
