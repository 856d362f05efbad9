"""Training data by hub name, mixtures and streaming (`tunebook.records.hub`, `tunebook.records.mix`).

Dataset repos are laid into a hub-shaped cache as huggingface_hub lays a download (tools/hub_cache.py: blobs, a snapshot of
links, refs/main), with the files a hub dataset repo has (README `configs:`, `main/train-*.parquet`, `data/*.jsonl`), and
read offline (HF_HUB_OFFLINE). The references are independent: pyarrow and `json` read the laid files directly,
`datasets.load_dataset` resolves the same repo folder, huggingface_hub's own HTTP error parser turns a real 403 response
of a local server into its GatedRepoError. No network is used."""
import http.server
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tunebook.config import TrainConfig
from tunebook.core import EMBEDDED_DIR
from tunebook.data import IGNORE_INDEX, SFTDataset
from tunebook.records import hub_records, mix_counts, read_data
from tunebook.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hub_cache", ROOT / "tools" / "hub_cache.py")
hub_cache = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(hub_cache)

# text a type-inferring reader would change: dates, leading zeros, exponents, booleans
END = "<|end|>\n"   # what the embedded tokenizer's chat template puts after each message: learned with the answer
TRICKY = ["2024-01-01", "007", "1e5", "true", "1.50", "-0", "NA", " 12 "]


def _sums(i): return {"question": f"{i}+{i}=", "answer": TRICKY[i % len(TRICKY)] + f"#{2 * i}"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache with three dataset repos: acme/sums (two subsets named by its README), acme/plain (the data/ layout,
    no README) and acme/jl (a JSONL file whose values datasets' JSON loader would infer as dates and numbers)."""
    root = tmp_path_factory.mktemp("hubdata")
    cache = root / "hub"
    sums = root / "sums"
    for sub, split, n in [("main", "train", 30), ("main", "test", 5), ("socratic", "train", 7)]:
        (sums / sub).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist([_sums(i) if sub == "main" else {**_sums(i), "question": "why " + _sums(i)["question"]}
                                             for i in range(n)]), sums / sub / f"{split}-00000-of-00001.parquet")
    (sums / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*.parquet\n"
                                    "  - split: test\n    path: main/test-*.parquet\n- config_name: socratic\n  data_files:\n"
                                    "  - split: train\n    path: socratic/train-*.parquet\n---\n# sums\n")
    plain = root / "plain" / "data"; plain.mkdir(parents=True)
    for split, n in (("train", 12), ("test", 3)):
        pq.write_table(pa.Table.from_pylist([{"prompt": f"p{i}", "response": TRICKY[i % 8]} for i in range(n)]),
                       plain / f"{split}-00000-of-00001.parquet")
    jl = root / "jl" / "data"; jl.mkdir(parents=True)
    (jl / "train.jsonl").write_text("".join(json.dumps({"prompt": f"day {i}", "response": f"2024-01-0{i + 1}"}) + "\n" for i in range(6)))
    prefs = root / "prefs" / "data"; prefs.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{i}+1=", "chosen": TRICKY[i % 8], "rejected": f"x{i}"} for i in range(20)]),
                   prefs / "train_prefs-00000-of-00001.parquet")
    snaps = {name: hub_cache.lay_dataset(folder, cache, name) for name, folder in
             (("acme/sums", sums), ("acme/plain", root / "plain"), ("acme/jl", root / "jl"), ("acme/prefs", root / "prefs"))}
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"echo {i}"},
                                                     {"role": "assistant", "content": TRICKY[i % 8] + f" {i}"}]}) + "\n" for i in range(60)))
    return dict(cache=cache, root=root, snaps=snaps, chat=chat, sums=sums)


@pytest.fixture
def offline(hub, monkeypatch):
    "The hub cache above, offline, as HF_HUB_CACHE=... HF_HUB_OFFLINE=1 set it (huggingface_hub reads these constants per call)."
    import huggingface_hub.constants as C
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    return hub


