#!/usr/bin/env python3
"""The reading-order check: no notebook uses a name that a later notebook defines (file order is reading order).

For every `from tunebook.x import a` / `import tunebook.x` in any cell of nbs/*.ipynb (and of nbs/solutions/NAME.ipynb, read\nas chapter NAME), the notebook that exports `a` (or
module `x`) is found from the exported modules (their `File to edit` header, their `__all__`, a package's re-exports); it
must be the importing notebook itself or an earlier one. `python tools/check_order.py` (run by `make check` and CI) prints
each import that reaches forward as `importer: what (defined in NOTEBOOK)` with the fix, and fails on any."""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG, TOP = ROOT / "tunebook", "tunebook"


def _module_name(path: Path, pkg: Path = PKG) -> str:
    parts = list(path.relative_to(pkg).with_suffix("").parts)
    if parts[-1] == "__init__": parts = parts[:-1]
    return ".".join([TOP] + parts)


def package_index(pkg: Path = PKG):
    "(module -> its notebook, owner(module, name) -> the notebook that defines `name` as `module` exposes it)."
    mods, alls, froms = {}, {}, {}
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text()
        m = re.search(r"File to edit: (\S+\.ipynb)", text)
        name = _module_name(path, pkg)
        mods[name] = Path(m.group(1)).name if m else None
        tree = ast.parse(text)
        alls[name] = next((list(ast.literal_eval(n.value)) for n in tree.body if isinstance(n, ast.Assign)
                           and any(getattr(t, "id", None) == "__all__" for t in n.targets)), [])
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]   # the package a relative import starts from
        froms[name] = []
        for n in tree.body:
            if not isinstance(n, ast.ImportFrom): continue
            if n.level: src = ".".join(here[:len(here) - (n.level - 1)] + ([n.module] if n.module else []))
            elif (n.module or "").startswith(TOP): src = n.module
            else: continue
            froms[name].append((src, [a.name for a in n.names]))

    def owner(module: str, name: str, seen=()) -> str | None:
        if f"{module}.{name}" in mods: return mods[f"{module}.{name}"]   # a submodule
        if module not in mods or (module, name) in seen: return None
        for src, names in froms[module]:   # a re-export: the name's own module says where it is defined
            if name in names or ("*" in names and name in alls.get(src, [])):
                return owner(src, name, seen + ((module, name),))
        return mods[module]   # defined in the module itself

    return mods, owner


def _cell_tree(source: str):
    "The cell's code as an AST (magics and shell lines blanked), or None when it does not parse."
    lines = ["" if l.lstrip().startswith(("%", "!")) else l for l in source.splitlines()]
    try: return ast.parse("\n".join(lines))
    except SyntaxError: return None


def forward_imports(nbs_dir: Path = ROOT / "nbs", pkg: Path = PKG) -> list[str]:
    "`importer: what (defined in NOTEBOOK)` for every import in a notebook of something a later notebook defines."
    (mods, owner), out = package_index(pkg), []
    order = {p.name: i for i, p in enumerate(sorted(nbs_dir.glob("*.ipynb")))}
    solutions = sorted((nbs_dir / "solutions").glob("*.ipynb"))   # read as the last chapter whose name sorts at or before theirs
    for nb_path in sorted(nbs_dir.glob("*.ipynb")) + solutions:
        me = order[nb_path.name] if nb_path.parent == nbs_dir else max((i for n, i in order.items() if n <= nb_path.name), default=-1)
        seen = set()
        for cell in json.loads(nb_path.read_text())["cells"]:
            if cell["cell_type"] != "code": continue
            tree = _cell_tree("".join(cell["source"]))
            if tree is None: continue
            for node in ast.walk(tree):
                uses = []
                if isinstance(node, ast.Import):
                    uses = [(a.name, mods.get(a.name)) for a in node.names if a.name.startswith(TOP + ".")]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(TOP) and not node.level:
                    uses = [(f"{node.module}.{a.name}", owner(node.module, a.name)) for a in node.names if a.name != "*"]
                for what, where in uses:
                    if where in order and order[where] > me and (what, where) not in seen:
                        seen.add((what, where)); out.append(f"{nb_path.relative_to(nbs_dir)}: {what} (defined in {where})")
    return out


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    found = forward_imports()
    for l in found: print(f"{l}: a notebook uses what a later one defines; move it to that notebook or later, or the definition earlier")
    if found: return 1
    n = len(list((ROOT / "nbs").glob("*.ipynb")))
    print(f"reading order: none of the {n} chapters imports what a later one defines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
