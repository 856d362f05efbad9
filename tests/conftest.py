"""Shared fixtures: small random-weight Hugging Face models written by transformers to a temp folder."""
import importlib
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*torchao.*")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def hf_model(arch="llama", seed=0, **kw):
    """A random-weight transformers causal LM, fp32, eval mode. kw are transformers config fields."""
    import transformers
    torch.manual_seed(seed)
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    base.update(kw)
    cls, cfg_cls = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
                    "gemma3_text": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig),
                    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config),
                    "smollm3": (transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config),
                    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig)}[arch]
    if arch in ("qwen3", "qwen3_moe"): base.setdefault("head_dim", base["hidden_size"] // base["num_attention_heads"])
    if arch == "gemma3_text":
        base.setdefault("head_dim", base["hidden_size"] // base["num_attention_heads"])
        base.setdefault("query_pre_attn_scalar", base["head_dim"])
    if arch in ("qwen3", "gemma3_text", "phi3", "mistral", "smollm3", "qwen3_moe"): base.setdefault("pad_token_id", 0)
    model = cls(cfg_cls(**base)).eval()
    # transformers initialises norms to one and biases to zero: randomise them so the test sees them
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"): p.add_(0.1 * torch.randn_like(p))  # q_norm/k_norm and Gemma's four norms too
            if n.endswith(".bias"): p.normal_(0, 0.1)
    return model


@pytest.fixture
def make_hf(tmp_path):
    """make_hf(arch, **config) -> (transformers model, folder it was saved to)."""
    def make(arch="llama", name="hf", **kw):
        m = hf_model(arch, **kw)
        d = tmp_path / name
        m.save_pretrained(d)
        return m, d
    return make


# ---------------------------------------------------------------- waiting without wall-clock limits
# Tests wait for what the code signals (a thread ending, a LiveRun update, a file appearing, a process exiting), never
# for a fixed time: a loaded 2-core machine is slow, not broken. HANG only guards against a hang, and says so.
HANG = float(os.environ.get("TUNEBOOK_TEST_HANG_S", 1800))


def hung(what: str, timeout: float = HANG) -> str:
    return f"hung: {what} did not happen within {timeout:.0f} s (a hang guard, not a speed limit; TUNEBOOK_TEST_HANG_S sets it)"


def wait_until(cond, what: str, timeout: float = HANG, poll: float = 0.05):
    """Poll `cond()` (a file appearing, a process exiting) until it is true; fail with `hung(what)` after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, hung(what, timeout)
        time.sleep(poll)


def joined(thread, what: str, timeout: float = HANG):
    """Join `thread` (the code's own signal that the work ended); fail with `hung(what)` if it is still alive."""
    if thread is not None: thread.join(timeout)
    assert thread is None or not thread.is_alive(), hung(what, timeout)


def run_reaches(run, cond, what: str, timeout: float = HANG):
    """Block until `cond(run)` holds for a `tunebook.live.LiveRun`, checked at each update it signals (its on_update
    hook, which it calls after every step and when it ends); the run ending without `cond` returns too."""
    done, inner = threading.Event(), run.on_update
    def hook(r):
        try:
            if inner is not None: inner(r)
        finally:
            if cond(r) or r.status in ("finished", "stopped", "failed"): done.set()
    run.on_update = hook
    if cond(run) or (run.thread is not None and not run.thread.is_alive()): done.set()   # it may have got there already
    assert done.wait(timeout), hung(what, timeout)


# ---------------------------------------------------------------- dev dependencies
def need(module: str):
    """Import a dev dependency (settings.ini's dev_requirements) or FAIL: a missing one is a broken install, and a skip
    would quietly drop the parity tests that need it."""
    try: return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is a dev dependency and does not import ({e}): pip install -e .[dev]", pytrace=False)


# ---------------------------------------------------------------- RL fixtures (test_rl.py, test_grpo.py)
def _embedded():
    from tunebook.embedded import EMBEDDED_DIR, FINETUNE_TASK
    return (str(EMBEDDED_DIR), FINETUNE_TASK)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(model folder, task): a random-weight pico model and a small tokenizer: for mechanics, not learning."""
    from tunebook.checkpoint import save_hf
    from tunebook.data import make_task
    from tunebook.model import build_model, pico
    from tunebook.tokenizer import train_tokenizer
    tok = train_tokenizer([f"{r['prompt']} {r['answer']}" for r in make_task("add", 1000)], vocab_size=300)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny")
    save_hf(build_model(pico(vocab_size=len(tok))), out); tok.save(out)
    return str(out), "add"


@pytest.fixture(scope="session")
def policy(tiny):
    """(model folder, task) of a model that already half-solves its task: the embedded default. Learning tests need it."""
    found = _embedded()   # shipped with the package: a missing model is a failure, never a skip
    assert (Path(found[0]) / "config.json").exists(), f"the embedded model is missing from {found[0]}"
    return found


# ---------------------------------------------------------------- vLLM (test_vllm.py, test_grpo_vllm.py: .venv-vllm)
def _vllm_in_process(path, **kw):
    """A VLLMGenerator whose engine runs in this process, as GRPO's own start_vllm runs it: no EngineCore child,
    which a killed test run would leave behind (a multiprocess engine whose parent was killed ignores SIGTERM)."""
    from tunebook.vllmgen import VLLMGenerator
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        g = VLLMGenerator(path, **kw)
    finally:
        if old is None: os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else: os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    print(f"\nvLLM engine start-up: {g.startup_seconds:.1f} s")
    return g


@pytest.fixture(scope="session")
def vllm_in_process():
    """vllm_in_process(path, **VLLMGenerator options) -> an engine in this process; the caller closes it."""
    return _vllm_in_process


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder `build(folder)` fills once per test session, shared by every pytest-xdist worker (under a file lock), so an
    expensive module fixture (a fine-tune, an export) is not made again by each worker that draws one of its tests."""
    from filelock import FileLock
    if not os.environ.get("PYTEST_XDIST_WORKER"): return _fill(tmp_path_factory.mktemp(name), build)
    root = tmp_path_factory.getbasetemp().parent   # this session's folder, above every worker's own
    folder = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)   # a build that failed in another worker: start over
            _fill(folder, build)
    return folder


def _fill(folder: Path, build) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    build(folder)
    (folder / ".built").write_text("ok")
    return folder
