"""Hosts of their own on one machine: the multi-host test bed (harness only; root, iproute2, util-linux).

Each host is what a node of a real cluster has to itself:

* a network namespace with one interface, ``eth0``, its own address on a private bridge that lives in
  a namespace of its own (the bed's *switch*): the hosts reach each other and their own loopback,
  nothing else, and nothing outside reaches them;
* a mount and UTS namespace with a private tmpfs on ``/dev/shm`` (its memory: gone when the host is),
  its own host name (``node0``, ``node1``, ...) and an ``/etc/hosts`` that resolves every host's name
  (optionally a host's own name to ``127.0.1.1``, as Debian's installer writes it);
* optionally a link rate, on both ends of its link (``tc ... tbf`` shapes egress only), and a delay
  where the kernel has ``netem``; optionally traffic classes on the link (:func:`shaping`): packets
  marked with the lower-effort DSCP queue behind everything else, as on a network with classes.

A host is held by one *holder* process (``sleep infinity`` in the host's namespaces); a command runs in
the host with ``nsenter --target <holder> --net --mount --uts`` - no ``ip netns exec``, which remounts
``/sys`` and breaks system daemons such as ``slurmd``. Losing a host SIGKILLs every process in its
network namespace at once (holder included: its ``/dev/shm`` goes with its mount namespace);
:meth:`HostBed.replace` brings a new, empty host up under the same name and address.

Nothing is left behind: :meth:`HostBed.down` (or leaving the ``with`` block) kills every process of
every host and deletes the namespaces; and a *reaper* (``python -m megatron_ft.testing.hosts reap``, in
a session of its own) does the same when the process that made the bed dies without doing it (a harness
SIGKILLed in the middle of a trial). A bed's names all start with ``mft<tag>``, so
:func:`teardown` also finds what a reaper could not (``python -m megatron_ft.testing.hosts clean``).

The addresses are planned apart from the commands that make them (:class:`BedPlan`, pure)::

    >>> p = BedPlan("4711", 3)
    >>> p.switch, p.host_ns(1), p.address(1)
    ('mft4711-sw', 'mft4711-h1', '10.77.0.12')
    >>> print(p.hosts_file(2, own_name_loopback=True))   # host 2 as Debian's installer leaves it
    127.0.0.1 localhost
    10.77.0.11 node0
    10.77.0.12 node1
    127.0.1.1 node2
    <BLANKLINE>
    >>> p.hosts_file(0).splitlines()[-1]                    # the others resolve node2 as it is
    '10.77.0.13 node2'
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .. import config as ftconfig
from .helpers import sigkill_each

NETNS_DIR = "/var/run/netns"
STATE_DIR = "/run/megatron-ft/hosts"
PREFIX = "mft"
INTERFACE = "eth0"
#: how long a process started on a host may take to join its namespaces
ENTER_WAIT_S = 10.0
#: what the bed needs from the machine (Debian packages: iproute2, util-linux, procps)
TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "taskset")


class BedUnavailable(RuntimeError):
    """Hosts cannot be made here (not root, a tool missing, namespaces refused); the message says which."""


@dataclass(frozen=True)
class BedPlan:
    """Names and addresses of a bed with ``hosts`` hosts (pure: no I/O)."""
    tag: str
    hosts: int
    subnet: str = "10.77.0"  # /24; hosts at .11, .12, ... (private to the bed's switch)

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.tag}-sw"

    def host_ns(self, i: int) -> str:
        return f"{PREFIX}{self.tag}-h{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{11 + i}"

    @staticmethod
    def name(i: int) -> str:
        return f"node{i}"

    def hosts_file(self, host: int, own_name_loopback: bool = False) -> str:
        """Host ``host``'s ``/etc/hosts``: every host's name; with ``own_name_loopback`` its own at 127.0.1.1."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{'127.0.1.1' if own_name_loopback and i == host else self.address(i)} {self.name(i)}"
                  for i in range(self.hosts)]
        return "\n".join(lines) + "\n"


