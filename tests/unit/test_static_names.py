"""Every name the package uses is defined where it is used, checked without running it (pyflakes).

Code that only runs on some machines - the GPU path, the etcd store, Slurm and Kubernetes helpers - is
not reached by the CPU suite, so a name it uses but never imports (an import lost in an edit) would
surface as a ``NameError`` only there. pyflakes' undefined-name checks find those statically."""
import ast
import pathlib

import pytest

checker = pytest.importorskip("pyflakes.checker")
messages = pytest.importorskip("pyflakes.messages")

ROOT = pathlib.Path(__file__).resolve().parents[2]
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


def test_no_name_is_used_that_is_not_defined():
    files = sorted((ROOT / "megatron_ft").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    assert len(files) > 50
    found = []
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        found += [str(m) for m in checker.Checker(tree, filename=str(f.relative_to(ROOT))).messages
                  if isinstance(m, UNDEFINED)]
    assert not found, "\n".join(found)
