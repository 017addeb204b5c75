"""The Megatron-LM patch series (patches/megatron-lm/<release>, one per supported release) against real
upstream trees of each release.

A tree is the project's shared archive of that release extracted once per module (for the newest
release ``MEGATRON_LM_DIR``, an unpatched work tree, when set; see
``megatron_ft.testing.megatron_lm.source``). The tests copy it, so the source is never modified.
"""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from megatron_ft.testing import megatron_lm


@pytest.fixture(scope="module", params=megatron_lm.TAGS)
def release(request):
    return request.param


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, release):
    """An unpatched upstream tree of ``release`` (the directory itself, or the archive extracted)."""
    src = megatron_lm.source(release)
    if not src:
        pytest.skip(f"no upstream Megatron-LM {release}: provide ../shared/upstream/megatron-lm-{release}.tar.gz")
    if os.path.isdir(src):
        return src
    dst = tmp_path_factory.mktemp("upstream")
    megatron_lm.extract_archive(src, str(dst))
    return str(dst / "Megatron-LM")


def series(release):
    d = os.path.join(REPO, "patches", "megatron-lm", release)
    return [os.path.join(d, ln.strip()) for ln in open(os.path.join(d, "series")) if ln.strip() and not ln.startswith("#")]


def test_every_patch_applies_with_git_apply_check(pristine, release):
    for p in series(release):  # the patches touch different places: each applies to the pristine tree
        out = subprocess.run(["git", "apply", "--check", p], cwd=pristine, capture_output=True, text=True)
        assert out.returncode == 0, f"{p}: {out.stderr}"


@pytest.fixture
def patched(tmp_path, pristine, release):
    dst = tmp_path / "mlm"
    shutil.copytree(os.path.join(pristine, "megatron"), dst / "megatron")
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_megatron_patches.sh"), str(dst)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"megatron-ft patch series {release} applied" in out.stdout, out.stdout  # the release's own series
    return dst


def test_patched_parser_lists_the_flags_and_selects_in_memory(patched, tmp_path, release):
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
        # the parser's own flags (core_v0.19.0's --help itself fails on an unescaped '%' in one of its helps)
        "print('FLAGS', ' '.join(sorted(p._option_string_actions)))\n"
        "print('CHOICES', p._option_string_actions['--non-persistent-ckpt-type'].choices)\n"
        "a = p.parse_args(['--inmem-ckpt', '--inmem-ckpt-interval', '3', '--save', 'x', '--load', 'x'])\n"
        "validate_args(a)\n"
        "print('SELECTED', a.non_persistent_ckpt_type, a.non_persistent_save_interval)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(patched), REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: ln for ln in out.stdout.splitlines()}
    flags = lines["FLAGS"].split()
    for flag in ("--inmem-ckpt", "--inmem-ckpt-config", "--inmem-ckpt-interval", "--inmem-ckpt-persist-interval",
                 "--inmem-ckpt-persist-dir"):
        assert flag in flags, flag
    assert "'in_memory'" in lines["CHOICES"], lines["CHOICES"]
    assert "SELECTED in_memory 3" in out.stdout


def test_a_tree_that_differs_is_refused_naming_the_patch(tmp_path, pristine, release):
    dst = tmp_path / "mlm"
    shutil.copytree(os.path.join(pristine, "megatron"), dst / "megatron")
    path = dst / "megatron" / "training" / "training.py"
    path.write_text(path.read_text().replace("        checkpointing_context = {}\n", "        checkpointing_context = dict()\n", 1))
    before = (dst / "megatron" / "training" / "arguments.py").read_text()
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_megatron_patches.sh"), str(dst)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    # no series applies: each supported release named, with its first patch that does not and git's report
    assert "none of the Megatron-LM releases megatron-ft supports" in out.stderr, out.stderr
    assert all(f"  {t}: patch " in out.stderr for t in megatron_lm.TAGS), out.stderr
    assert f"{release}: patch 0002-training" in out.stderr and "megatron/training/training.py" in out.stderr, out.stderr
    assert (dst / "megatron" / "training" / "arguments.py").read_text() == before  # nothing changed
