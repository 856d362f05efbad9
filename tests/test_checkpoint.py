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
                                     ("qwen2", dict())])
def test_save_hf_loads_in_transformers(make_hf, tmp_path, arch, kw):
    hf, d = make_hf(arch, **kw)
    ours = load_hf(d)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    assert (_logits(back, tokens) - _logits(hf, tokens)).abs().max().item() == 0.0


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
