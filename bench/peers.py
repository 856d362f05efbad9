"""One training step of tunebook, torchtune 0.6.1 and transformers + peft, each built its own way from the same
Hugging Face folder, with a choice of precision, per-block torch.compile and (transformers only) Liger kernels.

Used by bench_device.py (one configuration at a time, allocator peaks on CUDA) and bench_finetune.py
(alternating in one process on the CPU). A `Run` holds a model and an AdamW; `run.step(batch)` is one whole
optimizer step (forward, loss, backward, AdamW, zero_grad) and returns the loss as a float.

precision: "fp32" (fp32 weights), "bf16" (bf16 weights and optimizer state), "amp" (fp32 weights and optimizer
state, compute under `torch.autocast(bfloat16)`). Every loss is computed from fp32 logits.
method: "lora" (rank r on q, k, v, o, gate, up, down), "full", or "model" (forward + backward of every weight,
no optimizer step: the model's own speed).
"""
import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F

IGNORE = -100
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TT_NAMES = {".attn.": ".self_attn.", "output_proj": "o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w2": "mlp.down_proj",
             "mlp.w3": "mlp.up_proj"}


def make_batch(batch: int, seq: int, vocab: int, prompt_frac: float = 0.25, seed: int = 0, device="cpu") -> dict:
    "Random tokens, tunebook's already-shifted labels (first `prompt_frac` masked) and transformers' unshifted ones."
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.full_like(tokens, IGNORE)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, : int(seq * prompt_frac)] = IGNORE
    hf = torch.full_like(labels, IGNORE)
    hf[:, 1:] = labels[:, :-1]  # transformers shifts `labels` inside the model
    return {k: v.to(device) for k, v in dict(tokens=tokens, labels=labels, hf_labels=hf).items()}


ALIASES = {"bf16-mixed": "amp"}  # tunebook's name for fp32 master weights + bf16 autocast


def _autocast(device, precision):
    if ALIASES.get(precision, precision) != "amp": return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def _weights_dtype(precision):
    precision = ALIASES.get(precision, precision)
    if precision not in ("fp32", "bf16", "amp"): raise ValueError(f"precision must be fp32, bf16 or amp, got {precision!r}")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _optimizer(params, lr, device):
    params = [p for p in params if p.requires_grad]
    # fused everywhere it runs (CPU and CUDA), for every framework: torchtune's configs and transformers' default optim use it
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=torch.device(device).type in ("cpu", "cuda")) if params else None


class Run:
    "Base: `loss_of(batch)` is the framework's forward + loss; `step` adds backward and the optimizer."
    framework = "?"

    def __init__(self, method, precision, device, lr, compile, compile_backend):
        self.method, self.precision, self.device, self.compile = method, precision, device, compile
        self.lr, self.compile_backend = lr, compile_backend

    def finish(self, blocks):
        if self.method == "model":
            for p in self.model.parameters(): p.requires_grad_(True)
        if self.compile:  # regional: each block on its own (identical blocks share one compiled graph)
            self.compile_blocks(blocks)
        self.model.train()
        self.optimizer = None if self.method == "model" else _optimizer(self.model.parameters(), self.lr, self.device)
        return self

    def compile_blocks(self, blocks):
        for b in blocks: b.compile(backend=self.compile_backend)

    def step(self, batch) -> float:
        with _autocast(self.device, self.precision):
            loss = self.loss_of(batch)
        loss.backward()
        if self.optimizer is not None: self.optimizer.step()
        (self.optimizer or self.model).zero_grad(set_to_none=True)
        return loss.detach()

    def n_trainable(self):
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


class TunebookRun(Run):
    framework = "tunebook"

    def __init__(self, d, method, precision, device, rank=16, alpha=32.0, lr=1e-4, compile=False, compile_backend="inductor",
                 num_chunks=8):
        super().__init__(method, precision, device, lr, compile, compile_backend)
        from tunebook.checkpoint import load_hf
        from tunebook.lora import apply_lora
        from tunebook.loss import ChunkedCrossEntropy
        self.model = load_hf(d, dtype=_weights_dtype(precision), device=device)
        if method == "lora": apply_lora(self.model, rank=rank, alpha=alpha, targets=LORA_TARGETS)
        self.loss_fn = ChunkedCrossEntropy(num_chunks=num_chunks)
        if method == "lora" and ALIASES.get(precision, precision) == "amp":
            from tunebook.precision import resolve_precision, store_frozen_
            store_frozen_(self.model, resolve_precision("bf16-mixed"))  # frozen base weights in bf16: what autocast casts them to
        self.finish(self.model.layers)

    def compile_blocks(self, blocks):  # tunebook's own regional compile: blocks (dynamic length) and the loss with lm_head
        from tunebook.compile import compile_model
        compile_model(self.model, self.loss_fn, backend=self.compile_backend)

    def loss_of(self, batch):
        h = self.model(batch["tokens"], return_hidden=True)
        w = self.model.output_weight  # under autocast the loss casts it once; else it must match the hidden states
        return self.loss_fn(h, w if torch.is_autocast_enabled(h.device.type) else w.to(h.dtype), batch["labels"])

    def lora_A(self):
        return {n.split(".lora_A")[0]: p for n, p in self.model.named_parameters() if ".lora_A." in n}


