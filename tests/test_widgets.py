"""Widget state tests, no browser: set `.value`, call `.click()`, read the widgets and the plain state behind them."""
import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tunebook.data import make_task
from tunebook.model import build_model, get_config
from tunebook.tokenizer import train_tokenizer
from conftest import HANG, hung, joined, run_reaches
from tunebook import live
from tunebook.live import LiveRun, compare_techniques, estimate_memory, model_config, step_memory
from tunebook.memory import estimate, rough_estimate, state_bytes
from tunebook.widgets import AblationLab, Compare, RunBuilder, seq_lens

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
    if rb.run is not None and rb.run.running: rb.run.stop(); joined(rb.run.thread, "the stopped run's thread")


def test_run_click_trains_and_saves_chart(builder):
    builder.steps.value = 3
    builder.method.value = "full"
    empty = builder.loss_image.value
    builder.run_button.click()
    assert builder.run_button.disabled and not builder.stop_button.disabled
    joined(builder.run.thread, "a 3-step run")
    assert builder.run.status == "finished", builder.status.value
    assert builder.progress.value == 3 and builder.loss_image.value != empty
    assert builder.png_path.exists() and builder.png_path.read_bytes()[:4] == PNG
    assert list(builder.frame.step) == [1, 2, 3]
    assert {"parameters_bytes", "gradients_bytes", "optimizer_bytes", "peak_bytes"} <= set(builder.frame.columns)
    assert not builder.run_button.disabled
    _one_readable_table(builder.results.value, rows=3)


def _one_readable_table(html, rows):
    "One HTML table of `rows` body rows, no empty (NaN) cells' text, sizes in binary units, not raw byte counts."
    import re
    assert html.count("<table") == 1 and html.count("<tbody>") == 1, html
    assert html.split("<tbody>")[1].count("<tr") == rows, html
    assert "NaN" not in html and "None" not in html and re.search(r"\d+\.\d\d [KMG]iB", html), html
    assert not re.search(r">\s*\d{6,}(\.0)?\s*<", html), "a raw byte count: " + html   # 974224 is 951.39 KiB


def test_run_builder_defaults_to_the_finetune_task_and_names_the_known_ones(tmp_path):
    from tunebook.tasks import FINETUNE_TASK, PRETRAIN_TASKS
    rb = RunBuilder(loader=tiny_loader, output_dir=tmp_path, **FAST)
    assert rb.data.value == FINETUNE_TASK == rb.build_config().task == "reverse"
    assert all(t in rb.task_note.value for t in PRETRAIN_TASKS) and "pick" not in rb.task_note.value
    rb.data.value = "add"
    assert "'add' is a task the model already knows" in rb.task_note.value
    rb.model.value = str(tmp_path)   # a folder model: the builder does not claim to know what it learned
    assert rb.task_note.value == ""


def test_default_task_is_one_the_embedded_model_learns(tmp_path):
    "The builder's default run on the shipped model: the loss falls (on 'add', which it knows, it starts low and stays)."
    rb = RunBuilder(output_dir=tmp_path, **FAST)
    rb.steps.value, rb.batch_size.value, rb.seq_len.value = 20, 8, 64
    rb.run_button.click(); joined(rb.run.thread, "a 20-step run of the embedded model")
    loss = [r["loss"] for r in rb.run.rows]
    assert rb.run.status == "finished" and rb.run.config.task == "reverse"
    assert sum(loss[-3:]) / 3 < 0.6 * loss[0], loss


def test_run_table_shows_last_rows_and_only_columns_with_values():
    "30 steps with the tracker's mem_* columns on two of them: the last 8 rows, no all-empty column, readable units."
    import pandas as pd
    from tunebook.widgets import _table
    rows = [dict(step=i, loss=1 / i, lr=3e-3, peak_bytes=17274636, parameters_bytes=7368000, gradients_bytes=868352,
                 optimizer_bytes=1736928, peak_how="tunebook.memory.MemoryTracker: peak live tensors",
                 **({"mem_parameters": 7368000, "peak_phase": "backward"} if i <= 2 else {})) for i in range(1, 31)]
    html = _table(pd.DataFrame(rows), last=8, once=("peak_how",))
    _one_readable_table(html, rows=8)
    assert "mem_" not in html and "at peak" not in html and "peak_phase" not in html and "peak phase" not in html
    assert ">23<" in html and ">30<" in html and ">22<" not in html    # the last eight steps
    assert html.count("MemoryTracker") == 1                            # said once, under the table


def test_stop_keeps_checkpoint(builder):
    builder.steps.value = 1000
    builder.run_button.click()
    run_reaches(builder.run, lambda r: len(r.rows) >= 2, "two steps")
    builder.stop_button.click()
    joined(builder.run.thread, "the stopped run's thread")
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
    rb.run_button.click(); joined(rb.run.thread, "the failing run's thread")
    assert rb.run.status == "failed" and "boom" in rb.status.value and not rb.run_button.disabled


