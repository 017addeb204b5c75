"""Small helpers of the harness, in one place: free ports, bounded polling, event files, removing a
run's shared-memory segments, killing processes, a store server keeping the job record, and the
trainer's ``--inmem-ckpt`` flags over a job file. Imported by the demo, the chaos harness, the simulation,
tests and benchmarks; never by the runtime."""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import time
from typing import Any, Callable

from .. import config as ftconfig
from ..agent import shm
from ..config import port_plan
from ..health.job_record import RecordKeeper
from ..health.wire_store import KVServer, WireKV


class WaitTimeout(RuntimeError):
    pass


#: ports are drawn from here up to the kernel's ephemeral range
PORTS_FROM = 10000
_random = random.SystemRandom()  # not the global generator a test or trainer may have seeded


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral range starts (outgoing connections take their ports from it)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the ephemeral range, so no outgoing connection takes
    it before whoever it is for binds it."""
    return free_port_range(1)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_range(n: int) -> int:
    """A base port with ``n`` free ports from it (the agents' stores on one machine), below the
    ephemeral range (or, where that range leaves no room, any the kernel offers)."""
    hi = _ephemeral_low() - n
    for _ in range(200):
        if hi > PORTS_FROM:
            base = _random.randrange(PORTS_FROM, hi)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
        if base + n < 65535 and all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def with_free_ports(cfg: ftconfig.FTConfig, **sections: Any) -> ftconfig.FTConfig:
    """``cfg`` with ``sections`` replaced and every port of its plan (:func:`megatron_ft.config.port_plan`:
    rendezvous, agents' stores and peer transports, trainers' stores) moved into one block free on this
    machine now, so jobs side by side do not meet. Apply it to the job's final shape (the plan's ranges
    depend on its node count and restart budget)."""
    shaped = ftconfig.replace(cfg, **sections) if sections else cfg
    plan = port_plan(shaped)
    port = free_port_range(sum(r.count for r in plan))
    moved: dict = {name: dict(changes) for name, changes in sections.items() if name != "run_id"}
    for r in plan:
        section, key = r.setting.split(".")
        moved.setdefault(section, {})[key] = port
        port += r.count
    if "run_id" in sections:
        moved["run_id"] = sections["run_id"]
    return ftconfig.replace(cfg, **moved)


def wait_for(what: str, fn: Callable[[], Any], limit_s: float = 30.0, logs: Callable[[], str] = lambda: "") -> Any:
    """Poll ``fn`` until it returns something truthy (returned); past ``limit_s`` (a wait limit, not
    a performance check) raise :class:`WaitTimeout` naming ``what``, with ``logs()``."""
    deadline = time.time() + limit_s
    while True:
        v = fn()
        if v:
            return v
        if time.time() > deadline:
            raise WaitTimeout(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.05)


def read_jsonl(path: str) -> list[dict]:
    """The complete JSON lines of an event file (a line being written is skipped; no file: [])."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line being written
    except FileNotFoundError:
        pass
    return out


def remove_run_segments(shm_dir: str, run_id: str) -> list[str]:
    """Remove every shared-memory segment of ``run_id`` in ``shm_dir`` (slots and peer blocks of all
    nodes); returns their names."""
    return shm.remove_segments(shm_dir, lambda name: name.startswith(f"mft.{run_id}."))


def sigkill_each(pids: list[int]) -> list[int]:
    """SIGKILL every process of ``pids``; returns those that were there to kill (one already gone is
    passed over)."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


class RecordStore:
    """A real store server keeping the job record of ``nodes`` nodes under ``prefix`` (what a root
    agent's does), with the store interface the agents and launchers use: ``get``, ``set``, ``delete``
    and ``compare_set`` through :attr:`kv`, ``watch`` through :attr:`watch_kv`. ``wire``: both clients
    on the wire (:class:`WireKV`, the watch on a connection of its own, as a launcher's blocking watch
    has); otherwise one client in process (the server's own, as a root agent reads its store)."""

    def __init__(self, nodes: int, prefix: str = "", wire: bool = False):
        self.server = KVServer(("127.0.0.1", 0), None).start()
        RecordKeeper(nodes, "test").install(self.server, prefix)
        if wire:
            self.kv = WireKV(*self.server.address, prefix, 5.0)
            self.watch_kv = WireKV(*self.server.address, prefix, 5.0)
        else:
            self.kv = self.watch_kv = self.server.local(prefix)

    def get(self, key):
        return self.kv.get(key)

    def set(self, key, value):
        self.kv.set(key, value)

    def delete(self, key):
        self.kv.delete(key)

    def compare_set(self, key, expected, desired):
        return self.kv.compare_set(key, expected, desired)

    def watch(self, key, value, wait_s):
        return self.watch_kv.watch(key, value, wait_s)


def inmem_ckpt_flags(monkeypatch: Any, job_file: Any, text: str) -> argparse.ArgumentParser:
    """The trainer's ``--inmem-ckpt`` flags (:func:`megatron_ft.config.add_inmem_ckpt_args`), with
    ``job_file`` written to hold ``text`` (a job file for ``--inmem-ckpt-config``) and no job file or
    run id from the environment (``MFT_CONFIG``, ``MFT_RUN_ID`` unset through ``monkeypatch``)."""
    monkeypatch.delenv("MFT_CONFIG", raising=False)
    monkeypatch.delenv("MFT_RUN_ID", raising=False)
    with open(job_file, "w") as f:
        f.write(text)
    return ftconfig.add_inmem_ckpt_args(argparse.ArgumentParser())


def on_hosts(cfg: ftconfig.FTConfig, workdir: str) -> ftconfig.FTConfig:
    """``cfg`` on the bed's hosts of their own: every host has the default ports to itself; the job's secret
    is a file every host reads (the bed's hosts share this machine's file system but /dev/shm)."""
    from ..transport.credential import job_secret_file

    secret = cfg.security.secret_file or job_secret_file("", {}, workdir, multi_host=False)
    return ftconfig.replace(cfg, launch={"master_addr": "node0"}, health={"host_pattern": "node{node}"},
                            network={"interface": "eth0"}, security={"secret_file": secret})
