"""The node's agent as a process its launcher owns or adopted: what is checked before it starts
(:func:`preflight`: the socket and shared-memory directories; :func:`wait_ports_free`: the previous
generation's agent gone from its ports), the error when it cannot start (:class:`AgentStartError`), and the
``Popen`` verbs for an agent the launcher adopted rather than started (:class:`AdoptedProcess`). Each call is
the launcher's thread's; every wait is bounded by the deadline it is given.
"""
from __future__ import annotations

import os
import subprocess
from typing import Optional

import psutil

from .. import config as ftconfig
from .. import network
from ..agent import shm
from ..clock import Deadline


class AdoptedProcess:
    """The Popen verbs the launcher uses, for an agent it adopted (not its child)."""

    def __init__(self, proc: "psutil.Process"):
        self.proc, self.pid, self.returncode = proc, proc.pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None and not self.proc.is_running():
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        try:
            self.proc.wait(timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"agent pid {self.pid}", timeout or 0) from None
        except psutil.NoSuchProcess:
            pass
        self.returncode = -1 if self.returncode is None else self.returncode
        return self.returncode

    def terminate(self) -> None:
        try:
            self.proc.terminate()
        except psutil.NoSuchProcess:
            pass

    def kill(self) -> None:
        try:
            self.proc.kill()
        except psutil.NoSuchProcess:
            pass


class AgentStartError(RuntimeError):
    """A node's agent could not start."""


def preflight(cfg: ftconfig.FTConfig) -> Optional[str]:
    """What keeps this node from protecting its trainers, checked before anything starts (None: fine)."""
    from ..transport.wire import private_directory

    try:  # the agent's and the spare pool's sockets: private to the job's user
        private_directory(cfg.agent.socket_dir)
    except OSError as e:
        return f"agent.socket_dir={cfg.agent.socket_dir!r} cannot hold the job's sockets: {e}"
    if not cfg.agent.required:
        return None
    d = cfg.agent.shm_dir
    if not os.path.isdir(d):
        return (f"agent.shm_dir={d!r} does not exist (or is not a directory): create it or point agent.shm_dir at a "
                f"tmpfs; agent.required: false trains unprotected")
    if not os.access(d, os.W_OK | os.X_OK):
        return f"agent.shm_dir={d!r} is not writable by this user"
    need = cfg.agent.shm_limit_mib << 20
    free = shm.shm_free_bytes(d)
    if need and free < need:
        return (f"agent.shm_dir={d!r} has {free / 2**20:.0f} MiB free but agent.shm_limit_mib="
                f"{cfg.agent.shm_limit_mib}; enlarge it or lower the limit")
    return None


def wait_ports_free(cfg: ftconfig.FTConfig, node: int, deadline: Deadline) -> None:
    """Until node ``node``'s store and peer ports are free here (the previous generation's agent that held
    them - on one machine another node's - has stopped); bounded by ``deadline``."""
    addr = network.listen_address(cfg, node) if not cfg.health.one_machine else "127.0.0.1"
    ports = [network.peer_port(cfg, node), cfg.health.store_port + (node if cfg.health.one_machine else 0)]
    for port in ports:
        while not network.port_free(addr, port):
            if deadline.expired():
                raise AgentStartError(f"node {node}: port {port} is still in use on {addr} after "
                                      f"launch.start_timeout_s={cfg.launch.start_timeout_s:g} s")
            deadline.pause(0.1)
