#!/usr/bin/env python3
"""The layer check: no tunebook module imports one from a higher layer (the `LAYERS` table below, which the README's
newcomer's map mirrors), and no tunebook modules import each other in a cycle (same-layer cycles included). Imports
count at top level and inside functions alike, so a lazy import hides neither. Usage:
`python tools/check_layers.py [package_dir]`; exit 1 with one line per problem (file:line, what, the fix), each
cycle printed once as `a -> b -> ... -> a`."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

# module (dotted, inside the package) -> layer; a subpackage's modules take their package's layer unless listed
LAYERS = {
    "__init__": 0, "_modidx": 0, "core": 0,
    "attention": 1, "layers": 1, "moe": 1, "deltanet": 1, "gptoss": 1, "gemma4": 1, "modelconfig": 1, "model": 1,
    "checkpoint": 2, "hfconfig": 2, "hfgemma4": 2, "tokenizer": 2, "data": 2, "records": 2, "batches": 2, "tasks": 2, "generate": 2, "hub": 2, "llamacpp": 2, "ollama": 2,
    "lora": 3, "loss": 3, "optim": 3, "memory": 3, "precision": 3, "compile": 3,
    "distributed": 4, "launch": 4, "mesh": 4,
    "train": 5, "config": 5, "rundir": 5, "preference": 5, "logprobs": 5, "kto": 5, "vllmgen": 5, "dpo": 5, "distill": 5, "grpo": 5, "embedded": 5, "loggers": 5, "lmeval": 5, "card": 5, "export": 5,
    "objectives": 6, "recipes": 6, "live": 6, "charts": 6, "widgets": 6, "cli": 6, "chat": 6, "push": 6,
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


def _from_base(node: ast.ImportFrom, importer: str, is_pkg: bool) -> str | None:
    "The package-relative module a `from ... import ...` statement names ('' for the top package, None outside it)."
    if node.level:
        base = importer.split(".") if is_pkg else importer.split(".")[:-1]
        if importer == "__init__": base = []
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))
    if node.module == TOP or (node.module or "").startswith(TOP + "."): return node.module[len(TOP) + 1:]
    return None


def _resolve_from(node: ast.ImportFrom, importer: str, is_pkg: bool) -> list[str]:
    "Package-relative names that a `from ... import ...` statement imports (empty when outside the package)."
    mod = _from_base(node, importer, is_pkg)
    if mod is None: return []
    if mod: return [mod]
    return [a.name for a in node.names]   # `from . import x` / `from tunebook import x`: x is a module


def _node_imports(node: ast.AST, importer: str, is_pkg: bool):
    "Yield (line, package-relative module name or None for an unresolvable dynamic import) for the import `node` is, if any."
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name == TOP or a.name.startswith(TOP + "."): yield node.lineno, a.name[len(TOP) + 1:] or "__init__"
    elif isinstance(node, ast.ImportFrom):
        for m in _resolve_from(node, importer, is_pkg): yield node.lineno, m
    elif isinstance(node, ast.Call) and node.args:   # importlib.import_module("tunebook.x"), __import__(...)
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if fname not in ("import_module", "__import__"): return
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(TOP):
            yield node.lineno, arg.value[len(TOP) + 1:] or "__init__"
        elif (isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant)
              and str(arg.values[0].value).startswith(TOP + ".")):
            yield node.lineno, None


def imports(tree: ast.AST, importer: str, is_pkg: bool):
    "Yield (line, package-relative module name or None for an unresolvable dynamic import) for every import in `tree`."
    for node in ast.walk(tree): yield from _node_imports(node, importer, is_pkg)


def _modules(root: Path) -> dict[str, Path]:
    "Dotted name -> file of every module in the package folder `root`."
    return {module_name(p, root): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def _encloses(pkg: str, name: str) -> bool:
    "Whether package `pkg` contains module `name` (the top package, `__init__`, contains all)."
    return pkg == "__init__" or name.startswith(pkg + ".")


def _runs(target: str, importer: str, modules) -> list[str]:
    """The modules that importing `target` from `importer` runs: its closest module and the packages around it, less
    those enclosing `importer` (they are already running when `importer` runs)."""
    parts = target.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules and not _encloses(m, importer)]


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """importer -> {module it imports: line of the first such import} over the package folder `root`, lazy imports
    included. Importing `a.b` runs `a` too, unless `a` encloses the importer. `from a import x` runs the submodule `a.x`
    when there is one, and takes names from `a` otherwise (an edge to `a` even when `a` encloses the importer)."""
    root = Path(root)
    modules, graph = _modules(root), {}
    for name, path in modules.items():
        tree, edges, is_pkg = ast.parse(path.read_text(), filename=str(path)), {}, path.name == "__init__.py"
        def add(line, mods):
            for m in mods:
                if m != name: edges.setdefault(m, line)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                for line, target in _node_imports(node, name, is_pkg):
                    if target is not None: add(line, _runs(target, name, modules))
                continue
            base = _from_base(node, name, is_pkg)
            if base is None: continue
            base = base or "__init__"
            add(node.lineno, _runs(base, name, modules))
            for a in node.names:
                sub = a.name if base == "__init__" else f"{base}.{a.name}"
                if sub in modules: add(node.lineno, _runs(sub, name, modules))
                elif base in modules: add(node.lineno, [base])     # a name defined in `base`: its body must have run
        graph[name] = dict(sorted(edges.items(), key=lambda kv: kv[1]))
    return graph


def _sccs(graph) -> list[set]:
    "The strongly connected components of `graph` that hold more than one module (Tarjan's algorithm, iterative)."
    index, low, on, stack, out = {}, {}, set(), [], []
    def visit(v):
        index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for start in sorted(graph):
        if start in index: continue
        visit(start); work = [(start, iter(sorted(graph[start])))]
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index: visit(w); work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on: low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work: low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while v not in comp:
                    u = stack.pop(); on.discard(u); comp.add(u)
                if len(comp) > 1: out.append(comp)
    return out


def _shortest_back(graph, comp, src, dst) -> list[str]:
    "The shortest path src -> ... -> dst inside `comp` (breadth first, neighbours in name order)."
    prev, frontier = {src: None}, [src]
    while frontier and dst not in prev:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in comp and w not in prev: prev[w] = v; nxt.append(w)
        frontier = nxt
    path = [dst]
    while path[-1] != src: path.append(prev[path[-1]])
    return path[::-1]


def import_cycles(graph: dict) -> list[list[str]]:
    """Import cycles of `graph`, each once, from its alphabetically first module. Every import that crosses between
    top-level modules inside a cycle is shown, in the shortest cycle through it (inside one package: every import)."""
    top = lambda m: m.split(".")[0]
    cycles = set()
    for comp in _sccs(graph):
        edges = [(a, b) for a in sorted(comp) for b in graph[a] if b in comp]
        crossing = [(a, b) for a, b in edges if top(a) != top(b)] or edges
        for a, b in crossing:
            cyc = [a] + _shortest_back(graph, comp, b, a)[:-1]
            i = cyc.index(min(cyc))
            cycles.add(tuple(cyc[i:] + cyc[:i]))
    return sorted((list(c) for c in cycles), key=lambda c: (c[0], len(c), c))


def check(root: Path, layers: dict = LAYERS) -> list[str]:
    "Problems in the package folder `root`: unknown modules, imports of a higher layer and import cycles, one line each."
    root, problems, top = Path(root), [], max(layers.values())
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts: continue
        name, where = module_name(path, root), path.relative_to(root.parent)
        mine = layer_of(name, layers)
        if mine is None:
            problems.append(f"{where}:1: module {name!r} has no layer; fix: add it to LAYERS in tools/check_layers.py "
                            "and to the README's newcomer's map (index.ipynb)")
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
    return problems + cycle_problems(root)


def cycle_problems(root: Path) -> list[str]:
    "One line per import cycle in the package folder `root`: the cycle, where each of its imports is, and the fix."
    root = Path(root)
    graph, files = import_graph(root), _modules(root)
    out = []
    for cyc in import_cycles(graph):
        at = [f"{files[a].relative_to(root).as_posix()}:{graph[a][b]}" for a, b in zip(cyc, cyc[1:] + cyc[:1])]
        out.append(f"{root.name}/{at[0]}: import cycle {' -> '.join(cyc + cyc[:1])} (imports at {', '.join(at)}); fix: move "
                   "what they share down into a module that imports none of them, or pass it in from the caller")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / TOP
    problems = check(root)
    for p in problems: print(p)
    print(f"layer check: {len(problems)} problem(s) in {root}" if problems else f"layer check: {root} is clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
