"""Hugging Face checkpoints in and out, checked with transformers; bad input named clearly."""
import json

import pytest
import torch
import transformers

from conftest import LLAMA3_ROPE
from tunebook.checkpoint import load_hf, save_hf

TOL = 1e-4


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("arch,kw", [("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
                                     ("llama", dict(tie_word_embeddings=True)),
                                     ("qwen2", dict()),
                                     ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
                                     ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
                                     ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
                                     ("mistral", dict(sliding_window=4)),
                                     ("gemma3_text", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                                          query_pre_attn_scalar=24, final_logit_softcapping=5.0)),
                                     ("gemma3_text", dict(sliding_window=4, num_hidden_layers=3, tie_word_embeddings=False,
                                                          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})),
                                     ("phi3", dict(sliding_window=5)),
                                     ("phi3", dict(partial_rotary_factor=0.5, tie_word_embeddings=True)),
                                     ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=8,
                                                   rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 1.2] * 2,
                                                                 "long_factor": [3.0, 5.0, 2.0, 9.0] * 2})),
                                     ("smollm3", dict(num_hidden_layers=4)),
                                     ("smollm3", dict(num_hidden_layers=2, no_rope_layers=[0, 1], use_sliding_window=True, sliding_window=4))])
def test_save_hf_loads_in_transformers(make_hf, tmp_path, arch, kw):
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    assert (_logits(back, tokens) - _logits(hf, tokens)).abs().max().item() == 0.0
    assert (_logits(ours, tokens) - _logits(hf, tokens)).abs().max().item() <= TOL


def test_old_and_new_rope_spellings(make_hf, tmp_path):
    """transformers 5 writes rope_parameters (per layer type for Gemma 3); the 4.x spelling loads the same model."""
    hf, d = make_hf("gemma3_text", sliding_window=4, num_hidden_layers=3,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})
    cfg = json.loads((d / "config.json").read_text())
    assert "full_attention" in cfg["rope_parameters"]
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e5, rope_local_base_freq=1e3, rope_scaling={"type": "linear", "factor": 2.0}, sliding_window_pattern=6)
    (d / "config.json").write_text(json.dumps(old))
    tokens = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    assert (_logits(load_hf(d), tokens) - _logits(hf, tokens)).abs().max().item() <= TOL
    back = transformers.AutoModelForCausalLM.from_pretrained(d).eval()  # and transformers reads it the same way
    assert (_logits(back, tokens) - _logits(hf, tokens)).abs().max().item() == 0.0


def test_multimodal_gemma3_loads_its_text_decoder(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: load_hf takes the language model (skipping the vision
    tower), equal to transformers' multimodal model on text; save_hf writes it as a Gemma3ForCausalLM."""
    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                                    boi_token_index=297, eoi_token_index=298)
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for n, p in mm.named_parameters():
            if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))
    mm.save_pretrained(tmp_path / "mm")
    ours = load_hf(tmp_path / "mm")
    assert ours.config.arch == "gemma3_text" and ours.config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    tokens = torch.randint(0, 296, (2, 11), generator=torch.Generator().manual_seed(0))
    ref = _logits(mm, tokens)
    assert (_logits(ours, tokens) - ref).abs().max().item() <= TOL
    back = transformers.AutoModelForCausalLM.from_pretrained(save_hf(ours, tmp_path / "text")).eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    assert (_logits(back, tokens) - ref).abs().max().item() <= TOL


def test_sharded_round_trip(make_hf, tmp_path):
    hf, d = make_hf("llama")
    ours = load_hf(d)
    out = save_hf(ours, tmp_path / "sharded", max_shard_size=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = _logits(hf, tokens)
    assert torch.equal(_logits(load_hf(out), tokens), ref)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(_logits(back, tokens), ref)
    # and transformers' own sharded output loads here
    hf.save_pretrained(tmp_path / "hf_sharded", max_shard_size="64KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").exists()
    assert (_logits(load_hf(tmp_path / "hf_sharded"), tokens) - ref).abs().max() <= TOL


def test_dtype_choice(make_hf, tmp_path):
    hf, d = make_hf("llama")
    assert load_hf(d).lm_head.weight.dtype == torch.float32
    m = load_hf(d, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.rope.inv_freq.dtype == torch.float32
    out = save_hf(m, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_hf(out).lm_head.weight.dtype == torch.bfloat16  # None keeps the file's dtype


def test_overwrite_is_atomic(make_hf, tmp_path):
    hf, d = make_hf("llama")
    m = load_hf(d)
    out = tmp_path / "ckpt"
    save_hf(m, out)
    with torch.no_grad():
        m.norm.weight.fill_(2.0)
    save_hf(m, out)
    assert torch.equal(load_hf(out).norm.weight, m.norm.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no temp folders left


def test_crash_leaves_old_checkpoint(make_hf, tmp_path, monkeypatch):
    hf, d = make_hf("llama")
    m = load_hf(d)
    out = save_hf(m, tmp_path / "ckpt")
    before = (out / "model.safetensors").read_bytes()
    import tunebook.checkpoint as ck
    def boom(*a, **k): raise RuntimeError("disk full")
    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_hf(m, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]


# ---- bad input: each error names the file or tensor and what was expected ----

def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tmp_path / "nope")


def test_missing_config(make_hf):
    hf, d = make_hf("llama")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(d)


def test_unsupported_architecture(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_hf(tmp_path / "gpt2")


def _rewrite(d, fn):
    from safetensors.torch import load_file, save_file
    sd = load_file(d / "model.safetensors")
    fn(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(make_hf):
    hf, d = make_hf("llama")
    _rewrite(d, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight.*\(128, 64\)"):
        load_hf(d)


def test_extra_tensor(make_hf):
    hf, d = make_hf("llama")
    _rewrite(d, lambda sd: sd.update({"model.layers.5.mlp.up_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.5\.mlp\.up_proj\.weight.*model\.safetensors"):
        load_hf(d)


def test_misshaped_tensor(make_hf):
    hf, d = make_hf("llama")
    _rewrite(d, lambda sd: sd.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight in model\.safetensors has shape \(64, 32\).*\(64, 64\)"):
        load_hf(d)


@pytest.mark.parametrize("keep", [100, 0.5])
def test_truncated_file(make_hf, keep):
    hf, d = make_hf("llama")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupt"):
        load_hf(d)


def test_pickle_refused(make_hf):
    hf, d = make_hf("llama")
    (d / "model.safetensors").unlink()
    torch.save(hf.state_dict(), d / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="does not load pickled weights"):
        load_hf(d)


def test_missing_shard(make_hf, tmp_path):
    hf, d = make_hf("llama")
    hf.save_pretrained(tmp_path / "sh", max_shard_size="64KB")
    next((tmp_path / "sh").glob("model-0000*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="names shard"):
        load_hf(tmp_path / "sh")
