"""The mixture-of-experts decoder (Qwen3-MoE) against transformers' own `Qwen3MoeForCausalLM` on the same random weights, fp32:
logits, router choices, the load-balancing loss, greedy generation, checkpoints both ways, and the named builders' sizes."""
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from conftest import hf_model
from tunebook.checkpoint import config_from_hf, config_to_hf, load_hf, save_hf
from tunebook.core import count_params
from tunebook.generate import generate
from tunebook.model import build_model, get_config, qwen3_30b_a3b
from tunebook.moe import Experts, MoEFeedForward, TopKRouter, count_active_params, load_balancing_loss, moe_aux_loss, moe_blocks

TOL = 1e-4  # max abs difference of fp32 logits

# 3 layers, layer 1 dense (mlp_only_layers); 8 experts of width 32, 2 per token
MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
           rope_theta=1000000.0, rms_norm_eps=1e-6)
CONFIGS = {"norm-topk": dict(MOE, norm_topk_prob=True),
           "raw-topk": dict(MOE, norm_topk_prob=False),
           "step2-tied-bias": dict(MOE, mlp_only_layers=[], decoder_sparse_step=2, num_hidden_layers=4, num_experts_per_tok=3,
                                   tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1)}


def moe_model(name="norm-topk", seed=0):
    """transformers' model with a decisive router (std 0.3, so top-k choices do not hang on rounding), fp32, eval."""
    hf = hf_model("qwen3_moe", seed=seed, **CONFIGS[name])
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"): p.normal_(0, 0.3)
    return hf


@pytest.fixture
def pair(tmp_path):
    """pair(name) -> (transformers model, ours loaded by load_hf from the folder transformers saved)."""
    def make(name="norm-topk"):
        hf = moe_model(name)
        hf.save_pretrained(tmp_path / name)
        return hf, load_hf(tmp_path / name)
    return make


def _tokens(B, T, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match(pair, name):
    hf, ours = pair(name)
    assert [type(l.mlp).__name__ for l in ours.layers] == [
        "MoEFeedForward" if "SparseMoe" in type(l.mlp).__name__ else "FeedForward" for l in hf.model.layers]
    for T in (1, 7, 33):
        tokens = _tokens(2, T, T)
        with torch.no_grad():
            diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
        assert diff <= TOL, f"{name} T={T}: max abs diff {diff}"


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch(pair, side):
    hf, ours = pair("norm-topk")
    tokens = _tokens(3, 11, 1)
    mask = torch.ones(3, 11, dtype=torch.long)
    for i, n in enumerate([11, 6, 3]):
        if side == "right": mask[i, n:] = 0
        else: mask[i, :11 - n] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(tokens, positions=positions, attn_mask=mask)
        out = hf(tokens, attention_mask=mask, position_ids=positions, output_router_logits=True)
        real = mask.bool()
        assert (a[real] - out.logits[real]).abs().max().item() <= TOL
        # the load-balancing loss leaves the padding out, as transformers' does
        assert abs(moe_aux_loss(ours).item() - out.aux_loss.item()) <= 1e-6


@pytest.mark.parametrize("name", CONFIGS)
def test_router_choices_token_for_token(pair, name):
    hf, ours = pair(name)
    tokens = _tokens(2, 19, 3)
    with torch.no_grad():
        ours(tokens)
        ref = hf(tokens, output_router_logits=True).router_logits
    blocks = moe_blocks(ours)
    assert len(blocks) == len(ref) > 0
    k = hf.config.num_experts_per_tok
    for b, r in zip(blocks, ref):
        assert (b.router_logits - r).abs().max().item() <= 1e-5
        mine = b.router_logits.softmax(-1).topk(k, -1)[1].sort(-1)[0]
        theirs = r.softmax(-1).topk(k, -1)[1].sort(-1)[0]
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", CONFIGS)
def test_aux_loss_equals_transformers(pair, name):
    hf, ours = pair(name)
    tokens = _tokens(2, 17, 4)
    with torch.no_grad():
        ours(tokens)
        out = hf(tokens, output_router_logits=True)
    assert abs(moe_aux_loss(ours).item() - out.aux_loss.item()) <= 1e-6
    assert abs(ours.router_aux_loss().item() - hf.config.router_aux_loss_coef * out.aux_loss.item()) <= 1e-9


def test_training_loss_and_gradients_equal_transformers(pair):
    """Cross-entropy + coef * aux loss: the same loss and the same gradients on the router and the stacked experts."""
    hf, ours = pair("raw-topk")
    ours.train(); hf.train()
    tokens = _tokens(2, 12, 5)
    out = hf(tokens, labels=tokens, output_router_logits=True)
    logits = ours(tokens)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss = ce + ours.router_aux_loss()
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    loss.backward(); out.loss.backward()
    ref = dict(hf.named_parameters())
    for i in (0, 2):
        a, b = ours.layers[i].mlp, f"model.layers.{i}.mlp."
        assert (a.gate.weight.grad - ref[b + "gate.weight"].grad).abs().max().item() <= 1e-6
        gate_up = torch.cat([a.experts.gate_proj.grad, a.experts.up_proj.grad], 1)
        assert (gate_up - ref[b + "experts.gate_up_proj"].grad).abs().max().item() <= 1e-6
        assert (a.experts.down_proj.grad - ref[b + "experts.down_proj"].grad).abs().max().item() <= 1e-6


def test_greedy_generation_equals_transformers(pair):
    hf, ours = pair("norm-topk")
    prompt = _tokens(1, 9, 6)
    ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)[0, 9:].tolist()
    assert generate(ours, prompt, max_new_tokens=32) == [ref]


