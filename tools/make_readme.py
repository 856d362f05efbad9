"""Write README.md from index.ipynb with its outputs (nbdev_readme needs Quarto, which this machine lacks).

Text outputs become code blocks and figures PNG files in docs/readme/ that README.md links; stderr (progress bars,
warnings) and hidden cells are left out. `make check` fails when README.md or its figures differ from what this writes."""
import sys
from pathlib import Path

import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parents[1]
FIGS = "docs/readme"
HEADER = "<!-- Generated from index.ipynb by tools/make_readme.py: edit the notebook, not this file. -->\n"


def render() -> tuple[str, dict[str, bytes]]:
    "(README text, {path relative to the root: figure bytes})."
    nb = nbformat.read(ROOT / "index.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if "#| hide" not in c.source.splitlines()[:3]]
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = [o for o in c.get("outputs", []) if not (o.output_type == "stream" and o.name == "stderr")]
            for o in c.outputs:   # tables as text: a code host shows HTML tables with their <style> blocks as text
                if "data" in o and "text/plain" in o.data: o.data.pop("text/html", None)
    body, res = MarkdownExporter().from_notebook_node(nb, resources={"output_files_dir": FIGS, "unique_key": "index"})
    return body.strip() + "\n\n" + HEADER, dict(res.get("outputs", {}))


if __name__ == "__main__":
    text, figs = render()
    d = ROOT / FIGS
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.png"):
        if f"{FIGS}/{old.name}" not in figs: old.unlink()
    for name, data in figs.items(): (ROOT / name).write_bytes(data)
    (ROOT / "README.md").write_text(text, encoding="utf-8")
