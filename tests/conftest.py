"""Shared fixtures: a real snapshot agent process with its own run id, sockets and persist dir."""
import os
import uuid

import pytest
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.sim import AgentProc  # noqa: F401 (the tests' real agent process)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def job_config(tmp_path):
    """A single-node config isolated in tmp_path with a unique run id."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = ftconfig.replace(ftconfig.load(), run_id=run_id,
                           cluster={"nodes": 1, "ranks_per_node": 1}, parallel={"tensor": 1, "pipeline": 1},
                           persist={"dir": str(tmp_path / "persist"), "interval": 0})
    path = str(tmp_path / "job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    yield cfg, path
    for name in os.listdir(cfg.agent.shm_dir):
        if name.startswith(f"mft.{run_id}."):
            os.unlink(os.path.join(cfg.agent.shm_dir, name))


@pytest.fixture
def agent(job_config):
    cfg, path = job_config
    a = AgentProc(cfg, path).start()
    yield a
    a.kill()
