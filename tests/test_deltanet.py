"""Qwen3.5's hybrid decoder (Gated DeltaNet + gated full attention, tunebook.deltanet) against transformers' own
`Qwen3_5ForCausalLM` on the same random weights, fp32: logits at several lengths (inside, at and past the 64-position
chunk), padded batches, chunked = recurrent, greedy generation, checkpoints both ways, a training step, config.json.
transformers runs its pure-PyTorch fallback here (no flash-linear-attention / causal-conv1d kernels installed:
`test_transformers_runs_its_torch_fallback` checks it)."""
import inspect

import pytest
import torch
import transformers

from tunebook.checkpoint import config_from_hf, config_to_hf, load_hf, save_hf
from tunebook.core import count_params
from tunebook.deltanet import DeltaNetBlock, GatedDeltaNet, chunked_delta_rule, l2norm, recurrent_delta_rule
from tunebook.generate import generate
from tunebook.model import ModelConfig, build_model, qwen3_5_layer_types

TOL = 1e-4  # max abs difference of fp32 logits

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, pad_token_id=0)
CONFIGS = {  # 4 layers: transformers' default pattern (3 DeltaNet, 1 attention); value heads twice the key heads
    "interval4": dict(BASE, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=8),
    # attention first, tied embeddings, attention bias, equal k/v heads, half the head rotated, another theta
    "mixed-tied": dict(BASE, num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
                       tie_word_embeddings=True, attention_bias=True,
                       rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5)),
}


