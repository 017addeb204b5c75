"""Simulated nodes on one machine, for tests and benchmarks: one real agent process per node (its
own shared memory, the peer transport, the embedded store), and one trainer per node driven from
the calling process (a plain torch model + optimizer through the real SnapshotEngine and Restorer).

Losing a node = SIGKILL of its agent and removal of its shared memory; a fresh agent takes its
place with empty memory (``replace_node``), as a replacement machine would.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Callable, Optional

import torch
import yaml

from . import faults
from .. import config as ftconfig
from ..agent.protocol import AgentClient, socket_path
from ..capture.state import TorchStateAdapter
from ..trainer.recovery import Restorer, RestoreResult
from ..trainer.snapshot import SnapshotEngine
from .helpers import WaitTimeout, with_free_ports





class AgentProc:
    """A real agent subprocess (``python -m megatron_ft.agent``, or ``module``) for one simulated node."""

    def __init__(self, cfg: ftconfig.FTConfig, cfg_path: str, node: int = 0, module: str = "megatron_ft.agent"):
        self.cfg, self.cfg_path, self.node, self.module = cfg, cfg_path, node, module
        self.sock = socket_path(cfg.agent.socket_dir, cfg.run_id, node)
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = cfg_path + f".agent{node}.log"

    def start(self, timeout: float = 60.0, fault: Optional[str] = None) -> "AgentProc":
        return self.launch(fault).wait_ready(timeout)

    def launch(self, fault: Optional[str] = None) -> "AgentProc":
        """Start the agent process without waiting (several agents start faster side by side);
        ``fault``: a :mod:`megatron_ft.testing.faults` fault the agent fires (e.g. ``mid-exchange:3``)."""
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass
        cmd = ["-m", self.module, "--config", self.cfg_path, "--node", str(self.node)]
        if fault:
            cmd = faults.wrap(cmd, fault)
        self.proc = subprocess.Popen([sys.executable, *cmd], stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 60.0) -> "AgentProc":
        deadline = time.time() + timeout
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited at start-up:\n{self.log()}")
            if time.time() > deadline:
                raise WaitTimeout(f"agent did not open its socket:\n{self.log()}")
            time.sleep(0.02)
        return self

    def client(self, rank: int = 0) -> AgentClient:
        """A client of this agent; a connection refused a moment after its socket file appeared (bound,
        not yet listening) is tried again, as a trainer's is (``agent.connect_timeout_s``)."""
        c = AgentClient(self.sock, self.cfg.agent.request_timeout_s)
        c.connect({"rank": rank, "local_rank": rank, "pid": os.getpid(), "run_id": self.cfg.run_id},
                  self.cfg.agent.connect_timeout_s)
        return c

    def kill(self) -> None:
        """SIGKILL the agent and wait for it; its socket file (which it cannot unlink) is removed."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.forget_socket()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def forget_socket(self) -> None:
        """Remove the socket file a killed agent left (it cannot unlink it); once the agent is gone."""
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass

    def dump_threads(self) -> None:
        """A live agent writes every thread's stack into its log (SIGUSR1, faulthandler)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


def remove_run_segments(shm_dir: str, run_id: str, node: Optional[int] = None) -> None:
    prefix = f"mft.{run_id}." + (f"n{node}." if node is not None else "")
    for name in os.listdir(shm_dir):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(shm_dir, name))
            except FileNotFoundError:
                pass


ModelFactory = Callable[[int, int], tuple]  # (rank, seed) -> (model, optimizer or None)


