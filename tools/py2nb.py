"""Author a notebook as plain text: `python tools/py2nb.py draft.py nbs/NN_name.ipynb`.

Cells are separated by lines that are exactly `# %%` (code) or `# %% md` (markdown, written raw).
The notebook is the source of truth once written; this is only a convenience for drafting."""
import sys

import nbformat


def convert(src: str):
    cells, kind, buf = [], None, []

    def flush():
        text = "\n".join(buf).strip("\n")
        if kind is not None and text:
            cells.append(nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text))

    for line in src.splitlines():
        if line.strip() in ("# %%", "# %% md"):
            flush()
            kind, buf = ("md" if line.strip() == "# %% md" else "code"), []
        else:
            buf.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}}
    return nb


if __name__ == "__main__":
    src, dst = sys.argv[1:3]
    nbformat.write(convert(open(src).read()), dst)
