"""The per-node snapshot agent (REFT's snapshot management process): its service.

One long-lived process per node, started by ``megatron-ft launch`` before the trainers and not
a child of any of them. It

* owns the node's shared-memory slots (:mod:`.slot_store`): two per local rank (REFT's clean/dirty
  double buffer), created and pre-faulted on first registration, re-adopted after an agent restart;
* hands a trainer the slot to write next (``begin``) and never the one holding the newest
  globally consistent version; flips a slot to CLEAN only when the trainer ``commit``s a
  complete, well-formed snapshot;
* persists the newest globally consistent version to disk every ``persist.interval`` steps,
  and at once when a trainer's connection drops without ``bye`` ("save at breakpoint"; :mod:`.persister`);
* serves restarted trainers the list of clean versions it holds (they map the slot and read);
* judges whether a local trainer hangs, from where each says it is (:mod:`.hang_watch`);
* removes its segments on clean shutdown (``shutdown`` op, SIGTERM or SIGINT; or its launcher gone
  for good, :mod:`.launcher_watch`).

The service (:class:`Agent`) wires the parts together: it answers the trainers' operations through
a table (:data:`.operations.HANDLERS`), and where a version operation concerns the redundancy or the
persister, it tells them what the slot store returned - with no lock of the slot store held.
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

from . import shm
from .. import config as ftconfig, fatal, network
from ..transport import wire
from .decisions import NodeDecisions
from .guard_memory import GuardMemory
from .hang_watch import HangWatch, start_for
from ..health.monitor import stood_down_path
from .job_agreement import JobAgreement
from .launcher_watch import JobEndWatch, LauncherWatch
from .operations import HANDLERS
from .persister import Persister
from .protocol import MESSAGES, Hello, remove_node_sockets, socket_path
from .slot_store import SlotRef, SlotStore

__all__ = ["Agent", "JobEndWatch", "SlotRef", "main", "serve"]

log = logging.getLogger("megatron_ft.agent")


class Agent:
    """One node's agent service. Owns its parts: the slot store (``slots``), the persister, the guard
    memory, the launcher watch, the job-wide agreement and decisions, and (after :meth:`start_peers`)
    the coordination store, the heartbeat monitor and the peer redundancy.

    Lock order (docs/architecture.md): ``Agent.lock`` guards only the trainers' connection counts and
    nothing is taken under it. ``SlotStore.lock`` and ``Redundancy.lock`` are never held together: the
    redundancy calls into the slot store (``pin_step``, ``clean_steps``, ``slot_sizes``,
    ``install_recovered``) without its own lock, and the service reads the redundancy's steps before
    it calls the slot store. Neither is held across network I/O, a store call or a shared-memory
    allocation."""

    def __init__(self, cfg: ftconfig.FTConfig, node: int, secret: Optional[bytes] = None):
        self.cfg = cfg
        self.node = node
        self.secret = secret  # the job's: every store and peer-transport connection proves it (both ways)
        self.run_id = cfg.run_id
        self.lock = threading.Lock()
        self.connected: dict[int, int] = {}  # rank -> open trainer connections
        self._stop = threading.Event()
        self._done = threading.Event()  # set when shutdown() has finished
        self.slots = SlotStore(cfg, node)
        self.persister = Persister(cfg, node, self.slots, self._stop)
        self.guard = GuardMemory()
        self.launcher = LauncherWatch(cfg, node, self._stop, self.shutdown, lambda: self.store)
        self.decisions = NodeDecisions(cfg.cluster.ranks_per_node)
        self.socket_path = socket_path(cfg.agent.socket_dir, self.run_id, node)
        self._server: Optional[wire.Server] = None
        self.started = time.time()
        self.redundancy = None  # agent.redundancy.Redundancy when redundancy.scheme != none (start_peers)
        self.store = None
        self.monitor = None
        self.agreement: Optional[JobAgreement] = None  # snapshot.agreement: agents (start_agreement)
        self._marks = (-1, -1)  # the verdict's (certified, watched) applied to the local ranks
        self.hang: Optional[HangWatch] = None  # hang.enabled (serve starts it, after the store)
        self.exit_code = 0  # fatal.EXIT_STOOD_DOWN once it stood down (stand_down)

    def start_peers(self) -> None:
        """Join the job's coordination store (every multi-node job: heartbeats, verdicts, the rendezvous
        record) and, with peer redundancy, the group's peer transport."""
        from ..health.etcd_liveness import monitor_class
        from ..health.store import make_store, store_needed
        from .redundancy import Redundancy

        if not store_needed(self.cfg):
            return
        h = self.cfg.health
        self.store = make_store(self.cfg, self.node, self.secret)
        self.store.fence_as(os.getpid(), self.stand_down)  # writes refused once its node is claimed (health.fencing)
        self.store.connect(self.cfg.agent.connect_timeout_s)
        if self.cfg.redundancy.scheme != "none":
            self.redundancy = Redundancy(self.slots, self.cfg, self.node, self.secret, self.store,
                                         network.listen_address(self.cfg, self.node))
        # without a peer port the root has nothing to probe: a lost node is judged after timeout_s
        self.monitor = monitor_class(self.store)(self.store, self.node, self.cfg.cluster.nodes, h.heartbeat_s,
                                                 h.timeout_s, launcher_pid=self.launcher.launcher_pid,
                                                 address=self.redundancy.address if self.redundancy is not None else "",
                                                 trained=self.trained, fenced=self.stand_down, finished=lambda: (
                                                     self.hang is not None and self.hang.training_over)).start()
        if self.redundancy is not None:
            for rank, size in self.slots.slot_sizes().items():
                self.redundancy.peers.publish_size(rank, size)

    def start_agreement(self) -> None:
        """Join the job-wide agreement (``snapshot.agreement: agents``; after :meth:`start_peers`: through
        the store where the job has one, else decided on this node alone)."""
        if self.cfg.snapshot.agreement != "agents" or self.agreement is not None:
            return
        certify_after = self.cfg.recovery.certify_after if self.cfg.recovery.prefer == "certified" else None
        job = JobAgreement(self.node, self.cfg.cluster.nodes if self.store is not None else 1, self.store,
                           self.slots.protect_agreed, self._agreed_locally,
                           poll_s=max(0.5, 2 * self.cfg.health.heartbeat_s), certify_after=certify_after)
        with self.slots.lock:  # attached before its threads start: a verdict already in the store (a restarted
            self.slots.agreement.attach(job, self.slots.table)  # agent) is learned at once, into the slot store
        self.agreement = job.start()

    def stand_down(self, why: str) -> None:
        """Judged lost while it did not run, its node claimed meanwhile: end with ``EXIT_STOOD_DOWN``
        (its launcher then ends the node's trainers), its memory an old generation's (segments removed)."""
        log.error("agent node %d: %s: this agent stands down", self.node, why)
        self.exit_code = fatal.EXIT_STOOD_DOWN
        if os.environ.get("MFT_RUN_DIR"):  # for its launcher, whatever exit code it sees (an adopted agent's)
            open(stood_down_path(os.environ["MFT_RUN_DIR"], self.node), "w").close()
        threading.Thread(target=self.shutdown, name="stand-down", daemon=True).start()

    def trained(self) -> bool:
        """Whether a trainer registered with this agent (or with the agent whose slots it adopted):
        the job is past its start. Lock-free (one attribute read), called by the heartbeat thread."""
        return self.slots.trained

    def launcher_pid(self) -> int:
        """The launcher that owns this agent now (0: orphaned or never watched). Lock-free."""
        return self.launcher.launcher_pid()

    def watch_launcher(self, pid: int, poll_s: float = 0.5) -> None:
        """Follow the node's launcher ``pid`` (:class:`~.launcher_watch.LauncherWatch`)."""
        self.launcher.watch(pid, poll_s)

    # ------------------------------------------------------------------ operations that tell several parts
    def register(self, rank: int, layout_json: str) -> dict:
        """``rank``'s slots (:meth:`SlotStore.register`); their size published to the group afterwards."""
        reply, size = self.slots.register(rank, layout_json)
        if self.redundancy is not None:  # a store call: no lock held
            self.redundancy.peers.publish_size(rank, size)
        return reply

    def begin(self, rank: int, step: int) -> int:
        red = self.redundancy
        # the redundancy's steps are read before the slot store's lock is taken (lock order: never both)
        keep = red.protected_steps() if red is not None else set()
        staging_only = red is not None and red.own_copy_is_redundant
        if staging_only:
            keep = red.sending_steps()
        return self.slots.begin(rank, step, keep, staging_only)

    def commit(self, rank: int, slot_idx: int, step: int, loss: Optional[float] = None) -> None:
        self.slots.commit(rank, slot_idx, step)
        if loss is not None:
            self.guard.record(rank, step, loss)

    def refuse(self, rank: int, step: int) -> dict:
        """The guard refused ``step`` (its restored values, or the losses after restoring it): drop it
        and every newer version (as :meth:`rewind` to the step before), count the rollback; its count."""
        self.rewind(rank, step - 1)
        n = self.guard.refused(rank)
        log.error("agent node %d: rank %d refused step %d after restoring it (rollback %d)", self.node, rank, step, n)
        return {"rollbacks": n}

    def certify(self, rank: int, step: int) -> dict:
        """The job trained past ``step`` (restored, or taken while training) and its guard found nothing:
        ``step`` is certified - its slot kept while it is the newest certified one it holds - and the
        rollbacks counted so far are forgiven (the limit is per incident, not per job)."""
        certified = self.guard.certified(rank, step)
        held, marked = self.slots.mark(rank, step, certified=True)
        self._keep_marked(marked)
        return {"certified": certified, "held": held}

    def watch(self, rank: int, step: int) -> dict:
        """``step`` is the version whose next iterations the trainers judge: keep its slot until it is
        certified or another one is watched."""
        held, marked = self.slots.mark(rank, step, certified=False)
        self._keep_marked(marked)
        return {"held": held}

    def _keep_marked(self, steps: set[int]) -> None:
        """The marked steps kept in the node's peer blocks too, so that a lost member's ranks can be
        rebuilt at them (no lock of the slot store held)."""
        if self.redundancy is not None and self.cfg.recovery.marked_versions:
            self.redundancy.keep_marked(steps)

    def rewind(self, rank: int, step: int) -> dict:
        """The job resumed ``rank`` from ``step`` (-1: fresh): versions newer than ``step`` are an
        abandoned future; the agreed step, the redundancy's complete step and the persisted steps go
        down to ``step``, so the resumed version is protected and later snapshots are taken, exchanged
        and persisted again."""
        dropped = self.slots.rewind(rank, step)
        self.persister.rewound(step)
        if self.redundancy is not None:
            self.redundancy.rewind(step)
        return {"dropped": dropped}

    def mark_global(self, rank: int, step: int) -> None:
        """``step`` is clean on every rank of the job (the trainers agreed on it, or restored it)."""
        self.slots.agree(rank, step)
        self._agreed_locally()

    def _agreed_locally(self) -> None:
        """Every local rank's agreed step known: the step all of them agreed on is exchanged with the
        group and persisted when due, the job's certified and watched versions (its verdict, with
        ``recovery.prefer: certified``) marked on every local rank (the job agreement's ``after`` hook
        too; no lock held)."""
        self._apply_marks()
        low = self.slots.agree()
        persist_step = self.persister.due(low)
        if self.redundancy is not None and low >= 0:
            self.redundancy.version_global(low)
        if persist_step is not None:
            self.persister.request(persist_step, "interval")

    def judge(self, rank: int, iteration: int, anomalous: bool) -> dict:
        """``rank``'s verdict on ``iteration``'s loss, for the root's certifier; the reply says the newest
        certified step this agent knows."""
        with self.slots.lock:
            return {"certified": self.slots.agreement.judge(rank, iteration, anomalous, self.slots.table)}

    def _apply_marks(self) -> None:
        """The verdict's certified and watched steps, as ``certify`` and ``watch`` of every local rank,
        once per change (no lock held)."""
        if self.agreement is None:
            return
        v = self.agreement.verdict
        marks = (v.certified, v.watched)
        if v.judged < 0 or marks == self._marks:
            return
        self._marks = marks
        for r in list(self.slots.clean_steps()):
            if v.certified >= 0:
                self.certify(r, v.certified)
            if v.watched >= 0:
                self.watch(r, v.watched)

    def trainer_lost(self, rank: int) -> None:
        self.slots.transport.unpin(rank)  # its scheduled transfer died with it
        log.warning("agent node %d: trainer rank %d disconnected without bye (crashed?)", self.node, rank)
        if self.monitor is not None:
            self.monitor.report_software(rank)
        self.persister.breakpoint(rank)

    def status(self) -> dict:
        with self.lock:
            connected = {str(r): n for r, n in sorted(self.connected.items())}
        return {"node": self.node, "run_id": self.run_id, "pid": os.getpid(), "connected": connected,
                **self.slots.status(), **self.persister.status(),
                "root": self.store.root if self.store is not None else None,
                **(self.hang.status() if self.hang is not None else {}),
                "redundancy": self.redundancy.status() if self.redundancy is not None else None}

    # ------------------------------------------------------------------ serving
    def serve_forever(self) -> None:
        """Serve trainers on the node's Unix socket (:mod:`megatron_ft.transport.wire`) until
        :meth:`shutdown`; starts the persist thread."""
        self._server = wire.Server(self.socket_path, self, name=f"agent-n{self.node}")
        self.persister.start()
        log.info("agent node %d (pid %d) serving on %s; %s", self.node, os.getpid(), self.socket_path,
                 shm.backing_note(self.cfg.agent.shm_dir))
        self._server.serve_forever()

    # wire.Handler: one connection per trainer (and per scheduled-transport thread, launcher, CLI)
    def handle(self, conn: wire.Connection, msg: dict) -> "wire.Reply | dict":
        req = MESSAGES.parse(msg)  # a malformed request is refused here, naming the field
        reply = HANDLERS[req.op](self, req)
        if isinstance(req, Hello) and req.role is None and req.rank >= 0:
            rank = conn.state["rank"] = req.rank  # a trainer (not its transport's threads)
            with self.lock:
                fresh = not self.connected.get(rank)
                self.connected[rank] = self.connected.get(rank, 0) + 1
            if fresh:  # a restarted trainer: no transfer of the old one
                self.slots.transport.unpin(rank)
        if req.op == "bye":
            return wire.Reply(reply, close=True, orderly=True)
        if req.op == "shutdown":
            return wire.Reply(reply, close=True, orderly=True, then=self.shutdown)
        return reply

    def closed(self, conn: wire.Connection) -> None:
        rank = conn.state.get("rank")
        if rank is None:
            return
        with self.lock:
            self.connected[rank] = max(0, self.connected.get(rank, 1) - 1)
        if not conn.orderly and not self._stop.is_set():
            self.trainer_lost(rank)

    def shutdown(self, remove_segments: bool = True) -> None:
        """Clean shutdown: finish the persist under way, remove segments and the socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._server is not None:
            self._server.close()
        self.persister.close()
        if self.hang is not None:
            self.hang.close(unlink=remove_segments)
        if self.agreement is not None:
            self.agreement.close()
        if self.monitor is not None:
            self.monitor.stop()
        if self.redundancy is not None:
            self.redundancy.close(remove_segments)
        if self.store is not None and hasattr(self.store, "close"):  # its server and connections (embedded)
            try:
                self.store.close()
            except Exception as e:
                log.warning("agent node %d: closing the store: %s", self.node, e)
        self.slots.close(remove_segments)
        remove_node_sockets(self.cfg.agent.socket_dir, self.run_id, self.node)
        log.info("agent node %d: shut down%s", self.node, " (segments removed)" if remove_segments else "")
        self._done.set()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ft.agent", description="megatron-ft per-node snapshot agent")
    p.add_argument("--config", default=None, help="job YAML (default: embedded local-cpu.yaml)")
    p.add_argument("--node", type=int, required=True, help="node index")
    p.add_argument("--run-id", default=None)
    p.add_argument("--persist-interval", type=int, default=None)
    p.add_argument("--persist-dir", default=None)
    p.add_argument("--secret-file", default=None,
                   help="the job's secret (megatron_ft/transport/credential.py; default: security.secret_file, "
                        "else MFT_JOB_SECRET_FILE); needed by a job of several nodes or with peer redundancy")
    p.add_argument("--launcher-pid", type=int, default=None,
                   help="the node's launcher: when it dies, wait launch.start_timeout_s for a new one to adopt "
                        "this agent (its slots stay for the restarted trainers), else shut down and remove them")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[agent n{args.node} %(asctime)s] %(levelname)s %(message)s")
    # `kill -USR1 <agent pid>`: every thread's stack into the agent's log (a stuck agent, diagnosed live)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cfg = ftconfig.load(args.config)
    pers = {k: v for k, v in (("interval", args.persist_interval), ("dir", args.persist_dir or None)) if v is not None}
    changes = {**({"run_id": args.run_id} if args.run_id else {}), **({"persist": pers} if pers else {})}
    if changes:
        cfg = ftconfig.replace(cfg, **changes)
    secret = None
    from ..health.store import store_needed

    if store_needed(cfg):  # the store's and the peer transport's connections prove the job's secret
        from ..transport.credential import ENV, configured_secret, read_secret

        try:
            secret = read_secret(args.secret_file) if args.secret_file else configured_secret(cfg, os.environ)
            if secret is None:
                raise ftconfig.ConfigError(f"the agent of a job of several nodes or with peer redundancy needs the "
                                           f"job's secret: --secret-file, security.secret_file or {ENV}")
        except ftconfig.ConfigError as e:
            log.error("agent node %d: %s", args.node, e)
            return 2
    return serve(cfg, args.node, secret, args.launcher_pid)


def serve(cfg: ftconfig.FTConfig, node: int, secret: Optional[bytes], launcher_pid: Optional[int] = None) -> int:
    """Run node ``node``'s agent on the calling thread until it is shut down (SIGTERM, SIGINT, or its
    launcher gone for good); ``secret``: the job's, which every store and peer-transport connection
    proves (:func:`main` refuses to start a job that needs one without it). Returns the exit status."""
    agent = Agent(cfg, node, secret)
    agent.slots.adopt_existing()
    agent.start_peers()
    agent.start_agreement()
    agent.hang = start_for(cfg, node, agent.store)  # the local trainers' progress judged (hang.enabled)

    def on_signal(signum, frame):  # clean shutdown on SIGTERM / SIGINT
        threading.Thread(target=agent.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if launcher_pid:
        agent.watch_launcher(launcher_pid)
    agent.serve_forever()
    agent._done.wait(timeout=600)  # the shutdown thread drains persists and removes segments
    return agent.exit_code


if __name__ == "__main__":
    sys.exit(main())
