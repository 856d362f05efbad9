"""Widget state tests, no browser: set `.value`, call `.click()`, read the widgets and the plain state behind them."""
import time

import pytest
import torch

from tunebook.data import make_task
from tunebook.model import build_model, get_config
from tunebook.tokenizer import train_tokenizer
from tunebook.widgets import AblationLab, Compare, LiveRun, RunBuilder, estimate_memory, rough_estimate

FAST = dict(n_train=32, eval_samples=2, max_new_tokens=2, warmup_steps=0)
PNG = b"\x89PNG"


def tiny_loader(cfg):
    torch.manual_seed(0)
    rows = make_task("add", 200, seed=0)
    tok = train_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=300)
    return build_model(get_config("pico", vocab_size=len(tok))), tok


@pytest.fixture
def builder(tmp_path):
    rb = RunBuilder(loader=tiny_loader, output_dir=tmp_path / "rb", **FAST)
    rb.data.value, rb.batch_size.value, rb.seq_len.value = "add", 4, 32
    yield rb
    if rb.run is not None and rb.run.running: rb.run.stop(); rb.run.wait(60)


def test_run_click_trains_and_saves_chart(builder):
    builder.steps.value = 3
    builder.method.value = "full"
    empty = builder.loss_image.value
    builder.run_button.click()
    assert builder.run_button.disabled and not builder.stop_button.disabled
    builder.run.wait(120)
    assert builder.run.status == "finished", builder.status.value
    assert builder.progress.value == 3 and builder.loss_image.value != empty
    assert builder.png_path.exists() and builder.png_path.read_bytes()[:4] == PNG
    assert list(builder.frame.step) == [1, 2, 3]
    assert {"parameters_bytes", "gradients_bytes", "optimizer_bytes", "peak_bytes"} <= set(builder.frame.columns)
    assert not builder.run_button.disabled


def test_stop_keeps_checkpoint(builder):
    builder.steps.value = 1000
    builder.run_button.click()
    t0 = time.monotonic()
    while len(builder.run.rows) < 2 and time.monotonic() - t0 < 60: time.sleep(0.05)
    builder.stop_button.click()
    builder.run.wait(120)
    assert builder.run.status == "stopped" and len(builder.run.rows) < 1000
    from pathlib import Path
    assert list((Path(builder.run.config.output_dir) / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("field,value,message", [
    ("model", "does/not/exist", "no such folder"),
    ("model", "llama3.1-70b", "random weights"),
    ("data", "missing.jsonl", "no such file"),
])
def test_invalid_choice_is_a_message(builder, field, value, message):
    getattr(builder, field).value = value
    builder.run_button.click()  # must not raise
    assert message in builder.status.value and builder.run is None


def test_failure_inside_the_thread_is_a_message(tmp_path):
    def broken(cfg): raise RuntimeError("boom")
    rb = RunBuilder(loader=broken, output_dir=tmp_path, **FAST)
    rb.steps.value = 2
    rb.run_button.click(); rb.run.wait(60)
    assert rb.run.status == "failed" and "boom" in rb.status.value and not rb.run_button.disabled


def test_live_run_view_error_does_not_stop_training(tmp_path):
    from tunebook.train import TrainConfig
    def bad_view(run): raise ValueError("view broke")
    run = LiveRun(TrainConfig(task="add", max_steps=2, batch_size=4, max_seq_len=32, output_dir=str(tmp_path), **FAST),
                  loader=tiny_loader, on_update=bad_view).start().wait(120)
    assert run.status == "finished" and "view broke" in run.view_error


def test_ablation_sliders_redraw_at_once():
    lab = AblationLab(background=False, rough=True)
    chart, peak = lab.chart.value, lab.estimate.peak_bytes
    lab.model.value = "llama3.1-70b"
    assert lab.chart.value != chart and lab.estimate.peak_bytes > 100 * peak
    p = lab.estimate.peak_bytes
    lab.checkpointing.value = True
    assert lab.estimate.peak_bytes < p
    p = lab.estimate.peak_bytes
    lab.method.value = "qlora"
    assert lab.estimate.peak_bytes < p
    assert "141 GiB" in lab.numbers.value or "none of" in lab.numbers.value
    lab.measure_button.click()  # too big to measure: a message
    assert "only for models up to" in lab.message.value


def test_ablation_background_worker_draws_latest():
    lab = AblationLab(model="pico")
    lab.wait(120)
    first = lab.estimate
    for s in (128, 256, 64):
        lab.seq_len.value = s
    lab.wait(120)
    assert lab.estimate is not first
    assert "computing" not in lab.message.value
    assert lab.estimate is estimate_memory("pico", **lab.options())  # the latest request, from the cache


def test_ablation_invalid_is_a_message():
    lab = AblationLab(background=False, rough=True, model="pico")
    before = lab.chart.value
    lab.seq_len.value = 4096
    assert "max_seq_len" in lab.message.value and lab.chart.value == before


def test_rough_estimate_counts_parameters_exactly():
    from tunebook.core import count_params
    cfg = get_config("pico")
    e = rough_estimate(cfg, method="full", dtype="fp32")
    assert e.categories["parameters"] == 4 * count_params(build_model(cfg))


def test_compare_table_and_chart(tmp_path):
    cmp = Compare(loader=tiny_loader, output_dir=str(tmp_path), task="add", **FAST)
    cmp.combos.value = ("baseline", "optimizer in backward")
    cmp.steps.value, cmp.batch_size.value, cmp.seq_len.value = 1, 4, 32
    cmp.run_button.click(); cmp.wait(180)
    df = cmp.frame
    assert list(df.combination) == ["baseline", "optimizer in backward"]
    assert df.error.isna().all() and (df.tokens_per_s > 0).all()
    assert cmp.chart.value[:4] == PNG and cmp.status.value.startswith("done")
    cmp.combos.value = ()
    cmp.run_button.click()
    assert "at least one" in cmp.status.value
