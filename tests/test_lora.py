"""tunebook.lora against peft on small random models (no hub): adapters in both directions for every family
(Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3 with its fused modules, SmolLM3), DoRA, QLoRA, merging, trainable
parameters, NF4, bad input, and issue 17's adapter rows (A3, A5, A7, file mode)."""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import need   # a dev dependency: missing is a failure, never a skip
transformers = need("transformers")
peft = need("peft")

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


_NF4_VS_TORCHAO = """
import json, torch
from torchao.dtypes import nf4tensor
from tunebook.lora import nf4_dequantize, nf4_quantize
torch.manual_seed(6)
w = torch.randn(256, 128)
t = nf4tensor.to_nf4(w, 64, 256)
theirs = torch.stack([(t.quantized_data >> 4), t.quantized_data & 15], -1).view(-1)
ours = nf4_quantize(w, double_quant=False)["nf4"]
ours = torch.stack([(ours >> 4), ours & 15], -1).view(-1)
print(json.dumps(dict(match=(ours == theirs).float().mean().item(),
                      err_ours=(nf4_dequantize(nf4_quantize(w), w.shape) - w).abs().mean().item(),
                      err_theirs=(t.get_original_weight() - w).abs().mean().item())))
"""


def test_nf4_agrees_with_torchao():
    """Our NF4 codes equal torchao's; run in this venv when it has torchao, else in the bench venv (torchao 0.15 pins
    an older torch stack than peft here, so it lives beside torchtune in .venv-bench: `make bench-env`)."""
    import json, os, subprocess, sys
    try:
        import torchao.dtypes.nf4tensor  # noqa: F401
        py = sys.executable
    except ImportError:
        py = os.environ.get("TUNEBOOK_BENCH_PY")
        assert py, "torchao is not in this venv and TUNEBOOK_BENCH_PY names no venv that has it: run `make pytest` (it builds .venv-bench)"
    r = subprocess.run([py, "-c", _NF4_VS_TORCHAO], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["match"] > 0.999  # torchao rounds the levels to 4 decimals
    assert abs(got["err_ours"] - got["err_theirs"]) < 0.02 * got["err_theirs"]


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


# ---- every family: adapters interchangeable with peft, both directions (issue 14) ----
from conftest import hf_model as make_hf_model  # noqa: E402

FAMILY_KW = {"llama": dict(), "qwen2": dict(), "qwen3": dict(head_dim=32),
             "mistral": dict(sliding_window=5), "phi3": dict(sliding_window=6, partial_rotary_factor=0.75),
             "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24),
             "smollm3": dict(num_hidden_layers=4)}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    out = {}
    for arch, kw in FAMILY_KW.items():
        d = tmp_path_factory.mktemp(arch)
        make_hf_model(arch, seed=5, **kw).save_pretrained(d)
        out[arch] = d
    return out


def _hf(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("arch", list(FAMILY_KW))
def test_family_adapters_interchange_with_peft(family_dirs, tmp_path, arch, dora):
    d = family_dirs[arch]
    toks = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(6))
    # ours -> peft
    model = apply_lora(load_hf(d), rank=4, alpha=8, targets="all-linear", dora=dora)
    randomize(model)
    names = {n.rsplit(".", 1)[-1] for n in lora_modules(model)}
    if arch == "phi3": assert names == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}  # the fused modules, peft's names
    save_adapter(model, tmp_path / "ours")
    pm = peft.PeftModel.from_pretrained(_hf(d), tmp_path / "ours").eval()
    with torch.no_grad():
        assert (model(toks) - pm(toks).logits).abs().max().item() <= 1e-5
    # peft -> ours
    torch.manual_seed(3)
    pm = peft.get_peft_model(_hf(d), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora))
    randomize(pm, seed=7)
    pm.eval().save_pretrained(tmp_path / "peft")
    ours = load_adapter(load_hf(d), tmp_path / "peft")
    with torch.no_grad():
        assert (ours(toks) - pm(toks).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", list(FAMILY_KW))
def test_family_qlora_matches_dequantized(family_dirs, arch):
    """QLoRA on each family: the NF4 forward equals the same model with the dequantized weights loaded in full precision."""
    toks = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(8))
    q = apply_lora(load_hf(family_dirs[arch]), rank=4, targets="all-linear", quantize_base=True)
    randomize(q)
    ref = load_hf(family_dirs[arch])
    apply_lora(ref, rank=4, targets="all-linear")
    ref.load_state_dict({k: v for k, v in q.state_dict().items() if "lora_" in k}, strict=False)
    with torch.no_grad():
        for n, m in lora_modules(q).items(): lora_modules(ref)[n].weight.copy_(m.base_weight())
        diff = (q(toks) - ref(toks)).abs().max().item()
        assert diff <= 1e-5
        full = apply_lora(load_hf(family_dirs[arch]), rank=4, targets="all-linear")
        full.load_state_dict({k: v for k, v in q.state_dict().items() if "lora_" in k}, strict=False)
        assert (ref(toks) - full(toks)).abs().max().item() > 1e-4  # NF4 did change the weights: the check can fail