def test_live_run_view_error_does_not_stop_training(tmp_path):
    from tunebook.train import TrainConfig
    def bad_view(run): raise ValueError("view broke")
    run = LiveRun(TrainConfig(task="add", max_steps=2, batch_size=4, max_seq_len=32, output_dir=str(tmp_path), **FAST),
                  loader=tiny_loader, on_update=bad_view).start()
    joined(run.thread, "a 2-step run")
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
    assert "fits: none of 24 GiB, 40 GiB, 80 GiB, 141 GiB" not in lab.numbers.value   # a 70B QLoRA fits a big GPU
    lab.method.value = "full"
    assert "fits: none of 24 GiB, 40 GiB, 80 GiB, 141 GiB" in lab.numbers.value        # a 70B full fine-tune fits none
    lab.measure_button.click()  # too big to measure: a message
    assert "only for models up to" in lab.message.value


def _drawn(lab):
    """Wait for the lab's background worker to finish (it clears `state._worker` when no request is left)."""
    lab.wait(HANG)
    assert lab.state._worker is None, hung("the ablation worker's estimate")


def test_ablation_background_worker_draws_latest():
    lab = AblationLab(model="pico")
    _drawn(lab)
    first = lab.estimate
    for s in (128, 256, 64):
        lab.seq_len.value = s
    _drawn(lab)
    assert lab.estimate is not first
    assert "computing" not in lab.message.value
    assert lab.estimate is estimate_memory("pico", **lab.options())  # the latest request, from the cache


def test_ablation_invalid_is_a_message():
    lab = AblationLab(background=False, rough=True, model="pico")
    before = lab.chart.value
    lab.state.request("pico", **{**lab.options(), "seq_len": 4096})   # the slider cannot go there: ask the state directly
    assert "max_seq_len" in lab.message.value and lab.chart.value == before
    lab.checkpointing.value = True     # the next valid change redraws
    assert "max_seq_len" not in lab.message.value and lab.chart.value != before


def _drawn_without_error(lab, model, seq_len):
    assert "b00020" not in lab.message.value, lab.message.value       # no red error text
    assert lab.state.error is None and lab.state.key[0] == model and dict(lab.state.key[1])["seq_len"] == seq_len
    assert lab.chart.layout.display is None and lab.chart.value[:4] == PNG


def test_ablation_seq_len_range_follows_the_model():
    "The slider never offers a length the model cannot take: every position of it draws, for each model it visits."
    lab = AblationLab(background=False, rough=True)
    assert lab.seq_len.options[-1] == model_config("embedded").max_seq_len == 512
    for model in ("embedded", "smollm2-135m", "llama3.1-70b", "pico"):
        lab.model.value = model
        top = model_config(model).max_seq_len
        assert list(lab.seq_len.options) == seq_lens(top) and lab.seq_len.options[-1] == top
        _drawn_without_error(lab, model, lab.seq_len.value)
        for s in lab.seq_len.options[::-1]:       # drag across the whole range, down to the shortest
            chart = lab.chart.value
            if s != lab.seq_len.value: lab.seq_len.value = s; assert lab.chart.value != chart
            _drawn_without_error(lab, model, s)
        lab.seq_len.value = top
        for box in (lab.checkpointing, lab.in_backward, lab.checkpointing):   # toggling techniques redraws
            chart = lab.chart.value; box.value = not box.value
            assert lab.chart.value != chart; _drawn_without_error(lab, model, top)
    lab.model.value = "llama3.1-70b"; lab.seq_len.value = 131072
    lab.model.value = "embedded"                 # back to a short context: the value moves inside the range
    assert lab.seq_len.value == 512; _drawn_without_error(lab, "embedded", 512)


def test_ablation_error_is_a_message_and_the_lab_keeps_working(monkeypatch):
    lab = AblationLab(background=False, model="pico")
    before = lab.chart.value
    def broken(*a, **k): raise RuntimeError("estimator broke")
    monkeypatch.setattr(live, "estimate_memory", broken)
    lab.seq_len.value = 128                      # must not raise out of the observer
    assert "estimator broke" in lab.message.value and "still show pico, seq len 512" in lab.message.value
    assert lab.chart.value == before
    monkeypatch.undo()
    lab.checkpointing.value = True               # the next valid change redraws
    _drawn_without_error(lab, "pico", 128); assert lab.chart.value != before
    import tunebook.widgets
    def unreadable(name): raise OSError(f"cannot read {name}'s config.json")
    monkeypatch.setattr(tunebook.widgets, "model_config", unreadable)
    lab.model.value = "embedded"                 # following the model's context fails: a message, not a traceback
    assert "cannot read embedded" in lab.message.value and "b00020" in lab.message.value
    monkeypatch.undo()
    lab.model.value = "pico"
    _drawn_without_error(lab, "pico", 128)