# ---------------------------------------------------------------- a dataset by name, its subset and split
def test_hub_by_name_subset_and_split(offline):
    import datasets
    snap = offline["snaps"]["acme/sums"]
    assert (snap / "main" / "test-00000-of-00001.parquet").is_symlink()   # laid as huggingface_hub lays a download
    want = pq.read_table(offline["sums"] / "main" / "test-00000-of-00001.parquet").to_pylist()   # the file itself
    got = hub_records("acme/sums", "main", "test")
    assert got.rows == want and got.rows == datasets.load_dataset(str(snap), "main", split="test").to_list()
    assert got.where(2) == "'acme/sums/main/test-00000-of-00001.parquet' row 2"
    assert read_data("acme/sums:main:test").rows == want                               # NAME:SUBSET:SPLIT
    assert TrainConfig(data="acme/sums:test", data_subset="main").validate().records().rows == want   # --data NAME:SPLIT --data-subset
    cfg = TrainConfig(data="acme/sums", data_subset="socratic").validate()
    assert [r["question"] for r in cfg.records()] == [f"why {i}+{i}=" for i in range(7)]
    assert read_data("acme/sums:main:train[3:6]").rows == [_sums(i) for i in range(3, 6)]   # a sliced split
    assert read_data("acme/plain", split="test").rows == [{"prompt": f"p{i}", "response": TRICKY[i]} for i in range(3)]   # data/ layout
    # JSON lines: the file's text, where datasets' JSON loader infers dates
    lines = (offline["root"] / "jl" / "data" / "train.jsonl").read_text().splitlines()
    assert read_data("acme/jl").rows == [json.loads(l) for l in lines]
    inferred = datasets.load_dataset(str(offline["snaps"]["acme/jl"]), split="train")[0]["response"]
    assert not isinstance(inferred, str)   # what exact reading avoids: a timestamp, not the text "2024-01-01"


def test_every_objective_reads_a_hub_name(offline):
    "finetune, distill, DPO, KTO and GRPO read their rows through the one reader (`SourcePart.records`); DPO's pairs by split name."
    from tunebook.dpo import load_pairs
    from tunebook.objectives import OBJECTIVES
    want = pq.read_table(offline["root"] / "plain" / "data" / "train-00000-of-00001.parquet").to_pylist()
    for name, spec in OBJECTIVES.items():
        assert spec.config(data="acme/plain").records().rows == want, name
    cfg = OBJECTIVES["dpo"].config(data="acme/prefs:train_prefs").validate()
    train, held, evals, _ = load_pairs(cfg, load_tokenizer(EMBEDDED_DIR))
    assert sorted(a for _, a, _, _ in held.examples + train.examples) == sorted(TRICKY[i % 8] for i in range(20))


def test_streaming_reads_the_slice(offline):
    streamed = read_data("acme/sums:main:train[4:9]", streaming=True)
    assert streamed.rows == [_sums(i) for i in range(4, 9)] and "(streamed)" in streamed.name
    assert TrainConfig(data="acme/sums:main:train[:8]", data_streaming=True, epochs=2).validate().records().rows == [_sums(i) for i in range(8)]
    with pytest.raises(ValueError, match=r"give one, e.g. --data-split 'train\[:10000\]'"):
        TrainConfig(data="acme/sums", data_subset="main", data_streaming=True).validate()
    with pytest.raises(ValueError, match="--data-streaming applies to hub datasets and no source is one"):
        TrainConfig(data=str(offline["chat"]), data_streaming=True).validate()


# ---------------------------------------------------------------- errors: one line, at validation (before any model)
def _problem(**kw):
    with pytest.raises(ValueError) as e: TrainConfig(**kw).validate()
    return str(e.value)