class Listener(NamedTuple):
    """A listening TCP socket: its address, port and owning process (pid; 0 when ``ss`` names none)."""

    address: str
    port: int
    pid: int
    process: str  # the owner's command line ("" when gone)
    name: str = ""  # the owner's /proc/PID/comm

    @property
    def owner(self) -> str:
        """Which of a job's processes listens: ``agent``, ``launcher``, ``torchrun``, ``store host`` (a
        warm-spare keeper's fork hosting the trainers' store), ``slurm`` (Slurm's own: ``srun`` and the
        daemons, whose command line may name the launcher they start) or ``trainer`` (everything else:
        the trainers, whose collectives listen where torch picks)."""
        from ..spares.fast_restart import STORE_PROCESS_NAME

        if self.name in ("srun", "slurmstepd", "slurmd", "slurmctld"):
            return "slurm"
        if self.name == STORE_PROCESS_NAME:
            return "store host"
        if "megatron_ft.agent" in self.process:
            return "agent"
        if "megatron_ft.torchrun" in self.process or "torch.distributed.run" in self.process:
            return "torchrun"
        if " launch" in self.process and "megatron" in self.process and "spares" not in self.process:
            return "launcher"
        return "trainer"


#: the listening addresses that mean every interface
WILDCARDS = ("0.0.0.0", "*", "::")


def off_plan(cfg: ftconfig.FTConfig, listeners: list[Listener]) -> list[str]:
    """megatron-ft's own servers among ``listeners`` (one host's) that listen off the configuration's port
    plan (:func:`megatron_ft.config.port_plan`), or on every interface where they should listen on the
    node's own address only (the agent's store and peer transport, the trainers' store - hosted by a
    keeper's fork or by torchrun's rank 0); the trainers' other listeners are torch's collectives' and
    Slurm's are Slurm's: not judged. Empty: all as planned."""
    ports = {p: r.setting for r in ftconfig.port_plan(cfg) for p in range(r.first, r.last + 1)}
    trainer_store = {p for p, setting in ports.items() if setting == "launch.trainer_port"}
    out = []
    for s in listeners:
        if s.owner == "trainer" and s.port in trainer_store and s.address in WILDCARDS:
            out.append(f"a trainer (pid {s.pid}) serves launch.trainer_port on every interface ({s.address}:{s.port})")
        if s.owner in ("trainer", "slurm"):
            continue
        if s.port not in ports:
            out.append(f"{s.owner} (pid {s.pid}) listens on {s.address}:{s.port}, a port of no setting")
        elif s.owner in ("agent", "store host") and s.address in WILDCARDS:
            out.append(f"{s.owner} (pid {s.pid}) serves {ports[s.port]} on every interface ({s.address}:{s.port})")
    return out


