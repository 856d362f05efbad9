"""tools/export.py: a chapter exports to several modules, each written whole on every run (bare `nbdev_export` appends)."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


def _nb(path, *cells):
    nb = {"cells": [{"cell_type": kind, "id": f"{i:08x}", "metadata": {}, "source": text,
                     **({"outputs": [], "execution_count": None} if kind == "code" else {})} for i, (kind, text) in enumerate(cells)],
          "metadata": {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


@pytest.fixture
def project(tmp_path, monkeypatch):
    "A two-notebook nbdev project named like this one, in tmp_path."
    shutil.copy(ROOT / "settings.ini", tmp_path / "settings.ini")
    (tmp_path / "nbs").mkdir(); (tmp_path / "tunebook").mkdir()
    _nb(tmp_path / "nbs" / "01_first.ipynb",
        ("markdown", "# A chapter\n\n> The chapter's line."),
        ("code", "#| default_exp alpha"),
        ("markdown", "## `tunebook.alpha`\n\n> Alpha's own docstring."),
        ("code", "#| export\ndef f(): return 1"),
        ("markdown", "## `tunebook.beta`\n\n> Beta's own docstring."),
        ("code", "#| export beta\nfrom tunebook.alpha import f\ndef g(): return f() + 1"),
        ("code", "g()"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_module_is_written_whole_on_each_run(project):
    export = _load("export_tool", ROOT / "tools" / "export.py")
    cwd = Path.cwd()
    try:
        assert export.export(root=project) == ["alpha", "beta"]
        first = {p.name: p.read_text() for p in (project / "tunebook").glob("*.py")}
        export.export(root=project)   # again: nothing appended
        assert {p.name: p.read_text() for p in (project / "tunebook").glob("*.py")} == first
    finally:
        import os; os.chdir(cwd)
    beta = first["beta.py"]
    assert beta.count("def g()") == 1 and beta.startswith('"""Beta\'s own docstring."""')
    assert "from .alpha import f" in beta and "__all__ = ['g']" in beta
    assert first["alpha.py"].startswith('"""Alpha\'s own docstring."""')


def test_a_module_exported_by_two_notebooks_is_refused(project):
    _nb(project / "nbs" / "02_second.ipynb", ("code", "#| default_exp gamma"), ("code", "#| export beta\ndef h(): pass"))
    export = _load("export_tool2", ROOT / "tools" / "export.py")
    cwd = Path.cwd()
    try:
        with pytest.raises(SystemExit, match="module beta is exported by both 01_first.ipynb and 02_second.ipynb"):
            export.export(root=project)
    finally:
        import os; os.chdir(cwd)