def test_errors_before_any_model(offline, tmp_path):
    assert "has several subsets (main, socratic): choose one with --data-subset NAME" in _problem(data="acme/sums")
    assert "has no subset 'nope'; its subsets are 'main', 'socratic'" in _problem(data="acme/sums", data_subset="nope")
    assert "has no split 'validation'; its splits are 'train', 'test'" in _problem(data="acme/sums:main:validation")
    msg = _problem(data="acme/absent")
    assert f"nor a dataset in the hub cache at {offline['cache']}" in msg and "hf download acme/absent --repo-type dataset" in msg
    assert "data='nope.jsonl' (--data): no such file or folder" in _problem(data="nope.jsonl")   # a file name, not a hub name
    assert "it has no subsets; leave its subset out" in _problem(data=[{"data": str(offline["chat"]), "subset": "x", "weight": 1.0}])
    assert "no source is one" in _problem(data=str(offline["chat"]), data_subset="main")
    assert "every source a share (:0.3) or every source a row count" in _problem(data=f"{offline['chat']}:0.5,acme/plain")


@pytest.fixture
def hub_server(offline, monkeypatch):
    "A local HTTP server in the hub's place answering every request 403 with the hub's gated-repo error code; None: a closed port."
    import huggingface_hub.constants as C
    class Gated(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(403); self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("X-Error-Message", "Access to dataset acme/locked is restricted."); self.send_header("Content-Length", "0")
            self.end_headers()
        do_HEAD = do_GET
        def log_message(self, *a): pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gated)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)   # online for both libraries
    monkeypatch.setattr(C, "ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
    yield srv
    srv.shutdown()


def test_gated_and_no_network(hub_server, monkeypatch):
    """Not in the hub cache, online: a gated dataset (huggingface_hub's own parser raises GatedRepoError from the server's
    real 403 response) and an unreachable hub (a closed port) each end in one line naming the fix."""
    from huggingface_hub.errors import GatedRepoError
    from huggingface_hub import snapshot_download
    with pytest.raises(GatedRepoError): snapshot_download("acme/locked", repo_type="dataset")   # the library's own error
    with pytest.raises(ValueError, match=r"gated on the Hugging Face Hub: accept its terms at https://huggingface.co/datasets/"
                                         r"acme/locked, then log in \(`hf auth login`\) or set HF_TOKEN"):
        read_data("acme/locked")
    import huggingface_hub.constants as C
    monkeypatch.setattr(C, "ENDPOINT", "http://127.0.0.1:9")   # nothing listens: no network
    with pytest.raises(ValueError, match=r"not in the hub cache|nor a dataset in the hub cache .* could not be reached"):
        read_data("acme/locked")
    assert read_data("acme/plain").rows[0] == {"prompt": "p0", "response": TRICKY[0]}   # a cached one needs no network


# ---------------------------------------------------------------- a weighted mixture of two formats
def _expected(hub):
    "place -> the assistant text as the source files hold it (read with json and pyarrow, not tunebook)."
    out = {}
    for n, line in enumerate(hub["chat"].read_text().splitlines(), 1):
        out[f"{str(hub['chat'])!r} line {n}"] = json.loads(line)["messages"][-1]["content"]
    for i, r in enumerate(pq.read_table(hub["sums"] / "main" / "train-00000-of-00001.parquet").to_pylist()):
        out[f"'acme/sums/main/train-00000-of-00001.parquet' row {i}"] = r["answer"]
    return out


def test_mixture_tokens_and_proportions(offline):
    tok = load_tokenizer(EMBEDDED_DIR)
    data, fields = f"{offline['chat']}:0.7,acme/sums:main:train:0.3", dict(prompt_field="question", response_field="answer")
    mix = read_data(data, seed=3, **fields)
    n = [60, 30]; T = min(int(a / w) for a, w in zip(n, (0.7, 0.3)))   # the largest mixture without repeating a row: 85
    assert [s["taken"] for s in mix.sources] == [round(0.7 * T), round(0.3 * T)] == mix_counts(n, [0.7, 0.3])
    for s, w in zip(mix.sources, (0.7, 0.3)): assert abs(s["taken"] - w * T) <= 0.5 + 1e-9   # each share exact up to half a row
    assert sum(s["taken"] for s in mix.sources) == len(mix) == T
    assert [s["format"] for s in mix.sources] == ["chat", "instruct"] and mix.sources[0]["share"] in mix.name
    where = [mix.where(i) for i in range(len(mix))]
    assert sum(w.startswith("'acme/sums") for w in where) == round(0.3 * T)
    assert read_data(data, seed=3, **fields).rows == mix.rows and read_data(data, seed=4, **fields).rows != mix.rows   # the seed decides
    # the labelled tokens of every row decode to its source file's text, then the end of the assistant's turn
    ds = SFTDataset(mix, tok, format="auto")
    assert ds.format == "chat" and len(ds) == len(mix)
    expected, ends = _expected(offline), set()
    for i in range(len(ds)):
        text = tok.decode([l for l in ds[i]["labels"] if l != IGNORE_INDEX])
        want = expected[mix.where(i)]
        assert text.startswith(want), (mix.where(i), text, want)
        ends.add(text[len(want):])
    template = json.loads((EMBEDDED_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert "message['content'] + '" + END + "'" in template
    assert ends == {END}
    # row counts instead of shares, from a YAML list of sources each with its own fields
    rows = read_data([{"data": str(offline["chat"]), "rows": 11},
                      {"data": "acme/sums", "subset": "socratic", "rows": 4, "prompt_field": "question", "response_field": "answer"}])
    assert [s["taken"] for s in rows.sources] == [11, 4] and rows.sources[1]["format"] == "instruct"


def test_yaml_list_of_sources(offline, tmp_path):
    (tmp_path / "c.yaml").write_text(f"data:\n- data: {offline['chat']}\n  weight: 0.5\n- data: acme/sums\n  subset: main\n  weight: 0.5\n"
                                     "  prompt_field: question\n  response_field: answer\nmax_steps: 2\n")
    cfg = TrainConfig.from_yaml(tmp_path / "c.yaml").validate()
    assert [s["taken"] for s in cfg.records().sources] == [30, 30]
    cfg.save_yaml(tmp_path / "back.yaml")
    assert TrainConfig.from_yaml(tmp_path / "back.yaml").data == cfg.data   # written and read back the same


# ---------------------------------------------------------------- the CLI, end to end
def test_cli_finetune_mixture_by_name(offline, tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(offline["cache"]), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "dscache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--data", f"{offline['chat']}:0.75,acme/sums:train:0.25",
                        "--data-subset", "main", "--prompt-field", "question", "--response-field", "answer", "--max-steps", "2",
                        "--batch-size", "4", "--eval-samples", "2", "--max-new-tokens", "4", "--warmup-steps", "0",
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "run" / "log.txt").read_text()   # the run's log: how the data was read, source by source
    assert "a mixture of" in log and "(chat, 60 of 60 rows, 75.0%)" in log and "'acme/sums' subset 'main' split 'train' (instruct, 20 of 30 rows, 25.0%)" in log, log[-3000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data_subset"] == "main"
    bad = subprocess.run([sys.executable, "-m", "tunebook.cli", "finetune", "--data", "acme/sums", "--output-dir", str(tmp_path / "r2")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert bad.returncode != 0 and "choose one with --data-subset NAME" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "r2").exists()   # refused before any work


def test_a_task_beside_data_is_said_not_dropped(tmp_path):
    """--task with --data: the rows come from the data, and the run says the task is not used (GRPO's task checks the rows,
    so it says nothing there)."""
    import warnings
    from tunebook.grpo import GRPOConfig
    from tunebook.train import TrainConfig
    f = tmp_path / "rows.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n')
    with pytest.warns(UserWarning, match=r"--task reverse is not used: it chooses a synthetic task, and the rows come from --data"):
        TrainConfig(data=str(f), task="reverse", output_dir=str(tmp_path / "o")).records()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainConfig(data=str(f), output_dir=str(tmp_path / "o")).records()
        g = tmp_path / "q.jsonl"
        g.write_text('{"prompt": "1+1=", "answer": "2"}\n')
        GRPOConfig(data=str(g), task="add", output_dir=str(tmp_path / "g")).records()
