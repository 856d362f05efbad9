"""End to end: the lab notebook in a real JupyterLab page, driven by Debian's chromium through Playwright.

Never downloads a browser (no `playwright install`): it uses /usr/bin/chromium. Skipped, with the reason, when
chromium, jupyterlab or playwright is missing."""
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


@pytest.fixture
def lab_server(tmp_path):
    if (why := _missing()): pytest.skip(why)
    shutil.copy(ROOT / "nbs" / "17_lab.ipynb", tmp_path / "17_lab.ipynb")
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
    yield url
    proc.terminate()
    try: proc.wait(30)
    except subprocess.TimeoutExpired: proc.kill()


def test_lab_notebook_in_jupyterlab(lab_server):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(MS)   # every wait below ends when the page shows what it waits for; MS only guards against a hang
        page.goto(f"{lab_server}/lab/tree/13a_lab.ipynb")
        page.wait_for_selector(".jp-Notebook", timeout=MS)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], .jp-Toolbar-kernelStatus", timeout=MS)
        time.sleep(2)
        page.click(".jp-Notebook")
        page.keyboard.press("Escape")
        page.evaluate("() => 0")
        # Run > Run All Cells
        page.click("div.lm-MenuBar-itemLabel:text-is('Run')")
        page.click("li.lm-Menu-item:has-text('Run All Cells')")
        peak = page.wait_for_selector(".tb-peak", timeout=MS)
        page.wait_for_function("() => !document.querySelector('.tb-ablation-message').innerText.includes('computing')",
                               timeout=MS)
        before = page.inner_text(".tb-peak")
        handle = page.locator(".tb-seq-len .noUi-handle")
        handle.focus(); handle.press("ArrowLeft"); handle.press("ArrowLeft")
        page.wait_for_function("b => document.querySelector('.tb-peak') && document.querySelector('.tb-peak').innerText != b",
                               arg=before, timeout=MS)
        assert page.inner_text(".tb-peak") != before
        # a tiny run: the loss image changes as steps arrive
        loss0 = page.get_attribute(".tb-loss", "src")
        page.locator(".tb-run").click()
        page.wait_for_function("s => document.querySelector('.tb-loss').getAttribute('src') != s", arg=loss0, timeout=MS)
        loss1 = page.get_attribute(".tb-loss", "src")
        page.wait_for_function("s => document.querySelector('.tb-loss').getAttribute('src') != s", arg=loss1, timeout=MS)
        page.wait_for_function("() => /finished|stopped|failed/.test(document.querySelector('.tb-status').innerText)",
                               timeout=MS)
        status = page.inner_text(".tb-status")
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.locator(".tb-loss").scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        print(f"screenshot: {SCREENSHOT}")
        browser.close()
    assert "finished" in status, status
