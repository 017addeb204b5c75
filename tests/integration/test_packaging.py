"""What each kind of user installs: megatron-core only with the megatron extra (a DeepSpeed user's
install line and import path never touch it), torch not pinned to one build by the package."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

from conftest import REPO


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_megatron_core_comes_only_with_the_megatron_extra():
    p = project()
    assert "megatron-core" not in names(p["dependencies"])
    extras = p["optional-dependencies"]
    assert "megatron-core" in names(extras["megatron"])
    assert "megatron-core" not in names(extras["deepspeed"])
    assert not any(r.replace(" ", "").startswith("torch==") for r in p["dependencies"])


def test_the_readme_deepspeed_line_installs_no_megatron_core():
    readme = open(os.path.join(REPO, "README.md")).read()
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("| DeepSpeed |")]
    extras = re.findall(r"\.\[([\w,]+)\]", line)
    assert extras == ["deepspeed"], line
    wanted = set()
    for extra in extras[0].split(","):
        wanted |= names(project()["optional-dependencies"][extra])
    assert "megatron-core" not in wanted | names(project()["dependencies"])


def test_the_deepspeed_and_launch_paths_import_no_megatron():
    code = ("import sys, megatron_ft.deepspeed.engine, megatron_ft.trainer.checkpointer, megatron_ft.launch, "
            "megatron_ft.cli, megatron_ft.agent.server, megatron_ft.agent.redundancy\n"
            "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))\n"
            "assert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_set_up_installs_only_into_a_virtual_environment_blind_to_the_systems_packages(tmp_path):
    """scripts/check_venv.sh (run by setup.sh and .ci/run) refuses the machine's own Python and a virtual
    environment made with --system-site-packages: packages the machine carries would hide a missing
    install step (upstream's six and regex did)."""
    check = os.path.join(REPO, "scripts", "check_venv.sh")
    base = getattr(sys, "_base_executable", None) or sys.executable
    for flags, ok in (([], True), (["--system-site-packages"], False)):
        env_dir = tmp_path / ("blind" if ok else "sees-system")
        subprocess.run([base, "-m", "venv", "--without-pip", *flags, str(env_dir)], check=True, timeout=120)
        out = subprocess.run(["bash", check, str(env_dir / "bin" / "python")], capture_output=True, text=True,
                             timeout=60)
        assert (out.returncode == 0) == ok, out.stderr
        if not ok:
            assert "include-system-site-packages = true" in out.stderr
    out = subprocess.run(["bash", check, base], capture_output=True, text=True, timeout=60)
    if sys.prefix != sys.base_prefix:  # the base interpreter of the environment the tests run in
        assert out.returncode != 0 and "is not in a virtual environment" in out.stderr, out.stderr