@pytest.mark.parametrize("name", CONFIGS)
def test_save_hf_loads_in_transformers(tmp_path, name):
    """A model we built and saved: transformers reads it (per-expert keys, its config.json) to the same logits."""
    cfg = config_from_hf({**moe_model(name).config.to_dict(), "model_type": "qwen3_moe"})
    torch.manual_seed(1)
    ours = build_model(cfg)
    with torch.no_grad():
        for b in moe_blocks(ours): b.gate.weight.normal_(0, 0.3)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is transformers.Qwen3MoeForCausalLM
    assert (back.config.num_experts, back.config.num_experts_per_tok, back.config.norm_topk_prob, back.config.mlp_only_layers) == \
        (cfg.n_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.mlp_only_layers)
    tokens = _tokens(2, 13)
    with torch.no_grad():
        assert (ours(tokens) - back(tokens).logits).abs().max().item() <= TOL
    assert torch.equal(moe_blocks(load_hf(out))[0].experts.down_proj, moe_blocks(ours)[0].experts.down_proj)


def test_load_hf_reads_fused_expert_tensors(tmp_path):
    """A folder holding transformers' in-memory names (experts.gate_up_proj, experts.down_proj, stacked) loads too."""
    hf = moe_model("norm-topk")
    d = tmp_path / "fused"; d.mkdir()
    (d / "config.json").write_text(json.dumps(hf.config.to_dict()))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    ours = load_hf(d)
    tokens = _tokens(2, 10)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("name, total, active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9)])
def test_builder_param_counts_equal_transformers(name, total, active):
    """Total and active (k of 128 experts) parameters equal transformers' model on the same config, and the model card's."""
    ours = build_model(name, device="meta")
    hf_cfg = config_to_hf(ours.config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            hf_cfg.pop("model_type"), **{k: v for k, v in hf_cfg.items() if k != "architectures"}))
    assert type(hf) is transformers.Qwen3MoeForCausalLM
    n_hf = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    E, k = hf.config.num_experts, hf.config.num_experts_per_tok
    assert count_params(ours) == n_hf
    assert count_active_params(ours) == n_hf - experts // E * (E - k)
    assert abs(count_params(ours) - total) <= 0.05 * total and abs(count_active_params(ours) - active) <= 0.05 * active


def test_builder_config_round_trips():
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        cfg = get_config(name)
        assert config_from_hf(config_to_hf(cfg)) == cfg
    # the published config.json of Qwen/Qwen3-30B-A3B reads as the builder
    published = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, router_aux_loss_coef=0.001, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645, use_sliding_window=False, sliding_window=None, max_window_layers=48, hidden_act="silu")
    assert config_from_hf(published) == qwen3_30b_a3b()