def hf_qwen35(name="interval4", seed=0):
    """transformers' model with every weight random (norm offsets, A_log, dt_bias, conv), fp32, eval."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIGS[name])).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))
            if n.endswith(".bias"): p.normal_(0, 0.1)
            if n.endswith("dt_bias"): p.normal_(0, 0.5)
            if n.endswith("A_log"): p.uniform_(-1, 1)      # decays from slow to fast
            if n.endswith("in_proj_a.weight"): p.normal_(0, 0.1)
            if n.endswith("conv1d.weight"): p.normal_(0, 0.3)
    return hf


@pytest.fixture
def pair(tmp_path):
    """pair(name) -> (transformers model, ours loaded by load_hf from the folder transformers saved)."""
    def make(name="interval4"):
        hf = hf_qwen35(name)
        hf.save_pretrained(tmp_path / name)
        return hf, load_hf(tmp_path / name)
    return make


def _tokens(B, T, seed=0):
    return torch.randint(1, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match(pair, name):
    hf, ours = pair(name)
    kinds = ["DeltaNetBlock" if t == "linear_attention" else "TransformerBlock" for t in hf.config.layer_types]
    assert [type(l).__name__ for l in ours.layers] == kinds
    for T in (1, 7, 64, 150):   # short, exactly one chunk, past two chunks
        tokens = _tokens(2, T, T)
        with torch.no_grad():
            diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
        assert diff <= TOL, f"{name} T={T}: max abs diff {diff}"


def test_checkpoint_keys_are_transformers(pair):
    hf, ours = pair("interval4")
    hf_keys = {k for k in hf.state_dict() if "rotary" not in k}
    ours_keys = {("" if n.startswith("lm_head") else "model.") + n for n in ours.state_dict()}
    assert ours_keys == hf_keys


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch(pair, side):
    """transformers zeroes padded positions before a DeltaNet layer (and masks them in attention); so do we. With left
    padding the state stays zero through the padding, so each row equals the same prompt alone."""
    hf, ours = pair("interval4")
    T, lens = 80, [80, 50, 9]
    tokens = _tokens(3, T, 1)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, n in enumerate(lens):
        if side == "right": mask[i, :n] = 1
        else: mask[i, T - n:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(tokens, positions=positions, attn_mask=mask)
        ref = hf(tokens, attention_mask=mask, position_ids=positions).logits
        real = mask.bool()
        assert (a[real] - ref[real]).abs().max().item() <= TOL
        for i, n in enumerate(lens):
            alone = ours(tokens[i:i + 1, real[i]])[0]
            assert (a[i, real[i]] - alone).abs().max().item() <= TOL


def test_chunked_equals_recurrent():
    torch.manual_seed(0)
    B, H, dk, dv = 2, 3, 16, 8
    for T in (1, 63, 64, 150):
        q, k = l2norm(torch.randn(B, H, T, dk)), l2norm(torch.randn(B, H, T, dk))
        v, log_g, beta = torch.randn(B, H, T, dv), -torch.rand(B, H, T), torch.rand(B, H, T)
        S0 = torch.randn(B, H, dk, dv)
        o_r, S_r = recurrent_delta_rule(q, k, v, log_g, beta, S0)
        o_c, S_c = chunked_delta_rule(q, k, v, log_g, beta, S0)
        assert (o_c - o_r).abs().max().item() <= 1e-5 and (S_c - S_r).abs().max().item() <= 1e-5


def test_chunked_and_recurrent_equal_transformers_rules():
    """Our two forms against transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (grouped heads)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    torch.manual_seed(1)
    B, T, Hk, Hv, dk, dv = 2, 150, 2, 4, 16, 8
    q, k, v = torch.randn(B, T, Hk, dk), torch.randn(B, T, Hk, dk), torch.randn(B, T, Hv, dv)
    g, beta, S0 = -torch.rand(B, T, Hv), torch.rand(B, T, Hv), torch.randn(B, Hv, dk, dv)
    Q, K = (l2norm(t).repeat_interleave(Hv // Hk, 2).transpose(1, 2) for t in (q, k))
    for ours, theirs in ((chunked_delta_rule, m.torch_chunk_gated_delta_rule), (recurrent_delta_rule, m.torch_recurrent_gated_delta_rule)):
        o, S = ours(Q, K, v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), S0)
        ref, S_ref = theirs(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert (o.transpose(1, 2) - ref).abs().max().item() <= 1e-5 and (S - S_ref).abs().max().item() <= 1e-5


def test_model_recurrent_mode_equals_chunked(pair):
    _, ours = pair("interval4")
    tokens = _tokens(2, 100, 3)
    with torch.no_grad():
        a = ours(tokens)
        for l in ours.layers:
            if isinstance(l, DeltaNetBlock): l.linear_attn.mode = "recurrent"
        b = ours(tokens)
    assert (a - b).abs().max().item() <= TOL


def test_cache_prefill_then_steps_equal_full_forward(pair):
    """The DeltaNet cache (conv inputs + state, no keys/values) and the attention KV cache side by side."""
    _, ours = pair("interval4")
    tokens = _tokens(2, 90, 4)
    with torch.no_grad():
        full = ours(tokens)
        ours.setup_cache(2, 90)
        parts = [ours(tokens[:, :70])] + [ours(tokens[:, t:t + 1]) for t in range(70, 90)]
        assert ours.cache_size == 90
        ours.clear_cache()
    assert (torch.cat(parts, 1) - full).abs().max().item() <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_equals_transformers(pair, name):
    hf, ours = pair(name)
    prompt = _tokens(1, 9, 6)
    ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)[0, 9:].tolist()
    assert generate(ours, prompt, max_new_tokens=32) == [ref]


def test_generate_ragged_batch_and_samples_equal_one_by_one(pair):
    """Left-padded prompts (the DeltaNet state stays zero through the padding) and num_samples copying the DeltaNet cache."""
    _, ours = pair("interval4")
    prompts = [_tokens(1, 12, 7)[0].tolist(), _tokens(1, 5, 8)[0].tolist()]
    alone = [generate(ours, [p], max_new_tokens=16)[0] for p in prompts]
    assert generate(ours, prompts, max_new_tokens=16) == alone
    assert generate(ours, prompts, max_new_tokens=16, num_samples=2) == [alone[0], alone[0], alone[1], alone[1]]


def test_training_loss_and_gradients_equal_transformers(pair):
    hf, ours = pair("interval4")
    ours.train(); hf.train()
    tokens = _tokens(2, 80, 5)
    out = hf(tokens, labels=tokens)
    logits = ours(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    loss.backward(); out.loss.backward()
    ref = dict(hf.named_parameters())
    worst = max((p.grad - ref[("" if n.startswith("lm_head") else "model.") + n].grad).abs().max().item()
                for n, p in ours.named_parameters())
    assert worst <= 1e-5, worst
    dn = ours.layers[0].linear_attn
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (dn.A_log, dn.dt_bias, dn.conv1d.weight, dn.norm.weight))


@pytest.mark.parametrize("name", CONFIGS)
def test_save_hf_loads_in_transformers(tmp_path, name):
    cfg = config_from_hf(hf_qwen35(name).config.to_dict())
    torch.manual_seed(1)
    ours = build_model(cfg)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is transformers.Qwen3_5ForCausalLM and back.config.layer_types == cfg.layer_types
    tokens = _tokens(2, 70)
    with torch.no_grad():
        assert (ours(tokens) - back(tokens).logits).abs().max().item() <= TOL
    assert torch.equal(load_hf(out).layers[1].self_attn.A_log, ours.layers[1].self_attn.A_log)


def test_config_round_trips_and_defaults():
    for name in CONFIGS:
        hf = hf_qwen35(name).config.to_dict()
        cfg = config_from_hf(hf)
        assert config_from_hf(config_to_hf(cfg)) == cfg
        assert cfg.layer_types == hf["layer_types"] and cfg.attn_output_gate and cfg.qk_norm
        assert cfg.partial_rotary_factor == hf["rope_parameters"]["partial_rotary_factor"]
    # a config.json that leaves fields out reads with Qwen3_5TextConfig's defaults, as transformers does
    minimal = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2)
    cfg, ref = config_from_hf(minimal), transformers.Qwen3_5TextConfig(**{k: v for k, v in minimal.items() if k != "model_type"})
    assert cfg.layer_types == ref.layer_types == qwen3_5_layer_types(8)
    assert (cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta) == (ref.head_dim, 0.25, ref.rope_parameters["rope_theta"])
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel) == (
        ref.linear_num_key_heads, ref.linear_num_value_heads, ref.linear_key_head_dim, ref.linear_value_head_dim, ref.linear_conv_kernel_dim)
    # full_attention_interval spells the pattern too
    assert config_from_hf({**minimal, "full_attention_interval": 2}).layer_types == qwen3_5_layer_types(8, 2)
    # linear layers cannot be written as another family
    with pytest.raises(ValueError, match="qwen3_5_text"):
        config_to_hf(cfg.replace(arch="qwen3"))


