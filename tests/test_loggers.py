"""Tracker callbacks read back by each library's own reader, against the run's metrics.csv and summary.json:
TensorBoard's EventAccumulator (float32 events: equal to each value's float32), MlflowClient (float64: equal),
and W&B's offline transaction log (wandb ships no reader of it in Python since 0.19: the test reads its
leveldb-style blocks and decodes each record with wandb's own protobuf `Record`; values are JSON: equal)."""
import dataclasses
import glob
import json
import math
import struct
import types
import zlib

import numpy as np
import pandas as pd
import pytest
import torch

from tunebook.data import make_task
from tunebook.loggers import MLflowLogger, TensorBoardLogger, WandbLogger, make_loggers
from tunebook.model import build_model, pico
from tunebook.tokenizer import train_tokenizer
from tunebook.train import TrainConfig, Trainer

from conftest import need   # a dev dependency: missing is a failure, never a skip
need("tensorboard"); need("mlflow"); need("wandb")


def _expected_config(cfg):
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tok = train_tokenizer([r["prompt"] + " " + r["response"] for r in make_task("reverse", 300, seed=0)], vocab_size=300)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("runs") / "run"
    cfg = TrainConfig(model="given", task="reverse", n_train=64, eval_samples=4, batch_size=8, max_steps=3, log_every=1,
                      profile_memory=True, output_dir=str(out))
    loggers = make_loggers("csv,tensorboard,mlflow,wandb")
    tr = Trainer(cfg, model=build_model(pico(vocab_size=tok.vocab_size, dim=32, hidden_dim=64)), tokenizer=tok, callbacks=loggers)
    summary = tr.fit(progress=False)
    cfg = tr.config   # the trackers hear the options the run trained with: lr left None is the recipe's value
    assert cfg.lr == 5e-3 and cfg.batch_size == 8, cfg
    csv = pd.read_csv(out / "metrics.csv")
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    return out, cfg, csv, summary, loggers


def _csv_series(csv):
    "metric name -> [(step, value)] from metrics.csv: its numeric columns, NaN cells left out, the eval measures apart."
    out = {}
    for c in csv.columns:
        if c in ("step", "peak_phase", *EVALS): continue
        out[c] = [(int(s), float(v)) for s, v in zip(csv["step"], csv[c]) if not pd.isna(v)]
    return out


EVALS = ("eval_accuracy", "eval_loss")   # SFT's held-out measures: logged before training (step 0) and at the end


def _evals(summary, steps, k="eval_accuracy"):
    return [(0, summary[f"{k}_before"]), (steps, summary[f"{k}_after"])]


def test_tensorboard_reads_back(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, cfg, csv, summary, _ = run
    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}); ea.Reload()
    f32 = lambda v: float(np.float32(v))
    series = _csv_series(csv)
    assert {"loss", "lr", "grad_norm", "tokens", "seconds", "peak_bytes"} <= set(series) and any(k.startswith("mem_") for k in series)
    for k, ref in series.items():
        assert [(e.step, e.value) for e in ea.Scalars(k)] == [(s, f32(v)) for s, v in ref], k
    for k in EVALS: assert [(e.step, e.value) for e in ea.Scalars(k)] == [(s, f32(v)) for s, v in _evals(summary, 3, k)], k
    for k, v in summary.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
            assert ea.Scalars(f"summary/{k}")[0].value == f32(v), k
    text = lambda tag: ea.Tensors(tag)[0].tensor_proto.string_val[0].decode().strip("`\njson")
    assert json.loads(text("config/text_summary")) == _expected_config(cfg)
    assert json.loads(text("summary/text_summary")) == json.loads(json.dumps(summary))


def test_mlflow_reads_back(run):
    from mlflow import MlflowClient
    out, cfg, csv, summary, loggers = run
    ml = next(l for l in loggers if isinstance(l, MLflowLogger))
    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")   # a fresh client on the run folder's store
    (r,) = client.search_runs([client.get_experiment_by_name("tunebook").experiment_id])
    assert r.info.run_id == ml.run_id and r.info.status == "FINISHED"
    for k, ref in _csv_series(csv).items():
        assert sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k)) == ref, k
    for k in EVALS: assert sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k)) == _evals(summary, 3, k), k
    want = _expected_config(cfg)
    assert {k: (v if isinstance(want[k], str) else json.loads(v)) for k, v in r.data.params.items()} == want
    art = out / "mlartifacts"
    assert json.loads(open(client.download_artifacts(r.info.run_id, "config.json", str(art.parent / "dl"))).read()) == want
    assert json.loads(open(client.download_artifacts(r.info.run_id, "summary.json", str(art.parent / "dl"))).read()) == json.loads(json.dumps(summary))
    assert r.data.metrics["summary.final_loss"] == summary["final_loss"]


def wandb_records(path):
    "Every `Record` in a W&B transaction log (.wandb): a header, then 32 KiB blocks of CRC-checked chunks."
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7: pos += left; continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0: pos += left; continue
        chunk = data[pos + 7:pos + 7 + n]; pos += 7 + n
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc
        buf += chunk
        if kind in (1, 4):   # a full record, or the last chunk of one
            rec = pb.Record(); rec.ParseFromString(buf); buf = b""
            yield rec


def test_wandb_reads_back(run):
    out, cfg, csv, summary, _ = run
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    key = lambda i: i.key or "/".join(i.nested_key)
    config, history, summ = {}, {}, {}
    for r in wandb_records(path):
        t = r.WhichOneof("record_type")
        if t == "run": config = {i.key: json.loads(i.value_json) for i in r.run.config.update if i.key != "_wandb"}
        if t == "history":
            h = {key(i): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(h.pop("_step"), {}).update(h)
        if t == "summary": summ.update({key(i): json.loads(i.value_json) for i in r.summary.update})
    assert config == _expected_config(cfg)
    for k, ref in _csv_series(csv).items():
        assert [(s, history[s][k]) for s in sorted(history) if k in history[s]] == ref, k
    for k in EVALS: assert [(s, history[s][k]) for s in sorted(history) if k in history[s]] == _evals(summary, 3, k), k
    for k, v in json.loads(json.dumps(summary)).items(): assert summ[k] == v, k


def test_only_rank0_logs(tmp_path):
    "Under torchrun every rank calls the callbacks; only the one with is_main writes anything."
    cfg = TrainConfig(model="given", output_dir=str(tmp_path / "run"))
    for rank in (1, 0):
        trainer = types.SimpleNamespace(config=cfg, is_main=rank == 0, step=1)
        tb = TensorBoardLogger()
        tb.on_step(trainer, dict(step=1, loss=2.0)); tb.on_end(trainer, dict(final_loss=2.0))
        assert (tmp_path / "run" / "tensorboard").exists() == (rank == 0)


def test_make_loggers_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['tensorbord'\]; choose from csv"): make_loggers(["tensorbord"])
    with pytest.raises(ValueError, match="keyed by logger name"): make_loggers(["wandb"], project="x")
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install tunebook\[mlflow\]"): make_loggers("tensorboard,mlflow")
    (w,) = make_loggers(["wandb"], wandb=dict(project="p", mode="disabled"))
    assert (type(w), w.project, w.mode) == (WandbLogger, "p", "disabled")
