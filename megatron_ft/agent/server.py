"""The per-node snapshot agent (REFT's snapshot management process).

One long-lived process per node, started by ``megatron-ft launch`` before the trainers and not
a child of any of them. It

* owns the node's shared-memory slots: two per local rank (REFT's clean/dirty double buffer),
  created and pre-faulted on first registration, re-adopted after an agent restart;
* hands a trainer the slot to write next (``begin``) and never the one holding the newest
  globally consistent version; flips a slot to CLEAN only when the trainer ``commit``s a
  complete, well-formed snapshot;
* persists the newest globally consistent version to disk every ``persist.interval`` steps,
  and at once when a trainer's connection drops without ``bye`` ("save at breakpoint");
* serves restarted trainers the list of clean versions it holds (they map the slot and read);
* removes its segments on clean shutdown (``shutdown`` op, SIGTERM or SIGINT).
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from . import shm, persist
from .block_store import MAX_VERSIONS as MAX_BLOCK_VERSIONS
from .. import config as ftconfig
from .. import network
from ..capture import snapfile
from ..capture.layout import Layout
from ..redundancy.plan import plan_from_config
from ..transport import wire
from ..transport.messages import Request
from . import reductions
from .agreement import NodeReport, PendingAgreement, Verdict, node_report, resolved
from .job_agreement import JobAgreement
from .protocol import MESSAGES, Hello, socket_path
from .versions import CLEAN, TransitionError, VersionTable

log = logging.getLogger("megatron_ft.agent")

SLOTS_PER_RANK = 2
#: anomalous iterations a node's report carries at most (the newest; the root judges them in order)
MAX_ANOMALIES = 64
#: losses kept per rank for the guard after a restore (the newest committed steps')
LOSS_HISTORY = 64


@dataclass(frozen=True)
class SlotRef:
    """A slot handed to a reader outside the agent's lock (persist, exchange, scheduled transport):
    its segment and the step it held when pinned. The pin keeps ``begin`` off it until released."""
    rank: int
    index: int
    step: int
    segment: shm.Segment


class JobEndWatch:
    """Whether the job an orphaned agent belongs to is over, from the store (no I/O of its own: ``get``
    reads a key). Over when a launcher recorded the job's end (``ended``, written no earlier than
    ``health.timeout_s`` before this agent lost its launcher: an older record is another job's on a
    store that outlives jobs), or when every other node's heartbeat has not changed (or been absent)
    for ``timeout_s`` on this agent's clock: their agents were stopped with their launchers.

    >>> beats = {"hb/1": "a"}
    >>> w = JobEndWatch(node=0, nodes=2, timeout_s=5.0, since=100.0)
    >>> w.over(beats.get, now=101.0), w.over(beats.get, now=105.0), w.over(beats.get, now=106.5)
    (None, None, 'no heartbeat from nodes [1] for 5 s')
    >>> w.over({"ended": '{"node": 1, "rc": 0, "time": 99.0}'}.get, now=102.0)
    "node 1's launcher ended the job (exit 0)"
    """

    def __init__(self, node: int, nodes: int, timeout_s: float, since: float):
        self.node, self.nodes, self.timeout_s, self.since = node, nodes, timeout_s, since
        self._seen: dict[int, tuple[Optional[str], float]] = {}  # node -> (heartbeat, our time it last changed)

    def over(self, get, now: Optional[float] = None) -> Optional[str]:
        """Why the job is over, or None (also when the store cannot be read now)."""
        import json

        now = time.time() if now is None else now
        try:
            ended = get("ended")
            rec = json.loads(ended) if ended else None
            if isinstance(rec, dict) and float(rec.get("time", 0)) >= self.since - self.timeout_s:
                return f"node {rec.get('node')}'s launcher ended the job (exit {rec.get('rc')})"
            beats = {n: get(f"hb/{n}") for n in range(self.nodes) if n != self.node}
        except Exception:  # a store moving or gone: no news
            return None
        quiet = []
        for n, beat in beats.items():
            last = self._seen.get(n)
            if last is None or last[0] != beat:
                self._seen[n] = (beat, now)
            elif now - last[1] >= self.timeout_s:
                quiet.append(n)
        if beats and len(quiet) == len(beats):
            return f"no heartbeat from nodes {quiet} for {self.timeout_s:g} s"
        return None


@dataclass
class _Decision:
    """A job-wide decision's local side: the local ranks' values, whether the node's combination went
    out, the job's result or why there is none."""
    how: str
    values: dict = field(default_factory=dict)
    sent: bool = False
    result: Optional[list] = None
    error: Optional[str] = None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Agent:
    """One node's agent. Lock order: ``Agent.lock`` and ``Redundancy.lock`` are never held together:
    the redundancy calls into the agent (``pin_step``, ``clean_steps``, ``slot_sizes``,
    ``install_recovered``) without its own lock, and the agent reads the redundancy's steps before it
    takes its own. Neither is held across network I/O, a store call or a shared-memory allocation
    (docs/architecture.md)."""

    def __init__(self, cfg: ftconfig.FTConfig, node: int, secret: Optional[bytes] = None):
        self.cfg = cfg
        self.node = node
        self.secret = secret  # the job's: every store and peer-transport connection proves it (both ways)
        self.run_id = cfg.run_id
        self.lock = threading.RLock()
        self.table = VersionTable()  # slot states (pure; mirrored into the container headers)
        self.segments: dict[int, list[shm.Segment]] = {}  # rank -> its slots' segments, by index
        self.fingerprints: dict[int, str] = {}  # rank -> its layout's fingerprint
        self.layouts: dict[int, bytes] = {}  # rank -> its layout record (to re-initialise a repaired slot)
        self._reserved: dict[int, int] = {}  # rank -> shared memory being allocated for it (outside the lock)
        self._peer_reserved = 0  # shared memory this node's blocks for its group take at most (reserve_peer_blocks)
        self._peer_refusal = ""  # why they do not fit: every begin is refused with it
        self.connected: dict[int, int] = {}  # rank -> open trainer connections
        self.persisted: list[int] = []
        self.persist_errors: list[str] = []
        self._persist_q: "queue.Queue[Optional[tuple[int, str]]]" = queue.Queue()
        self._queued_steps: set[int] = set()
        self._persist_due = 0  # the next step at which an interval persist is due
        self._stop = threading.Event()
        self._done = threading.Event()  # set when shutdown() has finished
        self.socket_path = socket_path(cfg.agent.socket_dir, self.run_id, node)
        self._server: Optional[wire.Server] = None
        self._persist_thread: Optional[threading.Thread] = None
        self.started = time.time()
        self._sched_pins: dict[int, SlotRef] = {}  # rank -> the slot its scheduled transport reads
        self.redundancy = None  # agent.redundancy.Redundancy when redundancy.scheme != none (start_peers)
        self.store = None
        self.monitor = None
        self._launcher = 0  # the launcher pid watch_launcher follows (0: none)
        self._orphan = False  # that launcher is gone and no new one adopted this agent yet
        self._trained = False  # a trainer registered (or slots were adopted): the job is past its start
        # the guard's memory (megatron_ft.trainer.guard), kept across trainer restarts, lost with the agent:
        self.losses: dict[int, dict[int, float]] = {}  # rank -> {step: loss} of its newest committed steps
        self.rollbacks: dict[int, int] = {}  # rank -> versions refused since the guard last passed
        self.certified: dict[int, set[int]] = {}  # rank -> steps certified (the newest LOSS_HISTORY)
        # the job-wide agreement (snapshot.agreement: agents): each local rank's newest finished step,
        # this node's side of the agreement (start_agreement), what it skipped while a step was pending
        self.seen: dict[int, int] = {}
        # recovery.prefer: certified - each local rank's newest judged iteration and its anomalous ones
        self.judged: dict[int, int] = {}
        self.anomalies: dict[int, set[int]] = {}
        self._marks = (-1, -1)  # the verdict's (certified, watched) applied to the local ranks
        self.agreement: Optional[JobAgreement] = None
        self.skipped_pending = 0
        # job-wide decisions of the local ranks (a restore's), keyed by decision: their values, then the result
        self._decisions: dict[str, _Decision] = {}
        self._decided = threading.Condition(threading.Lock())

    def start_peers(self) -> None:
        """Join the job's coordination store (every multi-node job: heartbeats, verdicts, the rendezvous
        record) and, with peer redundancy, the group's peer transport."""
        from ..health.monitor import Monitor
        from ..health.store import make_store, store_needed
        from .redundancy import Redundancy

        if not store_needed(self.cfg):
            return
        h = self.cfg.health
        self.store = make_store(self.cfg, self.node, self.secret)
        self.store.connect(self.cfg.agent.connect_timeout_s)
        if self.cfg.redundancy.scheme != "none":
            self.redundancy = Redundancy(self, self.store, network.listen_address(self.cfg, self.node))
        # without a peer port the root has nothing to probe: a lost node is judged after timeout_s
        self.monitor = Monitor(self.store, self.node, self.cfg.cluster.nodes, h.heartbeat_s, h.timeout_s,
                               launcher_pid=self.launcher_pid,
                               address=self.redundancy.address if self.redundancy is not None else "",
                               trained=self.trained).start()
        if self.redundancy is not None:
            for rank, size in self.slot_sizes().items():
                self.redundancy.publish_size(rank, size)

    def start_agreement(self) -> None:
        """Join the job-wide agreement (``snapshot.agreement: agents``; after :meth:`start_peers`: through
        the store where the job has one, else decided on this node alone)."""
        if self.cfg.snapshot.agreement != "agents" or self.agreement is not None:
            return
        self.agreement = JobAgreement(self.node, self.cfg.cluster.nodes if self.store is not None else 1, self.store,
                                      self._protect_agreed, self._agreed_locally,
                                      poll_s=max(0.5, 2 * self.cfg.health.heartbeat_s),
                                      certify_after=(self.cfg.recovery.certify_after
                                                     if self.cfg.recovery.prefer == "certified" else None)).start()
        with self.lock:
            self._report()

    # ------------------------------------------------------------------ segments
    def adopt_existing(self) -> int:
        """Re-adopt slots left in shared memory by a previous agent of this node (agent restart);
        the previous agent's peer block versions are removed (the group sends the next version again).

        A slot whose file was damaged while no agent watched it - cut to any length (to zero, inside
        its header, inside its data), or its header unreadable - loses its version, never the rank's
        other slots: it is rebuilt at full size as an EMPTY container from a readable sibling's layout
        (every slot of a rank has the same layout and size), so the rank's older clean version is still
        restored and the next snapshots use every slot again. A rank with no readable slot is dropped."""
        gone = shm.remove_block_segments(self.cfg.agent.shm_dir, self.run_id, self.node)
        if gone:
            log.info("agent node %d: removed %d peer block version(s) of the previous agent", self.node, len(gone))
        found: dict[int, dict[int, str]] = {}
        for rank, slot_idx, path in shm.list_segments(self.cfg.agent.shm_dir, self.run_id, self.node):
            found.setdefault(rank, {})[slot_idx] = path
        n = 0
        for rank, paths in sorted(found.items()):
            readable: dict[int, tuple[shm.Segment, int, int]] = {}  # slot -> (segment, state, step)
            damaged: dict[int, str] = {}  # slot -> why
            layout_json = None
            for idx, path in sorted(paths.items()):
                try:
                    seg, state, step, lj = self._read_left_slot(path)
                except (shm.SharedMemoryError, snapfile.SnapshotFormatError, OSError, ValueError) as e:
                    damaged[idx] = str(e)
                    continue
                readable[idx] = (seg, state, step)
                layout_json = layout_json or lj
            if layout_json is None:
                log.warning("agent node %d: rank %d has no readable slot (%s); discarding them", self.node, rank,
                            damaged)
                for path in paths.values():
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                continue
            for idx in range(max(max(paths) + 1, self.slots_per_rank())):  # damaged or missing: back empty
                if idx in readable:
                    continue
                path = os.path.join(self.cfg.agent.shm_dir, shm.segment_name(self.run_id, self.node, rank, idx))
                log.error("agent node %d: rank %d slot %d (%s) is damaged (%s); its version is dropped and the "
                          "slot rebuilt empty", self.node, rank, idx, path, damaged.get(idx, "missing"))
                readable[idx] = (self._rebuild_slot(path, layout_json), snapfile.EMPTY, -1)
            self.fingerprints[rank] = Layout.from_json(layout_json).fingerprint()
            self.layouts[rank] = layout_json
            self.segments[rank] = [readable[i][0] for i in sorted(readable)]
            for idx in sorted(readable):
                _, state, step = readable[idx]
                self.table.adopt(rank, idx, state, step)
                n += 1
        if n:
            self._trained = True
            log.info("agent node %d: adopted %d existing slots: %s", self.node, n, self.describe())
        return n

    @staticmethod
    def _read_left_slot(path: str) -> tuple[shm.Segment, int, int, bytes]:
        """(segment, state, step, layout JSON) of a slot a previous agent left. Cut inside its data, the
        file gets its size back and its version is dropped (EMPTY); torn mid-snapshot (WRITING), EMPTY
        too; CLEAN only with a well-formed version record. Raises when the header or layout cannot be read."""
        seg = shm.open_segment(path)  # SharedMemoryError: empty
        try:
            hdr = snapfile.read_header(seg.mm)
            state = hdr.state
            if seg.size < hdr.geometry.total:  # truncated behind the agents' back: its version is gone
                log.error("%s was truncated (%d of %d bytes); its version is dropped", path, seg.size,
                          hdr.geometry.total)
                seg.close()
                shm.restore_size(path, hdr.geometry.total)
                seg = shm.open_segment(path)
                state = snapfile.EMPTY
            g = hdr.geometry
            layout_json = bytes(seg.mm[g.layout_off: g.layout_off + g.layout_len])
            snapfile.read_layout(seg.mm, hdr)  # checks the layout record
            if state == snapfile.CLEAN:
                snapfile.read_version(seg.mm, hdr)  # well-formed record or not adopted as clean
            else:
                state = snapfile.EMPTY  # a WRITING one was torn by a crash mid-snapshot
            snapfile.set_state(seg.mm, state)
        except BaseException:
            seg.close()
            raise
        return seg, state, hdr.step if state == snapfile.CLEAN else -1, layout_json

    @staticmethod
    def _rebuild_slot(path: str, layout_json: bytes) -> shm.Segment:
        """The slot file at ``path`` (cut, unreadable or missing) at the full size of ``layout_json``'s
        container, an EMPTY container with that layout (same inode when the file exists)."""
        geom = snapfile.geometry_for(Layout.from_json(layout_json), layout_json)
        if os.path.exists(path):
            shm.restore_size(path, geom.total)
            seg = shm.open_segment(path)
        else:
            seg = shm.create(path, geom.total)
        Agent._init_empty(seg, layout_json)
        return seg

    @staticmethod
    def _init_empty(seg: shm.Segment, layout_json: bytes) -> None:
        """Write an EMPTY container with ``layout_json``'s layout into ``seg`` (its full size already)."""
        snapfile.init_container(seg.mm, layout_json, snapfile.geometry_for(Layout.from_json(layout_json), layout_json))

    def register(self, rank: int, layout_json: str) -> dict:
        """Slots for ``rank``'s layout: its existing ones when they fit, else new ones. The shared
        memory is allocated and pre-faulted *outside* ``Agent.lock`` (seconds for GiBs: other ranks'
        begin/commit never wait on it), against a budget reserved under the lock; the size is
        published to the store after the lock is released."""
        layout = Layout.from_json(layout_json.encode())
        fp = layout.fingerprint()
        geom = snapfile.geometry_for(layout, layout_json.encode())
        nslots = self.slots_per_rank()
        limit = self.cfg.agent.shm_limit_mib << 20
        with self.lock:
            rv = self.table.ranks.get(rank)
            segs = self.segments.get(rank, [])
            adopted = bool(rv and self.fingerprints.get(rank) == fp and len(segs) == nslots
                           and all(g.size >= geom.total for g in segs))
            if not adopted:
                if rv and any(s.pins for s in rv.slots):
                    raise RuntimeError(f"rank {rank}: slots are busy (being persisted); retry")
                if rv:
                    log.info("agent node %d: rank %d changed layout; dropping its old slots", self.node, rank)
                    self._drop_rank(rank)
                used = self._slot_bytes() + self._peer_reserved
                budget = max(0, limit - used) if limit else None
                self._reserved[rank] = geom.total * nslots
        self._trained = True
        if adopted:
            self._publish_size(rank, segs[0].size)
            return {"slots": [g.path for g in segs], "adopted": True}
        created: list[shm.Segment] = []
        try:
            for i in range(nslots):
                path = os.path.join(self.cfg.agent.shm_dir, shm.segment_name(self.run_id, self.node, rank, i))
                left = None if budget is None else budget - sum(g.size for g in created)
                try:
                    seg = shm.create(path, geom.total, left)
                except shm.SharedMemoryError as e:
                    for g in created:  # do not keep half a rank
                        g.close()
                        os.unlink(g.path)
                    if limit:
                        raise shm.SharedMemoryError(f"{e} (agent.shm_limit_mib={self.cfg.agent.shm_limit_mib})") from None
                    raise
                snapfile.init_container(seg.mm, layout_json.encode(), geom)
                created.append(seg)
        finally:
            with self.lock:
                self._reserved.pop(rank, None)
        with self.lock:
            self.table.add_rank(rank, nslots)
            self.segments[rank] = created
            self.fingerprints[rank] = fp
            self.layouts[rank] = layout_json.encode()
        self._publish_size(rank, geom.total)
        log.info("agent node %d: rank %d registered, %d x %.1f MiB slots", self.node, rank, nslots, geom.total / 2**20)
        return {"slots": [g.path for g in created], "adopted": False}

    def _slot_bytes(self) -> int:
        """Shared memory of the slots, allocated or being allocated (under ``Agent.lock``)."""
        return sum(g.size for gs in self.segments.values() for g in gs) + sum(self._reserved.values())

    def reserve_peer_blocks(self, need: int, blocks: int, allocated: int) -> None:
        """Count ``need`` bytes - every version of the ``blocks`` this node holds for its group, of
        which ``allocated`` exist already - in ``agent.shm_limit_mib`` and against the free space of
        ``agent.shm_dir``, once the group's container sizes are known and before any of them is sent or
        received. When it does not fit, a :class:`~.shm.SharedMemoryError` naming both numbers and the
        fix, and every later ``begin`` of this node's trainers is refused with it (a trainer with
        ``agent.required`` ends the job: exit 2). Takes ``Agent.lock``; no I/O but a statvfs."""
        limit = self.cfg.agent.shm_limit_mib << 20
        d = self.cfg.agent.shm_dir
        versions = MAX_BLOCK_VERSIONS + self.cfg.recovery.marked_versions
        with self.lock:
            slots = self._slot_bytes()
            what = (f"node {self.node}'s blocks for its peers ({self.cfg.redundancy.scheme}: {blocks} block(s), "
                    f"{versions} versions each) need {_mib(need)} of shared memory beside its slots' {_mib(slots)}")
            problem = ""
            if limit and slots + need > limit:
                problem = (f"{what}, {_mib(slots + need)} in all, but agent.shm_limit_mib={self.cfg.agent.shm_limit_mib}: "
                           f"raise it to at least {-(-(slots + need) // 2**20)}")
            else:
                free = shm.shm_free_bytes(d) - sum(self._reserved.values())
                if need - allocated > free:
                    problem = (f"{what}, but {d} has {_mib(free)} free: give it at least {_mib(need - allocated - free)} "
                               f"more (docker --shm-size, a Kubernetes emptyDir with medium: Memory and a larger "
                               f"sizeLimit) or point agent.shm_dir at a larger tmpfs")
            if not problem:
                self._peer_reserved, self._peer_refusal = need, ""
                return
            said, self._peer_refusal = self._peer_refusal, f"shared memory too small: {problem}"
        if said != self._peer_refusal:  # once (every peer's put asks again)
            log.error("agent node %d: %s", self.node, self._peer_refusal)
        raise shm.SharedMemoryError(self._peer_refusal)

    def _publish_size(self, rank: int, size: int) -> None:
        if self.redundancy is not None:  # a store call: never under Agent.lock
            self.redundancy.publish_size(rank, size)

    def slots_per_rank(self) -> int:
        """Two (REFT's clean/dirty double buffer), or one on an rs parity node: every packet it
        owns is also held whole by a data node of its group (ECHECK), so its own clean copy is only
        a cache and the slot is the staging buffer; its trainers' software failures are then served
        from the data node's copy when the slot is mid-write."""
        if self.cfg.redundancy.scheme != "none" and plan_from_config(self.cfg).own_copy_is_redundant(self.node):
            return 1
        if self.cfg.redundancy.transport == "scheduled":
            # + the version its trainer is still sending, while the group's complete one, the newest
            # clean one and the one being written stay: snapshots go on during a transfer
            return SLOTS_PER_RANK + 2 + self.cfg.recovery.marked_versions
        return SLOTS_PER_RANK + self.cfg.recovery.marked_versions

    def _drop_rank(self, rank: int) -> None:
        for g in self.segments.pop(rank, []):
            g.close()
            try:
                os.unlink(g.path)
            except FileNotFoundError:
                pass
        self.table.drop_rank(rank)
        self.fingerprints.pop(rank, None)
        self.layouts.pop(rank, None)

    def slot_sizes(self) -> dict[int, int]:
        """Container size of every registered local rank (its slots' size)."""
        with self.lock:
            return {r: gs[0].size for r, gs in self.segments.items() if gs}

    def _mirror(self, rank: int, slots) -> None:
        """Write the table's state of these slots into their container headers (caller holds the lock)."""
        for s in slots:
            if s is not None:
                snapfile.set_state(self.segments[rank][s.index].mm, s.state)

    def _ref(self, rank: int, s) -> SlotRef:
        return SlotRef(rank, s.index, s.step, self.segments[rank][s.index])

    def _check_intact(self, rank: int) -> None:
        """Find slots of ``rank`` whose file was truncated behind the agent's back (caller holds the
        lock): their version is invalidated and the file gets its size and an empty container back,
        so no reader (persist, exchange, trainer) ever maps past its end (SIGBUS)."""
        for s, seg in zip(self.table.get(rank).slots, self.segments[rank]):
            if shm.intact(seg):
                continue
            log.error("agent node %d: rank %d slot %d (%s) was truncated; its version is dropped and the slot "
                      "re-initialised", self.node, rank, s.index, s.describe())
            if s.state != snapfile.EMPTY:
                s.state, s.step = snapfile.EMPTY, -1
            try:
                shm.restore_size(seg.path, seg.size)
                self._init_empty(seg, self.layouts[rank])
            except OSError as e:
                log.error("agent node %d: could not repair %s: %s", self.node, seg.path, e)
                s.pins += 1  # never handed out again by this agent

    # ------------------------------------------------------------------ versions
    def begin(self, rank: int, step: int) -> int:
        red = self.redundancy
        # the redundancy's steps are read before taking the agent's lock (lock order: never both)
        keep = red.protected_steps() if red is not None else set()
        staging_only = red is not None and red.own_copy_is_redundant
        if staging_only:
            keep = red.sending_steps()
        with self.lock:
            if self._peer_refusal:  # the node cannot hold its peers' blocks: no snapshot it could protect
                raise shm.SharedMemoryError(self._peer_refusal)
            self._check_intact(rank)
            try:
                self._refuse_if_pending(rank, self.table.choose(rank, step, keep, staging_only), step)
                slot = self.table.begin(rank, step, keep, staging_only)
            except Exception:
                self._finished(rank, step)  # this rank will not hold step: the agreement must not wait for it
                raise
            self._mirror(rank, [slot])
            return slot.index

    def _refuse_if_pending(self, rank: int, slot, step: int) -> None:
        """:class:`PendingAgreement` if ``slot`` (the one ``begin`` would hand out) holds a version the job
        has not resolved yet (lock held)."""
        if self.agreement is None or slot.state != CLEAN:
            return
        verdict = self.agreement.verdict
        if not resolved(slot.step, verdict, self.table.clean_steps(), self.seen):
            self.skipped_pending += 1
            raise PendingAgreement(f"rank {rank}: snapshot of step {step} skipped: its step {slot.step} waits for "
                                   f"the job's agreement (agreed: step {verdict.agreed})")

    def _finished(self, rank: int, step: int) -> None:
        """``rank`` is done with ``step`` (committed, failed or skipped): this node's report (lock held)."""
        if step > self.seen.get(rank, -1):
            self.seen[rank] = step
            self._report()

    def _report(self) -> None:
        """This node's agreement report, handed to the reporting thread (lock held; no I/O)."""
        if self.agreement is None:
            return
        report = node_report(self.table.clean_steps(), self.seen, self.cfg.cluster.ranks_per_node)
        if self.judged:
            rpn = self.cfg.cluster.ranks_per_node
            judged = min(self.judged.values()) if len(self.judged) >= rpn else -1
            done = self.agreement.verdict.judged
            bad = sorted({it for its in self.anomalies.values() for it in its if it > done})[-MAX_ANOMALIES:]
            report = NodeReport(report.held, report.seen, judged, tuple(bad))
        self.agreement.report(report)

    def judge(self, rank: int, iteration: int, anomalous: bool) -> dict:
        """``rank`` judged ``iteration``'s loss (``recovery.prefer: certified``): the node's report carries
        it to the root's certifier; the reply says the newest certified step as this agent knows it."""
        with self.lock:
            self.judged[rank] = max(iteration, self.judged.get(rank, -1))
            if anomalous:
                self.anomalies.setdefault(rank, set()).add(iteration)
            done = self.agreement.verdict.judged if self.agreement is not None else -1
            for its in self.anomalies.values():
                its.difference_update([it for it in its if it <= done])
            self._report()
            return {"certified": self.agreement.verdict.certified if self.agreement is not None else -1}

    def decide(self, rank: int, key: str, how: str, values: list[int], wait_s: float) -> list[int]:
        """``rank``'s values for the job-wide decision ``key`` (a restore's, :mod:`.reductions`); the
        job's result. The node's last local rank to arrive sends the node's combination and waits for the
        result; the others wait for it too, each at most ``wait_s``. Lock: ``_decided`` only (never
        ``Agent.lock``), released across the network wait."""
        if self.agreement is None or not self.agreement.decides:
            raise RuntimeError("job-wide decisions through the agents are off here (snapshot.agreement: "
                               "collective, or an etcd store)")
        deadline = time.monotonic() + wait_s
        with self._decided:
            d = self._decisions.get(key)
            if d is None:
                d = self._decisions[key] = _Decision(how)
                while len(self._decisions) > 64:  # (the oldest, long answered)
                    del self._decisions[next(iter(self._decisions))]
            if d.how != how:
                raise ValueError(f"decision {key!r}: rank {rank} combines by {how!r}, another local rank by {d.how!r}")
            d.values[rank] = list(values)
            send = len(d.values) >= self.cfg.cluster.ranks_per_node and not d.sent
            d.sent = d.sent or send
        if send:
            try:
                result = self.agreement.decide(key, how, reductions.combine(how, list(d.values.values())),
                                               max(0.0, deadline - time.monotonic()))
                with self._decided:
                    d.result = result
                    self._decided.notify_all()
            except Exception as e:
                with self._decided:
                    d.error = f"{type(e).__name__}: {e}"
                    self._decided.notify_all()
        with self._decided:
            while d.result is None and d.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job-wide decision {key!r}: {len(d.values)} of "
                                       f"{self.cfg.cluster.ranks_per_node} local ranks arrived within {wait_s:g} s")
                self._decided.wait(left)
            if d.error is not None:
                raise RuntimeError(d.error)
            return list(d.result)

    def skip(self, rank: int, step: int) -> None:
        """The trainer takes no snapshot of ``step`` (its state could not be captured or registered)."""
        with self.lock:
            self._finished(rank, step)

    def _protect_agreed(self, verdict: Verdict) -> None:
        """The job's new verdict becomes this node's, and its agreed step, where every local rank holds
        it, the protected version - together, under the lock (then ``_agreed_locally`` exchanges and
        persists it, outside)."""
        with self.lock:
            assert self.agreement is not None
            self.agreement.verdict = verdict
            ranks = list(self.table.ranks)
            if (verdict.agreed < 0 or len(ranks) < self.cfg.cluster.ranks_per_node
                    or any(self.table.get(r).slot_with(verdict.agreed) is None for r in ranks)):
                return
            for r in ranks:
                self.table.agree(r, verdict.agreed)

    def commit(self, rank: int, slot_idx: int, step: int, loss: Optional[float] = None) -> None:
        with self.lock:
            seg = self.segments[rank][slot_idx] if rank in self.segments and 0 <= slot_idx < len(self.segments[rank]) \
                else None
            s = self.table.slot(rank, slot_idx)
            if s.state != snapfile.WRITING or s.step != step or seg is None:
                raise TransitionError(f"rank {rank} slot {slot_idx}: commit of step {step} but the slot is "
                                      f"{s.describe()}")
            hdr = snapfile.read_header(seg.mm)
            snapfile.read_version(seg.mm, hdr)
            if hdr.step != step:
                raise RuntimeError(f"rank {rank} slot {slot_idx}: header step {hdr.step} != committed {step}")
            others = [o for o in self.table.get(rank).slots if o is not s]
            self.table.commit(rank, slot_idx, step)
            self._mirror(rank, [s, *others])
            self.seen[rank] = max(step, self.seen.get(rank, -1))
            self._report()
            if loss is not None:
                history = self.losses.setdefault(rank, {})
                history[step] = loss
                for old in sorted(history)[:-LOSS_HISTORY]:
                    del history[old]

    def refuse(self, rank: int, step: int) -> dict:
        """The guard refused ``step`` (its restored values, or the losses after restoring it): drop it
        and every newer version (as :meth:`rewind` to the step before), count the rollback; its count."""
        self.rewind(rank, step - 1)
        with self.lock:
            self.rollbacks[rank] = self.rollbacks.get(rank, 0) + 1
            log.error("agent node %d: rank %d refused step %d after restoring it (rollback %d)", self.node, rank, step,
                      self.rollbacks[rank])
            return {"rollbacks": self.rollbacks[rank]}

    def certify(self, rank: int, step: int) -> dict:
        """The job trained past ``step`` (restored, or taken while training) and its guard found nothing:
        ``step`` is certified - its slot kept while it is the newest certified one it holds - and the
        rollbacks counted so far are forgiven (the limit is per incident, not per job)."""
        with self.lock:
            self.certified.setdefault(rank, set()).add(step)
            for old in sorted(self.certified[rank])[:-LOSS_HISTORY]:
                self.certified[rank].discard(old)
            self.rollbacks[rank] = 0
            # the slot is kept for it only where the job prefers certified versions (two more slots per rank)
            held = (bool(self.cfg.recovery.marked_versions) and rank in self.table.ranks
                    and self.table.certify(rank, step))
            reply = {"certified": sorted(self.certified[rank])[-8:], "held": held}
        self._mark_blocks()
        return reply

    def _mark_blocks(self) -> None:
        """Every step a local rank certified or watches kept in the node's peer blocks too, so that a lost
        member's ranks can be rebuilt at it (the ranks' marks agree but for the moments between their
        requests: the union keeps the step that moves from watched to certified). Not under the agent's lock."""
        if self.redundancy is None or not self.cfg.recovery.marked_versions:
            return
        with self.lock:
            steps = {st for rv in self.table.ranks.values() for st in (rv.certified, rv.candidate)}
        self.redundancy.keep_marked(steps)  # lock order: never the agent's and the redundancy's

    def watch(self, rank: int, step: int) -> dict:
        """``step`` is the version whose next iterations the trainers judge: keep its slot until it is
        certified or another one is watched."""
        with self.lock:
            held = (bool(self.cfg.recovery.marked_versions) and rank in self.table.ranks
                    and self.table.watch(rank, step))
        self._mark_blocks()
        return {"held": held}

    def loss_history(self, rank: int) -> dict:
        with self.lock:
            return {"losses": {str(k): v for k, v in sorted(self.losses.get(rank, {}).items())},
                    "rollbacks": self.rollbacks.get(rank, 0)}

    def abort(self, rank: int, slot_idx: int) -> None:
        with self.lock:
            step = self.table.slot(rank, slot_idx).step
            self._mirror(rank, [self.table.abort(rank, slot_idx)])
            self._finished(rank, step)

    def invalidate(self, rank: int, step: int) -> bool:
        """A trainer found this version corrupt: never offer it again."""
        with self.lock:
            s = self.table.invalidate(rank, step)
            if s is None:
                return False
            self._mirror(rank, [s])
            log.warning("agent node %d: rank %d step %d invalidated (corrupt)", self.node, rank, step)
            return True

    def rewind(self, rank: int, step: int) -> dict:
        """The job resumed ``rank`` from ``step`` (-1: fresh): versions newer than ``step`` are an
        abandoned future; the agreed step (and the redundancy's complete step) go down to ``step``,
        so the resumed version is protected and later snapshots are taken and exchanged again."""
        with self.lock:
            # a rank not registered yet (a replacement node before its first snapshot) holds nothing to drop
            emptied = self.table.rewind(rank, step) if rank in self.table.ranks else []
            self._mirror(rank, emptied)
            self.seen[rank] = step  # the steps after it begin again
            self._report()
            self.persisted = [p for p in self.persisted if p <= step]
            interval = self.cfg.persist.interval
            if interval > 0:
                self._persist_due = min(self._persist_due, (max(step, 0) // interval + 1) * interval)
        if self.redundancy is not None:
            self.redundancy.rewind(step)
        if emptied:
            log.warning("agent node %d: rank %d resumed from step %d; emptied %d slot(s) holding newer or unfinished "
                        "versions", self.node, rank, step, len(emptied))
        return {"dropped": len(emptied)}

    def mark_global(self, rank: int, step: int) -> None:
        """``step`` is clean on every rank of the job (the trainers agreed on it, or restored it)."""
        with self.lock:
            self.table.agree(rank, step)
        self._agreed_locally()

    def _agreed_locally(self) -> None:
        """Every local rank's agreed step known: the step all of them agreed on is exchanged with the
        group and persisted when due; the job's certified and watched versions (its verdict, with
        ``recovery.prefer: certified``) marked on every local rank."""
        self._apply_marks()
        with self.lock:
            low = self.table.agreed_low(self.cfg.cluster.ranks_per_node)
            persist_step = None
            interval = self.cfg.persist.interval
            # due at the next multiple of the interval; if that step was skipped (its snapshot
            # found both slots busy, e.g. during a persist) the next consistent step catches up
            if interval > 0 and low >= max(self._persist_due, interval):
                self._persist_due = (low // interval + 1) * interval
                persist_step = low
        if self.redundancy is not None and low >= 0:
            self.redundancy.version_global(low)
        if persist_step is not None:
            self.request_persist(persist_step, "interval")

    def _apply_marks(self) -> None:
        """The verdict's certified and watched steps, as ``certify`` and ``watch`` of every local rank
        (each takes the lock itself), once per change."""
        if self.agreement is None:
            return
        v = self.agreement.verdict
        marks = (v.certified, v.watched)
        if v.judged < 0 or marks == self._marks:
            return
        self._marks = marks
        with self.lock:
            ranks = list(self.table.ranks)
        for r in ranks:
            if v.certified >= 0:
                self.certify(r, v.certified)
            if v.watched >= 0:
                self.watch(r, v.watched)

    def newest_consistent_step(self) -> int:
        """Newest step that every local rank holds clean (preferring globally agreed steps)."""
        with self.lock:
            return self.table.newest_consistent()

    def list_versions(self, rank: int) -> list[dict]:
        with self.lock:
            rv = self.table.ranks.get(rank)
            if rv is None:
                return []
            self._check_intact(rank)
            return [{"slot": s.index, "step": s.step, "state": snapfile.STATE_NAMES[s.state],
                     "path": self.segments[rank][s.index].path, "certified": s.step == rv.certified}
                    for s in rv.clean()]

    def status(self) -> dict:
        with self.lock:
            out = {
                "node": self.node, "run_id": self.run_id, "pid": os.getpid(),
                "connected": {str(r): n for r, n in sorted(self.connected.items())},
                "ranks": {str(r): {"global_step": rv.agreed,
                                   "slots": [{"slot": s.index, "state": snapfile.STATE_NAMES[s.state],
                                              "step": s.step, "pins": s.pins,
                                              "bytes": self.segments[r][s.index].size}
                                             for s in rv.slots]}
                          for r, rv in sorted(self.table.ranks.items())},
                "persisted": list(self.persisted),
                "persist_errors": list(self.persist_errors[-5:]),
                "pending_persists": self._persist_q.qsize(),
                "root": self.store.root if self.store is not None else None,
                "agreement": ({"agreed": self.agreement.verdict.agreed, "abandoned": list(self.agreement.verdict.abandoned),
                               "skipped_pending": self.skipped_pending, "seen": {str(r): s for r, s in self.seen.items()}}
                              if self.agreement is not None else None),
                "shared_memory": {"slots": self._slot_bytes(), "peer_blocks_reserved": self._peer_reserved,
                                  "limit": self.cfg.agent.shm_limit_mib << 20, "refused": self._peer_refusal},
            }
        out["redundancy"] = self.redundancy.status() if self.redundancy is not None else None
        return out

    def describe(self) -> str:
        with self.lock:
            return ", ".join(f"r{r}:" + "/".join(f"{snapfile.STATE_NAMES[s.state]}@{s.step}" for s in rv.slots)
                             for r, rv in sorted(self.table.ranks.items()))

    # ------------------------------------------------------------------ for the peer redundancy
    def pin_step(self, step: int) -> dict[int, SlotRef]:
        """Pin every local rank's clean slot of ``step`` (KeyError if one does not hold it)."""
        with self.lock:
            out = {}
            for rank, rv in self.table.ranks.items():
                self._check_intact(rank)
                s = rv.slot_with(step)
                if s is None:
                    raise KeyError(f"rank {rank} does not hold step {step} clean")
                out[rank] = s
            for s in out.values():
                s.pins += 1
            return {r: self._ref(r, s) for r, s in out.items()}

    def pin_rank_step(self, rank: int, step: int) -> SlotRef:
        """Pin one rank's clean slot of ``step`` for its trainer's scheduled transport: one pin per
        rank at a time (pinning again moves it; repeating a request is harmless), released by
        :meth:`unpin_rank` or when the trainer is lost or says hello again."""
        with self.lock:
            old = self._sched_pins.get(rank)
            if old is not None and old.step == step:
                cur = self.table.get(rank).slots[old.index]
                if cur.state == snapfile.CLEAN and cur.step == step:
                    return old
            self._check_intact(rank)
            s = self.table.get(rank).slot_with(step)
            if s is None:
                raise KeyError(f"rank {rank} does not hold step {step} clean on node {self.node}")
            self.unpin_rank(rank)
            s.pins += 1
            ref = self._sched_pins[rank] = self._ref(rank, s)
            return ref

    def unpin_rank(self, rank: int) -> None:
        with self.lock:
            ref = self._sched_pins.pop(rank, None)
            if ref is not None:
                self.unpin({rank: ref})

    def unpin(self, refs: dict[int, SlotRef]) -> None:
        with self.lock:
            for r, ref in refs.items():
                rv = self.table.ranks.get(r)
                if rv is not None and ref.index < len(rv.slots):
                    s = rv.slots[ref.index]
                    s.pins = max(0, s.pins - 1)

    def clean_steps(self) -> dict[int, list[int]]:
        with self.lock:
            return self.table.clean_steps()

    def clean_segment(self, rank: int, step: int) -> shm.Segment:
        with self.lock:
            self._check_intact(rank)
            s = self.table.get(rank).slot_with(step)
            if s is None:
                raise KeyError(f"rank {rank} step {step} is not held clean on node {self.node}")
            return self.segments[rank][s.index]

    def install_recovered(self, rank: int, step: int, data) -> None:
        """Write a container rebuilt from peers into one of ``rank``'s slots and mark it clean
        (the slots are created from the container's own layout when the rank has none)."""
        data = memoryview(data).cast("B")
        hdr = snapfile.read_header(data)
        g = hdr.geometry
        layout_json = bytes(data[g.layout_off: g.layout_off + g.layout_len])
        snapfile.read_version(data, hdr)  # a well-formed record, before any slot is touched
        with self.lock:
            segs = self.segments.get(rank)
            fits = bool(segs) and all(seg.size >= len(data) for seg in segs)
        if not fits:
            self.register(rank, layout_json.decode())
        with self.lock:
            s = self.table.install(rank, step)
            self._mirror(rank, [s])
            s.pins += 1  # the copy below runs without the lock
            seg = self.segments[rank][s.index]
        try:
            seg.mm[: len(data)] = data
            snapfile.set_state(seg.mm, snapfile.WRITING)
        finally:
            with self.lock:
                s.pins -= 1
        self.commit(rank, s.index, step)

    # ------------------------------------------------------------------ persistence
    def request_persist(self, step: int, reason: str) -> bool:
        with self.lock:
            if step < 0 or step in self.persisted or step in self._queued_steps:
                return False
            self._queued_steps.add(step)
        self._persist_q.put((step, reason))
        return True

    def trainer_lost(self, rank: int) -> None:
        self.unpin_rank(rank)  # its scheduled transfer died with it
        log.warning("agent node %d: trainer rank %d disconnected without bye (crashed?)", self.node, rank)
        if self.monitor is not None:
            self.monitor.report_software(rank)
        if self.cfg.persist.on_failure:
            step = self.newest_consistent_step()
            if step >= 0 and self.request_persist(step, f"breakpoint (rank {rank} lost)"):
                log.warning("agent node %d: saving step %d at breakpoint", self.node, step)

    def _persist_loop(self) -> None:
        while not self._stop.is_set():
            item = self._persist_q.get()
            if item is None:
                return
            step, reason = item
            try:
                self._persist(step, reason)
            except Exception as e:  # a failed persist never stops the agent
                msg = f"persist of step {step} ({reason}) failed: {e}"
                log.error("agent node %d: %s", self.node, msg)
                with self.lock:
                    self.persist_errors.append(msg)
            finally:
                with self.lock:
                    self._queued_steps.discard(step)

    def _persist(self, step: int, reason: str) -> None:
        """Write every local rank's clean version of ``step`` to disk, each verified (size, record
        and every chunk checksum) before a byte is written: a corrupt slot is invalidated and
        nothing of the step is written, so it never counts towards ``persist.keep``."""
        base = self.cfg.persist.dir
        with self.lock:
            refs = {}
            for rank in self.table.ranks:
                self._check_intact(rank)
                s = self.table.get(rank).slot_with(step)
                if s is None:
                    self.unpin(refs)
                    raise RuntimeError(f"rank {rank} no longer holds step {step} clean")
                s.pins += 1
                refs[rank] = self._ref(rank, s)
        t0 = time.perf_counter()
        nbytes = 0
        try:
            bad = {}
            for rank, ref in refs.items():
                try:
                    persist.verify_container(ref.segment.mm)
                except snapfile.SnapshotFormatError as e:
                    bad[rank] = e
            if bad:
                for rank in bad:
                    self.invalidate(rank, step)
                raise RuntimeError("not persisted, corrupt in shared memory: " +
                                   "; ".join(f"rank {r}: {e}" for r, e in bad.items()))
            for rank, ref in refs.items():
                nbytes += persist.write_container(ref.segment.mm, persist.rank_file(base, self.run_id, step, rank))
            persist.mark_persisted(base, self.run_id, step, self.node, {r: ref.segment.mm for r, ref in refs.items()},
                                   self.cfg.cluster.world_size)  # this node's files are durable: its marker
        finally:
            self.unpin(refs)
        dt = time.perf_counter() - t0
        with self.lock:
            self.persisted.append(step)
            ranks = list(self.table.ranks)
        persist.prune(base, self.run_id, ranks, self.cfg.persist.keep, protect=step)
        log.info("agent node %d: persisted step %d (%s): %.1f MiB in %.2f s", self.node, step, reason,
                 nbytes / 2**20, dt)

    # ------------------------------------------------------------------ serving
    def serve_forever(self) -> None:
        """Serve trainers on the node's Unix socket (:mod:`megatron_ft.transport.wire`) until
        :meth:`shutdown`; starts the persist thread."""
        self._server = wire.Server(self.socket_path, self, name=f"agent-n{self.node}")
        self._persist_thread = threading.Thread(target=self._persist_loop, name="persist", daemon=True)
        self._persist_thread.start()
        backing = shm.page_backing(self.cfg.agent.shm_dir)
        log.info("agent node %d (pid %d) serving on %s; shared memory in %s (%s pages)", self.node, os.getpid(),
                 self.socket_path, self.cfg.agent.shm_dir, "2 MiB" if backing == shm.HUGE else "4 KiB")
        if backing != shm.HUGE:
            log.info("agent node %d: %s has 4 KiB pages; a huge-page tmpfs restores ~2x faster: "
                     "`megatron-ft shm-mount DIR --size S` (root), then agent.shm_dir: DIR", self.node,
                     self.cfg.agent.shm_dir)
        self._server.serve_forever()

    # wire.Handler: one connection per trainer (and per scheduled-transport thread, launcher, CLI)
    def handle(self, conn: wire.Connection, msg: dict) -> "wire.Reply | dict":
        req = MESSAGES.parse(msg)  # a malformed request is refused here, naming the field
        op = req.op
        reply = self._dispatch(req)
        if isinstance(req, Hello) and req.role is None and req.rank >= 0:
            rank = conn.state["rank"] = req.rank  # a trainer (not its transport's threads)
            with self.lock:
                if not self.connected.get(rank):  # a restarted trainer: no transfer of the old one
                    self.unpin_rank(rank)
                self.connected[rank] = self.connected.get(rank, 0) + 1
        if op == "bye":
            return wire.Reply(reply, close=True, orderly=True)
        if op == "shutdown":
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

    def _dispatch(self, r: Request) -> dict:
        """``r``: the operation's typed request (megatron_ft.agent.protocol.MESSAGES)."""
        op = r.op
        if op == "hello":
            if r.run_id != self.run_id:
                raise ValueError(f"run_id {r.run_id!r} does not match this agent's {self.run_id!r}")
            return {"node": self.node, "agent_pid": os.getpid(), "settings": ftconfig.shared_settings(self.cfg),
                    "decides": self.agreement is not None and self.agreement.decides}
        if op == "register":
            return self.register(r.rank, r.layout)
        if op == "begin":
            return {"slot": self.begin(r.rank, r.step)}
        if op == "commit":
            self.commit(r.rank, r.slot, r.step, r.loss)
            return {"agreed": self.agreement.verdict.agreed} if self.agreement is not None else {}
        if op == "decide":
            return {"values": self.decide(r.rank, r.key, r.how, list(r.values), float(r.wait_s))}
        if op == "judged":
            return self.judge(r.rank, r.iteration, r.anomalous)
        if op == "agreed":
            return {"agreed": self.agreement.verdict.agreed if self.agreement is not None else -1}
        if op == "skip":
            self.skip(r.rank, r.step)
            return {"agreed": self.agreement.verdict.agreed} if self.agreement is not None else {}
        if op == "abort":
            self.abort(r.rank, r.slot)
            return {}
        if op == "invalidate":
            return {"invalidated": self.invalidate(r.rank, r.step)}
        if op == "refuse":
            return self.refuse(r.rank, r.step)
        if op == "losses":
            return self.loss_history(r.rank)
        if op == "certify":
            return self.certify(r.rank, r.step)
        if op == "watch":
            return self.watch(r.rank, r.step)
        if op == "global":
            self.mark_global(r.rank, r.step)
            return {}
        if op == "rewind":
            return self.rewind(r.rank, r.step)
        if op == "list":
            return {"versions": self.list_versions(r.rank)}
        if op == "peer_list":
            if self.redundancy is None:
                return {"versions": [], "unanswered": {}}
            return self.redundancy.candidates(r.rank, self._group_wait_s(r))
        if op == "recover":
            if self.redundancy is None:
                raise RuntimeError("redundancy.scheme is none: nothing to recover from peers")
            return self.redundancy.recover(r.rank, r.step, self._group_wait_s(r))
        if op.startswith("sched_"):  # the scheduled transport's trainers
            if self.redundancy is None or not self.redundancy.scheduled:
                raise RuntimeError(f"{op}: redundancy.transport is not 'scheduled' on node {self.node}")
            red = self.redundancy
            if op == "sched_pin":
                return red.sched_pin(r.rank, r.step)
            if op == "sched_unpin":
                self.unpin_rank(r.rank)
                return {}
            if op == "sched_recv_begin":
                return red.sched_recv_begin(r.src_rank, r.step, r.length)
            return red.sched_recv_done(r.src_rank, r.step)
        if op == "status":
            return {"status": self.status()}
        if op == "adopt":
            return self.adopt(r.launcher_pid)
        if op == "persist":
            step = r.step if r.step is not None else self.newest_consistent_step()
            return {"queued": self.request_persist(step, "requested"), "step": step}
        if op == "wait_persisted":
            wait_s = 60.0 if r.wait_s is None else r.wait_s
            deadline = time.time() + wait_s
            while time.time() < deadline:
                with self.lock:
                    if not self._queued_steps and self._persist_q.empty():
                        return {"persisted": list(self.persisted)}
                time.sleep(0.05)
            raise TimeoutError(f"persists still pending after {wait_s:g} s")
        return {}  # bye, shutdown: answered by handle

    def _group_wait_s(self, r: Request) -> float:
        """How long a restore's request may wait for the group's members to answer: what the trainer
        asked for (it waits that long plus its request timeout), else the health settings' default."""
        return r.wait_s if r.wait_s is not None else self.cfg.health.group_answer_s

    def trained(self) -> bool:
        """Whether a trainer registered with this agent (or with the agent whose slots it adopted):
        the job is past its start. Lock-free (one attribute read), called by the heartbeat thread."""
        return self._trained

    # ------------------------------------------------------------------ the launcher
    def launcher_pid(self) -> int:
        """The launcher that owns this agent now; 0 while orphaned (or never watched). Lock-free:
        two attribute reads, called by the heartbeat thread."""
        return 0 if self._orphan else self._launcher

    def watch_launcher(self, pid: int, poll_s: float = 0.5) -> None:
        """Follow the node's launcher (a thread): when it dies, the agent is an orphan; a restarted
        launcher adopts it (``adopt`` op) within ``launch.start_timeout_s``, else the agent shuts
        down and removes its segments, so nothing outlives a node whose launcher is gone. An orphan
        also shuts down as soon as the job is over (:class:`JobEndWatch`): a launcher recorded its
        end in the store, or every other node's agent has gone quiet for ``health.timeout_s``."""
        with self.lock:
            self._launcher = pid

        def alive(p: int) -> bool:
            try:
                os.kill(p, 0)
                return True
            except ProcessLookupError:
                return False
            except PermissionError:
                return True

        def loop() -> None:
            orphan_since = None
            watch = None
            while not self._stop.wait(poll_s):
                with self.lock:
                    pid_now = self._launcher
                if alive(pid_now) and not (pid_now == pid and os.getppid() != pid):
                    orphan_since, self._orphan, watch = None, False, None
                    continue
                if orphan_since is None:
                    orphan_since = time.time()
                    self._orphan = True
                    watch = JobEndWatch(self.node, self.cfg.cluster.nodes, self.cfg.health.timeout_s, orphan_since)
                    log.warning("agent node %d: launcher pid %d is gone; waiting %.0f s for a new launcher to "
                                "adopt this agent", self.node, pid_now, self.cfg.launch.start_timeout_s)
                elif self.store is not None and watch is not None and (why := watch.over(self.store.get)):
                    log.warning("agent node %d: the job is over (%s); shutting down instead of waiting for a "
                                "launcher", self.node, why)
                    self.shutdown()
                    return
                elif time.time() - orphan_since > self.cfg.launch.start_timeout_s:
                    log.error("agent node %d: no launcher adopted this agent within launch.start_timeout_s=%g s; "
                              "shutting down", self.node, self.cfg.launch.start_timeout_s)
                    self.shutdown()
                    return

        threading.Thread(target=loop, name="launcher-watch", daemon=True).start()

    def adopt(self, pid: int) -> dict:
        """A (restarted) launcher of this node takes this agent over."""
        with self.lock:
            old, self._launcher = self._launcher, pid
            self._orphan = False
        log.info("agent node %d: adopted by launcher pid %d (was %s)", self.node, pid, old)
        return {"node": self.node, "agent_pid": os.getpid()}

    def shutdown(self, remove_segments: bool = True) -> None:
        """Clean shutdown: finish queued persists, remove segments and the socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._persist_q.put(None)
        if self._server is not None:
            self._server.close()
        if self._persist_thread is not None:
            self._persist_thread.join(timeout=300)  # let queued persists finish
        if self.agreement is not None:
            self.agreement.close()
        if self.monitor is not None:
            self.monitor.stop()
        if self.redundancy is not None:
            self.redundancy.close()
            if remove_segments:
                self.redundancy.remove_segments()
        if self.store is not None and hasattr(self.store, "close"):  # its server and connections (embedded)
            try:
                self.store.close()
            except Exception as e:
                log.warning("agent node %d: closing the store: %s", self.node, e)
        with self.lock:
            if remove_segments:
                for rank in list(self.table.ranks):
                    self._drop_rank(rank)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
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
    changes: dict = {}
    if args.run_id:
        changes["run_id"] = args.run_id
    pers = {}
    if args.persist_interval is not None:
        pers["interval"] = args.persist_interval
    if args.persist_dir:
        pers["dir"] = args.persist_dir
    if pers:
        changes["persist"] = pers
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
    agent.adopt_existing()
    agent.start_peers()
    agent.start_agreement()

    def on_signal(signum, frame):  # clean shutdown on SIGTERM / SIGINT
        threading.Thread(target=agent.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if launcher_pid:
        agent.watch_launcher(launcher_pid)
    agent.serve_forever()
    agent._done.wait(timeout=600)  # the shutdown thread drains persists and removes segments
    return 0


if __name__ == "__main__":
    sys.exit(main())
