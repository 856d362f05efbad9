"""tunebook.tokenizer against independent references: sentencepiece itself, transformers' tokenizers and its
`apply_chat_template`, on tokenizers and folders built here from generated data (no hub)."""
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sentencepiece as spm
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

from tunebook.tokenizer import CHATML_TEMPLATE, Tokenizer, load_tokenizer, train_tokenizer

from conftest import need   # a dev dependency: missing is a failure, never a skip
transformers = need("transformers")

WORDS = ("the quick brown fox jumps over a lazy dog . don't it's café naïve 東京 über straße hello world 42 1999 "
         "data model token user assistant system , ! ?").split()

def corpus(n=2000, seed=0):
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14)))
        lines.append(line + rng.choice(["", "\n", "  ", "\t", "\n\n"]))
    return lines

STRINGS = ["hello world", "", " ", "   ", "x", "  two  spaces  ", "tabs\tand\nnew\nlines\n\n", "trailing   ",
           "東京 café 🎉 ünïcödé naïve", "Ω≈ç√ ∑ — “quotes”", "123 4567 1999", "don't stop . it's here !",
           "the quick brown fox jumps over the lazy dog", " leading space", "\n\nnewline first", "a\u00a0nbsp"]

# ---------------------------------------------------------------- SentencePiece

@pytest.fixture(scope="module")
def sp_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    # Llama's settings: BPE, byte fallback, digits split, no normalization, whitespace kept
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_prefix=str(d / "tokenizer"), vocab_size=500,
        model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    return d

@pytest.fixture(scope="module")
def sp_unigram_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("spu")
    # sentencepiece's defaults: unigram, NFKC normalization, extra whitespace removed
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_prefix=str(d / "tokenizer"), vocab_size=300,
        hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return d

def llama_fast_reference(sp):
    "transformers' Llama tokenizer built from the model's pieces (its converter needs protobuf, absent here)."
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import generate_merges
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    return LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), bos_token="<s>", eos_token="</s>", unk_token="<unk>")

def sp_backend_reference(folder):
    "transformers' sentencepiece backend (the slow tokenizer, which calls sentencepiece)."
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend
    return SentencePieceBackend(vocab_file=str(folder / "tokenizer.model"), bos_token="<s>", eos_token="</s>", unk_token="<unk>")

def test_sentencepiece_matches_sentencepiece(sp_folder, sp_unigram_folder):
    for folder in (sp_folder, sp_unigram_folder):
        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        tok = load_tokenizer(folder)
        assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (sp.bos_id(), sp.eos_id(), sp.eos_id(), sp.get_piece_size())
        for s in STRINGS:
            assert tok.encode(s, add_bos=False) == sp.encode(s), s
            assert tok.encode(s) == [sp.bos_id()] + sp.encode(s), s
            assert tok.decode(sp.encode(s)) == sp.decode(sp.encode(s)), s
            # skipping special tokens drops bos, eos and unk, as transformers does
            plain = [i for i in sp.encode(s) if i != sp.unk_id()]
            assert tok.decode([sp.bos_id()] + sp.encode(s) + [sp.eos_id()], skip_special_tokens=True) == sp.decode(plain)

def test_sentencepiece_matches_transformers(sp_folder):
    sp = spm.SentencePieceProcessor(model_file=str(sp_folder / "tokenizer.model"))
    tok, fast, slow = load_tokenizer(sp_folder), llama_fast_reference(sp), sp_backend_reference(sp_folder)
    for s in STRINGS:
        ids = tok.encode(s, add_bos=False)
        assert ids == slow.encode(s, add_special_tokens=False), s
        # transformers' converted Llama tokenizer adds no dummy prefix to text that starts with a space
        # (sentencepiece does, and so do we): compare where they agree by construction
        if not s[:1].isspace(): assert ids == fast.encode(s, add_special_tokens=False), s
        assert tok.decode(ids) == fast.decode(ids), s
        assert tok.decode([1] + ids + [2], skip_special_tokens=True) == fast.decode([1] + ids + [2], skip_special_tokens=True), s
    # special tokens written in the text are matched as tokens, each text piece encoded on its own (transformers' legacy mode)
    for s in ["<s>hi</s>", "hi <s> there</s>", "a</s><s>b", "<s>[INST] q [/INST] a </s>"]:
        assert tok.encode(s, add_bos=False) == slow.encode(s, add_special_tokens=False), s
        assert tok.decode(tok.encode(s, add_bos=False)) == s