def parse_listeners(ss_output: str) -> list[Listener]:
    """``ss -H -ltnp`` lines as :class:`Listener` s (one per owning process).

    >>> parse_listeners('LISTEN 0 128 10.77.0.10:29600 0.0.0.0:* users:(("python",pid=4242,fd=7))')[0][:3]
    ('10.77.0.10', 29600, 4242)
    """
    out = []
    for line in ss_output.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[0] != "LISTEN":
            continue
        address, _, port = parts[3].rpartition(":")
        pids = [int(p) for p in re.findall(r"pid=(\d+)", line)] or [0]
        for pid in dict.fromkeys(pids):
            out.append(Listener(address.strip("[]"), int(port), pid, _cmdline(pid), _comm(pid)))
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _run(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise BedUnavailable(f"`{' '.join(argv)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def unavailable_reason() -> Optional[str]:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "the multi-host test bed needs root (network and mount namespaces)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"the multi-host test bed needs {missing} (Debian: apt-get install iproute2 util-linux)"
    return None


def _netns_inode(ns: str) -> Optional[int]:
    try:
        return os.stat(os.path.join(NETNS_DIR, ns)).st_ino
    except OSError:
        return None


def processes_in(ns: str) -> list[int]:
    """Every process whose network namespace is ``ns`` (a bed host's: everything running on it)."""
    ino = _netns_inode(ns)
    if ino is None:
        return []
    want = f"net:[{ino}]"
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/net") == want:
                    out.append(int(name))
            except OSError:
                pass
    return out


def kill_all_in(ns: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL every process in network namespace ``ns`` at once and wait until none is left (bounded)."""
    killed: list[int] = []
    deadline = time.monotonic() + wait_s
    while True:
        pids = processes_in(ns)
        if not pids:
            return sorted(set(killed))
        killed += sigkill_each(pids)
        if time.monotonic() > deadline:  # (a zombie has no namespaces left: it is not listed)
            raise BedUnavailable(f"processes {pids} of {ns} survived SIGKILL for {wait_s:g} s")
        time.sleep(0.02)


def bed_namespaces(tag: Optional[str] = None) -> list[str]:
    """The namespaces of bed ``tag`` (every bed's when None) that exist now."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    start = f"{PREFIX}{tag}-" if tag is not None else PREFIX
    return sorted(n for n in names if n.startswith(start) and (tag is not None or "-" in n))


def teardown(tag: str) -> None:
    """Kill every process of bed ``tag``'s hosts and delete its namespaces and state (idempotent)."""
    for ns in bed_namespaces(tag):
        if not ns.endswith("-sw"):
            kill_all_in(ns)
    for ns in bed_namespaces(tag):
        _run("ip", "netns", "del", ns, check=False)
    state = os.path.join(STATE_DIR, f"{tag}.json")
    try:
        with open(state, encoding="utf-8") as f:
            workdir = json.load(f).get("workdir")
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        os.unlink(state)
    except (OSError, ValueError):
        pass


#: the DSCP a link with classes queues behind everything else (CS1, "lower effort")
LOWER_EFFORT_DSCP = 8


def shaping(dev: str, rate: str, classes: bool = False) -> list[list[str]]:
    """``tc`` arguments that limit ``dev``'s egress to ``rate``: one token bucket (``tbf``, 256 KiB of
    burst, 100 ms of queue), or with ``classes`` an HTB tree of the same rate and burst whose default
    class is guaranteed the whole rate and whose lower class - packets whose DSCP is
    :data:`LOWER_EFFORT_DSCP` - is guaranteed almost nothing and borrows what the default class leaves
    (this kernel has no ``prio`` qdisc; HTB and ``u32`` it has). Training's packets are not delayed by
    the lower class; a TCP connection in it can wait out seconds of backed-off retransmission timers
    beside a busy default class (docs/benchmarks.md, traffic classes: findings).

    >>> shaping("eth0", "20mbit")
    [['qdisc', 'add', 'dev', 'eth0', 'root', 'tbf', 'rate', '20mbit', 'burst', '256kb', 'latency', '100ms']]
    >>> print(" ".join(shaping("eth0", "20mbit", classes=True)[-1]))  # DSCP 8 is TOS byte 0x20
    filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip tos 0x20 0xfc flowid 1:20
    """
    if not classes:
        return [["qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]]
    burst = ["burst", "256kb", "cburst", "256kb"]
    return [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate, *burst],
        ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", rate, "ceil", rate,
         *burst, "prio", "0"],
        ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate", "64kbit", "ceil", rate,
         *burst, "prio", "1"],
        ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "tos",
         hex(LOWER_EFFORT_DSCP << 2), "0xfc", "flowid", "1:20"],
    ]


@dataclass
class HostBed:
    """``hosts`` hosts of their own; ``shm_mib``: each one's /dev/shm; ``rate``: a tbf rate for every
    link (e.g. ``"100mbit"``; None: unlimited); ``classes``: with ``rate``, the links queue the
    lower-effort DSCP behind everything else (:func:`shaping`); ``delay_ms``: needs netem
    (:attr:`delay_applied` says); ``loopback_names``: hosts whose own name resolves to 127.0.1.1 in
    their /etc/hosts."""
    hosts: int
    shm_mib: int = 512
    rate: Optional[str] = None
    classes: bool = False
    delay_ms: float = 0.0
    loopback_names: frozenset = frozenset()
    #: every process of host i runs on core i (modulo the machine's): hosts that do not take each
    #: other's CPU, as separate machines would not (benchmarks; the default shares every core)
    own_cores: bool = False
    plan: BedPlan = field(init=False)
    holders: dict[int, subprocess.Popen] = field(default_factory=dict, init=False)
    delay_applied: bool = field(default=False, init=False)
    _workdir: str = field(default="", init=False)
    _reaper: Optional[subprocess.Popen] = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ValueError(f"hosts={self.hosts} is invalid: must be >= 1")
        if self.classes and not self.rate:
            raise ValueError("classes=True needs a rate: the classes share a link's limited rate")
        self.plan = BedPlan(f"{os.getpid() % 100000:05d}{int(time.time() * 1000) % 1000:03d}", self.hosts)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> "HostBed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "HostBed":
        why = unavailable_reason()
        if why:
            raise BedUnavailable(why)
        p = self.plan
        self._workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{p.tag}-")
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(os.path.join(STATE_DIR, f"{p.tag}.json"), "w", encoding="utf-8") as f:
            json.dump({"tag": p.tag, "owner": os.getpid(), "workdir": self._workdir}, f)
        self._reaper = subprocess.Popen([sys.executable, "-m", __name__, "reap", p.tag, str(os.getpid())],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            _run("ip", "netns", "add", p.switch)
            _run("ip", "-n", p.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", p.switch, "link", "set", "br0", "up")
            for i in range(self.hosts):
                with open(self._hosts_file(i), "w", encoding="utf-8") as f:
                    f.write(p.hosts_file(i, own_name_loopback=i in self.loopback_names))
                self._wire(i)
                self._start(i)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Every process of every host killed, the namespaces deleted, the reaper stopped."""
        for proc in self.holders.values():
            proc.poll()
        teardown(self.plan.tag)
        for proc in self.holders.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.holders.clear()
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait(timeout=10)

    # ------------------------------------------------------------------ hosts
    def _wire(self, i: int) -> None:
        """Host ``i``'s namespace, its eth0 linked to the switch's bridge, the link shaped."""
        p, ns = self.plan, self.plan.host_ns(i)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", f"h{i}", "netns", p.switch)
        _run("ip", "-n", p.switch, "link", "set", f"h{i}", "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{p.address(i)}/24", "dev", INTERFACE)
        _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        for where, dev in ((ns, INTERFACE), (p.switch, f"h{i}")):  # both directions of the link
            if self.delay_ms:
                args = ["delay", f"{self.delay_ms}ms"] + (["rate", self.rate] if self.rate else [])
                out = _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "netem", *args, check=False)
                if out.returncode == 0:
                    self.delay_applied = True
                    continue
            if self.rate:
                for argv in shaping(dev, self.rate, self.classes):
                    _run("tc", "-n", where, *argv)

    def _start(self, i: int) -> None:
        """Host ``i``'s holder: its mount and UTS namespaces, /dev/shm, name and /etc/hosts."""
        setup = (f"mount -t tmpfs -o size={self.shm_mib}m,mode=1777 {PREFIX}shm /dev/shm && "
                 f"mount --bind {self._hosts_file(i)} /etc/hosts && "
                 f"hostname {self.plan.name(i)} && touch {self._ready(i)} && exec sleep infinity")
        proc = subprocess.Popen(["nsenter", f"--net={os.path.join(NETNS_DIR, self.plan.host_ns(i))}", "unshare",
                                 "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", setup],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        deadline = time.monotonic() + 20
        while not os.path.exists(self._ready(i)):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode(errors="replace") if proc.poll() is not None else "timed out"
                raise BedUnavailable(f"host {self.plan.name(i)} did not come up: {err.strip()}")
            time.sleep(0.01)
        os.unlink(self._ready(i))
        self.holders[i] = proc

    def _hosts_file(self, i: int) -> str:
        return os.path.join(self._workdir, f"hosts{i}")

    def _ready(self, i: int) -> str:
        return os.path.join(self._workdir, f"ready{i}")

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` as run on host ``i`` (its network, mounts and name; with ``own_cores``, its core)."""
        if self.own_cores:
            cores = sorted(os.sched_getaffinity(0))
            argv = ["taskset", "--cpu-list", str(cores[i % len(cores)]), *argv]
        return ["nsenter", f"--target={self.holders[i].pid}", "--net", "--mount", "--uts", "--", *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (``kw`` as for :class:`subprocess.Popen`) and return once it runs
        there: ``nsenter`` joins the host's namespaces a moment after it starts, and a process still on
        the machine's own network would escape :meth:`lose` (waits at most ``ENTER_WAIT_S``)."""
        proc = subprocess.Popen(self.command(i, argv), **kw)
        want = f"net:[{_netns_inode(self.plan.host_ns(i))}]"
        deadline = time.monotonic() + ENTER_WAIT_S
        while proc.poll() is None:
            try:
                if os.readlink(f"/proc/{proc.pid}/ns/net") == want:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(timeout=10)
                raise BedUnavailable(f"{argv[0]} did not enter host {self.plan.name(i)} within {ENTER_WAIT_S} s")
            time.sleep(0.002)
        return proc

    def run(self, i: int, argv: list[str], timeout: float = 120.0, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``i`` to its end (bounded by ``timeout``), capturing its output."""
        return subprocess.run(self.command(i, argv), capture_output=True, text=True, timeout=timeout, **kw)

    def processes(self, i: int) -> list[int]:
        return processes_in(self.plan.host_ns(i))

    def listeners(self, i: int) -> list["Listener"]:
        """Every TCP socket listening on host ``i`` now, with its process (``ss -ltnp`` in its namespace)."""
        out = _run("ss", "-N", self.plan.host_ns(i), "-H", "-ltnp").stdout
        return parse_listeners(out)

    def lose(self, i: int) -> list[int]:
        """Host ``i`` dies: every process on it SIGKILLed at once, its /dev/shm gone. Returns their pids."""
        killed = kill_all_in(self.plan.host_ns(i))
        proc = self.holders.pop(i, None)
        if proc is not None:
            proc.wait(timeout=10)
        return killed

    def replace(self, i: int) -> None:
        """A new machine in lost host ``i``'s place: same name, address and link; empty memory."""
        if i in self.holders:
            raise ValueError(f"host {self.plan.name(i)} is up: lose it first")
        self._start(i)


# ---------------------------------------------------------------------- reaper and clean-up
def reap(tag: str, owner: int, poll_s: float = 0.2) -> None:
    """Wait for ``owner`` to die, then tear bed ``tag`` down (the bed's owner may be SIGKILLed)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL (the owner's down()) stops it early
    state = os.path.join(STATE_DIR, f"{tag}.json")
    while os.path.exists(state):
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        time.sleep(poll_s)
    teardown(tag)


def outsider_probes(addrs: list, requests: dict) -> list[dict]:
    """Run on a host that is not one of the job's (``python -m megatron_ft.testing.hosts probe``): each
    request of ``requests`` (op -> fields) to each ``[host, port]`` of ``addrs`` in the wire's framing,
    once without answering the server's challenge and once with a guessed answer. Per probe: whether
    the server challenged it, and what it served (a reply with ``ok``)."""
    from ..transport import wire

    out = []
    for host, port in addrs:
        for op, fields in requests.items():
            for answer in (False, True):
                first, got = None, []
                try:
                    with socket.create_connection((host, port), timeout=5) as s:
                        first = wire.recv_frame(s)  # the server speaks first: its challenge
                        if answer:  # a guess at the response
                            wire.send_frame(s, {"op": "auth", "nonce": "00" * 16, "mac": "00" * 32})
                            got.append(wire.recv_frame(s))
                        wire.send_frame(s, dict(fields, op=op))
                        got.append(wire.recv_frame(s))
                except (OSError, wire.WireError):
                    pass  # refused: the server closed the connection
                out.append({"to": f"{host}:{port}", "op": op, "answered_challenge": answer,
                            "challenged": isinstance(first, dict) and first.get("op") == "challenge",
                            "served": [g for g in got if g.get("ok")]})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ft.testing.hosts", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reap", help="tear bed TAG down once process OWNER is gone")
    r.add_argument("tag")
    r.add_argument("owner", type=int)
    sub.add_parser("clean", help="tear down every bed whose owner is gone")
    q = sub.add_parser("probe", help="outsider_probes: JSON [[host, port], ...] and {op: fields}; prints JSON")
    q.add_argument("addrs")
    q.add_argument("requests")
    args = p.parse_args(argv)
    if args.cmd == "probe":
        print(json.dumps(outsider_probes(json.loads(args.addrs), json.loads(args.requests))))
        return 0
    if args.cmd == "reap":
        reap(args.tag, args.owner)
        return 0
    for tag in sorted({n[len(PREFIX):].split("-")[0] for n in bed_namespaces()}):
        if _owner_alive(tag):
            print(f"bed {tag}: its owner runs; left alone")
            continue
        teardown(tag)
        print(f"removed bed {tag}")
    return 0


def _owner_alive(tag: str) -> bool:
    try:
        with open(os.path.join(STATE_DIR, f"{tag}.json"), encoding="utf-8") as f:
            os.kill(int(json.load(f)["owner"]), 0)
        return True
    except (OSError, ValueError, KeyError):
        return False


if __name__ == "__main__":
    sys.exit(main())