def test_param_count_equals_transformers_on_meta():
    """transformers' default Qwen3_5TextConfig (its docstring: 'Qwen3.5-9B style'), both built on meta."""
    ref_cfg = transformers.Qwen3_5TextConfig()
    ours = build_model(config_from_hf(ref_cfg.to_dict()), device="meta")
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForCausalLM(ref_cfg)
    assert count_params(ours) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", CONFIGS)
def test_documents_end_to_end_equal_each_alone_in_transformers(pair, name):
    """Packed and padding-free rows: documents of 70 (past the 64-position chunk), 9 and 130 tokens end to end in one
    row, positions restarting. Each DeltaNet layer starts every document from a zero state and zero convolution inputs,
    each attention layer attends inside it: the logits, the summed loss and every gradient equal transformers' on each
    document alone (its torch fallback has no cu_seqlens)."""
    hf, ours = pair(name)
    ours.train(); hf.train()
    lens = [70, 9, 130]
    docs = [_tokens(1, n, 10 + i) for i, n in enumerate(lens)]
    tokens = torch.cat(docs, 1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lens)], 1)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    logits = ours(tokens, positions=positions, doc_ids=doc_ids)
    loss, ref_loss, start = 0.0, 0.0, 0
    for d, n in zip(docs, lens):
        ref = hf(d, labels=d)
        assert (logits[0, start:start + n] - ref.logits[0]).abs().max().item() <= TOL, n
        part = logits[0, start:start + n - 1]
        loss = loss + torch.nn.functional.cross_entropy(part, d[0, 1:], reduction="sum")
        ref_loss = ref_loss + ref.loss * (n - 1)
        start += n
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    loss.backward(); ref_loss.backward()
    named = dict(hf.named_parameters())
    worst = max((p.grad - named[("" if n.startswith("lm_head") else "model.") + n].grad).abs().max().item()
                for n, p in ours.named_parameters())
    assert worst <= 1e-4, worst


