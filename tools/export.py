#!/usr/bin/env python3
"""Export nbs/*.ipynb to tunebook/ (`make export`): nbdev's own exporter, with every module a chapter names written whole.

A chapter notebook exports to several modules: its `#| default_exp` module, and others by `#| export tunebook-relative.name`
cells (`#| export lora.nf4`). nbdev 2's `nbdev_export` writes the default module fresh but *appends* to the others, so
running it twice repeats their code. Here each module is written fresh from the one notebook that exports it (a module
exported by two notebooks is refused, naming both), then nbdev's own `add_init` and `_build_modidx` run as in
`nbdev_export`. Usage: `python tools/export.py` from anywhere in the repository."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from fastcore.all import AttrDict, L
from nbdev.config import get_config
from nbdev.doclinks import _build_modidx, nbglob
from nbdev.export import ExportModuleProc, black_format
from nbdev.maker import ModuleMaker, add_init
from nbdev.process import NBProcessor

ROOT = Path(__file__).resolve().parents[1]


def modules_of(nb_path: Path) -> dict[str, tuple[list, list]]:
    "module name -> (its cells, the cells that feed its `__all__`) for one notebook."
    exp = ExportModuleProc()
    proc = NBProcessor(nb_path, [exp, black_format])
    proc.process()
    docs = {}   # a section `## \`tunebook.x\`` with a `> summary` line gives module x its docstring
    for c in proc.nb.cells:
        m = re.match(r"## `tunebook\.([\w.]+)`", c.source) if c.cell_type == "markdown" else None
        if m: docs[m.group(1)] = c
    out = {}
    for mod, cells in exp.modules.items():
        if not any(c.cell_type == "code" for c in cells): continue
        name = getattr(exp, "default_exp", None) if mod == "#" else mod
        if not name: raise SystemExit(f"{nb_path}: cells marked `#| export` but no `#| default_exp` cell; add one naming the module")
        if name in out: raise SystemExit(f"{nb_path}: `#| export {name}` names the notebook's default module; write `#| export`")
        doc = docs.get(name.removesuffix(".__init__"))
        if doc is not None: cells = [AttrDict(cell_type="markdown", source="# " + doc.source[3:])] + [c for c in cells if c.cell_type == "code"]
        out[name] = (cells, exp.in_all[mod])
    return out


def export(nbs: list[Path] | None = None, root: Path = ROOT) -> list[str]:
    "Write every module of every notebook of the nbdev project at `root` fresh; returns the module names written."
    os.chdir(root)
    get_config.cache_clear()   # nbdev caches the config of the first project it saw
    cfg = get_config()
    nbs = nbs or nbglob(path=cfg.nbs_path, as_path=True).sorted("name")
    owner = {}
    for nb in nbs:
        for name, (cells, all_cells) in modules_of(Path(nb)).items():
            if name in owner:
                raise SystemExit(f"module {name} is exported by both {owner[name]} and {Path(nb).name}; "
                                 "export each module from one notebook")
            owner[name] = Path(nb).name
            ModuleMaker(dest=cfg.lib_path, name=name, nb_path=nb, is_new=True).make(cells, all_cells, lib_path=cfg.lib_path)
    add_init(cfg.lib_path)
    _build_modidx()
    return sorted(owner)


if __name__ == "__main__":
    names = export()
    print(f"exported {len(names)} modules from {len(set(names))} module names")
