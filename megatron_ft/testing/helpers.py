"""Small helpers of the harness, in one place: free ports, bounded polling, event files, and
removing a run's shared-memory segments. Imported by the demo, the chaos harness, the simulation,
tests and benchmarks; never by the runtime."""
from __future__ import annotations

import json
import random
import socket
import time
from typing import Any, Callable

from .. import config as ftconfig
from ..agent import shm
from ..config import port_plan


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