def _tt_config(cfg):
    "torchtune builder arguments from a config.json; Llama 3 RoPE scaling (and 1.0 without it) as `scale_factor`."
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", "default") not in ("default", "llama3"): raise ValueError(f"torchtune run: RoPE {rp} not supported here")
    if rp.get("rope_type") == "llama3" and (rp.get("low_freq_factor"), rp.get("high_freq_factor"), rp.get("original_max_position_embeddings")) != (1.0, 4.0, 8192):
        raise ValueError(f"torchtune's Llama3ScaledRoPE fixes low 1, high 4, original length 8192; got {rp}")
    return dict(scale_factor=float(rp["factor"]) if rp.get("rope_type") == "llama3" else 1.0,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), **_tt_base(cfg))


def _tt_base(cfg):
    return dict(vocab_size=cfg["vocab_size"], num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg["num_key_value_heads"], embed_dim=cfg["hidden_size"], max_seq_len=cfg["max_position_embeddings"],
                intermediate_dim=cfg["intermediate_size"], norm_eps=cfg["rms_norm_eps"], rope_base=cfg["rope_theta"])


class TorchtuneRun(Run):
    framework = "torchtune"

    def __init__(self, d, method, precision, device, rank=16, alpha=32.0, lr=1e-4, compile=False, compile_backend="inductor",
                 num_chunks=8):
        super().__init__(method, precision, device, lr, compile, compile_backend)
        import json
        from safetensors.torch import load_file
        from torchtune.models.convert_weights import hf_to_tune
        from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
        from torchtune.modules.loss import CEWithChunkedOutputLoss
        from torchtune.modules.peft import get_adapter_params, set_trainable_params
        if precision == "amp": raise ValueError("torchtune runs in fp32 or bf16 weights; it has no autocast mode")
        cfg = json.loads((Path(d) / "config.json").read_text())
        cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        kw = _tt_config(cfg)
        old = torch.get_default_dtype()
        torch.set_default_dtype(_weights_dtype(precision))
        try:
            with torch.device(device):
                # llama3_2's builders: llama3's layers, plus tied embeddings and Llama 3 RoPE scaling (scale_factor 1: plain RoPE)
                self.model = (lora_llama3_2(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                                            apply_lora_to_output=False, lora_rank=rank, lora_alpha=alpha, lora_dropout=0.0, **kw)
                              if method == "lora" else llama3_2(**kw))
        finally:
            torch.set_default_dtype(old)
        sd = {}
        for f in sorted(Path(d).glob("*.safetensors")): sd.update(load_file(str(f)))
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        sd = hf_to_tune(sd, num_heads=kw["num_heads"], num_kv_heads=kw["num_kv_heads"], dim=kw["embed_dim"], head_dim=hd)
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        bad = [k for k in missing if "lora" not in k] + list(unexpected)
        if bad: raise RuntimeError(f"torchtune: checkpoint keys do not match the model: {bad[:5]}")
        if method == "lora": set_trainable_params(self.model, get_adapter_params(self.model))
        # its recipes' loss: the output projection in `num_chunks` chunks of the sequence, each upcast to fp32 in the loss.
        # On the CPU in bf16 pass num_chunks=1: a chunk is a (B, T/k, D) view that F.linear cannot fold into one mm, so
        # matmul goes to bmm and copies the transposed (D, V) weight for every chunk (4.8 s each at the 1B shape)
        self.model.set_num_output_chunks(num_chunks)
        self.loss_fn = CEWithChunkedOutputLoss(num_output_chunks=num_chunks)
        self.finish(self.model.layers)

    def loss_of(self, batch):
        return self.loss_fn(self.model(batch["tokens"]), batch["labels"])

    def lora_A(self):
        out = {}
        for n, p in self.model.named_parameters():
            if ".lora_a." not in n: continue
            k = n.split(".lora_a")[0]
            for a, b in _TT_NAMES.items(): k = k.replace(a, b)
            out[k] = p
        return out