def test_what_documents_end_to_end_do_not_combine_with():
    cfg = config_from_hf(hf_qwen35().config.to_dict())
    model = build_model(cfg)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="DeltaNet.*not a ready-made mask"):
        model(_tokens(1, 6), mask=torch.ones(1, 1, 6, 6, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="DeltaNet"):
        model(_tokens(1, 6), doc_ids=ids, attn_mask=torch.ones(1, 6, dtype=torch.long))
    from tunebook.attention import DocumentSpans
    dn = next(l.linear_attn for l in model.layers if isinstance(l, DeltaNetBlock))
    dn.setup_cache(1, 16)
    with pytest.raises(ValueError, match="cache"):
        dn(torch.randn(1, 6, cfg.dim), mask=DocumentSpans.from_doc_ids(ids))


def _what_runs(f):
    """The function a transformers kernel hook would call: transformers 5.25 wraps the delta rule in an nn.Module whose
    forward calls a wrapper that holds the chosen `implementation` (flash-linear-attention's, or the torch function)."""
    if isinstance(f, torch.nn.Module):
        f = inspect.getclosurevars(f.forward).nonlocals["func"]
    return inspect.getclosurevars(f).nonlocals.get("implementation", f) if hasattr(f, "__wrapped__") else f


def test_transformers_runs_its_torch_fallback():
    "The reference the parity tests compare with runs transformers' own PyTorch delta rule, not a kernel."
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    f = _what_runs(m.torch_chunk_gated_delta_rule)
    assert f.__module__ == m.__name__ and "torch" in f.__name__, f
    try:
        import fla  # noqa: F401
        pytest.skip("flash-linear-attention is installed: transformers may use its kernel")
    except ImportError:
        pass


def test_load_hf_reads_a_multimodal_qwen3_5_folder(tmp_path):
    """The published Qwen3.5 folders are Qwen3_5ForConditionalGeneration (model_type qwen3_5): the text decoder under
    model.language_model.*, the top level's tie_word_embeddings; the vision tower and mtp.* are skipped, as
    transformers' Qwen3_5ForCausalLM does."""
    from safetensors.torch import load_file, save_file
    text = {k: v for k, v in CONFIGS["interval4"].items()}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    for tie in (False, True):
        torch.manual_seed(0)
        vlm = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)).eval()
        with torch.no_grad():
            for n, p in vlm.named_parameters():
                if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))
        d = tmp_path / f"vlm-{tie}"
        vlm.save_pretrained(d)
        sd = load_file(d / "model.safetensors")
        sd["mtp.fc.weight"] = torch.zeros(4, 4)   # a multi-token-prediction tensor, as the published folders hold
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        ours = load_hf(d)
        assert ours.config.tie_embeddings == tie and ours.config.arch == "qwen3_5_text"
        tokens = _tokens(2, 70, 9)
        with torch.no_grad():
            assert (ours(tokens) - vlm(input_ids=tokens).logits).abs().max().item() <= TOL


def test_load_hf_skips_mtp_tensors(tmp_path):
    from safetensors.torch import load_file, save_file
    hf = hf_qwen35()
    hf.save_pretrained(tmp_path / "m")
    sd = load_file(tmp_path / "m" / "model.safetensors")
    sd["mtp.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    ours = load_hf(tmp_path / "m")
    tokens = _tokens(1, 20)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= TOL


def test_a_small_qwen3_5_learns(tmp_path):
    """The training loop end to end on a hybrid model: a random 4-layer Qwen3.5 (3 DeltaNet + 1 attention) fine-tuned 40
    steps (full) on the embedded task; the held-out loss falls (measured 5.56 -> 2.75)."""
    from tunebook.checkpoint import load_embedded
    from tunebook.train import TrainConfig, Trainer
    _, tok = load_embedded()
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**CONFIGS["interval4"], "vocab_size": len(tok)}))
    hf.save_pretrained(tmp_path / "m"); tok.save(tmp_path / "m")
    tr = Trainer(TrainConfig(model=str(tmp_path / "m"), method="full", dtype="fp32", batch_size=16, max_steps=40, lr=3e-3,
                             warmup_steps=5, n_train=512, eval_samples=16, output_dir=str(tmp_path / "run")))
    s = tr.fit(progress=False)
    assert s["eval_loss_after"] < s["eval_loss_before"] - 2.0, s


