"""docs/architecture.md stays true: every package and module it names exists, every package of
megatron_ft is named in it, and so is every module.

A module, for this check, is every ``.py`` file and every C source (``.c``) under ``megatron_ft/``
except ``__init__.py``: a package's ``__init__.py`` is stood for by the package's own row of the
map. ``__main__.py`` files count (they are programs: ``python -m megatron_ft.agent``), and so does
every module of a nested package (``megatron_ft/redundancy/codecs/``). ``__pycache__`` is skipped."""
from __future__ import annotations

import os
import re

from conftest import REPO

DOC = os.path.join(REPO, "docs", "architecture.md")
NAMED = re.compile(r"megatron_ft/[\w/]*(?:\.py|\.c|/)")
MODULE_SUFFIXES = (".py", ".c")
NOT_LISTED = {"__init__.py"}  # stood for by its package's row


def named_paths(text: str) -> set[str]:
    return set(NAMED.findall(text))


def _walk(root: str):
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "megatron_ft")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        yield dirpath, filenames


def packages(root: str = REPO) -> set[str]:
    out = set()
    for dirpath, filenames in _walk(root):
        if "__init__.py" in filenames:
            out.add(os.path.relpath(dirpath, root) + "/")
    return out


def modules(root: str = REPO) -> set[str]:
    """Every module the map must name (see the rule above), as ``megatron_ft/...`` paths."""
    out = set()
    for dirpath, filenames in _walk(root):
        for f in filenames:
            if f.endswith(MODULE_SUFFIXES) and f not in NOT_LISTED:
                out.add(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return out


def unnamed_modules(text: str, root: str = REPO) -> list[str]:
    return sorted(modules(root) - named_paths(text))


def test_the_checker_sees_paths_and_packages():
    text = "see `megatron_ft/agent/server.py` and `megatron_ft/capture/` but not megatron_ft.agent"
    assert named_paths(text) == {"megatron_ft/agent/server.py", "megatron_ft/capture/"}
    assert "megatron_ft/" in packages() and "megatron_ft/agent/" in packages()


def test_the_checker_sees_modules(tmp_path):
    pkg = tmp_path / "megatron_ft" / "sub"
    (pkg / "__pycache__").mkdir(parents=True)
    for name in ("__init__.py", "__main__.py", "a.py", "k.c", "notes.txt"):
        (pkg / name).write_text("")
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_text("")
    (tmp_path / "megatron_ft" / "__init__.py").write_text("")
    assert modules(str(tmp_path)) == {"megatron_ft/sub/__main__.py", "megatron_ft/sub/a.py", "megatron_ft/sub/k.c"}
    text = "`megatron_ft/sub/` (`megatron_ft/sub/a.py`, `megatron_ft/sub/__main__.py`)"
    assert unnamed_modules(text, str(tmp_path)) == ["megatron_ft/sub/k.c"]
    # the real map, less one of its entries, fails
    doc = open(DOC).read()
    assert "megatron_ft/policy/wasted.py" in doc
    assert "megatron_ft/policy/wasted.py" in unnamed_modules(doc.replace("megatron_ft/policy/wasted.py", ""))


def test_every_named_package_and_module_exists():
    missing = sorted(p for p in named_paths(open(DOC).read()) if not os.path.exists(os.path.join(REPO, p)))
    assert missing == []


def test_every_package_is_named():
    named = named_paths(open(DOC).read())
    assert sorted(packages() - named - {"megatron_ft/"}) == []


def test_every_module_is_named():
    """Each module under megatron_ft/ (not __init__.py) appears in the package map or the top-level
    list of docs/architecture.md: a new module is added there with what it computes."""
    assert unnamed_modules(open(DOC).read()) == []