def test_router_renormalises_only_when_asked():
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    for norm in (True, False):
        r = TopKRouter(16, 6, 2, norm_topk_prob=norm); r.normal_init(0.5)
        logits, w, idx = r(x)
        probs = logits.softmax(-1)
        assert torch.allclose(w, probs.gather(1, idx) / (probs.gather(1, idx).sum(-1, keepdim=True) if norm else 1))
    with pytest.raises(ValueError, match="experts per token"): TopKRouter(16, 4, 5)
    with pytest.raises(ValueError, match="sigmoid"): TopKRouter(16, 4, 2, scoring="sigmoid")


def test_experts_equal_a_loop_over_tokens():
    torch.manual_seed(0)
    ex = Experts(6, 16, 8); ex.normal_init(0.3)
    x, idx, w = torch.randn(9, 16), torch.randint(0, 6, (9, 3)), torch.rand(9, 3)
    f = lambda e, v: torch.nn.functional.linear(torch.nn.functional.silu(ex.gate_proj[e] @ v) * (ex.up_proj[e] @ v), ex.down_proj[e])
    ref = torch.stack([sum(w[t, j] * f(idx[t, j], x[t]) for j in range(3)) for t in range(9)])
    assert (ex(x, idx, w) - ref).abs().max().item() <= 1e-5


def test_aux_loss_of_a_balanced_router_is_k():
    assert abs(load_balancing_loss([torch.zeros(32, 8)], k=2).item() - 2.0) <= 1e-6
    assert moe_aux_loss(build_model(get_config("pico"))) == 0.0


def test_moe_config_errors():
    with pytest.raises(ValueError, match="experts_per_token"): qwen3_30b_a3b(experts_per_token=0)
    with pytest.raises(ValueError, match="moe_hidden_dim"): qwen3_30b_a3b(moe_hidden_dim=None)
    with pytest.raises(ValueError, match="qwen3_moe"): config_to_hf(get_config("qwen3-0.6b", n_experts=4, experts_per_token=2, moe_hidden_dim=8))
    with pytest.raises(ValueError, match="use_sliding_window"):
        config_from_hf({**config_to_hf(qwen3_30b_a3b()), "use_sliding_window": True, "sliding_window": 64})


def test_flat_gemma3_config_names_the_fix(make_hf):
    """model_type gemma3 with the text fields at the top level (no text_config): the message says so and names the fix."""
    _, d = make_hf("gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3"}))
    with pytest.raises(ValueError) as e: load_hf(d)
    msg = str(e.value)
    assert "text_config" in msg and '"model_type": "gemma3_text"' in msg and "hidden_size=64" in msg
    assert "2304" not in msg and "262208" not in msg   # no default shape the file never states


def test_bf16_close(pair, tmp_path):
    """bf16 weights on both sides: logits agree to bf16 rounding."""
    hf, _ = pair("norm-topk")
    ours, hf = load_hf(tmp_path / "norm-topk", dtype="bf16"), hf.to(torch.bfloat16)
    tokens = _tokens(2, 16)
    with torch.no_grad():
        a, b = ours(tokens).float(), hf(tokens).logits.float()
    assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()


def test_activation_checkpointing_keeps_the_aux_loss_and_its_gradient():
    """Blocks recomputed in backward: the same loss (cross-entropy stand-in + aux) and the same router gradients."""
    from tunebook.memory.techniques import apply_activation_checkpointing
    cfg = qwen3_30b_a3b(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, moe_hidden_dim=16,
                        n_experts=6, experts_per_token=2)
    torch.manual_seed(0)
    a, b = build_model(cfg), build_model(cfg)
    b.load_state_dict(a.state_dict())
    apply_activation_checkpointing(b)
    tokens = _tokens(2, 9)
    losses = []
    for m in (a, b):
        m.train()
        loss = m(tokens).logsumexp(-1).mean() + m.router_aux_loss()
        loss.backward(); losses.append(loss.item())
    assert losses[0] == losses[1]
    for i in range(2):
        assert torch.equal(a.layers[i].mlp.gate.weight.grad, b.layers[i].mlp.gate.weight.grad)