class HFRun(Run):
    framework = "transformers+peft"

    def __init__(self, d, method, precision, device, rank=16, alpha=32.0, lr=1e-4, compile=False, compile_backend="inductor",
                 liger=False):
        super().__init__(method, precision, device, lr, compile, compile_backend)
        import transformers
        self.liger = liger
        if liger:  # patches transformers' Llama classes in this process: run Liger configurations last
            from liger_kernel.transformers import apply_liger_kernel_to_llama
            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
        model = transformers.LlamaForCausalLM.from_pretrained(d, dtype=_weights_dtype(precision), attn_implementation="sdpa").to(device)
        model.config.use_cache = False   # training: no KV cache (compiled, its DynamicCache recompiled every layer until dynamo's limit)
        if method == "lora":
            import peft
            lc = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                 target_modules=list(LORA_TARGETS))
            # adapters in the base dtype, as tunebook and torchtune keep them (peft would upcast them to fp32)
            model = peft.get_peft_model(model, lc, autocast_adapter_dtype=False)
        self.model = model
        base = model.get_base_model() if method == "lora" else model
        self.finish(base.model.layers)

    def loss_of(self, batch):
        return self.model(input_ids=batch["tokens"], labels=batch["hf_labels"]).loss

    def lora_A(self):
        return {"layers." + n.split(".lora_A")[0].split(".layers.", 1)[1]: p
                for n, p in self.model.named_parameters() if ".lora_A." in n}


def copy_lora_A(a: dict, *dsts: Run):
    "Give every run the adapter A matrices `a` (B is zero everywhere), so their losses stay comparable step after step."
    with torch.no_grad():
        for r in dsts:
            b = r.lora_A()
            if set(a) != set(b): raise RuntimeError(f"{r.framework}: LoRA modules {sorted(b)[:3]} != {sorted(a)[:3]}")
            for k, p in b.items(): p.copy_(a[k])


def train_flops_per_token(cfg: dict, seq: int, method: str, rank: int = 16) -> float:
    "Model FLOPs per trained token (PaLM's convention: matmuls only, attention scores counted without the causal half)."
    d, L, V, f = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    linear = L * (d * q + 2 * d * kv + q * d + 3 * d * f) + d * V  # weights that multiply each token (lm_head included)
    attn = L * 2 * seq * q  # QK^T and AV: 2 * seq * q multiply-adds per token per layer
    fwd = 2 * linear + 2 * attn
    if method in ("full", "model"): return 3 * fwd
    ins = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    adapters = L * sum(rank * (i + o) for i, o in ins)
    # LoRA: frozen weights need the input gradient only (2x forward), attention needs both (3x), adapters train fully
    return 2 * (2 * linear) + 3 * (2 * attn) + 6 * adapters


def bf16_matmul_peak(device, n=2048, seconds=1.0, clock="wall") -> float:
    """FLOP/s of a loop of n x n x n bf16 matmuls here (the best of a few timed bursts); clock="cpu": FLOP per second of
    this process's CPU time (CPU only: what one thread does when it runs, far less swayed by other programs)."""
    import time
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    cuda = torch.device(device).type == "cuda"
    if clock not in ("wall", "cpu") or (cuda and clock == "cpu"): raise ValueError(f"clock must be 'wall' (or 'cpu' on the CPU), got {clock!r}")
    now = time.process_time if clock == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a @ b; sync()
    best, t_end = 0.0, time.perf_counter() + seconds
    reps = 20 if cuda else 2
    while time.perf_counter() < t_end:
        t0 = now()
        for _ in range(reps): a @ b
        sync()
        best = max(best, reps * 2 * n ** 3 / max(now() - t0, 1e-9))
    return best


def bf16_matmul_peaks(n=2048, seconds=0.3, reps=2) -> tuple:
    """(FLOP per wall-second, FLOP per CPU-second) of a loop of n x n x n bf16 matmuls on the CPU, each the best
    of the same timed bursts: short enough (0.3 s) to be measured right before and after every timed step."""
    import time
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    wall = cpu = 0.0
    t_end = time.perf_counter() + seconds
    while True:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps): a @ b
        t1, c1 = time.perf_counter(), time.process_time()
        wall = max(wall, reps * 2 * n ** 3 / max(t1 - t0, 1e-9))
        cpu = max(cpu, reps * 2 * n ** 3 / max(c1 - c0, 1e-9))
        if t1 >= t_end: return wall, cpu


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