def test_sentencepiece_config_and_save(sp_folder, tmp_path):
    d = tmp_path / "sp"; d.mkdir()
    (d / "tokenizer.model").write_bytes((sp_folder / "tokenizer.model").read_bytes())
    cfg = {"add_bos_token": True, "add_eos_token": True, "pad_token": "<unk>", "chat_template": CHATML_TEMPLATE,
           "added_tokens_decoder": {"500": {"content": "<|im_start|>", "special": True},
                                    "501": {"content": "<|im_end|>", "special": True}}}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    assert tok.vocab_size == 502 and tok.pad_id == 0
    assert tok.encode("hi") == [1] + sp.encode("hi") + [2]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello world"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello world<|im_end|>\n"
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == 500 and ids.count(501) == 2 and tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\nhello world\n"
    ids2, mask = tok.encode_messages(msgs)
    assert ids2 == ids and tok.decode([i for i, m in zip(ids, mask) if m]) == "hello world<|im_end|>\n"
    tok2 = load_tokenizer(tok.save(tmp_path / "saved"))
    for s in STRINGS + [text]:
        assert tok2.encode(s) == tok.encode(s)
    assert (tok2.pad_id, tok2.add_eos, tok2.chat_template) == (0, True, CHATML_TEMPLATE)

# ---------------------------------------------------------------- tokenizer.json

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>"]

def build_bytelevel(vocab_size=600):
    "A Llama-3-like tokenizer.json: regex split, byte-level BPE, bos added by the post-processor."
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    return tok

def build_unigram():
    "A SentencePiece-like tokenizer.json: Metaspace pre-tokenizer and a Unigram model."
    tok = tokenizers.Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(corpus(), trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                            unk_token="<unk>", show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok

def write_folder(d: Path, tok: tokenizers.Tokenizer, **cfg):
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False}
             for t in SPECIALS + ["<unk>", "<s>", "</s>"] if tok.token_to_id(t) is not None}
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "added_tokens_decoder": added, **cfg}))
    return d

LLAMA3_CFG = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", clean_up_tokenization_spaces=True)
FOLDERS = {
    "llama3": lambda: (build_bytelevel(), LLAMA3_CFG),
    "llama3_no_cleanup": lambda: (build_bytelevel(), {**LLAMA3_CFG, "clean_up_tokenization_spaces": False}),
    # transformers 5's generic loader ignores these config flags: the tokenizer.json's post-processor decides
    "explicit_bos_eos": lambda: (build_bytelevel(), dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                                          pad_token="<|im_end|>", add_bos_token=False, add_eos_token=True)),
    "unigram": lambda: (build_unigram(), dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")),
    "unigram_cleanup": lambda: (build_unigram(), dict(bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=True)),
}

@pytest.mark.parametrize("name", list(FOLDERS))
def test_tokenizer_json_matches_transformers(name, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok_json, cfg = FOLDERS[name]()
    d = write_folder(tmp_path / name, tok_json, **cfg)
    tok = load_tokenizer(d)
    for ref in (PreTrainedTokenizerFast.from_pretrained(str(d)), AutoTokenizer.from_pretrained(str(d))):
        assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id)
        if ref.pad_token_id is not None: assert tok.pad_id == ref.pad_token_id
        assert tok.vocab_size == len(ref)
        for s in STRINGS + ["<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|>x<|eot_id|>"]:
            ids = tok.encode(s)
            assert ids == ref.encode(s), (name, s)
            assert tok.encode(s, add_bos=False, add_eos=False) == ref.encode(s, add_special_tokens=False), (name, s)
            assert tok.decode(ids) == ref.decode(ids), (name, s)
            assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), (name, s)
            assert [tok.id_to_token(i) for i in ids] == ref.convert_ids_to_tokens(ids)