def test_ablation_axis_scales_to_what_is_drawn():
    "The embedded model's default estimate (about 22 MiB) fills its axis: no 0-25 GiB axis, no GPU line out of reach."
    from tunebook.charts import GiB, ablation_axis
    from tunebook.memory import MemoryReport
    lab = AblationLab(background=False, rough=True)
    unit, size, end, gpus = ablation_axis(lab.estimate)
    drawn = max(lab.estimate.peak_bytes, sum(lab.estimate.categories.values()))
    assert unit == "MiB" and gpus == [] and drawn / size < end < 1.5 * drawn / size
    r = MemoryReport(20 * GiB, dict(parameters=20 * GiB), "formula", "x")   # 24 GiB is within reach, 40 GiB is not
    unit, size, end, gpus = ablation_axis(r)
    assert (unit, gpus) == ("GiB", ["24 GiB"]) and 24 < end < 30


def test_gpu_slider_gives_per_gpu_bytes_under_fsdp():
    lab = AblationLab(background=False, model="pico")
    lab.method.value, lab.dtype.value, lab.seq_len.value = "full", "fp32", 64
    one = lab.estimate
    lab.nproc.value = 4
    four = lab.estimate
    ref = estimate(get_config("pico"), method="full", dtype="fp32", batch_size=1, seq_len=64, lora_rank=16, nproc=4)
    assert four.categories == ref.categories and four.peak_bytes == ref.peak_bytes
    assert four.categories["parameters"] < one.categories["parameters"] and "per GPU of 4" in lab.numbers.value
    assert not lab.nproc.disabled


def test_rough_estimate_counts_parameters_exactly():
    from tunebook.core import count_params
    cfg = get_config("pico")
    e = rough_estimate(cfg, method="full", dtype="fp32")
    assert e.categories["parameters"] == 4 * count_params(build_model(cfg))


def test_compare_table_and_chart(tmp_path):
    cmp = Compare(loader=tiny_loader, output_dir=str(tmp_path), task="add", **FAST)
    assert cmp.chart.layout.display == "none" and cmp.table.value == ""   # no broken image before a chart exists
    cmp.combos.value = ("baseline", "optimizer in backward")
    cmp.steps.value, cmp.batch_size.value, cmp.seq_len.value = 1, 4, 32
    cmp.run_button.click(); joined(cmp.thread, "the comparison's two runs")
    df = cmp.frame
    assert list(df.combination) == ["baseline", "optimizer in backward"]
    assert df.error.isna().all() and (df.tokens_per_s > 0).all()
    assert df.gradients_bytes[1] < df.gradients_bytes[0]           # in backward: one gradient at a time
    assert df.optimizer_bytes[1] == df.optimizer_bytes[0] > 0      # the same AdamW state either way
    assert (df.state_bytes == df.parameters_bytes + df.gradients_bytes + df.optimizer_bytes).all()
    assert df.peak_how.str.startswith("measured").all() and (df.peak_bytes > df.parameters_bytes).all()
    assert cmp.chart.value[:4] == PNG and cmp.status.value.startswith("done") and cmp.chart.layout.display is None
    _one_readable_table(cmp.table.value, rows=2)   # one table, replaced as each combination finished
    cmp.combos.value = ()
    cmp.run_button.click()
    assert "at least one" in cmp.status.value


def test_compare_table_is_replaced_not_stacked():
    "Rows arriving from the worker thread replace the one table (an Output cleared from a thread kept every old one)."
    import pandas as pd
    cmp = Compare(loader=tiny_loader)
    row = dict(combination="baseline", tokens_per_s=4178.03, state_bytes=9973280, parameters_bytes=7368000,
               peak_bytes=22946572, peak_how="measured: one real training step on cpu", error=None)
    t = threading.Thread(target=lambda: [cmp._show(pd.DataFrame([row] * n)) for n in (1, 2, 3)]); t.start(); t.join()
    _one_readable_table(cmp.table.value, rows=3)
    assert "9.51 MiB" in cmp.table.value and "error" not in cmp.table.value   # an empty error column is left out
    assert cmp.chart.layout.display is None and cmp.chart.value[:4] == PNG


