"""End to end: the lab notebook in a real JupyterLab page, driven by Debian's chromium through Playwright.

Never downloads a browser (no `playwright install`): it uses /usr/bin/chromium. Skipped, with the reason, when
chromium, jupyterlab or playwright is missing.

The page is the chapter's "lab" section, the cells a reader runs (the chapter's reference sections below it are
tested by running the notebook itself); its stored outputs are dropped, so every widget on the page is one the
kernel drew. The test does what a reader does: moves the AblationLab's controls (the model, the sequence length
from one end of its range to the other, a technique), runs the RunBuilder and a tiny Compare, and checks after each
step that the chart and table were redrawn with no error text, and that the page holds one of each widget."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import HANG

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("TUNEBOOK_CHROMIUM", "/usr/bin/chromium")
NOTEBOOK = "17_lab.ipynb"
SCREENSHOT = ROOT / "runs" / "browser" / "lab.png"
MS = int(HANG * 1000)   # Playwright's timeouts are in milliseconds


def _missing() -> str | None:
    if not Path(CHROMIUM).exists(): return f"no chromium at {CHROMIUM} (apt-get install -y chromium)"
    try: import playwright.sync_api  # noqa: F401
    except ImportError: return "playwright is not installed (pip install playwright; never `playwright install`)"
    try: import jupyterlab  # noqa: F401
    except ImportError: return "jupyterlab is not installed (pip install jupyterlab)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _status(url):
    try: return urllib.request.urlopen(url + "/api/status", timeout=2).read()
    except Exception: return None


def lab_section(src: Path, dst: Path) -> int:
    "Write the cells of `src` above its first `## \\`tunebook.` section to `dst`, outputs dropped; returns the code cells."
    nb = json.loads(src.read_text())
    end = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("## `tunebook."))
    nb["cells"] = nb["cells"][:end]
    for c in nb["cells"]:
        if c["cell_type"] == "code": c["outputs"], c["execution_count"] = [], None
    dst.write_text(json.dumps(nb, indent=1))
    return sum(c["cell_type"] == "code" for c in nb["cells"])


@pytest.fixture
def lab_server(tmp_path):
    if (why := _missing()): pytest.skip(why)
    cells = lab_section(ROOT / "nbs" / NOTEBOOK, tmp_path / NOTEBOOK)
    port = _free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / ".jupyter"), "JUPYTER_RUNTIME_DIR": str(tmp_path / ".rt"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
                             "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
                             f"--ServerApp.root_dir={tmp_path}", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "w"))
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()   # wait for the server to answer or exit; HANG only guards against a hang
    while proc.poll() is None and _status(url) is None and time.monotonic() - t0 < HANG: time.sleep(0.5)
    if proc.poll() is not None or _status(url) is None:
        proc.terminate(); pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
    yield url, cells
    proc.terminate()
    try: proc.wait(30)
    except subprocess.TimeoutExpired: proc.kill()


# what the page shows of the ablation lab: the chart's blob URL changes with every redraw
ABLATION = """() => ({chart: document.querySelector('.tb-ablation-chart').getAttribute('src') || '',
    visible: getComputedStyle(document.querySelector('.tb-ablation-chart')).display != 'none',
    numbers: document.querySelector('.tb-ablation-numbers').innerText,
    drawn: (document.querySelector('.tb-ablation-for') || {innerText: ''}).innerText,
    message: document.querySelector('.tb-ablation-message').innerText,
    red: !!document.querySelector('.tb-ablation-message span[style*="b00020"]'),
    model: document.querySelector('.tb-model .widget-readout').innerText.trim(),
    seq: document.querySelector('.tb-seq-len .widget-readout').innerText.trim()})"""
# a page-level error: a widget the front end could not draw, or a traceback in any output
PAGE_ERRORS = """() => [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.innerText)
    .filter(t => /Traceback|Error displaying widget|Exception in/.test(t))"""


def test_lab_notebook_in_jupyterlab(lab_server):
    from playwright.sync_api import sync_playwright
    url, cells = lab_server
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(MS)   # every wait below ends when the page shows what it waits for; MS only guards against a hang
        page.goto(f"{url}/lab/tree/{NOTEBOOK}")
        page.wait_for_selector(".jp-Notebook", timeout=MS)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], .jp-Toolbar-kernelStatus", timeout=MS)
        time.sleep(2)
        page.click(".jp-Notebook")
        page.keyboard.press("Escape")
        # Run > Run All Cells, then wait for every code cell's prompt to show its number
        page.click("div.lm-MenuBar-itemLabel:text-is('Run')")
        page.click("li.lm-Menu-item:has-text('Run All Cells')")
        page.wait_for_function("n => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];"
                               " return p.length == n && p.every(e => /\\[\\d+\\]/.test(e.innerText)); }",
                               arg=cells, timeout=MS)

        def ablation(): return page.evaluate(ABLATION)

        def drag(slider, to):
            """Drag `slider`'s handle with the mouse past the `to` ("start" or "end") of its track, as a reader does.
            (Not the End key: noUiSlider's End goes to the first range a slider had, not the one its options have now.)"""
            box = page.locator(f"{slider} .noUi-handle").bounding_box()
            track = page.locator(f"{slider} .noUi-base").bounding_box()
            y = box["y"] + box["height"] / 2
            page.mouse.move(box["x"] + box["width"] / 2, y); page.mouse.down()
            x = track["x"] + track["width"] + 30 if to == "end" else track["x"] - 30
            page.mouse.move((box["x"] + x) / 2, y, steps=3); page.mouse.move(x, y, steps=3); page.mouse.up()

        def failed():
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT.with_name("lab-failed.png")), full_page=True)

        def redrawn(before, model, seq_len, what):
            """Wait until the chart and the table were both redrawn since `before` and the table shows the final estimate for
            `model` and `seq_len`, or an error shows; then check for none. The lab sets the chart, then the table: a new chart
            beside the old table is a moment in between (a preview's chart under the last final table), so the table must
            have changed too; once it shows a final estimate, the chart set before it is final as well."""
            want = f"{model} · seq len {seq_len} · lora, bf16 · batch 1"   # not '... · computing…': the preview
            try: page.wait_for_function(f"a => {{ const s = ({ABLATION})(); return s.red || (s.chart != a[0].chart && s.numbers != a[0].numbers && s.drawn == a[1]); }}",
                                        arg=[before, want], timeout=MS)   # red error text ends the wait at once
            except Exception as e:
                failed(); raise AssertionError(f"{what}: the page never showed {want!r}; it shows {ablation()}") from e
            now = ablation()
            assert (now["model"], now["seq"]) == (model, str(seq_len)), f"{what}: the sliders show {now}"
            assert not now["red"] and "error" not in now["message"].lower(), f"{what}: {now['message']}"
            assert now["visible"] and "peak" in now["numbers"] and "fits" in now["numbers"], f"{what}: {now}"
            assert page.evaluate(PAGE_ERRORS) == [], f"{what}: {page.evaluate(PAGE_ERRORS)}"
            return now

        # one of each widget: the hidden last cell draws nothing
        for cls in (".tb-run", ".tb-ablation-chart", ".tb-compare-run"):
            assert page.locator(cls).count() == 1, f"{page.locator(cls).count()} widgets with {cls} on the page"
        assert page.evaluate(PAGE_ERRORS) == []
        assert page.locator(".tb-compare-chart").is_hidden()        # no (broken) image before a comparison ran
        page.wait_for_function(f"() => ({ABLATION})().drawn == 'embedded · seq len 512 · lora, bf16 · batch 1'", timeout=MS)
        first = ablation()
        assert first["visible"] and not first["red"] and (first["model"], first["seq"]) == ("embedded", "512"), first
        assert " MiB" in first["numbers"]

        # the model: two steps up, to SmolLM2-135M (8192 positions)
        s = ablation()
        model = page.locator(".tb-model .noUi-handle")
        model.focus(); model.press("ArrowRight"); model.press("ArrowRight")
        page.wait_for_function("() => document.querySelector('.tb-model .widget-readout').innerText.trim() == 'smollm2-135m'")
        s = redrawn(s, "smollm2-135m", 512, "the model two steps up")
        # the sequence length dragged across its range: to its end (the model's context), its start, its end again
        drag(".tb-seq-len", "end")
        s = redrawn(s, "smollm2-135m", 8192, "seq len to the end")
        drag(".tb-seq-len", "start")
        s = redrawn(s, "smollm2-135m", 64, "seq len to the start")
        drag(".tb-seq-len", "end")
        s = redrawn(s, "smollm2-135m", 8192, "seq len to the end again")
        # a technique on and off
        for state in ("on", "off"):
            peak = page.inner_text(".tb-peak")
            page.locator(".tb-checkpointing input").click()
            s = redrawn(s, "smollm2-135m", 8192, f"checkpointing {state}"); assert page.inner_text(".tb-peak") != peak
        # back to the embedded model: the sequence length moves inside its shorter range, no error
        model.focus(); model.press("Home")
        s = redrawn(s, "embedded", 512, "the model back to embedded")
        seq = page.locator(".tb-seq-len .noUi-handle")
        seq.focus(); seq.press("ArrowLeft")
        s = redrawn(s, "embedded", 256, "seq len one step down")

        # a tiny comparison: two combinations, one timed step, batch 1, the shortest sequence
        page.select_option(".tb-compare-combos select", ["baseline", "chunked CE"])
        page.locator(".tb-compare-steps input").fill("1"); page.locator(".tb-compare-steps input").press("Enter")
        for cls in (".tb-compare-batch", ".tb-compare-seq-len"):
            h = page.locator(f"{cls} .noUi-handle"); h.focus(); h.press("Home")
        page.locator(".tb-compare-run").click()
        page.wait_for_function("() => /done|Error/.test(document.querySelector('.tb-compare-status').innerText)", timeout=MS)
        assert page.inner_text(".tb-compare-status").startswith("done"), page.inner_text(".tb-compare-status")
        assert page.locator(".tb-compare-table table").count() == 1
        rows = page.locator(".tb-compare-table tbody tr")
        assert rows.count() == 2 and "chunked CE" in rows.nth(1).inner_text()
        table = page.inner_text(".tb-compare-table")
        assert "NaN" not in table and ("MiB" in table or "KiB" in table), table
        assert page.locator(".tb-compare-chart").is_visible()
        assert page.locator(".tb-compare-run").count() == 1 and page.evaluate(PAGE_ERRORS) == []

        # the run builder: the fine-tune task by default, the known tasks named; a run's loss image changes as steps arrive
        assert page.input_value(".tb-data input") == "reverse"
        assert "add" in page.inner_text(".tb-task-note") and "reverse" in page.inner_text(".tb-task-note")
        loss0 = page.get_attribute(".tb-loss", "src")
        page.locator(".tb-run").click()
        page.wait_for_function("s => document.querySelector('.tb-loss').getAttribute('src') != s", arg=loss0, timeout=MS)
        loss1 = page.get_attribute(".tb-loss", "src")
        page.wait_for_function("s => document.querySelector('.tb-loss').getAttribute('src') != s", arg=loss1, timeout=MS)
        page.wait_for_function("() => /finished|stopped|failed/.test(document.querySelector('.tb-status').innerText)",
                               timeout=MS)
        status = page.inner_text(".tb-status")
        if "finished" in status:
            page.wait_for_selector(".tb-results table", timeout=MS)
            assert page.locator(".tb-results table").count() == 1 and page.locator(".tb-results tbody tr").count() == 8
            results = page.inner_text(".tb-results")
            assert "NaN" not in results and "MiB" in results, results
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        for name, cls in (("ablation", ".tb-ablation-chart"), ("compare", ".tb-compare-table")):   # each widget whole
            page.locator(cls).locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')]").screenshot(
                path=str(SCREENSHOT.with_name(f"lab-{name}.png")))
        print(f"screenshots: {SCREENSHOT.parent}")
        browser.close()
    assert "finished" in status, status
