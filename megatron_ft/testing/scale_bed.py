"""A simulated cluster of many nodes on one machine, running the real agents, store and wire code,
for the job-wide agreement's scale figures (``benchmarks/scale.py``) and its default-suite test.

What is real: every node's :class:`~megatron_ft.agent.server.Agent` (``start_peers``: its embedded
store server on ``127.0.0.1:health.store_port + node``, its heartbeats; ``start_agreement``: its
reports and its watch of the verdict; ``serve_forever``: its Unix socket), the root's store and its
in-process aggregation, the authenticated wire, the shared-memory slots. What is light: the trainers.
Each node has one rank (``cluster.ranks_per_node: 1``) whose trainer is a :class:`LightTrainer`: it
speaks the real trainer-agent protocol (:class:`~megatron_ft.agent.protocol.AgentClient`: ``hello``,
``register`` of a one-tensor layout of 1 KiB, then per step ``begin`` -> a real version record
written into the slot the agent handed out (``snapfile.write_version``, as ``SnapshotEngine._write``
does, with the chunk checksums of the slot's data) -> ``commit``), but copies no state.

Processes: the nodes are spread over ``procs`` worker processes (``python -m
megatron_ft.testing.scale_bed``), each hosting its share of the agents in threads; the coordinator
(:class:`ScaleBed`, in the caller's process) drives them over their stdin/stdout (one JSON line per
command and per answer). Worker 0 hosts node 0, which becomes the root, and starts first.

Sizing on one machine (pid_max 32,768 threads machine-wide, 20,000 descriptors and 65,530 mappings per
process here; 2 cores). What made 2,048 nodes fit (docs/benchmarks.md, "Scale, part 2"):

* **the servers' idle wake-up** (the bed's, not a node's cost): every ``transport.wire.Server`` runs
  socketserver's accept loop with a 0.05 s poll, only so that ``close()`` returns soon - 2 servers per
  node, 20 wake-ups a second each, nothing on a real node; 4,096 of them on 2 cores were most of a core
  (1.46 cores idle for 1,024 health-mode agents in one process, 0.24 at 1 s). Each worker makes that loop
  wake every :data:`ACCEPT_POLL_S` (1 s) instead (:func:`_slow_accept_poll`); a connection or a request
  still wakes a server at once, only a server's ``close()`` waits longer;
* **fewer threads per simulated node where they are the bed's**: ``mode="health"`` runs each agent's
  store and heartbeat only (:mod:`.scale_health`: 3 threads per node - its store server, its heartbeat,
  its launcher watch - and 1 per connection at the root: 6,152 threads at 2,048 nodes, at most 880 per
  process), and the threads' stacks are 512 KiB; ``mode="agreement"`` (the agreement and restores) keeps
  the 7 threads per agent of the product (store server, heartbeat, report, verdict, Unix server, the
  trainer's connection handler, persist) plus the root's 2 per node: 14,344 threads at 2,048 nodes;
* **the root alone** (``root_alone``): node 0 alone in worker 0, the others spread over the rest, so that
  the job's store shares its process's lock and GIL with no other agent, as on a cluster;
* **more workers** (8 at 2,048 nodes), RLIMIT_NOFILE raised to its hard limit in each;
* **a teardown that starts no election**: every heartbeat is stopped first, then every worker but the
  root's at once, then the root's.

What remains the product's: the root's thread per connection (2,048 agents' connections plus the launcher
side's in the root's process; a restore's decisions open one more per node at once, which collapsed the
bed's 2,048-node restores). Its clients' way of finding the root no longer loads it: a root slow to answer
made each client probe every node's server in turn (N x N probes); they now stop at the first server that
answers (``health.store.find_root``, docs/health.md). A node holds 2 slots of a few KiB
(files in a tmpfs directory of the bed's own under /dev/shm, removed at the end; the Unix sockets in a
short directory under /tmp, likewise). Ports: ``[base, base + nodes)`` for the stores
(``health.store_port``; :func:`free_port_base` picks a range below the ephemeral ports that nothing
listens on), the next ``nodes`` for the (unused) peer port setting. Heartbeats every ``heartbeat_s`` and
a ``timeout_s`` the caller chooses (the agreement's runs: a long one, so a loaded bed never judges a node
failed; the health scenarios: 10 s, and they count what is judged).

Per step the coordinator measures: each worker's first and last commit (monotonic clock: one
machine), the time each agent learnt the agreed step (its ``protect`` hook wrapped: the moment the
agent applied the verdict), the reports and verdicts counted by each agent's ``JobAgreement``, the
root's store requests by op (:meth:`~megatron_ft.health.wire_store.KVServer.op_counts`), the
workers' CPU seconds.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from .scale_procs import BedError, _Proc, _raise_nofile  # noqa: F401 (the bed's names)

SECRET_ENV = "MFT_SCALE_BED_SECRET"
#: the one tensor each light trainer registers: 256 float32 (1 KiB)
TENSOR_NUMEL = 256
#: the steps a restoring rank offers at most (``megatron_ft.trainer.recovery.MAX_CANDIDATES``; not imported:
#: that module loads torch, which the workers do without)
RESTORE_MAX_CANDIDATES = 4
#: the workers' servers' idle accept wake-up (the product's: 0.05 s; see the module, "Sizing")
ACCEPT_POLL_S = 1.0


def bed_config(run_id: str, nodes: int, base_port: int, shm_dir: str, socket_dir: str, persist_dir: str,
               heartbeat_s: float, timeout_s: float, store: str = "embedded", secret_file: str = "") -> dict:
    """The job's configuration (a dict for :func:`megatron_ft.config.from_dict`): ``nodes`` x 1 rank,
    the agents' agreement, nothing persisted, no redundancy; ``store``: ``embedded`` or ``etcd://...``;
    ``secret_file``: the job's secret for the processes that read it from the configuration (the
    launcher side's store clients)."""
    return {
        "run_id": run_id,
        "cluster": {"nodes": nodes, "ranks_per_node": 1},
        "parallel": {"tensor": 1, "pipeline": 1},
        "snapshot": {"interval": 1, "chunk_mib": 1, "agreement": "agents"},
        "persist": {"interval": 0, "dir": persist_dir, "on_failure": False},
        "agent": {"shm_dir": shm_dir, "socket_dir": socket_dir, "connect_timeout_s": 300.0,
                  "request_timeout_s": 120.0},
        "health": {"store": store, "store_port": base_port, "heartbeat_s": heartbeat_s, "timeout_s": timeout_s},
        "network": {"peer_port": base_port + nodes},
        "redundancy": {"scheme": "none"},
        "security": {"secret_file": secret_file},
    }


