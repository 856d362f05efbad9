"""tunebook.chat: `generate` equals transformers' greedy output; `chat` answers from run folders (adapter or merged)."""
import io
import json

import pytest
import torch

from tunebook.chat import chat_main, generate_main, load_for_chat
from tunebook.checkpoint import load_hf, save_hf
from tunebook.data import encode_prompt
from tunebook.embedded import EMBEDDED_DIR
from tunebook.lora import apply_lora, merge_lora, save_adapter
from tunebook.tokenizer import load_tokenizer
from tunebook.train import stop_ids


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(EMBEDDED_DIR)


def _hf_greedy(folder, ids, n, tok):
    "transformers' greedy continuation of `ids` with the model in `folder`, as text."
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=stop_ids(tok), pad_token_id=tok.pad_id)[0, len(ids):].tolist()
    return tok.decode([t for t in out if t not in stop_ids(tok)], skip_special_tokens=True)


def _feed(lines):
    it = iter(lines)
    def fake_input(_):
        try: return next(it)
        except StopIteration: raise EOFError
    return fake_input


def test_generate_equals_transformers_greedy(tok):
    for prompt in ["12+7=", "copy hello=", "a=3 b=7 c=1 b?"]:
        buf = io.StringIO()
        assert generate_main([str(EMBEDDED_DIR), "--prompt", prompt, "--max-new-tokens", "12"], out=buf) == 0
        ref = _hf_greedy(EMBEDDED_DIR, encode_prompt(tok, [{"role": "user", "content": prompt}]), 12, tok)
        assert buf.getvalue() == ref + "\n", prompt


def test_sampling_flags_seeded(tok):
    outs = []
    for seed in (1, 1, 2, 3, 4, 5):
        buf = io.StringIO()
        generate_main([str(EMBEDDED_DIR), "--prompt", "reverse qzxw=", "--temperature", "3", "--top-k", "50", "--top-p", "0.99",
                       "--seed", str(seed), "--max-new-tokens", "16"], out=buf)
        outs.append(buf.getvalue())
    assert outs[0] == outs[1] and len(set(outs)) > 1     # same seed, same text; other seeds differ


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    "Two run folders of one LoRA-adapted embedded model: adapter/ only, and merged model/."
    root = tmp_path_factory.mktemp("runs")
    torch.manual_seed(0)
    m = apply_lora(load_hf(EMBEDDED_DIR, dtype=torch.float32), rank=4, targets=("q_proj", "v_proj", "up_proj"))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.5)   # a real change, so the adapter shows in the answers
    save_adapter(m, root / "a" / "adapter", base_model_name_or_path=str(EMBEDDED_DIR))
    (root / "a" / "config.json").write_text(json.dumps({"model": str(EMBEDDED_DIR)}))
    save_hf(merge_lora(m), root / "b" / "model")
    load_tokenizer(EMBEDDED_DIR).save(root / "b" / "model")
    return root / "a", root / "b"


def test_chat_answers_from_run_folders(run_dirs, tok):
    a, b = run_dirs
    assert "adapter" in load_for_chat(a)[2] and "merged model/" in load_for_chat(b)[2]
    turns = ["12+7=", "copy hello="]
    replies = []
    for folder in (a, b):
        buf = io.StringIO()
        assert chat_main([str(folder), "--temperature", "0", "--max-new-tokens", "12"], input_fn=_feed(turns), out=buf) == 0
        replies.append(buf.getvalue().split("\n")[:2])
    assert replies[0] == replies[1]                       # adapter on base == merged model
    first = [{"role": "user", "content": turns[0]}]
    assert replies[1][0] == _hf_greedy(b / "model", encode_prompt(tok, first), 12, tok)
    second = first + [{"role": "assistant", "content": replies[1][0]}, {"role": "user", "content": turns[1]}]
    assert replies[1][1] == _hf_greedy(b / "model", encode_prompt(tok, second), 12, tok)   # the history is kept
    base = io.StringIO()
    chat_main([str(EMBEDDED_DIR), "--temperature", "0", "--max-new-tokens", "12"], input_fn=_feed(turns[:1]), out=base)
    assert base.getvalue().split("\n")[0] != replies[0][0]   # the adapter was used


def test_errors_and_help(tmp_path, capsys):
    assert generate_main([str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert chat_main([str(tmp_path / "empty")], input_fn=_feed([])) == 2
    assert "neither a model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate_main(["--help"])
    h = capsys.readouterr().out
    for flag in ("--prompt", "--temperature", "--top-k", "--top-p", "--max-new-tokens", "--seed", "--system-prompt", "--no-chat-template"):
        assert flag in h


@pytest.mark.parametrize("flags,want", [
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--temperature", "-1"], "--temperature -1.0: must be >= 0"),
    (["--temperature", "nan"], "--temperature nan: must be >= 0"),
    (["--top-k", "0"], "--top-k 0: must be >= 1"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
])
def test_bad_sampling_flags_refused_before_loading(flags, want, capsys, monkeypatch):
    """N2: each bad flag is one line naming it, exit 2, and the model is never loaded (it used to be a traceback after loading)."""
    import tunebook.chat as chat
    monkeypatch.setattr(chat, "load_for_chat", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    for run in (lambda: generate_main([str(EMBEDDED_DIR), "--prompt", "1+1=", *flags]),
                lambda: chat_main([str(EMBEDDED_DIR), *flags], input_fn=_feed(["1+1="]))):
        assert run() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], err


def test_generation_stops_at_the_context(capsys):
    """N3: asked for more tokens than the context holds, generate caps them there and says so (it used to run past the
    context, allocating the whole cache up front, and print garbage); a prompt longer than the context is refused."""
    model, tok = load_hf(EMBEDDED_DIR), load_tokenizer(EMBEDDED_DIR)
    context = model.config.max_seq_len
    out = io.StringIO()
    assert generate_main([str(EMBEDDED_DIR), "--prompt", "copy ab=", "--max-new-tokens", "1000000"], out=out) == 0
    err = capsys.readouterr().err
    n_prompt = len(encode_prompt(tok, [{"role": "user", "content": "copy ab="}], True))
    assert f"--max-new-tokens 1000000 capped at {context - n_prompt}" in err
    assert generate_main([str(EMBEDDED_DIR), "--prompt", "ab " * context]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the model's context is {context}" in err[0], err
