"""Shared fixtures: a real snapshot agent process with its own run id, sockets and persist dir."""
import os
import uuid

import pytest
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.testing.helpers import remove_run_segments
from megatron_ft.testing.sim import AgentProc  # noqa: F401 (the tests' real agent process)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def shm_cleanup():
    """``shm_cleanup(cfg)`` registers a job: after the test, whatever happened, every shared-memory
    segment of its run id is removed (the one place tests clean /dev/shm)."""
    runs = []
    yield lambda cfg: runs.append((cfg.agent.shm_dir, cfg.run_id))
    for shm_dir, run_id in runs:
        remove_run_segments(shm_dir, run_id)


@pytest.fixture
def job_config(tmp_path, shm_cleanup):
    """A single-node config isolated in tmp_path with a unique run id."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = ftconfig.replace(ftconfig.load(), run_id=run_id,
                           cluster={"nodes": 1, "ranks_per_node": 1}, parallel={"tensor": 1, "pipeline": 1},
                           persist={"dir": str(tmp_path / "persist"), "interval": 0})
    path = str(tmp_path / "job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    shm_cleanup(cfg)
    return cfg, path


@pytest.fixture
def agent(job_config):
    cfg, path = job_config
    a = AgentProc(cfg, path).start()
    yield a
    a.kill()
    a.forget_socket()


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory):
    """Where the demo runs of the whole session keep their reference runs (one per job shape, reused by
    every later run of that shape: ``megatron-ft demo --reference-dir``)."""
    return str(tmp_path_factory.mktemp("references"))


def run_demo(cmd: list, timeout: float = 1200) -> dict:
    """Run a ``megatron-ft demo`` command; return its JSON summary after asserting what every recovery
    test needs: bit-exact, the promised tier reached (bit-exact alone cannot tell a recovery from a
    fresh restart), exit status 0."""
    import json
    import subprocess

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"demo printed no summary (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    summary = json.loads(lines[-1])
    assert summary["bitwise_identical"], summary["problems"]
    assert summary["tier_ok"], (summary["recovered_from"], summary["promised_tier"])
    assert out.returncode == 0, out.stderr[-3000:]
    # the guard after a restore never refuses a good version (no false alarm): it rolls back only where a
    # version was made bad on purpose
    if not any(f"--kill-point={a}" in cmd for a in ("poison-after-commit", "scale-optimizer-after-commit",
                                                        "poison-expert-after-commit")):
        assert summary.get("rollbacks", 0) == 0, summary
    if summary.get("recovery_seconds") is not None:  # the breakdown accounts for the recovery, phase by phase
        phases = summary["recovery_breakdown"]
        assert phases and all(v is None or v >= -0.02 for v in phases.values()), phases
        assert round(sum(v for v in phases.values() if v is not None), 3) == summary["recovery_seconds"], phases
        assert summary["cold_start_seconds"] is None or summary["cold_start_seconds"] > 0
    return summary
