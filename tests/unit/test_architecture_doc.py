"""docs/architecture.md stays true: every package and module it names exists, and every package
of megatron_ft is named in it."""
from __future__ import annotations

import os
import re

from conftest import REPO

DOC = os.path.join(REPO, "docs", "architecture.md")
NAMED = re.compile(r"megatron_ft/[\w/]*(?:\.py|\.c|/)")


def named_paths(text: str) -> set[str]:
    return set(NAMED.findall(text))


def packages(root: str = REPO) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "megatron_ft")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            out.add(os.path.relpath(dirpath, root) + "/")
    return out


def test_the_checker_sees_paths_and_packages():
    text = "see `megatron_ft/agent/server.py` and `megatron_ft/capture/` but not megatron_ft.agent"
    assert named_paths(text) == {"megatron_ft/agent/server.py", "megatron_ft/capture/"}
    assert "megatron_ft/" in packages() and "megatron_ft/agent/" in packages()


def test_every_named_package_and_module_exists():
    missing = sorted(p for p in named_paths(open(DOC).read()) if not os.path.exists(os.path.join(REPO, p)))
    assert missing == []


def test_every_package_is_named():
    named = named_paths(open(DOC).read())
    assert sorted(packages() - named - {"megatron_ft/"}) == []
