"""The package's import graph: no cycles (imports inside functions and ``importlib.import_module``
calls count), the runtime imports nothing of the harness (``megatron_ft.testing``: the demo,
the chaos harness, simulation, fault injection), and no module imports from a layer above its own
(:data:`LAYERS`). Read from the source, not by importing it."""
from __future__ import annotations

import ast
import os

from conftest import REPO

PKG = "megatron_ft"
HARNESS = f"{PKG}.testing"
ENTRY_POINTS = {f"{PKG}.cli"}  # the command line dispatches to the harness's commands (demo, chaos)

#: The package's layers, lowest first. A module may import from its own layer and from the layers
#: below it, never from one above (imports inside functions and relative imports included). An
#: entry names a subpackage or a module relative to the package (``""``: the package's own
#: ``__init__``); a module is in the layer of the longest entry that names it or a package above it,
#: so ``transport.scheduled`` sits above the rest of ``transport``. Every module must be in one.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"", "clock", "config", "fatal", "faultpoints", "tiers", "network", "scheduler", "_native",
                    "rank_files"}),
    ("bytes, the wire, health", {"capture", "transport", "health"}),  # transport: wire, messages, p2p order
    ("pure models", {"policy"}),
    ("pure plans", {"redundancy", "schedule"}),
    ("the scheduled transport", {"transport.scheduled"}),  # runs a schedule of a redundancy plan
    ("the node's agent", {"agent"}),
    ("warm spares", {"spares"}),
    ("the trainer", {"trainer"}),
    ("integrations and the launcher", {"megatron", "deepspeed", "launch", "rendezvous", "deploy", "torchrun"}),
    ("the harness", {"testing"}),  # never imported by the runtime (test_the_runtime_imports_nothing_...)
    ("the command line", {"cli"}),  # the one entry point that dispatches to the harness (ENTRY_POINTS)
]


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


def _full(entry: str) -> str:
    return f"{PKG}.{entry}" if entry else PKG


def layer_of(module: str, layers: list[tuple[str, set[str]]] = LAYERS) -> int | None:
    """Index in ``layers`` of ``module`` (the longest entry naming it or a package above it; the
    entry ``""`` names the package's ``__init__`` only); None when no entry does."""
    best: tuple[int, int] | None = None  # (entry length, layer)
    for i, (_, entries) in enumerate(layers):
        for e in entries:
            full = _full(e)
            if module == full or (e and module.startswith(full + ".")):
                if best is None or len(full) > best[0]:
                    best = (len(full), i)
    return None if best is None else best[1]


def upward_imports(g: dict[str, set[str]], layers: list[tuple[str, set[str]]] = LAYERS) -> list[str]:
    """Every import in ``g`` from a module into a layer above its own, as
    ``importer (its layer) imports imported (its layer)``, sorted."""
    out = []
    for importer, deps in g.items():
        i = layer_of(importer, layers)
        for imported in deps:
            j = layer_of(imported, layers)
            if i is not None and j is not None and j > i:
                out.append(f"{importer} (layer {i}: {layers[i][0]}) imports {imported} "
                           f"(layer {j}: {layers[j][0]})")
    return sorted(out)


def test_the_layer_checker_finds_upward_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    for f in ("__init__.py", "low/__init__.py", "high/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high import b\n")  # upward, inside a function
    (pkg / "low" / "c.py").write_text("from ..high.b import g\n")  # upward, relative, a name of a module
    (pkg / "low" / "d.py").write_text("from . import a\n")  # its own layer
    (pkg / "high" / "b.py").write_text("from megatron_ft.low import a\ndef g():\n    pass\n")  # downward
    layers = [("low", {"", "low"}), ("high", {"high"})]
    modules = package_modules(str(tmp_path))
    g = {n: imports_of(n, p, modules) for n, p in modules.items()}
    assert upward_imports(g, layers) == [
        f"{PKG}.low.a (layer 0: low) imports {PKG}.high.b (layer 1: high)",
        f"{PKG}.low.c (layer 0: low) imports {PKG}.high.b (layer 1: high)"]


def test_every_module_is_in_one_layer():
    entries = [e for _, es in LAYERS for e in es]
    assert len(entries) == len(set(entries)), "an entry is named in two layers"
    assert [m for m in sorted(graph()) if layer_of(m) is None] == []


def test_no_module_imports_from_a_layer_above_its_own():
    found = upward_imports(graph())
    assert not found, "imports from a layer above the importer's own:\n" + "\n".join(found)


def test_the_layers_forbid_the_scheduled_transport_the_agent_and_the_policy_the_planner():
    # the two imports the rule was written against: the scheduled transport takes the agent's
    # connection and segment mapping from its caller, and GEMINI's Algorithm 1 lives in the policy
    assert layer_of(f"{PKG}.agent.shm") > layer_of(f"{PKG}.transport.scheduled")
    assert layer_of(f"{PKG}.agent.protocol") > layer_of(f"{PKG}.transport.scheduled")
    assert layer_of(f"{PKG}.redundancy.gemini") > layer_of(f"{PKG}.policy.recoverability")
    assert layer_of(f"{PKG}.transport.wire") < layer_of(f"{PKG}.agent.server")  # the rest of transport stays low
