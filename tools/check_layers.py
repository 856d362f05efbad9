#!/usr/bin/env python3
"""The layer check: no tunebook module imports one from a higher layer (the table in DESIGN.md), at top level or
inside a function, so a lazy import cannot hide a violation. Usage: `python tools/check_layers.py [package_dir]`;
exit 1 with one line per violation (file:line, what, the fix)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

# module (dotted, inside the package) -> layer; a subpackage's modules take their package's layer unless listed
LAYERS = {
    "__init__": 0, "_modidx": 0, "core": 0,
    "attention": 1, "layers": 1, "model": 1,
    "checkpoint": 2, "hfconfig": 2, "tokenizer": 2, "data": 2, "records": 2, "batches": 2, "tasks": 2, "generate": 2, "hub": 2,
    "lora": 3, "loss": 3, "optim": 3, "memory": 3, "precision": 3, "compile": 3,
    "distributed": 4, "launch": 4,
    "train": 5, "config": 5, "rundir": 5, "preference": 5, "logprobs": 5, "kto": 5, "vllmgen": 5, "dpo": 5, "distill": 5, "grpo": 5, "rl": 5, "embedded": 5, "loggers": 5, "lmeval": 5,
    "objectives": 6, "recipes": 6, "live": 6, "charts": 6, "widgets": 6, "cli": 6, "chat": 6,
}
TOP = "tunebook"


def module_name(path: Path, root: Path) -> str:
    "The dotted name of `path` inside the package folder `root` (`memory/tracker.py` -> `memory.tracker`)."
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1: parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str, layers: dict = LAYERS) -> int | None:
    "The layer of a dotted module name: its own entry, else its closest listed package's; None when unknown."
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in layers: return layers[".".join(parts[:i])]
    return None


def _resolve_from(node: ast.ImportFrom, importer: str, is_pkg: bool) -> list[str]:
    "Package-relative names that a `from ... import ...` statement imports (empty when outside the package)."
    if node.level:
        base = importer.split(".") if is_pkg else importer.split(".")[:-1]
        if importer == "__init__": base = []
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        mod = ".".join(base + ([node.module] if node.module else []))
    elif node.module == TOP or (node.module or "").startswith(TOP + "."):
        mod = node.module[len(TOP) + 1:]
    else: return []
    if mod: return [mod]
    return [a.name for a in node.names]   # `from . import x` / `from tunebook import x`: x is a module


def imports(tree: ast.AST, importer: str, is_pkg: bool):
    "Yield (line, package-relative module name or None for an unresolvable dynamic import) for every import in `tree`."
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == TOP or a.name.startswith(TOP + "."): yield node.lineno, a.name[len(TOP) + 1:] or "__init__"
        elif isinstance(node, ast.ImportFrom):
            for m in _resolve_from(node, importer, is_pkg): yield node.lineno, m
        elif isinstance(node, ast.Call) and node.args:   # importlib.import_module("tunebook.x"), __import__(...)
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if fname not in ("import_module", "__import__"): continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(TOP):
                yield node.lineno, arg.value[len(TOP) + 1:] or "__init__"
            elif (isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant)
                  and str(arg.values[0].value).startswith(TOP + ".")):
                yield node.lineno, None


def check(root: Path, layers: dict = LAYERS) -> list[str]:
    "Problems in the package folder `root`: unknown modules and imports of a higher layer, one line each."
    root, problems, top = Path(root), [], max(layers.values())
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts: continue
        name, where = module_name(path, root), path.relative_to(root.parent)
        mine = layer_of(name, layers)
        if mine is None:
            problems.append(f"{where}:1: module {name!r} has no layer; fix: add it to LAYERS in tools/check_layers.py "
                            "and to the layer table in DESIGN.md")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in imports(tree, name, path.name == "__init__.py"):
            if target is None:
                if mine < top:
                    problems.append(f"{where}:{line}: {name} (layer {mine}) imports a tunebook module named at run time, "
                                    "which the layer check cannot see; fix: import the module by name")
                continue
            theirs = layer_of(target, layers)
            if theirs is None:
                problems.append(f"{where}:{line}: {name} imports {target!r}, which has no layer; fix: add it to LAYERS")
            elif theirs > mine:
                problems.append(f"{where}:{line}: {name} (layer {mine}) imports {target} (layer {theirs}); fix: move what "
                                f"{name} needs down to layer {mine} or below, or pass it in from the caller")
    return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / TOP
    problems = check(root)
    for p in problems: print(p)
    print(f"layer check: {len(problems)} problem(s) in {root}" if problems else f"layer check: {root} is clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
