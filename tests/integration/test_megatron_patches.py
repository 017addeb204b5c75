"""The Megatron-LM patch series (patches/megatron-lm/core_v0.16.1) against a real upstream tree.

The tree is ``MEGATRON_LM_DIR`` (a Megatron-LM work tree at tag ``core_v0.16.1``, unpatched) or, when
that is not set, the project's shared archive extracted once per session (see
``megatron_ft.testing.megatron_lm.source``). The tests copy it, so the source is never modified.
"""
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO
from megatron_ft.testing import megatron_lm

SERIES = os.path.join(REPO, "patches", "megatron-lm", "core_v0.16.1")
SOURCE = megatron_lm.source()
pytestmark = pytest.mark.skipif(not SOURCE, reason="no upstream Megatron-LM: set MEGATRON_LM_DIR (a checkout at "
                                                   "core_v0.16.1) or provide ../shared/upstream/megatron-lm-core_v0.16.1.tar.gz")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """An unpatched upstream tree (the directory itself, or the archive extracted)."""
    if os.path.isdir(SOURCE):
        return SOURCE
    dst = tmp_path_factory.mktemp("upstream")
    with tarfile.open(SOURCE) as tf:
        tf.extractall(dst, filter="data")
    return str(dst / "Megatron-LM")


def series():
    return [ln.strip() for ln in open(os.path.join(SERIES, "series")) if ln.strip() and not ln.startswith("#")]


def test_every_patch_applies_with_git_apply_check(pristine):
    for p in series():  # the patches touch different files: each applies to the pristine tree
        out = subprocess.run(["git", "apply", "--check", os.path.join(SERIES, p)], cwd=pristine,
                             capture_output=True, text=True)
        assert out.returncode == 0, f"{p}: {out.stderr}"


@pytest.fixture
def patched(tmp_path, pristine):
    dst = tmp_path / "mlm"
    shutil.copytree(os.path.join(pristine, "megatron"), dst / "megatron")
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_megatron_patches.sh"), str(dst)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return dst


def test_patched_parser_lists_the_flags_and_selects_in_memory(patched, tmp_path):
    code = (
        "import sys, types\n"
        # CPU only: megatron.training imports a Triton kernel module at import time (no Triton here)
        "stub = types.ModuleType('megatron.core.transformer.custom_layers.batch_invariant_kernels')\n"
        "stub.enable_batch_invariant_mode = None\n"
        "sys.modules[stub.__name__] = stub\n"
        "from megatron.training.arguments import add_megatron_arguments\n"
        "from megatron_ft.megatron.local_manager import validate_args\n"
        "import argparse\n"
        "p = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))\n"
        "print(p.format_help())\n"
        "a = p.parse_args(['--inmem-ckpt', '--inmem-ckpt-interval', '3', '--save', 'x', '--load', 'x'])\n"
        "validate_args(a)\n"
        "print('SELECTED', a.non_persistent_ckpt_type, a.non_persistent_save_interval)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(patched), REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for flag in ("--inmem-ckpt ", "--inmem-ckpt-config", "--inmem-ckpt-interval", "--inmem-ckpt-persist-interval",
                 "--inmem-ckpt-persist-dir"):
        assert flag in out.stdout, flag
    assert "{global,local,in_memory}" in out.stdout
    assert "SELECTED in_memory 3" in out.stdout


def test_a_tree_that_differs_is_refused_naming_the_patch(tmp_path, pristine):
    dst = tmp_path / "mlm"
    shutil.copytree(os.path.join(pristine, "megatron"), dst / "megatron")
    path = dst / "megatron" / "training" / "training.py"
    path.write_text(path.read_text().replace("        checkpointing_context = {}\n", "        checkpointing_context = dict()\n", 1))
    before = (dst / "megatron" / "training" / "arguments.py").read_text()
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_megatron_patches.sh"), str(dst)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "0002-training" in out.stderr and "megatron/training/training.py" in out.stderr, out.stderr
    assert (dst / "megatron" / "training" / "arguments.py").read_text() == before  # nothing changed
