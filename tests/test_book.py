"""`make book` keeps each notebook's outputs with a hash of the source that made them; `make check` fails on stale ones."""
import importlib.util
import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("book", ROOT / "tools" / "book.py")
book = importlib.util.module_from_spec(spec); spec.loader.exec_module(book)


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return [c.id for c in nb.cells[1:]]


def test_run_keeps_outputs_and_check_sees_a_changed_cell(tmp_path):
    p = tmp_path / "t.ipynb"
    ids = _notebook(p, "x = 2\nx * 21", "#| eval: false\nraise SystemExit('never run')", "print('hi')")
    assert book.stale_cells(p) == ids   # never run: every code cell is stale
    assert book.main(["--check", str(p)]) == 1
    assert book.main([str(p)]) == 0   # in a process of its own, as `make book` runs each notebook
    cells = [c for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code"]
    assert "".join(cells[0]["outputs"][0]["data"]["text/plain"]) == "42"
    assert cells[1]["outputs"] == [] and cells[1]["metadata"]["tunebook"]["skipped"] is True
    assert "".join(cells[2]["outputs"][0]["text"]) == "hi\n"
    assert book.stale_cells(p) == [] and book.main(["--check", str(p)]) == 0
    nb = json.loads(p.read_text())
    nb["cells"][1]["source"] = "x = 3\nx * 21"   # edited after the run: its output is no longer what it shows
    p.write_text(json.dumps(nb))
    assert book.stale_cells(p) == [ids[0]]
    assert book.main(["--check", str(p)]) == 1


def test_a_failing_notebook_is_left_as_it_was(tmp_path):
    p = tmp_path / "bad.ipynb"
    _notebook(p, "1 / 0")
    before = p.read_text()
    path, err = book.run_notebook(p)
    assert "ZeroDivisionError" in err and p.read_text() == before


def test_a_cell_that_shows_nothing_now_loses_its_old_outputs(tmp_path):
    """A cell that displayed something once and nothing after an edit must not keep the old display (a stale widget)."""
    p = tmp_path / "t.ipynb"
    _notebook(p, "x = 1\nx")
    assert book.main([str(p)]) == 0
    nb = json.loads(p.read_text())
    assert nb["cells"][1]["outputs"]
    nb["cells"][1]["source"] = "x = 1"
    p.write_text(json.dumps(nb))
    assert book.main([str(p)]) == 0
    assert json.loads(p.read_text())["cells"][1]["outputs"] == []
