"""Shared fixtures: a real snapshot agent process with its own run id, sockets and persist dir."""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.protocol import AgentClient, socket_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class AgentProc:
    """A real agent subprocess (python -m megatron_ft.agent) for one simulated node."""

    def __init__(self, cfg: ftconfig.FTConfig, cfg_path: str, node: int = 0):
        self.cfg, self.cfg_path, self.node = cfg, cfg_path, node
        self.sock = socket_path(cfg.agent.socket_dir, cfg.run_id, node)
        self.proc = None
        self.log_path = cfg_path + f".agent{node}.log"

    def start(self) -> "AgentProc":
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_ft.agent", "--config", self.cfg_path,
                                      "--node", str(self.node)], stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while not os.path.exists(self.sock):
            assert self.proc.poll() is None, open(self.log_path).read()
            if time.time() > deadline:  # a wait limit, not a performance check
                pytest.fail(f"agent did not open its socket:\n{open(self.log_path).read()}")
            time.sleep(0.02)
        return self

    def client(self, rank: int = 0) -> AgentClient:
        c = AgentClient(self.sock)
        c.connect({"rank": rank, "local_rank": rank, "pid": os.getpid(), "run_id": self.cfg.run_id})
        return c

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def log(self) -> str:
        return open(self.log_path).read()


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