def test_save_reads_back_in_transformers(tmp_path):
    from transformers import AutoTokenizer
    tok = load_tokenizer(write_folder(tmp_path / "src", build_bytelevel(), chat_template=LLAMA3_TEMPLATE, **LLAMA3_CFG))
    out = tok.save(tmp_path / "out")
    ref, back = AutoTokenizer.from_pretrained(str(out)), load_tokenizer(out)
    msgs = CONVERSATIONS["system"]
    for s in STRINGS:
        assert tok.encode(s) == back.encode(s) == ref.encode(s)
        assert tok.decode(tok.encode(s)) == ref.decode(tok.encode(s))
    assert back.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs)
    # a changed bos/eos policy is written into the saved tokenizer.json, so transformers follows it too
    tok.add_bos, tok.add_eos = False, True
    out = tok.save(tmp_path / "out2")
    ref, back = AutoTokenizer.from_pretrained(str(out)), load_tokenizer(out)
    for s in STRINGS:
        assert tok.encode(s) == back.encode(s) == ref.encode(s)
        assert tok.encode(s)[-1] == tok.eos_id

# ---------------------------------------------------------------- chat templates

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if tools is not none %}
    {%- set system_message = system_message + "\\n\\nYou have these tools:\\n" %}
    {%- for t in tools %}
        {%- set system_message = system_message + (t | tojson(indent=4)) + "\\n" %}
    {%- endfor %}
{%- endif %}
{%- if system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported after the system message!') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>\\n' }}{%- endgeneration %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CONVERSATIONS = {
    "system": [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": "What is 2+2?"},
               {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 東京 café?  "}],
    "no_system": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": " hi there\n"},
                  {"role": "user", "content": "bye"}, {"role": "assistant", "content": "bye ! don't go"}],
    "one_turn": [{"role": "user", "content": "x"}],
}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]

@pytest.fixture(scope="module")
def chat_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = build_bytelevel()
    llama = write_folder(root / "llama3", tok, chat_template=LLAMA3_TEMPLATE, **LLAMA3_CFG)
    qwen = write_folder(root / "qwen", tok, eos_token="<|im_end|>", pad_token="<|end_of_text|>")
    (qwen / "chat_template.jinja").write_text(QWEN_TEMPLATE)     # the newer layout: the template in its own file
    listed = write_folder(root / "listed", tok, eos_token="<|im_end|>",
                          chat_template=[{"name": "default", "template": QWEN_TEMPLATE}, {"name": "tool_use", "template": "x"}])
    return {"llama3": llama, "qwen": qwen, "listed": listed}

@pytest.mark.parametrize("folder", ["llama3", "qwen", "listed"])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_matches_transformers(chat_folders, folder, conv, gen):
    from transformers import AutoTokenizer
    d = chat_folders[folder]
    tok, ref = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    msgs = CONVERSATIONS[conv]
    text = tok.apply_chat_template(msgs, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
    ref_ids = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
    assert ids == list(ref_ids)
    if folder == "llama3":
        assert tok.apply_chat_template(msgs, tools=TOOLS) == ref.apply_chat_template(msgs, tools=TOOLS, tokenize=False)

def test_template_errors_match(chat_folders):
    tok = load_tokenizer(chat_folders["llama3"])
    with pytest.raises(Exception, match="Only user and assistant"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"): tok.apply_chat_template(CONVERSATIONS["one_turn"])

@pytest.mark.parametrize("conv", ["system", "no_system"])
def test_assistant_mask_matches_transformers(chat_folders, conv):
    "Our prefix-rendering mask equals transformers' `{% generation %}`-based `return_assistant_tokens_mask`."
    from transformers import AutoTokenizer
    d = chat_folders["qwen"]
    tok, ref = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    msgs = CONVERSATIONS[conv]
    ids, mask = tok.encode_messages(msgs)
    out = ref.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(out["input_ids"])
    assert mask == list(out["assistant_masks"])
    assert sum(mask) > 0

def test_assistant_mask_llama3(chat_folders):
    tok = load_tokenizer(chat_folders["llama3"])
    msgs = CONVERSATIONS["no_system"]
    ids, mask = tok.encode_messages(msgs)
    assert ids == tok.apply_chat_template(msgs, tokenize=True)
    said = tok.decode([i for i, m in zip(ids, mask) if m])
    assert said == "hi there<|eot_id|>bye ! don't go<|eot_id|>"   # trimmed by the template

# ---------------------------------------------------------------- training

def test_train_tokenizer_deterministic_across_processes(tmp_path):
    code = ("import sys, random; from tunebook.tokenizer import train_tokenizer; rng = random.Random(1); "
            "w = 'alpha beta gamma delta 東京 12 ! ,'.split(); "
            "texts = [' '.join(rng.choice(w) for _ in range(8)) for _ in range(500)]; "
            "train_tokenizer(texts, vocab_size=300, path=sys.argv[1])")
    digests = []
    for i, seed in enumerate(["1", "2"]):
        out = tmp_path / f"t{i}"
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        digests.append([hashlib.sha256((out / f).read_bytes()).hexdigest() for f in ("tokenizer.json", "tokenizer_config.json")])
    assert digests[0] == digests[1]

def test_trained_tokenizer_in_transformers(tmp_path):
    from transformers import AutoTokenizer
    tok = train_tokenizer(corpus(500), vocab_size=400, path=tmp_path / "t")
    ref = AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    assert (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    for s in STRINGS:
        assert tok.encode(s) == ref.encode(s)
        assert tok.decode(tok.encode(s), skip_special_tokens=True) == s
    msgs = CONVERSATIONS["system"]
    for gen in (False, True):
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

# ---------------------------------------------------------------- bad input

def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"): load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="looked for tokenizer.json and tokenizer.model"): load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "bad"; bad.mkdir()
    (bad / "tokenizer.json").write_text(build_bytelevel().to_str()[:500])
    with pytest.raises(ValueError, match="could not be read as a tokenizer.json.*copy it again"): load_tokenizer(bad)
    with pytest.raises(ValueError, match="could not be read as a tokenizer.json"): load_tokenizer(bad / "tokenizer.json")
    badsp = tmp_path / "badsp"; badsp.mkdir(); (badsp / "tokenizer.model").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="could not be read as a SentencePiece model"): load_tokenizer(badsp)
    cfg = write_folder(tmp_path / "cfg", build_unigram())
    (cfg / "tokenizer_config.json").write_text('{"bos_token": ')
    with pytest.raises(ValueError, match="tokenizer_config.json.*not valid JSON"): load_tokenizer(cfg)
    tok = train_tokenizer(corpus(200), vocab_size=300)
    with pytest.raises(TypeError, match="encode takes a str"): tok.encode(["a", "b"])


def test_chat_template_saved_as_the_source_stored_it(tmp_path):
    """A folder whose template is in chat_template.jinja (transformers 5) is saved back the same way, byte for byte."""
    tok = train_tokenizer(corpus(300), vocab_size=300)
    src = tmp_path / "src"
    tok.save(src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template") + "{# kept as written: ünïcödé #}"
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    (src / "chat_template.jinja").write_text(template, encoding="utf-8")
    load_tokenizer(src).save(tmp_path / "out")
    assert (tmp_path / "out" / "chat_template.jinja").read_bytes() == (src / "chat_template.jinja").read_bytes()
    assert "chat_template" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == template
    train_tokenizer(corpus(300), vocab_size=300).save(tmp_path / "trained")   # a template that came from code stays in the config
    assert json.loads((tmp_path / "trained" / "tokenizer_config.json").read_text())["chat_template"] == CHATML_TEMPLATE


def test_stop_ids_end_every_turn(sp_folder):
    "eos, plus the chat templates' end-of-turn tokens that the vocabulary has (what generation stops at)."
    t = train_tokenizer(corpus(300), vocab_size=300, special_tokens=("<s>", "</s>", "<pad>", "<|im_end|>", "<|eot_id|>", "<x>"))
    assert t.stop_ids == sorted(t.token_to_id(s) for s in ("</s>", "<|im_end|>", "<|eot_id|>"))
    sp = load_tokenizer(sp_folder)                       # a SentencePiece model with no chat tokens: eos alone
    assert sp.stop_ids == [sp.token_to_id("</s>")] == [2]