def free_port_base(count: int, low: int = 10000, high: int = 29000, tries: int = 40) -> int:
    """A base port with ``2 * count`` ports above it that nothing listens on now (below the ephemeral
    range, so no client connection takes one meanwhile, and below the launch ports a configuration
    keeps apart from them: launch.rdzv_port 29400, launch.trainer_port 29700)."""
    import random

    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - 2 * count)
        ok = True
        for p in range(base, base + 2 * count):
            s = socket.socket()
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
            except OSError:
                ok = False
                break
            finally:
                s.close()
        if ok:
            return base
    raise RuntimeError(f"no free range of {2 * count} ports in {low}-{high}")


# ---------------------------------------------------------------------------------------- the trainers
class LightTrainer:
    """Node ``node``'s one rank: the real protocol, a 1 KiB layout, no state copied."""

    def __init__(self, cfg, node: int):
        from ..agent import shm
        from ..agent.protocol import AgentClient, socket_path
        from ..capture import checksum
        from ..capture.layout import TensorSpec, plan_layout
        from ..capture import snapfile

        self.cfg, self.rank = cfg, node  # one rank per node: rank == node
        self._snapfile = snapfile
        self.client = AgentClient(socket_path(cfg.agent.socket_dir, cfg.run_id, node), cfg.agent.request_timeout_s)
        self.client.connect({"rank": self.rank, "local_rank": 0, "pid": os.getpid(), "run_id": cfg.run_id},
                            wait_s=60.0)
        self.identity = {"run_id": cfg.run_id, "rank": self.rank, "world_size": cfg.cluster.world_size}
        self.layout = plan_layout([TensorSpec("w", "float32", (TENSOR_NUMEL,))], cfg.snapshot.chunk_bytes,
                                  self.identity)
        reply = self.client.request("register", rank=self.rank, layout=self.layout.to_json().decode())
        self.slots = [shm.open_segment(p) for p in reply["slots"]]
        hdr = snapfile.read_header(self.slots[0].mm)
        off = hdr.geometry.data_off
        area = self.slots[0].array[off: off + self.layout.data_nbytes]
        self.sums = [f"{checksum.checksum(area[lo:hi]):016x}"
                     for lo, hi in (self.layout.chunk_bounds(i) for i in range(self.layout.num_chunks))]
        self.agreed = -1

    def step(self, step: int) -> float:
        """begin -> version record -> commit; the time the commit was sent (monotonic)."""
        slot = int(self.client.request("begin", rank=self.rank, step=step)["slot"])
        record = {"chunks": self.sums, "checksum": "fl32x8-v1", "extra": {"iteration": step},
                  "created": time.time(), "identity": self.identity}
        self._snapfile.write_version(self.slots[slot].mm, step, record)
        t = time.monotonic()
        reply = self.client.request("commit", rank=self.rank, slot=slot, step=step)
        self.agreed = max(self.agreed, int(reply.get("agreed", -1)))
        return t

    def restore(self, key: str, decisions: int, fresh: bool, wait_s: float, t0: float, stagger_s: float = 0.0) -> dict:
        """One restore's job-wide decisions as :class:`~megatron_ft.trainer.recovery.Restorer` makes them in
        the best case (the newest common step loads everywhere): the steps this rank holds (``list``, as
        ``Restorer.local_candidates``), their ``intersect`` over the job, then ``min`` of (ok, not
        refused) after the check and again after loading (and, with ``decisions`` 4, first the ``max`` of
        the newest certified step, as ``prefer: certified`` does). ``fresh``: on a connection of its own
        (``role: coordination``, as ``Checkpointer._decisions`` opens per restore), else on the
        trainer's. Waits until ``t0`` (monotonic) so that every client of every worker starts together.
        ``stagger_s``: this rank starts ``rank x stagger_s`` later (the unmeasured warm-up's, see
        :meth:`ScaleBed.restores`). Per decision: (request sent, answer received, answer)."""
        from ..agent.protocol import AgentClient, socket_path

        left = t0 + self.rank * stagger_s - time.monotonic()
        if left > 0:
            time.sleep(left)
        out: dict = {"rank": self.rank, "decisions": [], "error": None}
        coord = self.client
        try:
            if fresh:
                coord = AgentClient(socket_path(self.cfg.agent.socket_dir, self.cfg.run_id, self.rank),
                                    self.cfg.agent.request_timeout_s)
                coord.reconnects = 0  # a decision is never sent twice
                coord.connect({"rank": self.rank, "local_rank": 0, "pid": os.getpid(), "run_id": self.cfg.run_id,
                               "role": "coordination"})
            versions = self.client.request("list", rank=self.rank)["versions"]
            mine = sorted({int(v["step"]) for v in versions}, reverse=True)[:RESTORE_MAX_CANDIDATES]
            certified = max((int(v["step"]) for v in versions if v.get("certified")), default=-1)
            plan = ([("max", [certified])] if decisions >= 4 else []) + [("intersect", mine), ("min", [1, 1]),
                                                                          ("min", [1, 1])]
            for seq, (how, values) in enumerate(plan):
                t_req = time.monotonic()
                got = coord.request("decide", rank=self.rank, key=f"{key}/{seq}", how=how, values=values,
                                    wait_s=wait_s)["values"]
                out["decisions"].append([t_req, time.monotonic(), [int(x) for x in got]])
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            if coord is not self.client:
                try:
                    coord.close(orderly=True)
                except Exception:
                    pass
        return out

    def close(self) -> None:
        try:
            self.client.close()  # bye: not a lost trainer
        except Exception:
            pass
        for seg in self.slots:
            seg.close()
        self.slots = []