def test_a_ragged_file_trains_padding_free_on_a_hybrid_model(tmp_path):
    """A bare fine-tune of a Qwen3.5 model on a ragged file goes padding-free (the rule, as for any model): its steps
    give the losses and weights of padded batches of the same rows (fp32, 1e-5), where padded batches are checked
    against transformers above."""
    import json, random
    from tunebook.checkpoint import load_embedded
    from tunebook.train import TrainConfig, Trainer
    _, tok = load_embedded()
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**CONFIGS["interval4"], "vocab_size": len(tok)}))
    hf.save_pretrained(tmp_path / "m"); tok.save(tmp_path / "m")
    rnd = random.Random(0)
    rows = [" ".join(rnd.choice(["abc", "tune", "book", "step"]) for _ in range(rnd.choice([1, 1, 2, 20, 40]))) for _ in range(32)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": "reverse " + r, "response": r[::-1]}) + "\n" for r in rows))
    def run(name, **kw):
        tr = Trainer(TrainConfig(model=str(tmp_path / "m"), data=str(tmp_path / "d.jsonl"), method="full", dtype="fp32", batch_size=8,
                                 max_steps=3, lr=1e-3, eval_samples=0, eval_fraction=0, output_dir=str(tmp_path / name), **kw)).setup()
        return tr, [tr.train_step()["loss"] for _ in range(3)]
    free, a = run("free")
    assert free.config.padding_free is True and free.choices["padding_free_report"].startswith("on (left unset"), free.choices
    assert free.micro_batch(0)["tokens"].shape[0] == 1 and "doc_ids" in free.micro_batch(0)
    padded, b = run("padded", padding_free=False)
    assert "attn_mask" in padded.micro_batch(0)
    assert all(abs(x - y) <= 1e-5 * y for x, y in zip(a, b)), (a, b)
    theirs = dict(padded.model.named_parameters())
    assert max((p - theirs[n]).abs().max().item() for n, p in free.model.named_parameters()) <= 1e-5


@pytest.mark.slow
def test_compiled_blocks_equal_eager(pair):
    """`compile_model` on a hybrid model (inductor, what --compile runs): a DeltaNet block gets its (B, T) padding mask or
    none (not the causal mask built for attention blocks), documents end to end run its per-document loop eagerly; logits
    and gradients equal the eager model's for plain, padded and end-to-end rows. (aot_eager's backward of the chunked
    delta rule fails on a view in torch 2.13, where inductor's and eager's do not.)"""
    import copy
    from tunebook.compile import compile_model, is_compiled
    torch._dynamo.reset()
    _, eager = pair("interval4")
    eager.train()
    comp = compile_model(copy.deepcopy(eager))
    assert all(is_compiled(b) for b in comp.layers)
    pad = torch.ones(2, 70, dtype=torch.long); pad[1, 45:] = 0
    lens = [70, 9, 51]
    ends = dict(doc_ids=torch.cat([torch.full((1, n), i) for i, n in enumerate(lens)], 1),
                positions=torch.cat([torch.arange(n) for n in lens])[None])
    for tokens, kw, keep in [(_tokens(2, 70, 1), {}, None), (_tokens(2, 70, 2), dict(attn_mask=pad), pad.bool()),
                             (_tokens(2, 83, 3), {}, None), (_tokens(1, 130, 4), ends, None)]:
        outs = []
        for m in (eager, comp):
            m.zero_grad(set_to_none=True)
            y = m(tokens, **kw)
            (y[keep] if keep is not None else y).square().mean().backward()
            outs.append((y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        (a, ga), (b, gb) = outs
        sel = (lambda t: t[keep]) if keep is not None else (lambda t: t)
        assert (sel(a) - sel(b)).abs().max().item() <= 1e-5, kw.keys()
        assert max((ga[n] - gb[n]).abs().max().item() for n in ga) <= 1e-5, kw.keys()
    torch._dynamo.reset()
