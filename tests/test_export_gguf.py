"""`tunebook export`: LoRA fine-tunes of SmolLM2-135M-Instruct and of Gemma 3 270M (given a Gemma chat template) go to
GGUF through llama.cpp's own converter (both in f16, SmolLM2 also in q8_0), and llama.cpp's runtime (built from the
registry's llama-cpp-python source by `make llama-cpp`) answers the runs' held-out prompts, rendered by the GGUF's own
chat template, as tunebook does: f16 token for token, q8_0 the same text on >= 90% of prompts. The Modelfile's Go template renders the tokenizer's
prompt text; the metadata carries the template and end-of-turn tokens; `--to merged` loads in transformers with the
logits of peft's own merge. The module skips itself where llama.cpp is not built (`make llama-cpp`)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tunebook.llamacpp import llama_cpp_dir  # noqa: E402

if llama_cpp_dir() is None:
    pytest.skip("llama.cpp is not built here: `make llama-cpp` (tools/llama_cpp.py)", allow_module_level=True)

from conftest import built_once  # noqa: E402
from realckpt import gemma3_dir, smollm2_dir, user_records  # noqa: E402
from tunebook.checkpoint import load_hf  # noqa: E402
from tunebook.data import encode_prompt  # noqa: E402
from tunebook.export import check_gguf, export_main, read_modelfile  # noqa: E402
from tunebook.generate import generate  # noqa: E402
from tunebook.llamacpp import LlamaCppModel  # noqa: E402
from tunebook.ollama import ollama_data, render_go_template  # noqa: E402
from tunebook.tokenizer import load_tokenizer  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]
MAX_NEW = 24
# Gemma 3 270M is the base model: it ships no chat template, so its run gets Gemma's turn format (system text folded
# into the first user turn, the assistant's role written `model`, turns closed by <end_of_turn>)
GEMMA_TEMPLATE = ("{{ bos_token }}{% set sys = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' else '' %}"
                  "{% for m in messages if m['role'] != 'system' %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user')"
                  " + '\n' + (sys if loop.first else '') + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _finetune(base, tmp, steps):
    data = tmp / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in user_records(120, seed=0)))
    out = tmp / "run"
    cmd = [sys.executable, "-m", "tunebook.cli", "finetune", "--model", str(base), "--data", str(data), "--max-steps", str(steps),
           "--eval-samples", "8", "--output-dir", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _export(run, tmp, quants):
    out = tmp / "gguf"
    assert export_main([str(run), "--to", "gguf", "--quant", *quants, "--output", str(out), "--quiet"]) == 0
    return out


QUANTS = {"smol": ("f16", "q8_0"), "gemma": ("f16",)}   # q8_0's path is the same for both: llama.cpp's quantizer, run once


# each run and its export is made once per session, whichever xdist workers draw its tests (conftest.built_once)
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    def build(tmp): _export(_finetune(smollm2_dir(), tmp, 12), tmp, QUANTS["smol"])
    tmp = built_once(tmp_path_factory, "gguf-smol", build)
    return tmp / "run", tmp / "gguf"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    def build(tmp):
        base = tmp / "gemma3-270m"
        base.mkdir()
        for f in gemma3_dir().iterdir(): (base / f.name).symlink_to(f)
        (base / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
        _export(_finetune(base, tmp, 10), tmp, QUANTS["gemma"])   # f16 only: q8_0 of answers learned in 10 steps differed on 3 of 10 prompts (30 steps agreed)
    tmp = built_once(tmp_path_factory, "gguf-gemma", build)
    return tmp / "run", tmp / "gguf"


def _prompts(run):
    "The run's held-out prompts (samples.jsonl), then fresh rows of the same task: 10 conversations."
    held = list(dict.fromkeys(json.loads(l)["prompt"] for l in (run / "samples.jsonl").read_text().splitlines()))
    fresh = [r["prompt"] for r in user_records(20, seed=7) if r["prompt"] not in held]
    return [[{"role": "user", "content": p}] for p in (held + fresh)[:10]]


@pytest.fixture(scope="module", params=["smol", "gemma"])
def case(request):
    run, out = request.getfixturevalue(request.param)
    model, tok = load_hf(run / "model", dtype=torch.float32).eval(), load_tokenizer(run / "model")
    convs = _prompts(run)
    ours = [generate(model, [encode_prompt(tok, c)], MAX_NEW, eos_id=tok.stop_ids, pad_id=tok.pad_id)[0] for c in convs]
    return dict(name=request.param, run=run, out=out, tok=tok, convs=convs, ours=ours, quants=QUANTS[request.param])


def _gguf(case, quant):
    return case["out"] / f"{case['run'].name}-{quant}.gguf"


def test_metadata_carries_template_and_end_of_turn(case):
    tok = case["tok"]
    for q in case["quants"]:
        facts = check_gguf(_gguf(case, q), tok)
        assert facts["chat_template"] == tok.chat_template and facts["eos_token_id"] == tok.eos_id
        assert all(facts["stops_at"].values()) and len(facts["stops_at"]) == len(tok.stop_ids)
    if case["name"] == "gemma": assert set(facts["stops_at"]) == {"<eos>", "<end_of_turn>"}


def _llama_answers(case, quant):
    with LlamaCppModel(_gguf(case, quant), n_ctx=512, threads=1) as m:
        prompts = [m.tokenize(m.chat_prompt(c)) for c in case["convs"]]
        assert prompts == [encode_prompt(case["tok"], c) for c in case["convs"]]   # the GGUF's template and tokenizer: the same ids
        return [m.greedy(p, MAX_NEW) for p in prompts]


def test_f16_answers_token_for_token(case):
    got = _llama_answers(case, "f16")
    assert got == case["ours"], [(case["tok"].decode(a), case["tok"].decode(b)) for a, b in zip(got, case["ours"]) if a != b]


@pytest.mark.parametrize("case", [n for n, q in QUANTS.items() if "q8_0" in q], indirect=True)
def test_q8_0_answers_the_same_text(case):
    tok = case["tok"]
    text = lambda ids: tok.decode([t for t in ids if t not in tok.stop_ids])
    got = _llama_answers(case, "q8_0")
    same = sum(text(a) == text(b) for a, b in zip(got, case["ours"]))
    assert same >= 0.9 * len(got), [(text(a), text(b)) for a, b in zip(got, case["ours"])]


def test_modelfile_renders_the_tokenizer_prompt(case):
    tok = case["tok"]
    for q in case["quants"]:
        mf = read_modelfile((case["out"] / f"{case['run'].name}-{q}.Modelfile").read_text())
        assert mf["FROM"] == f"./{_gguf(case, q).name}" and (case["out"] / mf["FROM"]).is_file()
        assert mf["stop"] == [tok.id_to_token(i) for i in tok.stop_ids]
        convs = case["convs"] + [[{"role": "system", "content": "Answer tersely."}] + case["convs"][0],
                                 case["convs"][0] + [{"role": "assistant", "content": "ok"}] + case["convs"][1]]
        for c in convs:
            assert render_go_template(mf["TEMPLATE"], ollama_data(c)) == tok.apply_chat_template(c, add_generation_prompt=True)


def test_check_catches_a_lost_template_or_eos(smol, tmp_path):
    "The file edited by llama.cpp's own metadata tool (gguf-py's gguf_new_metadata): no template, or another eos: refused."
    run, out = smol
    src, tok = out / f"{run.name}-q8_0.gguf", load_tokenizer(run / "model")
    for edit, says in ((["--remove-metadata", "tokenizer.chat_template"], "tokenizer.chat_template is missing"),
                       (["--special-token-by-id", "eos", "0"], f"eos token 0 != the tokenizer's {tok.eos_id}")):
        bad = tmp_path / "bad.gguf"
        r = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(src), str(bad), "--force", *edit],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        with pytest.raises(ValueError, match=says): check_gguf(bad, tok)
        bad.unlink()


def test_merged_folder_loads_in_transformers_with_peft_logits(smol, tmp_path):
    "--to merged on a run holding only its adapter: the base + adapter merged, 16-bit; transformers loads it."
    import transformers
    from peft import PeftModel
    run, _ = smol
    lean = tmp_path / "run"
    shutil.copytree(run / "adapter", lean / "adapter")
    shutil.copyfile(run / "config.json", lean / "config.json")
    assert export_main([str(lean), "--to", "merged", "--quant", "bf16", "--output", str(tmp_path / "merged"), "--quiet"]) == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, run / "adapter").merge_and_unload().eval()
    with torch.no_grad():
        for p in ref.parameters(): p.copy_(p.to(torch.bfloat16).float())   # the same 16-bit rounding
        ids = torch.tensor([encode_prompt(load_tokenizer(tmp_path / "merged"), _prompts(run)[0])])
        err = (ours(ids).logits - ref(ids).logits).abs().max().item()
    assert err <= 0.05, err   # bf16 weights: a merged value off by one bf16 step moves a logit by ~1e-2 at most here
    from safetensors import safe_open
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_refusals_before_work(smol, tmp_path, capsys, monkeypatch):
    run, _ = smol
    bad = tmp_path / "foo"
    shutil.copytree(run / "model", bad)
    cfg = json.loads((bad / "config.json").read_text()); cfg["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    cases = [([str(bad), "--to", "gguf"], "has no FooForCausalLM"),
             ([str(run), "--to", "gguf", "--quant", "q3_k_s"], "--quant q3_k_s"),
             ([str(run), "--to", "merged", "--quant", "q8_0"], "16-bit"),
             ([str(tmp_path / "nope"), "--to", "gguf"], "does not exist")]
    for argv, says in cases:
        assert export_main(argv + ["--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    monkeypatch.setenv("TUNEBOOK_LLAMA_CPP", str(tmp_path / "no-build"))
    assert export_main([str(run), "--to", "gguf", "--output", str(tmp_path / "out")]) == 2
    assert "make llama-cpp" in capsys.readouterr().err
