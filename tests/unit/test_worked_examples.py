"""Every worked example in the package's docstrings runs and holds.

The modules are found by reading the source: any file under megatron_ft/ with a ``>>>`` line is
one, so a module that gains an example is tested without being listed here. One test per module,
so a failure names it; each must run at least one example (a ``>>>`` that doctest cannot see, in a
comment or a nested function, fails too) and none may fail."""
from __future__ import annotations

import doctest
import importlib
import io
import os

import pytest

from conftest import REPO

PKG = "megatron_ft"
#: import names of the optional extras (pyproject.toml): a module that needs one absent here is skipped
OPTIONAL = {"megatron", "deepspeed", "etcd3gw", "matplotlib", "xxhash", "pyeclib"}


def modules_with_examples(root: str = REPO) -> list[str]:
    """Dotted names of the package's modules whose source has a ``>>>`` line, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PKG)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            with open(path, encoding="utf-8") as src:
                if not any(line.lstrip().startswith(">>>") for line in src):
                    continue
            name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            out.append(name.removesuffix(".__init__"))
    return sorted(out)


MODULES = modules_with_examples()


def test_the_modules_with_examples_are_found():
    assert MODULES, f"no module under {PKG}/ has a >>> example"
    assert {"megatron_ft.redundancy.gemini", "megatron_ft.capture.layout", "megatron_ft.transport.messages",
            "megatron_ft.policy.survival"} <= set(MODULES), MODULES


@pytest.mark.parametrize("name", MODULES)
def test_worked_examples(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} imports the optional package {e.name}, which is not installed")
        raise
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    runner = doctest.DocTestRunner(verbose=False)
    report = io.StringIO()
    for test in tests:
        runner.run(test, out=report.write)
    assert runner.tries > 0, f"{name} has a >>> line but doctest found no example to run in it"
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} examples failed:\n{report.getvalue()}"