def test_compare_techniques_measures_what_each_saves(tmp_path):
    from tunebook.train import TrainConfig
    base = TrainConfig(task="add", batch_size=4, max_seq_len=32, output_dir=str(tmp_path), **FAST)
    df = compare_techniques(base, ["baseline", "chunked CE", "checkpointing", dict(method="prepend")], steps=1,
                            loader=tiny_loader)
    assert df.error[:3].isna().all() and "method" in df.error[3]
    assert df.peak_bytes[1] < df.peak_bytes[0]     # the chunked loss never holds the full logits
    assert df.peak_bytes[2] < df.peak_bytes[0]     # checkpointing keeps only block inputs
    assert df.parameters_bytes[0] == df.parameters_bytes[1] == df.parameters_bytes[2]


def test_logic_modules_do_not_import_ipywidgets():
    code = "import sys, tunebook.live, tunebook.charts, tunebook.memory; print('ipywidgets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_step_memory_keeps_the_run_peak_on_cuda(monkeypatch):
    """A live run's CUDA peak is the run's: step_memory must never reset the allocator's peak."""
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: calls.append(a))
    model = build_model(get_config("pico", n_layers=1))
    opt = torch.optim.AdamW(model.parameters())

    class FakeCudaTrainer:   # what step_memory reads of a trainer, reporting a CUDA allocator peak
        config = type("C", (), {"optimizer_in_backward": False})()
        step, optimizer = 3, opt
        def __init__(self): self.model = model
        def peak_memory(self): return 10 * 2**30, "torch.cuda.max_memory_allocated"
    m = step_memory(FakeCudaTrainer())
    assert calls == []
    assert m["device_peak"] == 10 * 2**30 and m["categories"]["activations + other"] == 10 * 2**30 - sum(
        state_bytes(model, opt).values())


def test_estimate_cache_is_bounded_and_keyed_by_config(tmp_path, monkeypatch):
    from tunebook.checkpoint import save_hf
    folder = tmp_path / "m"
    save_hf(build_model(get_config("pico", n_layers=2)), folder)
    a = estimate_memory(str(folder), rough=True, method="full", seq_len=64)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    b = estimate_memory(str(folder), rough=True, method="full", seq_len=64)
    assert b.categories["parameters"] > a.categories["parameters"]     # the same folder name, a new estimate
    monkeypatch.setattr(live, "CACHE_SIZE", 3)
    for s in (32, 64, 128, 256, 512): estimate_memory("pico", rough=True, seq_len=s)
    assert len(live._CACHE) <= 3


def test_lab_estimates_phi3_with_default_targets(tmp_path):
    "The lab's estimate adapts every linear layer by default, so Phi-3's fused qkv_proj / gate_up_proj work."
    from tunebook.checkpoint import save_hf
    from tunebook.core import count_params
    from tunebook.lora import apply_lora
    from tunebook.model import build_model, pico
    folder = tmp_path / "phi3-small"
    save_hf(build_model(pico(arch="phi3")), folder)
    r = estimate_memory(str(folder), method="lora", seq_len=32, lora_rank=8)
    assert r.settings["lora_targets"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    ref = apply_lora(build_model(pico(arch="phi3")), rank=8, targets="all-linear")
    assert r.settings["trainable_params"] == count_params(ref, trainable_only=True)


def test_lab_hidden_cells_display_nothing():
    "A hidden cell of the lab notebook may not end in an expression (JupyterLab would draw a returned widget twice)."
    nb = json.loads((Path(__file__).resolve().parents[1] / "nbs" / "17_lab.ipynb").read_text())
    hidden = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).lstrip().startswith("#| hide")]
    assert hidden
    for c in hidden:
        src = "".join(c["source"])
        body = ast.parse(src).body
        shows = body and isinstance(body[-1], ast.Expr) and not src.rstrip().endswith(";")
        assert not shows, f"hidden cell {c.get('id')} ends in an expression that displays its value:\n{src}"
        for o in c.get("outputs", []):
            assert "application/vnd.jupyter.widget-view+json" not in o.get("data", {}), f"hidden cell {c.get('id')} shows a widget"


def test_lab_shows_parameters_held_and_active_for_an_moe():
    """The lab says how many parameters a model holds and, for a mixture of experts, how many one token uses: the rough
    formula's counts equal the model's (transformers' counts are checked against the same in test_moe.py)."""
    from tunebook.lora import apply_lora
    from tunebook.model import build_model
    from tunebook.moe import count_active_params
    lab = AblationLab(background=False, rough=True, model="qwen3-30b-a3b")
    m = build_model("qwen3-30b-a3b", device="meta")
    apply_lora(m, rank=16, alpha=32, targets="all-linear")   # the lab's default method, LoRA rank 16
    held, active = sum(p.numel() for p in m.parameters()), count_active_params(m)
    assert f"{held / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token" in lab.numbers.value, lab.numbers.value
    assert lab.state.report.settings["params"] == held and lab.state.report.settings["active_params"] == active
    dense = AblationLab(background=False, rough=True, model="pico")
    assert "B parameters</div>" in dense.numbers.value and "active" not in dense.numbers.value