def test_lora_all_linear_leaves_router_and_experts_frozen():
    from tunebook.lora import apply_lora
    cfg = qwen3_30b_a3b(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, moe_hidden_dim=16,
                        n_experts=6, experts_per_token=2)
    m = apply_lora(build_model(cfg), targets="all-linear", rank=4)
    assert not any(p.requires_grad for b in moe_blocks(m) for p in b.parameters())
    m(_tokens(1, 5)).sum().backward()
    assert all(p.grad is not None for n, p in m.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_through_tunebook_is_exact(pair, tmp_path, name):
    """transformers' folder -> load_hf -> save_hf -> transformers: bit-identical logits and the same tensor names."""
    from safetensors import safe_open
    hf, ours = pair(name)
    out = save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(2, 13)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)
    keys = lambda d: set(safe_open(str(d / "model.safetensors"), "pt").keys())
    assert keys(out) == keys(tmp_path / name)


def test_backward_never_slices_a_full_size_gradient_per_expert():
    """The graph holds one Unbind per stacked weight and one Split of the tokens, no per-expert Select/Slice (each of whose
    backward zero-fills a full-size gradient: 10x slower at 64 experts)."""
    torch.manual_seed(0)
    m = MoEFeedForward(TopKRouter(16, 32, 4), Experts(32, 16, 8)); m.gate.normal_init(0.5); m.experts.normal_init(0.1)
    y = m(torch.randn(1, 40, 16, requires_grad=True))
    seen, stack, kinds = set(), [y.grad_fn], {}
    while stack:
        f = stack.pop()
        if f is None or f in seen: continue
        seen.add(f); kinds[type(f).__name__] = kinds.get(type(f).__name__, 0) + 1
        stack.extend(g for g, _ in f.next_functions)
    assert kinds.get("UnbindBackward0") == 3 and "SelectBackward0" not in kinds and "SliceBackward0" not in kinds, kinds


def test_a_trained_model_can_be_deep_copied():
    """After a training forward the router logits are inside the graph; deepcopy (LoRA merge for saving) still works."""
    import copy
    cfg = qwen3_30b_a3b(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, moe_hidden_dim=16,
                        n_experts=6, experts_per_token=2)
    m = build_model(cfg).train()
    m(_tokens(1, 5)).sum()
    c = copy.deepcopy(m)
    assert all(b.router_logits is None for b in moe_blocks(c)) and all(b.router_logits is not None for b in moe_blocks(m))
    assert torch.equal(c.layers[0].mlp.experts.up_proj, m.layers[0].mlp.experts.up_proj)


@pytest.mark.parametrize("kw", [dict(), dict(activation_checkpointing=True), dict(method="lora")])
def test_memory_estimate_of_an_moe_step_equals_the_measured_one(kw):
    """The estimator runs the step under FakeTensorMode, where routing is unknown (an even split); the peak is the measured one."""
    from tunebook.memory import estimate
    cfg = qwen3_30b_a3b(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, moe_hidden_dim=32,
                        n_experts=8, experts_per_token=2)
    r = estimate(cfg, batch_size=2, seq_len=64, dtype="fp32", measure=True, **kw)
    assert abs(r.error) <= 0.01, (r.peak_bytes, r.measured_peak_bytes)


def test_compiled_moe_blocks_equal_eager():
    """compile_block leaves dynamo a graph break at the routing of an MoE block (fullgraph would refuse its data-dependent sizes)."""
    from tunebook.compile import compile_model
    cfg = qwen3_30b_a3b(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, moe_hidden_dim=16,
                        n_experts=6, experts_per_token=2, mlp_only_layers=[0])
    torch.manual_seed(0)
    a, b = build_model(cfg).train(), build_model(cfg).train()
    b.load_state_dict(a.state_dict())
    compile_model(b, backend="aot_eager")
    tokens = _tokens(2, 7)
    la = a(tokens).logsumexp(-1).mean() + a.router_aux_loss()
    lb = b(tokens).logsumexp(-1).mean() + b.router_aux_loss()
    la.backward(); lb.backward()
    assert abs(la.item() - lb.item()) <= 1e-6
    assert (a.layers[1].mlp.gate.weight.grad - b.layers[1].mlp.gate.weight.grad).abs().max().item() <= 1e-6


def test_vllm_weight_sync_names_each_expert_as_the_checkpoint_does():
    """The tensors GRPO hands vLLM (LoRA merged) are the checkpoint's: one per expert, the same names and shapes as save_hf's."""
    from tunebook.checkpoint import expected_tensors
    from tunebook.lora import apply_lora
    from tunebook.vllmgen.engine import policy_tensors
    cfg = qwen3_30b_a3b(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, moe_hidden_dim=16,
                        n_experts=6, experts_per_token=2)
    tensors = policy_tensors(apply_lora(build_model(cfg), targets="all-linear", rank=4))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: tuple(s) for k, s in expected_tensors(build_model(cfg, device="meta")).items()}