# ---------------------------------------------------------------------------------------- a worker process
def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_counts() -> dict:
    out = {"threads": threading.active_count()}
    try:
        out["fds"] = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/maps") as f:
            out["maps"] = sum(1 for _ in f)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_mib"] = round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return out


class _Worker:
    def __init__(self, cfg, secret: bytes, nodes: range, mode: str = "agreement"):
        self.cfg, self.secret, self.nodes, self.mode = cfg, secret, nodes, mode
        self.agents: list = []
        self.health = None  # the health scenario's instruments (scale_health.WorkerHealth)
        self.trainers: list[LightTrainer] = []
        self.cond = threading.Condition()
        self.agreed: dict[int, int] = {}  # node -> the newest agreed step its agent applied
        self.learnt: dict[int, dict[int, float]] = {}  # step -> node -> when (monotonic)

    def _instrument(self, agent) -> None:
        """Wrap the agent's ``protect`` hook: the moment it applied a verdict (the agent's code untouched)."""
        ja = agent.agreement
        inner, node = ja.protect, agent.node

        def protect(verdict, inner=inner, node=node):
            inner(verdict)
            t = time.monotonic()
            with self.cond:
                if verdict.agreed > self.agreed.get(node, -1):
                    self.agreed[node] = verdict.agreed
                    self.learnt.setdefault(verdict.agreed, {})[node] = t
                    self.cond.notify_all()

        ja.protect = protect

    def start(self, say) -> dict:
        from ..agent.server import Agent

        from .scale_health import WorkerHealth

        self.health = WorkerHealth(self)
        t0 = time.monotonic()
        for n in self.nodes:
            a = Agent(self.cfg, n, self.secret)
            a.start_peers()
            self.health.instrument(a)
            if self.mode == "health":  # heartbeats and verdicts only: the coordinator stands as every launcher
                a.watch_launcher(os.getppid(), poll_s=30.0)
            else:
                a.start_agreement()
                self._instrument(a)
                threading.Thread(target=a.serve_forever, name=f"agent-n{n}", daemon=True).start()
            self.agents.append(a)
            if n == 0:
                say({"event": "root"})
        if self.mode != "health":
            for a in self.agents:
                self.trainers.append(LightTrainer(self.cfg, a.node))
        return {"event": "ready", "start_s": round(time.monotonic() - t0, 3), **_proc_counts()}

    def _root_ops(self) -> Optional[dict]:
        for a in self.agents:
            if a.store is not None and a.store.is_root and hasattr(a.store, "_server"):
                return a.store._server.op_counts()  # the root's own server: the job's store
        return None

    def counters(self) -> dict:
        ags = [a.agreement for a in self.agents if a.agreement is not None]
        return {"reports": sum(j.reports_sent for j in ags), "verdicts": sum(j.verdicts_seen for j in ags),
                "skipped": sum(a.slots.agreement.skipped_pending for a in self.agents),
                "ops": self._root_ops(), "cpu_s": _cpu_s(), **_proc_counts()}

    def step(self, step: int, timeout_s: float) -> dict:
        commits = [t.step(step) for t in self.trainers]
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(self.agreed.get(a.node, -1) < step for a in self.agents):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            learnt = dict(self.learnt.get(step, {}))
            behind = [a.node for a in self.agents if self.agreed.get(a.node, -1) < step]
        return {"event": "step", "step": step, "first_commit": min(commits), "last_commit": max(commits),
                "learnt": [learnt[n] for n in sorted(learnt)], "missing": behind, **self.counters()}

    def restore(self, key: str, decisions: int, fresh: bool, wait_s: float, t0: float,
                stagger_s: float = 0.0) -> dict:
        """Every light client of this worker runs one restore's decisions (:meth:`LightTrainer.restore`)
        at once, each on a thread of its own (as every rank does); per decision: the first request and
        the last answer of this worker's clients, the distinct answers."""
        results: list = [None] * len(self.trainers)

        def one(i: int, t: LightTrainer) -> None:
            results[i] = t.restore(key, decisions, fresh, wait_s, t0, stagger_s)

        threads = [threading.Thread(target=one, args=(i, t), name=f"restore-n{t.rank}", daemon=True)
                   for i, t in enumerate(self.trainers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(wait_s + 60)
        errors = [f"node {self.trainers[i].rank}: {r['error'] if r else 'no answer'}"
                  for i, r in enumerate(results) if r is None or r["error"]]
        done = [r for r in results if r is not None and not r["error"]]
        per = []
        for d in range(max((len(r["decisions"]) for r in done), default=0)):
            got = [r["decisions"][d] for r in done if len(r["decisions"]) > d]
            per.append({"first_request": min(g[0] for g in got), "last_request": max(g[0] for g in got),
                        "first_answer": min(g[1] for g in got), "last_answer": max(g[1] for g in got),
                        "clients": len(got), "answers": sorted({json.dumps(g[2]) for g in got})})
        return {"event": "restore", "key": key, "decisions": per, "errors": errors[:20], "failed": len(errors),
                **self.decision_state()}

    def decision_state(self) -> dict:
        """What the job-wide decisions left: contributions (``red/<decision>/<node>``) and results in the
        root's map, decisions the root still has open, the agents' store watch connections (one per
        thread that ever watched), the decisions each agent sent."""
        out = {"decisions_sent": sum(a.agreement.decisions_sent for a in self.agents),
               "watch_conns": sum(a.store.watchers.count() for a in self.agents if hasattr(a.store, "watchers")),
               "root": None}
        for a in self.agents:
            if a.store is not None and a.store.is_root:
                m = a.store._server._map
                prefix = f"{a.store.prefix}red/"
                with m._lock:
                    red = [k[len(prefix):] for k in m.data if k.startswith(prefix)]
                out["root"] = {"red_keys": sorted(red), "open": sorted(a.agreement._root_red._open)}
        return out

    def stop(self) -> dict:
        for t in self.trainers:
            t.close()

        def down(a) -> None:
            try:
                a.shutdown()
            finally:
                if a.store is not None:
                    try:
                        a.store.close()
                    except Exception:  # closed already (a node the bed killed)
                        pass

        threads = [threading.Thread(target=down, args=(a,), daemon=True) for a in self.agents]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        from ..agent import shm

        left = [p for a in self.agents for _, _, p in shm.list_segments(self.cfg.agent.shm_dir, self.cfg.run_id, a.node)]
        return {"event": "stopped", "left": left, "stuck": sum(t.is_alive() for t in threads)}


def _slow_accept_poll(socketserver, poll_s: float) -> None:
    """Every server's accept loop here wakes every ``poll_s`` instead of the interval its caller passes
    (``transport.wire.Server``: 0.05 s, only so that ``close()`` returns soon): a node's 2 servers waking
    20 times a second cost nothing, 4,096 of them on one 2-core machine most of a core (see the module).
    A connection or request wakes the loop at once either way; only a server's ``close()`` waits longer."""
    inner = socketserver.BaseServer.serve_forever

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        inner(self, max(poll_interval, poll_s))

    socketserver.BaseServer.serve_forever = serve_forever


def _worker_main() -> None:
    spec = json.loads(sys.stdin.readline())
    _raise_nofile()
    import socketserver

    if spec.get("backlog"):  # diagnostic only: the listen backlog of every server here (the agents' own otherwise)
        from ..transport import wire

        wire.LISTEN_BACKLOG = int(spec["backlog"])
    if spec.get("accept_poll_s"):  # the servers' idle wake-up (see the module: shutdown latency only)
        _slow_accept_poll(socketserver, float(spec["accept_poll_s"]))
    threading.stack_size(spec.get("stack_kib", 512) << 10)
    logging.basicConfig(level=getattr(logging, spec.get("log_level", "WARNING")), stream=sys.stderr,
                        format="[scale-bed w%(process)d %(asctime)s] %(name)s %(levelname)s %(message)s")
    from .. import config as ftconfig

    cfg = ftconfig.from_dict(spec["config"], source="<scale bed>")
    secret = bytes.fromhex(os.environ[SECRET_ENV])
    lock = threading.Lock()

    def say(obj: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    w = _Worker(cfg, secret, range(spec["first"], spec["last"]), spec.get("mode", "agreement"))
    try:
        say(w.start(say))
        for line in sys.stdin:  # the coordinator's commands; its end (EOF) stops the worker too
            cmd = json.loads(line)
            if cmd["cmd"] == "step":
                say(w.step(cmd["step"], cmd.get("timeout_s", 60.0)))
            elif cmd["cmd"] == "counters":
                say({"event": "counters", **w.counters(), **w.decision_state()})
            elif cmd["cmd"] == "restore":
                say(w.restore(cmd["key"], cmd.get("decisions", 3), cmd.get("fresh", True), cmd.get("wait_s", 120.0),
                              cmd["t0"], cmd.get("stagger_s", 0.0)))
            elif cmd["cmd"] == "stop":
                break
            else:  # the health scenario's commands (scale_health.WorkerHealth)
                say(w.health.command(cmd))
    except Exception as e:  # said, then torn down all the same
        logging.getLogger("megatron_ft.scale_bed").exception("worker failed")
        say({"event": "error", "error": f"{type(e).__name__}: {e}"})
    say(w.stop())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the agents' daemon threads end with the process


# ---------------------------------------------------------------------------------------- the coordinator
def _both(ops: dict, key: str) -> int:
    """``key``'s count over the wire and in the root's own process (``"local " + key``: a root that serves
    its own calls in process counts them apart)."""
    return ops.get(key, 0) + ops.get(f"local {key}", 0)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[k]


class ScaleBed:
    """``nodes`` simulated nodes over ``procs`` worker processes. ``start()``, ``step(s)`` (one agreed
    step, measured), ``counters()``, ``close()`` (the teardown's findings); a context manager."""

    def __init__(self, nodes: int, procs: int = 4, heartbeat_s: float = 2.0, timeout_s: float = 120.0,
                 run_id: Optional[str] = None, step_timeout_s: float = 120.0, log_level: str = "WARNING",
                 backlog: Optional[int] = None, mode: str = "agreement", store: str = "embedded",
                 accept_poll_s: float = ACCEPT_POLL_S, root_alone: bool = False):
        if procs < 1 or nodes < procs:
            raise ValueError(f"nodes={nodes}, procs={procs}: every worker process needs a node")
        self.nodes, self.procs = nodes, procs
        self.heartbeat_s, self.timeout_s, self.step_timeout_s = heartbeat_s, timeout_s, step_timeout_s
        self.run_id = run_id or f"sb{nodes}-{secrets.token_hex(3)}"
        self.log_level = log_level
        #: diagnostic: the listen backlog of every server in the workers (None: ``wire.LISTEN_BACKLOG``, as the
        #: agents run); a burst of connections to the root's store beyond it is what it shows
        self.backlog = backlog
        #: ``agreement``: agents with the job-wide agreement, their Unix servers and light trainers;
        #: ``health``: agents with their store and heartbeats only (the health, launch and spares scenarios)
        self.mode, self.store, self.accept_poll_s, self.root_alone = mode, store, accept_poll_s, root_alone
        self.config: dict = {}
        self.config_path = ""  # the configuration as a YAML file (what MFT_CONFIG names for the keepers' side)
        self.tmp = tempfile.mkdtemp(prefix="mftsb-", dir="/tmp")
        self.shm_dir = tempfile.mkdtemp(prefix="mftsb-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.workers: list[_Proc] = []
        self.base_port = -1
        self.started = {}
        self.closed: Optional[dict] = None
        self.last_step = 0  # the newest step the trainers committed

    # -------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = 600.0) -> "ScaleBed":
        try:
            self._start(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        self.base_port = free_port_base(self.nodes)
        secret = secrets.token_bytes(32)
        secret_file = os.path.join(self.tmp, "secret")
        with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(secret)
        cfg = self.config = bed_config(self.run_id, self.nodes, self.base_port, self.shm_dir,
                                       os.path.join(self.tmp, "s"), os.path.join(self.tmp, "persist"),
                                       self.heartbeat_s, self.timeout_s, self.store, secret_file)
        os.makedirs(cfg["agent"]["socket_dir"], mode=0o700)
        self.config_path = os.path.join(self.tmp, "job.yaml")
        with open(self.config_path, "w") as f:
            json.dump(cfg, f)  # JSON is YAML
        env = {**os.environ, SECRET_ENV: secret.hex()}
        t0 = time.monotonic()
        for i, (first, last) in enumerate(self.node_ranges()):
            log_path = os.path.join(self.tmp, f"worker{i}.log")
            with open(log_path, "w") as log:
                popen = subprocess.Popen([sys.executable, "-m", "megatron_ft.testing.scale_bed"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            w = _Proc(popen, first, last, log_path)
            self.workers.append(w)
            w.send({"config": cfg, "first": first, "last": last, "log_level": self.log_level, "backlog": self.backlog,
                    "mode": self.mode, "accept_poll_s": self.accept_poll_s})
            if i == 0:  # node 0 is the root before any other node looks for one
                w.recv(timeout_s, "root")
        ready = [w.recv(max(1.0, timeout_s - (time.monotonic() - t0)), "ready") for w in self.workers]
        self.started = {"start_s": round(time.monotonic() - t0, 2),
                        "threads": sum(r.get("threads", 0) for r in ready),
                        "max_threads_per_proc": max(r.get("threads", 0) for r in ready),
                        "max_fds_per_proc": max(r.get("fds", 0) for r in ready),
                        "max_maps_per_proc": max(r.get("maps", 0) for r in ready),
                        "rss_mib": round(sum(r.get("rss_mib", 0) for r in ready), 1)}

    def node_ranges(self) -> list[tuple[int, int]]:
        """Each worker's nodes ``[first, last)``: an equal share each, or (``root_alone``) node 0 alone in
        worker 0 and the others shared by the rest - the root's store then shares its process's lock
        with no other agent's threads, as on a cluster, where it has its node to itself."""
        if self.root_alone and self.procs > 1:
            per = -(-(self.nodes - 1) // (self.procs - 1))
            return [(0, 1)] + [(1 + i * per, min(self.nodes, 1 + (i + 1) * per)) for i in range(self.procs - 1)
                               if 1 + i * per < self.nodes]
        per = -(-self.nodes // self.procs)
        return [(i * per, min(self.nodes, (i + 1) * per)) for i in range(self.procs) if i * per < self.nodes]

    def ask_all(self, cmd: dict, timeout_s: float = 120.0) -> list[dict]:
        """Send ``cmd`` to every worker; their answers (the event ``cmd["cmd"]``), in worker order."""
        for w in self.workers:
            w.send(cmd)
        return [w.recv(timeout_s, cmd["cmd"]) for w in self.workers]

    def ask(self, node: int, cmd: dict, timeout_s: float = 120.0) -> dict:
        """Send ``cmd`` to the worker hosting ``node``; its answer (the event ``cmd["cmd"]``)."""
        w = next(w for w in self.workers if w.first <= node < w.last)
        w.send(cmd)
        return w.recv(timeout_s, cmd["cmd"])

    def __enter__(self) -> "ScaleBed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- measurements
    def step(self, step: int) -> dict:
        """Every trainer commits ``step``; returns once every agent applied it as agreed (or BedError)."""
        self.last_step = max(self.last_step, step)
        for w in self.workers:
            w.send({"cmd": "step", "step": step, "timeout_s": self.step_timeout_s})
        replies = [w.recv(self.step_timeout_s + 30, "step") for w in self.workers]
        missing = [n for r in replies for n in r["missing"]]
        learnt = [t for r in replies for t in r["learnt"]]
        last = max(r["last_commit"] for r in replies)
        first = min(r["first_commit"] for r in replies)
        ops = next((r["ops"] for r in replies if r.get("ops") is not None), None)
        return {"step": step, "nodes_learnt": len(learnt), "missing": missing,
                "all_learnt_s": (max(learnt) - last) if learnt and not missing else None,
                "median_learnt_s": (statistics.median(learnt) - last) if learnt else None,
                "commit_spread_s": last - first,
                "reports": sum(r["reports"] for r in replies), "verdicts": sum(r["verdicts"] for r in replies),
                "skipped": sum(r["skipped"] for r in replies), "ops": ops,
                "cpu_s": sum(r["cpu_s"] for r in replies), "threads": sum(r["threads"] for r in replies)}

    def counters(self) -> dict:
        for w in self.workers:
            w.send({"cmd": "counters"})
        replies = [w.recv(60, "counters") for w in self.workers]
        return {"reports": sum(r["reports"] for r in replies), "verdicts": sum(r["verdicts"] for r in replies),
                "skipped": sum(r["skipped"] for r in replies),
                "ops": next((r["ops"] for r in replies if r.get("ops") is not None), None),
                "cpu_s": sum(r["cpu_s"] for r in replies)}

    def run(self, steps: int, warmup: int = 1, settle_s: float = 0.5) -> dict:
        """``warmup`` agreed steps, then ``steps`` measured ones (after the newest step so far); the figures
        (see benchmarks/scale.py)."""
        start = self.last_step + 1
        for s in range(start, start + warmup):
            self._check(self.step(s))
        time.sleep(settle_s)
        c0, wall0, load0 = self.counters(), time.monotonic(), os.getloadavg()[0]
        per_step = []
        for s in range(start + warmup, start + warmup + steps):
            per_step.append(self._check(self.step(s)))
        wall = time.monotonic() - wall0
        time.sleep(settle_s)  # the last verdict's watches re-issued
        c1 = self.counters()
        window = time.monotonic() - wall0  # what the op counts span (about)
        n, k = self.nodes, steps
        ops = {key: c1["ops"].get(key, 0) - c0["ops"].get(key, 0) for key in c1["ops"]}
        reports = _both(ops, "set agree")  # the root's own (in process, "local ...") counted with the wire's
        watches = _both(ops, "watch agreed") - _both(ops, "watch-timeout agreed")
        latency = [r["all_learnt_s"] for r in per_step]
        median_agent = [r["median_learnt_s"] for r in per_step]
        return {
            "nodes": n, "procs": len(self.workers), "steps": k, "heartbeat_s": self.heartbeat_s,
            "timeout_s": self.timeout_s,
            "agreement_msgs_per_step": (reports + watches) / k,
            "agreement_msgs_per_node_step": (reports + watches) / (k * n),
            "reports_per_node_step": reports / (k * n), "verdict_replies_per_node_step": watches / (k * n),
            "idle_repolls": _both(ops, "watch-timeout agreed"),
            "reports_sent_per_node_step": (c1["reports"] - c0["reports"]) / (k * n),
            "verdicts_seen_per_node_step": (c1["verdicts"] - c0["verdicts"]) / (k * n),
            "rounds": (round((c1["reports"] - c0["reports"]) / (k * n)) + round((c1["verdicts"] - c0["verdicts"])
                                                                                 / (k * n))),
            "heartbeat_msgs_per_s": (ops.get("set hb", 0) + ops.get("get hb", 0)) / window,
            "store_requests_per_step": sum(v for key, v in ops.items() if " " not in key) / k,
            "ops": ops,
            "skipped_pending": c1["skipped"] - c0["skipped"],
            "all_learnt_p50_ms": 1e3 * statistics.median(latency), "all_learnt_p99_ms": 1e3 * _pct(latency, 0.99),
            "median_agent_p50_ms": 1e3 * statistics.median(median_agent),
            "commit_spread_p50_ms": 1e3 * statistics.median(r["commit_spread_s"] for r in per_step),
            "step_wall_ms": 1e3 * wall / k,
            "bed_cpu_cores": (c1["cpu_s"] - c0["cpu_s"]) / window, "loadavg_1m": [round(load0, 2),
                                                                                round(os.getloadavg()[0], 2)],
            **self.started,
        }

    def counters_all(self) -> list[dict]:
        """Each worker's counters and what the job-wide decisions left (:meth:`_Worker.decision_state`)."""
        for w in self.workers:
            w.send({"cmd": "counters"})
        return [w.recv(60, "counters") for w in self.workers]

    def restore(self, key: str, decisions: int = 3, fresh: bool = True, wait_s: float = 120.0,
                stagger_s: float = 0.0) -> dict:
        """Every light client runs one restore's job-wide decisions under ``key`` (the same for all, as
        the restore's identifier is on every rank); returns, per decision, the first request, the last
        answer and the answers (one, if every client got the same), and the restore's time from the
        first client's first request to the last client's last answer."""
        lead = 0.2 + 0.002 * -(-self.nodes // len(self.workers))  # every worker's threads up before t0
        t0 = time.monotonic() + lead
        for w in self.workers:
            w.send({"cmd": "restore", "key": key, "decisions": decisions, "fresh": fresh, "wait_s": wait_s,
                    "t0": t0, "stagger_s": stagger_s})
        replies = [w.recv(wait_s + 120 + stagger_s * self.nodes, "restore") for w in self.workers]
        per = []
        for d in range(decisions):
            got = [r["decisions"][d] for r in replies if len(r["decisions"]) > d]
            if not got:
                break
            first, last_req = min(g["first_request"] for g in got), max(g["last_request"] for g in got)
            last = max(g["last_answer"] for g in got)
            per.append({"clients": sum(g["clients"] for g in got),
                        "answers": sorted({a for g in got for a in g["answers"]}),
                        "first_request_to_last_answer_s": last - first,
                        "last_request_to_last_answer_s": last - last_req,
                        "request_spread_s": last_req - first, "first_request": first, "last_answer": last})
        return {"key": key, "decisions": per, "failed": sum(r["failed"] for r in replies),
                "errors": [e for r in replies for e in r["errors"]][:20],
                "restore_s": (per[-1]["last_answer"] - per[0]["first_request"]) if per else None}

    def restores(self, count: int, decisions: int = 3, fresh: bool = True, wait_s: float = 120.0,
                 settle_s: float = 0.5, warm_stagger_s: float = 0.002) -> dict:
        """``count`` restores' decisions (:meth:`restore`), keys ``restore/<random>/<i>`` (the random part
        the coordinator's, handed to every worker); the figures (see benchmarks/scale.py): store messages
        per node per restore and per decision from the root's op counts (``set red``: the nodes'
        contributions, ``watch red``: the results' watches), rounds from the agents' own counts, times,
        the bed's CPU and load, and what was left behind.

        On the trainer's connection (``fresh`` false), one unmeasured warm-up restore first, its clients
        started ``warm_stagger_s`` apart: each agent's handler thread of that connection opens its store
        watch connection to the root there, not all N at once in a measured restore (a burst the root's
        listen backlog of 5 does not take, see docs/benchmarks.md); the measured ones reuse it."""
        ident = secrets.token_hex(6)
        warm = None
        if not fresh and warm_stagger_s > 0:
            warm = self.restore(f"restore/{ident}/warm", decisions, fresh, wait_s, warm_stagger_s)
            if warm["failed"]:
                raise BedError(f"the warm-up restore failed on {warm['failed']} clients: {warm['errors'][:3]}")
        time.sleep(settle_s)
        c0, wall0, load0 = self.counters_all(), time.monotonic(), os.getloadavg()[0]
        runs = [self.restore(f"restore/{ident}/{i}", decisions, fresh, wait_s) for i in range(count)]
        time.sleep(settle_s)
        c1 = self.counters_all()
        window = time.monotonic() - wall0
        ops0 = next((r["ops"] for r in c0 if r.get("ops") is not None), {}) or {}
        ops1 = next((r["ops"] for r in c1 if r.get("ops") is not None), {}) or {}
        ops = {k: ops1.get(k, 0) - ops0.get(k, 0) for k in ops1 if k.endswith(" red") and ops1.get(k, 0) != ops0.get(k, 0)}
        n, k = self.nodes, count
        nd = n * k * decisions
        sets, watches, idle = _both(ops, "set red"), _both(ops, "watch red"), _both(ops, "watch-timeout red")
        sent = sum(r["decisions_sent"] for r in c1) - sum(r["decisions_sent"] for r in c0)
        root = next((r["root"] for r in c1 if r.get("root") is not None), None) or {"red_keys": [], "open": []}
        mine = f"restore/{ident}/"
        # a contribution is red/<decision>/<node> (absorbed by the root as it arrives): none may stay
        contributions = [key for key in root["red_keys"] if key.startswith(mine) and key.count("/") >= 4]
        results = [key for key in root["red_keys"] if key.startswith(mine) and key.count("/") == 3
                   and not key.startswith(mine + "warm/")]
        per_dec = [d["first_request_to_last_answer_s"] for r in runs for d in r["decisions"]]
        after_last = [d["last_request_to_last_answer_s"] for r in runs for d in r["decisions"]]
        spread = [d["request_spread_s"] for r in runs for d in r["decisions"]]
        whole = [r["restore_s"] for r in runs if r["restore_s"] is not None]
        answers = [[d["answers"] for d in r["decisions"]] for r in runs]
        return {
            "nodes": n, "procs": len(self.workers), "restores": k, "decisions_per_restore": decisions,
            "fresh_connection": fresh,
            "msgs_per_node_restore": (sets + watches) / (n * k), "msgs_per_node_decision": (sets + watches) / nd,
            "contributions_per_node_decision": sets / nd, "result_watches_per_node_decision": watches / nd,
            "idle_repolls": idle, "red_ops": ops,
            "decisions_sent_per_node_decision": sent / nd,
            "rounds": round(sent / nd) + round((watches - idle) / nd),
            "clients_answered": min((d["clients"] for r in runs for d in r["decisions"]), default=0),
            "failed": sum(r["failed"] for r in runs), "errors": [e for r in runs for e in r["errors"]][:20],
            "same_answers": all(len(a) == 1 for ans in answers for a in ans) and len(answers) == k
                            and all(len(ans) == decisions for ans in answers),
            "answers": answers[0] if answers else [],
            "restore_p50_ms": 1e3 * statistics.median(whole) if whole else None,
            "restore_p99_ms": 1e3 * _pct(whole, 0.99) if whole else None,
            "decision_p50_ms": 1e3 * statistics.median(per_dec) if per_dec else None,
            "decision_p99_ms": 1e3 * _pct(per_dec, 0.99) if per_dec else None,
            "after_last_request_p50_ms": 1e3 * statistics.median(after_last) if after_last else None,
            "request_spread_p50_ms": 1e3 * statistics.median(spread) if spread else None,
            "left_contributions": contributions, "left_open": root["open"], "results_kept": len(results),
            "watch_conns_added": sum(r["watch_conns"] for r in c1) - sum(r["watch_conns"] for r in c0),
            "threads_added": sum(r["threads"] for r in c1) - sum(r["threads"] for r in c0),
            "warm_up_restore_s": warm["restore_s"] if warm else None, "backlog": self.backlog,
            "bed_cpu_cores": (sum(r["cpu_s"] for r in c1) - sum(r["cpu_s"] for r in c0)) / window,
            "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        }

    @staticmethod
    def _check(r: dict) -> dict:
        if r["missing"]:
            raise BedError(f"step {r['step']}: nodes {r['missing'][:20]} (of {len(r['missing'])}) never learnt it "
                           f"was agreed")
        return r

    # -------------------------------------------------------------- teardown
    def close(self) -> dict:
        """Stop the workers (the root's last), check nothing is left (segments, sockets, processes),
        remove the bed's directories. Returns what was left (empty lists: nothing)."""
        if self.closed is not None:
            return self.closed
        left: list[str] = []
        stuck: list[int] = []
        # first every agent's heartbeat stopped (no agent starts a root election while the others stop), then
        # every worker but the root's stopped at once, then the root's
        live = [w for w in self.workers if w.popen.poll() is None]
        for w in live:
            try:
                w.send({"cmd": "quiesce"})
            except (OSError, ValueError):
                pass
        for w in live:
            try:
                w.recv(60, "quiesce")
            except BedError:
                pass
        for group in (self.workers[1:], self.workers[:1]):
            for w in group:
                try:
                    if w.popen.poll() is None:
                        w.send({"cmd": "stop"})
                        w.popen.stdin.close()  # type: ignore[union-attr]
                except (OSError, ValueError):
                    pass
            for w in group:
                try:
                    left += w.recv(180, "stopped")["left"]
                except BedError:
                    pass
                try:
                    w.popen.wait(30)
                except subprocess.TimeoutExpired:
                    stuck.append(w.popen.pid)
                    w.popen.kill()  # only the bed's own worker, by its pid
                    w.popen.wait(10)
        left += [os.path.join(self.shm_dir, f) for f in os.listdir(self.shm_dir)] if os.path.isdir(self.shm_dir) else []
        sockets = os.path.join(self.tmp, "s")
        left += [os.path.join(sockets, f) for f in os.listdir(sockets)] if os.path.isdir(sockets) else []
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.closed = {"left": sorted(set(left)), "stuck_workers": stuck,
                       "alive_workers": [w.popen.pid for w in self.workers if w.popen.poll() is None]}
        return self.closed


if __name__ == "__main__":
    _worker_main()
