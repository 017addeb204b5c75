"""The package's import graph: no cycles (imports inside functions and ``importlib.import_module``
calls count), and the runtime imports nothing of the harness (``megatron_ft.testing``: the demo,
the chaos harness, simulation, fault injection). Read from the source, not by importing it."""
from __future__ import annotations

import ast
import os

from conftest import REPO

PKG = "megatron_ft"
HARNESS = f"{PKG}.testing"
ENTRY_POINTS = {f"{PKG}.cli"}  # the command line dispatches to the harness's commands (demo, chaos)


def package_modules(root: str = REPO) -> dict[str, str]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PKG)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def imports_of(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]

    def absolute(level: int, module: str | None) -> str:
        base = package
        for _ in range(level - 1):
            base = base.rsplit(".", 1)[0]
        return f"{base}.{module}" if module else base

    def owner(dotted: str) -> str | None:  # the module that defines ``dotted``
        while dotted not in modules:
            if "." not in dotted:
                return None
            dotted = dotted.rsplit(".", 1)[0]
        return dotted

    found: set[str] = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.level, node.module) if node.level else (node.module or "")
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            names = subs + ([base] if len(subs) < len(node.names) else [])  # names defined in base itself
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            names = [node.args[0].value]
        for n in names:
            if n.startswith(PKG) and (m := owner(n)) is not None and m != name:
                found.add(m)
    return found


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_checker_finds_a_cycle_through_a_function_level_import_and_importlib(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import importlib\nimportlib.import_module('megatron_ft.a')\n")
    (pkg / "c.py").write_text("from . import a\n")
    modules = package_modules(str(tmp_path))
    g = {n: imports_of(n, p, modules) for n, p in modules.items()}
    assert g[f"{PKG}.a"] == {f"{PKG}.sub.b"} and g[f"{PKG}.c"] == {f"{PKG}.a"}
    assert cycles(g) == [[f"{PKG}.a", f"{PKG}.sub.b"]]


def test_the_package_has_no_import_cycles():
    assert cycles(graph()) == []


def test_the_runtime_imports_nothing_from_the_harness():
    g = graph()
    offenders = {m: sorted(d for d in deps if d == HARNESS or d.startswith(HARNESS + "."))
                 for m, deps in g.items()
                 if not (m == HARNESS or m.startswith(HARNESS + ".")) and m not in ENTRY_POINTS}
    assert {m: d for m, d in offenders.items() if d} == {}
    assert any(d.startswith(HARNESS) for d in g[f"{PKG}.cli"])  # the checker sees the cli's imports