# ---- issue 17: adapter rows A3, A5, A7 and the file mode ----
def _two_sizes(tmp_path):
    torch.manual_seed(0)
    dirs = {}
    for n in (4, 6):
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / f"l{n}")
        dirs[n] = tmp_path / f"l{n}"
    return dirs


def test_a3_adapter_for_fewer_layers_refused(tmp_path):
    dirs = _two_sizes(tmp_path)
    pm = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(dirs[4]), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    pm.save_pretrained(tmp_path / "a4")
    model = load_hf(dirs[6])
    with pytest.raises(ValueError, match=r"adapts 4 layer\(s\), this model has 6"):
        load_adapter(model, tmp_path / "a4")
    assert not lora_modules(model)   # refused before any change
    load_adapter(load_hf(dirs[4]), tmp_path / "a4")  # its own base loads


def test_a5_layers_to_transform_honoured_like_peft(base_dir, tokens, tmp_path):
    model = apply_lora(our_model(base_dir), rank=4, targets=["q_proj", "v_proj"])
    randomize(model)
    save_adapter(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    cfg["layers_to_transform"] = [0]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="outside layers_to_transform"):
        ours = load_adapter(our_model(base_dir), tmp_path / "a")
    assert sorted(lora_modules(ours)) == ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj"]
    pm = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path / "a").eval()
    with torch.no_grad():
        assert (ours(tokens) - pm(tokens).logits).abs().max().item() <= 1e-5
        assert (ours(tokens) - model(tokens)).abs().max().item() > 1e-3   # layer 1's adapter really left out


def test_a5_layers_pattern_refused(base_dir, tmp_path):
    model = apply_lora(our_model(base_dir), rank=4)
    save_adapter(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    cfg.update(layers_to_transform=[0], layers_pattern="h")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="layers_pattern"):
        load_adapter(our_model(base_dir), tmp_path / "a")


def test_a7_auto_peft_loads_adapter_with_local_base(base_dir, tokens, tmp_path, monkeypatch):
    model = apply_lora(load_hf(base_dir), rank=4, targets=["q_proj", "v_proj"])
    randomize(model)
    monkeypatch.chdir(tmp_path)   # the recorded path is absolute: it loads from any working folder
    save_adapter(model, "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base_dir.resolve())
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (model(tokens) - pm(tokens).logits).abs().max().item() <= 1e-5
    save_adapter(model, tmp_path / "named", base_model_name_or_path="org/base")   # the trainer can pass it
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/base"


def test_adapter_files_are_0644_like_other_outputs(base_dir, tmp_path):
    import os
    umask = os.umask(0); os.umask(umask)
    out = save_adapter(apply_lora(our_model(base_dir), rank=4), tmp_path / "a")
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        assert os.stat(out / f).st_mode & 0o777 == 0o666 & ~umask, f


def test_unfused_targets_on_phi3_name_the_fused_module(family_dirs):
    with pytest.raises(ValueError, match=r"fuses q_proj/k_proj/v_proj into qkv_proj.*target 'qkv_proj'"):
        apply_lora(load_hf(family_dirs["phi3"]), targets=["q_proj", "v_proj"])
