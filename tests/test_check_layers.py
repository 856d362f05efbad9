"""tools/check_layers.py on a tiny fake package (a clean tree passes; each kind of violation is named) and on the real one."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_layers  # noqa: E402

CLEAN = {
    "__init__.py": "",
    "core.py": "import os\n",
    "model.py": "from .core import x\nimport tunebook.core\n",
    "memory/__init__.py": "from .tracker import T\nfrom ..model import M\n",
    "memory/tracker.py": "from tunebook.core import y\nfrom . import estimate\n",
    "memory/estimate.py": "from .tracker import T\n",
    "train.py": "def f():\n    from tunebook.memory import T\n    import importlib\n    importlib.import_module(user_spec)\n",
    "cli.py": "import importlib\ndef g(m):\n    return importlib.import_module(f'tunebook.{m}')\n",
}


def write(tmp_path, files):
    pkg = tmp_path / "tunebook"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_clean_tree_passes(tmp_path):
    assert check_layers.check(write(tmp_path, CLEAN)) == []


@pytest.mark.parametrize("file,text,expected", [
    ("model.py", "from .train import Trainer\n", "tunebook/model.py:1: model (layer 1) imports train (layer 5)"),
    ("core.py", "import os\n\ndef lazy():\n    from tunebook.memory.tracker import T\n",
     "tunebook/core.py:4: core (layer 0) imports memory.tracker (layer 3)"),
    ("memory/tracker.py", "import os\nfrom .. import distributed\n",
     "tunebook/memory/tracker.py:2: memory.tracker (layer 3) imports distributed (layer 4)"),
    ("memory/estimate.py", "import importlib\nimportlib.import_module('tunebook.cli')\n",
     "tunebook/memory/estimate.py:2: memory.estimate (layer 3) imports cli (layer 6)"),
    ("train.py", "import importlib\ndef f(m): return importlib.import_module(f'tunebook.{m}')\n",
     "tunebook/train.py:2: train (layer 5) imports a tunebook module named at run time"),
    ("model.py", "from tunebook.mystery import z\n", "imports 'mystery', which has no layer"),
    ("mystery.py", "", "module 'mystery' has no layer"),
])
def test_violation_is_named(tmp_path, file, text, expected):
    problems = check_layers.check(write(tmp_path, {**CLEAN, file: text}))
    assert len(problems) == 1 and expected in problems[0], problems
    assert "fix:" in problems[0]


def test_cli_exit_status(tmp_path):
    run = lambda pkg: subprocess.run([sys.executable, str(ROOT / "tools" / "check_layers.py"), str(pkg)],
                                     capture_output=True, text=True)
    ok = run(write(tmp_path / "a", CLEAN))
    bad = run(write(tmp_path / "b", {**CLEAN, "core.py": "from .model import M\n"}))
    assert ok.returncode == 0 and "clean" in ok.stdout
    assert bad.returncode == 1 and "tunebook/core.py:1: core (layer 0) imports model (layer 1)" in bad.stdout


def test_real_package_is_clean():
    assert check_layers.check(ROOT / "tunebook") == []
