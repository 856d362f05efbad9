#!/usr/bin/env python3
"""The book: every notebook run top to bottom with its outputs kept, so a reader sees what each cell shows without running it.

`python tools/book.py [NB ...]` (`make book`) runs each notebook (default: nbs/*.ipynb, nbs/solutions/*.ipynb and index.ipynb) as `nbdev_test`
does (the `slow` cells included; cells flagged for hardware this machine may lack, or `eval: false`, are skipped), writes
the outputs into the notebook and records in each code cell's metadata a hash of the source that made them. A notebook
that fails keeps its previous outputs and the run exits 1.

`python tools/book.py --check` (run by `make check` and CI) fails when a code cell's outputs are missing or were made from
another source than the cell has now, naming the notebook and the command that mends it."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "tunebook"        # the cell metadata key (settings.ini's allowed_cell_metadata_keys keeps it through nbdev_clean)
FORCED = {"slow"}       # flags run here as in CI; the other test flags (cuda, multigpu, train) are skipped


def source_hash(source) -> str:
    "A short hash of a cell's source (a string or nbformat's list of lines)."
    text = "".join(source) if isinstance(source, list) else source
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def notebooks(paths=None) -> list[Path]:
    "The notebooks of the book: the given paths, else the chapters (nbs/*.ipynb) in order, their solutions and index.ipynb."
    if paths: return [Path(p).resolve() for p in paths]
    return sorted((ROOT / "nbs").glob("*.ipynb")) + sorted((ROOT / "nbs" / "solutions").glob("*.ipynb")) + [ROOT / "index.ipynb"]


def stale_cells(path: Path) -> list[str]:
    "Ids of the code cells of `path` whose outputs were not made from their current source."
    nb = json.loads(Path(path).read_text())
    return [c.get("id", f"#{i}") for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            and c.get("metadata", {}).get(KEY, {}).get("source") != source_hash(c["source"])]


def _plain(x):
    "execnb's AttrDicts as plain JSON values."
    return json.loads(json.dumps(x, default=str))


def run_notebook(path: Path) -> tuple[str, str | None]:
    "Run `path` top to bottom and write its outputs and source hashes into it: (path, None) or (path, the error)."
    from execnb.shell import CaptureShell
    from fastcore.xtras import working_directory
    from nbdev.config import get_config
    from nbdev.frontmatter import FrontmatterProc
    from nbdev.process import NBProcessor
    path = Path(path)
    skip = set(get_config().tst_flags.split()) - FORCED
    ran = NBProcessor(path, procs=FrontmatterProc, process=True).nb
    for c in ran.cells:   # execnb replaces a cell's outputs only when the run shows some: a cell that shows nothing now would keep old ones
        if c.cell_type == "code": c.outputs = []
    skipped = set()

    def no_eval(cell):   # as nbdev_test decides which cells run
        if cell.cell_type != "code": return True
        direc = getattr(cell, "directives_", {}) or {}
        if "nbdev_export(" in cell.source or direc.get("eval:", [""])[0].lower() == "false" or skip & direc.keys():
            skipped.add(cell.get("id")); return True
        return False

    shell = CaptureShell(path, mpl_format="png")   # figures at 100 dpi: the book stays small
    try:
        with working_directory(path.parent): shell.run_all(ran, exc_stop=True, preproc=no_eval)
    except Exception:
        return str(path), shell.prettytb(fname=path)
    outputs = {c.get("id"): _plain(c.get("outputs", [])) for c in ran.cells if c.cell_type == "code"}
    raw = json.loads(path.read_text())
    for c in raw["cells"]:
        if c["cell_type"] != "code": continue
        c["outputs"] = [] if c.get("id") in skipped else outputs.get(c.get("id"), [])
        c.setdefault("metadata", {})[KEY] = {"source": source_hash(c["source"]), **({"skipped": True} if c.get("id") in skipped else {})}
    path.write_text(json.dumps(raw, indent=1, ensure_ascii=False) + "\n")
    subprocess.run([str(Path(sys.executable).parent / "nbdev_clean"), "--fname", str(path)], cwd=ROOT, check=True)
    return str(path), None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="notebooks (default: all of nbs/ and index.ipynb)")
    p.add_argument("--check", action="store_true", help="fail on missing or stale outputs instead of running")
    p.add_argument("--workers", type=int, default=2, help="notebooks run at once, each in its own process (one torch thread each)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # run the one notebook given in this process
    a = p.parse_args(argv)
    paths = notebooks(a.paths)
    if a.one:
        _, err = run_notebook(paths[0])
        if err: print(err, file=sys.stderr)
        return 1 if err else 0
    if a.check:
        bad = {q: s for q in paths if (s := stale_cells(q))}
        for q, s in bad.items():
            rel = q.relative_to(ROOT) if q.is_relative_to(ROOT) else q
            print(f"{rel}: {len(s)} code cell(s) whose outputs are missing or were made from other source (first: {s[0]}); "
                  f"fix: make book NB={rel}")
        if bad: return 1
        print(f"book: the outputs of all {len(paths)} notebooks were made from their current cells")
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    def one(path):   # a process per notebook: IPython's shell takes over the process's __main__ and state
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--one", str(path)], cwd=ROOT, env=env, capture_output=True, text=True)
        return path, (r.stderr[-5000:] or f"exit {r.returncode}") if r.returncode else None, time.perf_counter() - t0
    failed = []
    with ThreadPoolExecutor(max(1, a.workers)) as ex:
        for path, err, secs in ex.map(one, paths):
            print(f"{'FAILED' if err else 'ran'} {Path(path).name} in {secs:.0f} s", flush=True)
            if err: failed.append(path); print(err, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
