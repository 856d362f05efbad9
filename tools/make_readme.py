"""Write README.md from index.ipynb (nbdev_readme needs Quarto, which this machine lacks)."""
import sys
from pathlib import Path

import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parents[1]
HEADER = "<!-- Generated from index.ipynb by tools/make_readme.py: edit the notebook, not this file. -->\n"


def render() -> str:
    nb = nbformat.read(ROOT / "index.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if "#| hide" not in c.source.splitlines()[:3]]
    body, _ = MarkdownExporter(exclude_output=True).from_notebook_node(nb)
    return body.strip() + "\n\n" + HEADER


if __name__ == "__main__":
    (ROOT / "README.md").write_text(render(), encoding="utf-8")