def test_trainer_step_adds_the_load_balancing_loss_as_transformers_does(tmp_path):
    """The training loop's step on a Qwen3-MoE checkpoint: its loss is transformers' (mean cross-entropy over the labelled
    tokens + router_aux_loss_coef x aux_loss) on the same batch, and the router's part is logged as router_aux_loss."""
    import torch.nn.functional as F
    from tunebook.checkpoint import load_embedded
    from tunebook.train import TrainConfig, Trainer
    _, tok = load_embedded()
    hf = hf_model("qwen3_moe", seed=0, **{**CONFIGS["raw-topk"], "vocab_size": len(tok), "router_aux_loss_coef": 0.5})
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"): p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "m"); tok.save(tmp_path / "m")
    tr = Trainer(TrainConfig(model=str(tmp_path / "m"), method="full", dtype="fp32", batch_size=4, max_steps=2, n_train=16,
                             eval_samples=0, output_dir=str(tmp_path / "run"))).setup()
    b = tr.micro_batch(0)
    with torch.no_grad():
        out = hf(b["tokens"], attention_mask=b.get("attn_mask"), output_router_logits=True)
    want = F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100) + 0.5 * out.aux_loss
    row = tr.train_step()
    assert abs(row["loss"] - want.item()) <= 1e-5, (row["loss"], want.item())
    assert abs(row["router_aux_loss"] - 0.5 * out.aux_loss.item()) <= 1e-6


def test_a_small_moe_learns_and_the_balancing_loss_spreads_the_load(tmp_path):
    """A random 8-expert Qwen3-MoE fine-tuned 60 steps on the embedded task: the held-out loss falls (5.6 -> 2.5), and with
    the balancing loss on (coef 0.05) no expert takes more than a third of the routed (token, slot) pairs (uniform: 12.5%;
    measured 30%), and fewer than without it (46%)."""
    from tunebook.checkpoint import load_embedded
    from tunebook.train import TrainConfig, Trainer
    _, tok = load_embedded()
    shares = {}
    for coef in (0.0, 0.05):
        hf = hf_model("qwen3_moe", seed=0, **{**MOE, "vocab_size": len(tok), "router_aux_loss_coef": coef})
        hf.save_pretrained(tmp_path / f"m{coef}"); tok.save(tmp_path / f"m{coef}")
        tr = Trainer(TrainConfig(model=str(tmp_path / f"m{coef}"), method="full", dtype="fp32", batch_size=16, max_steps=60, lr=3e-3,
                                 warmup_steps=5, n_train=512, eval_samples=16, output_dir=str(tmp_path / f"run{coef}")))
        s = tr.fit(progress=False)
        assert s["eval_loss_after"] < s["eval_loss_before"] - 2.5, s
        tr.model.eval()
        with torch.no_grad(): tr.model(tr.micro_batch(0)["tokens"])
        shares[coef] = max((torch.bincount(b.router_logits.topk(MOE["num_experts_per_tok"], -1).indices.flatten(), minlength=8)
                            .float() / b.router_logits.shape[0] / MOE["num_experts_per_tok"]).max().item() for b in moe_blocks(tr.model))
    assert shares[0.05] <= 1 / 3 and shares[0.05] < shares[0.0], shares


def test_estimate_reports_held_and_active_parameters(tmp_path):
    """The memory estimate of an MoE folder says how many parameters are held and how many one token uses (transformers'
    count minus the k-of-E experts not chosen); a dense model's has no active count."""
    from tunebook.memory import estimate
    hf = moe_model("raw-topk")
    hf.save_pretrained(tmp_path / "moe")
    r = estimate(tmp_path / "moe", method="full", seq_len=8, dtype="fp32")
    n_hf = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    E, k = hf.config.num_experts, hf.config.num_experts_per_tok
    assert r.settings["params"] == n_hf and r.settings["active_params"] == n_hf - experts // E * (E - k)
    assert "active_params" not in estimate("pico", method="full", seq_len=8, dtype="fp32").settings
