"""tools/check_layers.py on tiny fake packages (a clean tree passes; each kind of violation and each import cycle is named)
and on the real one."""
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
    "memory/estimate.py": "from ..core import z\n",
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
    problems = [p for p in check_layers.check(write(tmp_path, {**CLEAN, file: text})) if "import cycle" not in p]
    assert len(problems) == 1 and expected in problems[0], problems
    assert "fix:" in problems[0]


def test_cli_exit_status(tmp_path):
    run = lambda pkg: subprocess.run([sys.executable, str(ROOT / "tools" / "check_layers.py"), str(pkg)],
                                     capture_output=True, text=True)
    ok = run(write(tmp_path / "a", CLEAN))
    bad = run(write(tmp_path / "b", {**CLEAN, "core.py": "from .model import M\n"}))
    assert ok.returncode == 0 and "clean" in ok.stdout
    assert bad.returncode == 1 and "tunebook/core.py:1: core (layer 0) imports model (layer 1)" in bad.stdout


def cycles(tmp_path, files, base=CLEAN):
    return check_layers.cycle_problems(write(tmp_path, {**base, **files}))


def test_two_module_cycle_through_lazy_import(tmp_path):
    got = cycles(tmp_path, {"dpo.py": "from .train import Trainer\n",
                            "train.py": "import os\n\ndef f():\n    from tunebook.dpo import DPO\n"})
    assert len(got) == 1, got
    assert got[0].startswith("tunebook/dpo.py:1: import cycle dpo -> train -> dpo (imports at dpo.py:1, train.py:4)")
    assert "fix:" in got[0]
    assert [p for p in check_layers.check(tmp_path / "tunebook") if "import cycle" not in p] == []   # no layer violation


def test_same_layer_cycle_inside_a_package(tmp_path):
    got = cycles(tmp_path, {"memory/estimate.py": "from .tracker import T\n"})   # tracker imports estimate
    assert got == [got[0]] and "import cycle memory.estimate -> memory.tracker -> memory.estimate" in got[0], got
    assert "memory/estimate.py:1" in got[0] and "memory/tracker.py:2" in got[0]


def test_three_module_cycle_printed_once(tmp_path):
    got = cycles(tmp_path, {"dpo.py": "from .kto import K\n", "kto.py": "import tunebook.grpo\n",
                            "grpo/__init__.py": "from .loss import L\n", "grpo/loss.py": "def f():\n    import tunebook.dpo\n"})
    assert len(got) == 1, got
    assert "import cycle dpo -> kto -> grpo -> grpo.loss -> dpo" in got[0]
    assert "(imports at dpo.py:1, kto.py:1, grpo/__init__.py:1, grpo/loss.py:2)" in got[0]


def test_cycle_through_a_package_shown_by_its_imports_between_modules(tmp_path):
    "Of the cycles a package's inner imports add, only those naming a new import between top-level modules are shown."
    got = cycles(tmp_path, {"embedded.py": "from .train import Trainer\n",
                            "train/__init__.py": "from .load import *\nfrom .trainer import *\nfrom .outputs import *\n",
                            "train/load.py": "def f():\n    from tunebook.embedded import EMBEDDED_DIR\n",
                            "train/trainer.py": "from .load import x\n",
                            "train/outputs.py": "from .trainer import T\ndef g():\n    from ..embedded import FINETUNE_TASK\n"},
                 base={k: v for k, v in CLEAN.items() if k != "train.py"})
    assert [g.split(" (")[0] for g in got] == ["tunebook/embedded.py:1: import cycle embedded -> train -> train.load -> embedded",
                                               "tunebook/embedded.py:1: import cycle embedded -> train -> train.outputs -> embedded"]


def test_package_front_door_is_no_cycle(tmp_path):
    "A package's __init__ importing its modules, which import each other and the package's siblings, is acyclic."
    files = {"grpo/__init__.py": "from .loss import *\nfrom .objective import *\n",
             "grpo/loss.py": "from . import rollout\nfrom ..train import T\n",
             "grpo/rollout.py": "from tunebook.core import x\n",
             "grpo/objective.py": "from .loss import L\nfrom tunebook.grpo.rollout import R\n",
             "dpo.py": "def f():\n    from tunebook.grpo import G\n"}
    assert cycles(tmp_path, files) == []
    assert check_layers.check(tmp_path / "tunebook") == []


def test_acyclic_tree_has_no_cycle(tmp_path):
    graph = check_layers.import_graph(write(tmp_path, CLEAN))
    assert graph["train"] == {"memory": 2} and graph["memory"] == {"memory.tracker": 1, "model": 2}
    assert check_layers.import_cycles(graph) == []


def test_cycles_are_enumerated_from_a_graph():
    "Each cycle once, from its first module; every import between top-level modules appears in a cycle shown."
    g = {"a": {"b": 1}, "b": {"a": 1, "c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert check_layers.import_cycles(g) == [["a", "b"], ["a", "b", "c"]]


def test_real_package_has_no_upward_import():
    assert [p for p in check_layers.check(ROOT / "tunebook") if "import cycle" not in p] == []


def test_real_package_has_no_import_cycle():
    assert check_layers.cycle_problems(ROOT / "tunebook") == []