class LocalCluster:
    """``nodes`` agents with one trainer each; ``redundancy`` is the config section; ``config``:
    more config sections (e.g. ``{"health": {"store": "etcd://127.0.0.1:2379"}}``). The agents prove
    the job's secret, made here as a launcher of one machine makes it; ``authenticate=False`` runs them
    without one (:mod:`megatron_ft.testing.unauthenticated_agent`: a benchmark's baseline only)."""

    def __init__(self, workdir: str, nodes: int, make_model: ModelFactory, chunk_bytes: int = 1 << 20,
                 persist_interval: int = 0, config: Optional[dict] = None, authenticate: bool = True,
                 **redundancy):
        self.run_id = f"t{uuid.uuid4().hex[:10]}"
        extra = dict(config or {})
        self.cfg = with_free_ports(
            ftconfig.load(), run_id=self.run_id, cluster={"nodes": nodes, "ranks_per_node": 1},
            parallel={"tensor": 1, "pipeline": 1}, redundancy=redundancy,
            persist={"dir": os.path.join(workdir, "persist"), "interval": persist_interval, "on_failure": False},
            **extra)
        os.makedirs(workdir, exist_ok=True)
        if authenticate and not self.cfg.security.secret_file:  # the job's secret, as a launcher of one machine makes it
            from ..transport.credential import job_secret_file

            self.cfg = ftconfig.replace(self.cfg, security={"secret_file": job_secret_file("", {}, workdir, False)})
        self.path = os.path.join(workdir, f"{self.run_id}.yaml")
        with open(self.path, "w") as f:
            yaml.safe_dump(self.cfg.to_dict(), f)
        self.nodes = nodes
        self.make_model = make_model
        module = "megatron_ft.agent" if authenticate else "megatron_ft.testing.unauthenticated_agent"
        self.agents = [AgentProc(self.cfg, self.path, n, module) for n in range(nodes)]
        for a in self.agents:
            a.launch()
        for a in self.agents:
            a.wait_ready()
        self.models = [make_model(r, 0) for r in range(nodes)]
        self.clients = [a.client(r) for r, a in enumerate(self.agents)]
        self.engines = [SnapshotEngine(c, r, self.identity(r), chunk_bytes) for r, c in enumerate(self.clients)]

    def identity(self, rank: int) -> dict:
        return {"run_id": self.cfg.run_id, "rank": rank, "world_size": self.nodes}

    def status(self, n: int) -> dict:
        return self.clients[n].request("status")["status"]

    def train(self, steps: int, start: int = 1, wait_complete: bool = True) -> None:
        """``steps`` iterations: every trainer computes its step, then all snapshot at once (as the
        ranks of a job do, so the agents' exchanges start together)."""
        for step in range(start, start + steps):
            captures = []
            for r, (m, opt) in enumerate(self.models):
                self.engines[r].wait()
                torch.manual_seed(step * 1000 + r)
                x = torch.randn(8, next(m.parameters()).shape[-1])
                loss = m(x).pow(2).mean()
                if opt is not None:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                ad = TorchStateAdapter(m, opt)
                ad.extra = {"iteration": step}
                captures.append(ad.capture())
            for r, cap in enumerate(captures):
                self.engines[r].snapshot(step, *cap)
            for e in self.engines:
                e.wait()
            if wait_complete and self.cfg.redundancy.scheme != "none":
                self.wait_complete(step)

    def wait_complete(self, step: int, nodes=None, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        nodes = range(self.nodes) if nodes is None else nodes
        while True:
            got = [self.status(n)["redundancy"]["complete_step"] for n in nodes]
            if all(g >= step for g in got):
                return
            if time.time() > deadline:
                raise WaitTimeout(f"step {step} not complete on every node: {got}; " + self.logs(nodes))
            time.sleep(0.02)

    def logs(self, nodes=None, tail: int = 3000) -> str:
        """For a failed wait: the live agents dump their threads' stacks, then each log's tail."""
        nodes = range(self.nodes) if nodes is None else nodes
        for n in nodes:
            self.agents[n].dump_threads()
        time.sleep(0.5)
        return "\n".join(self.agents[n].log()[-tail:] for n in nodes)

    def lose_node(self, n: int) -> None:
        """The node's memory goes with it: kill its agent, drop its shared memory."""
        self.agents[n].kill()
        remove_run_segments(self.cfg.agent.shm_dir, self.run_id, n)

    def replace_node(self, n: int) -> None:
        """A new machine in the lost node's place: a fresh agent and a fresh trainer process
        (client and snapshot engine; the model object stands for the state it will restore)."""
        self.agents[n].start()
        self.clients[n] = self.agents[n].client(n)
        self.engines[n] = SnapshotEngine(self.clients[n], n, self.identity(n), self.engines[n].chunk_size)

    def restore(self, rank: int, seed: int = 7, group_wait_s: Optional[float] = None) -> tuple[RestoreResult, tuple]:
        """Rank ``rank``'s restore into a fresh model (``group_wait_s``: how long its agent waits for
        the group's members to answer; default ``health.group_answer_s``)."""
        model = self.make_model(rank, seed)
        wait = self.cfg.health.group_answer_s if group_wait_s is None else group_wait_s
        res = Restorer(rank, self.nodes, self.identity(rank), self.run_id, self.cfg.persist.dir,
                       self.clients[rank], group_wait_s=wait).restore(TorchStateAdapter(*model))
        return res, model

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close(orderly=True)
            except Exception:
                pass
        for a in self.agents:
            a.stop()
            a.forget_socket()  # a node lost and not replaced left it
        remove_run_segments(self.cfg.agent.shm_dir, self.run_id)
