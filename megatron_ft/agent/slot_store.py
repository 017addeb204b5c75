"""The node's slot store: its local ranks' slots in shared memory and the versions they hold.

Owns the segments (two or more per local rank: REFT's clean/dirty double buffer, created and
pre-faulted on first registration, re-adopted after an agent restart), the version table
(:mod:`.versions`, pure; mirrored into the container headers), the pins of the readers outside the
lock (persist, exchange, the scheduled transport) and the agreement's local side
(:mod:`.node_agreement`). Every version operation is a method here; it calls nothing above it: where
an operation concerns the redundancy or the persister too, it *returns* what changed (the size of a
rank's new slots, the steps every local rank agreed on, the marked steps, the slots a rewind emptied)
and the agent service (:mod:`.server`) tells them.

Lock: ``SlotStore.lock`` (re-entrant; the agent's former lock) guards the table, the segments and the
pins. It is never held with ``Redundancy.lock``, nor across network I/O, a store call or a
shared-memory allocation; only the innermost ``ShmBudget.lock`` is taken under it (and the job
agreement's hand-off of a report: no I/O). Not collective: each call concerns this node's ranks.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Iterable, Optional

from . import shm
from .node_agreement import NodeAgreement
from .shm_budget import ShmBudget
from .versions import TransitionError, VersionTable
from .. import config as ftconfig
from ..capture import snapfile
from ..capture.layout import Layout
from ..redundancy.plan import plan_from_config

log = logging.getLogger("megatron_ft.agent")

SLOTS_PER_RANK = 2


@dataclass(frozen=True)
class SlotRef:
    """A slot handed to a reader outside the slot store's lock (persist, exchange, scheduled transport):
    its segment and the step it held when pinned. The pin keeps ``begin`` off it until released."""
    rank: int
    index: int
    step: int
    segment: shm.Segment


def slots_per_rank(cfg: ftconfig.FTConfig, node: int) -> int:
    """Two (REFT's clean/dirty double buffer), or one on an rs parity node: every packet it
    owns is also held whole by a data node of its group (ECHECK), so its own clean copy is only
    a cache and the slot is the staging buffer; its trainers' software failures are then served
    from the data node's copy when the slot is mid-write. Pure (of the configuration)."""
    if cfg.redundancy.scheme != "none" and plan_from_config(cfg).own_copy_is_redundant(node):
        return 1
    if cfg.redundancy.transport == "scheduled":
        # + the version its trainer is still sending, while the group's complete one, the newest
        # clean one and the one being written stay: snapshots go on during a transfer
        return SLOTS_PER_RANK + 2 + cfg.recovery.marked_versions
    return SLOTS_PER_RANK + cfg.recovery.marked_versions


def describe(table: VersionTable) -> str:
    """Every rank's slots as ``r0:CLEAN@3/WRITING@4`` (pure)."""
    return ", ".join(f"r{r}:" + "/".join(f"{snapfile.STATE_NAMES[s.state]}@{s.step}" for s in rv.slots)
                     for r, rv in sorted(table.ranks.items()))


# ---------------------------------------------------------------------- the slot files (I/O, no state)
def init_empty(seg: shm.Segment, layout_json: bytes) -> None:
    """Write an EMPTY container with ``layout_json``'s layout into ``seg`` (its full size already)."""
    snapfile.init_container(seg.mm, layout_json, snapfile.geometry_for(Layout.from_json(layout_json), layout_json))


def read_left_slot(path: str) -> tuple[shm.Segment, int, int, bytes]:
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


def rebuild_slot(path: str, layout_json: bytes) -> shm.Segment:
    """The slot file at ``path`` (cut, unreadable or missing) at the full size of ``layout_json``'s
    container, an EMPTY container with that layout (same inode when the file exists)."""
    geom = snapfile.geometry_for(Layout.from_json(layout_json), layout_json)
    if os.path.exists(path):
        shm.restore_size(path, geom.total)
        seg = shm.open_segment(path)
    else:
        seg = shm.create(path, geom.total)
    init_empty(seg, layout_json)
    return seg


def mirror(segments: list[shm.Segment], slots: Iterable) -> None:
    """Write the table's state of these slots (None: skipped) into their container headers."""
    for s in slots:
        if s is not None:
            snapfile.set_state(segments[s.index].mm, s.state)


def check_intact(node: int, rank: int, slots: list, segments: list[shm.Segment], layout_json: bytes) -> None:
    """Find ``rank``'s slots whose file was truncated behind the agent's back: their version is
    invalidated (the table's ``slots`` changed in place: the caller holds the slot store's lock) and the
    file gets its size and an empty container back, so no reader (persist, exchange, trainer) ever maps
    past its end (SIGBUS). One that cannot be repaired stays pinned: never handed out again."""
    for s, seg in zip(slots, segments):
        if shm.intact(seg):
            continue
        log.error("agent node %d: rank %d slot %d (%s) was truncated; its version is dropped and the slot "
                  "re-initialised", node, rank, s.index, s.describe())
        if s.state != snapfile.EMPTY:
            s.state, s.step = snapfile.EMPTY, -1
        try:
            shm.restore_size(seg.path, seg.size)
            init_empty(seg, layout_json)
        except OSError as e:
            log.error("agent node %d: could not repair %s: %s", node, seg.path, e)
            s.pins += 1


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SlotStore:
    """One node's slot store (see the module). ``budget``: its shared-memory budget; ``agreement``: the
    agreement's local side; ``transport``: the scheduled transport's pins; ``trained``: a trainer
    registered (or slots were adopted): the job is past its start (read lock-free)."""

    def __init__(self, cfg: ftconfig.FTConfig, node: int):
        self.cfg, self.node, self.run_id = cfg, node, cfg.run_id
        self.lock = threading.RLock()
        self.table = VersionTable()  # slot states (pure; mirrored into the container headers)
        self.segments: dict[int, list[shm.Segment]] = {}  # rank -> its slots' segments, by index
        self.fingerprints: dict[int, str] = {}  # rank -> its layout's fingerprint
        self.layouts: dict[int, bytes] = {}  # rank -> its layout record (to re-initialise a repaired slot)
        self.budget = ShmBudget(cfg, node)
        self.agreement = NodeAgreement(cfg.cluster.ranks_per_node)
        self.transport = TransportPins(self)
        self.trained = False

    # ------------------------------------------------------------------ segments
    def adopt_existing(self) -> int:
        """Re-adopt slots left in shared memory by a previous agent of this node (agent restart);
        the previous agent's peer block versions are removed (the group sends the next version again).

        A slot whose file was damaged while no agent watched it - cut to any length (to zero, inside
        its header, inside its data), or its header unreadable - loses its version, never the rank's
        other slots: it is rebuilt at full size as an EMPTY container from a readable sibling's layout
        (every slot of a rank has the same layout and size), so the rank's older clean version is still
        restored and the next snapshots use every slot again. A rank with no readable slot is dropped.
        Before serving: file I/O under the lock."""
        gone = shm.remove_block_segments(self.cfg.agent.shm_dir, self.run_id, self.node)
        if gone:
            log.info("agent node %d: removed %d peer block version(s) of the previous agent", self.node, len(gone))
        found: dict[int, dict[int, str]] = {}
        for rank, slot_idx, path in shm.list_segments(self.cfg.agent.shm_dir, self.run_id, self.node):
            found.setdefault(rank, {})[slot_idx] = path
        n = 0
        with self.lock:
            for rank, paths in sorted(found.items()):
                readable: dict[int, tuple[shm.Segment, int, int]] = {}  # slot -> (segment, state, step)
                damaged: dict[int, str] = {}  # slot -> why
                layout_json = None
                for idx, path in sorted(paths.items()):
                    try:
                        seg, state, step, lj = read_left_slot(path)
                    except (shm.SharedMemoryError, snapfile.SnapshotFormatError, OSError, ValueError) as e:
                        damaged[idx] = str(e)
                        continue
                    readable[idx] = (seg, state, step)
                    layout_json = layout_json or lj
                if layout_json is None:
                    log.warning("agent node %d: rank %d has no readable slot (%s); discarding them", self.node, rank,
                                damaged)
                    for path in paths.values():
                        _unlink(path)
                    continue
                for idx in range(max(max(paths) + 1, slots_per_rank(self.cfg, self.node))):  # damaged or missing
                    if idx in readable:
                        continue
                    path = os.path.join(self.cfg.agent.shm_dir, shm.segment_name(self.run_id, self.node, rank, idx))
                    log.error("agent node %d: rank %d slot %d (%s) is damaged (%s); its version is dropped and the "
                              "slot rebuilt empty", self.node, rank, idx, path, damaged.get(idx, "missing"))
                    readable[idx] = (rebuild_slot(path, layout_json), snapfile.EMPTY, -1)
                self.fingerprints[rank] = Layout.from_json(layout_json).fingerprint()
                self.layouts[rank] = layout_json
                self.segments[rank] = [readable[i][0] for i in sorted(readable)]
                self.budget.slots_done(rank, sum(g.size for g in self.segments[rank]))
                for idx in sorted(readable):
                    _, state, step = readable[idx]
                    self.table.adopt(rank, idx, state, step)
                    n += 1
            if n:
                self.trained = True
                log.info("agent node %d: adopted %d existing slots: %s", self.node, n, describe(self.table))
        return n

    def register(self, rank: int, layout_json: str) -> tuple[dict, int]:
        """Slots for ``rank``'s layout: its existing ones when they fit, else new ones; the ``register``
        op's reply and the slots' container size (the caller publishes it, with no lock held). The
        shared memory is allocated and pre-faulted *outside* the lock (seconds for GiBs: other ranks'
        begin/commit never wait on it), against a budget reserved under it."""
        layout = Layout.from_json(layout_json.encode())
        fp = layout.fingerprint()
        geom = snapfile.geometry_for(layout, layout_json.encode())
        nslots = slots_per_rank(self.cfg, self.node)
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
                budget = self.budget.reserve_slots(rank, geom.total * nslots)
        self.trained = True
        if adopted:
            return {"slots": [g.path for g in segs], "adopted": True}, segs[0].size
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
                    created = []
                    if self.budget.limit:
                        raise shm.SharedMemoryError(f"{e} (agent.shm_limit_mib={self.cfg.agent.shm_limit_mib})") from None
                    raise
                snapfile.init_container(seg.mm, layout_json.encode(), geom)
                created.append(seg)
        finally:
            with self.lock:
                self.budget.slots_done(rank, sum(g.size for g in created) if len(created) == nslots else None)
        with self.lock:
            self.table.add_rank(rank, nslots)
            self.segments[rank] = created
            self.fingerprints[rank] = fp
            self.layouts[rank] = layout_json.encode()
        log.info("agent node %d: rank %d registered, %d x %.1f MiB slots", self.node, rank, nslots, geom.total / 2**20)
        return {"slots": [g.path for g in created], "adopted": False}, geom.total

    def _drop_rank(self, rank: int) -> None:
        """Remove ``rank``'s slots and their files (lock held)."""
        for g in self.segments.pop(rank, []):
            g.close()
            _unlink(g.path)
        self.table.drop_rank(rank)
        self.fingerprints.pop(rank, None)
        self.layouts.pop(rank, None)
        self.budget.slots_dropped(rank)

    def slot_sizes(self) -> dict[int, int]:
        """Container size of every registered local rank (its slots' size)."""
        with self.lock:
            return {r: gs[0].size for r, gs in self.segments.items() if gs}

    def check_intact(self, rank: int) -> None:
        """:func:`check_intact` for ``rank``'s slots (lock held)."""
        check_intact(self.node, rank, self.table.get(rank).slots, self.segments[rank], self.layouts[rank])

    # ------------------------------------------------------------------ versions
    def begin(self, rank: int, step: int, keep: Iterable[int] = (), staging_only: bool = False) -> int:
        """The slot ``rank`` writes ``step`` into (never one holding a step of ``keep``: the caller reads
        the redundancy's protected steps before, without this lock). Refused with the budget's refusal,
        and with :class:`~.agreement.PendingAgreement` while the slot's version waits for the job."""
        with self.lock:
            if self.budget.refusal:  # the node cannot hold its peers' blocks: no snapshot it could protect
                raise shm.SharedMemoryError(self.budget.refusal)
            self.check_intact(rank)
            try:
                self.agreement.check_begin(rank, self.table.choose(rank, step, keep, staging_only), step, self.table)
                slot = self.table.begin(rank, step, keep, staging_only)
            except Exception:
                self.agreement.finished(rank, step, self.table)  # the agreement must not wait for it
                raise
            mirror(self.segments[rank], [slot])
            return slot.index

    def commit(self, rank: int, slot_idx: int, step: int) -> None:
        """``rank`` wrote ``step`` completely into slot ``slot_idx``: CLEAN once its version record is
        well-formed (the header's step must be ``step``)."""
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
            mirror(self.segments[rank], [s, *others])
            self.agreement.finished(rank, step, self.table, always=True)

    def abort(self, rank: int, slot_idx: int) -> None:
        with self.lock:
            step = self.table.slot(rank, slot_idx).step
            mirror(self.segments[rank], [self.table.abort(rank, slot_idx)])
            self.agreement.finished(rank, step, self.table)

    def skip(self, rank: int, step: int) -> None:
        """The trainer takes no snapshot of ``step`` (its state could not be captured or registered)."""
        with self.lock:
            self.agreement.finished(rank, step, self.table)

    def invalidate(self, rank: int, step: int) -> bool:
        """A reader found this version corrupt: never offer it again."""
        with self.lock:
            s = self.table.invalidate(rank, step)
            if s is None:
                return False
            mirror(self.segments[rank], [s])
            log.warning("agent node %d: rank %d step %d invalidated (corrupt)", self.node, rank, step)
            return True

    def rewind(self, rank: int, step: int) -> int:
        """The job resumed ``rank`` from ``step`` (-1: fresh): versions newer than ``step`` are an
        abandoned future, emptied; its agreed step goes down to ``step``. Returns how many slots were
        emptied (the caller rewinds the redundancy and the persister)."""
        with self.lock:
            # a rank not registered yet (a replacement node before its first snapshot) holds nothing to drop
            emptied = self.table.rewind(rank, step) if rank in self.table.ranks else []
            if emptied:
                mirror(self.segments[rank], emptied)
            self.agreement.rewound(rank, step, self.table)
        if emptied:
            log.warning("agent node %d: rank %d resumed from step %d; emptied %d slot(s) holding newer or unfinished "
                        "versions", self.node, rank, step, len(emptied))
        return len(emptied)

    def mark(self, rank: int, step: int, certified: bool) -> tuple[bool, set[int]]:
        """``certified``: ``rank`` certified ``step`` - its slot kept while it is the newest certified one
        it holds; else ``step`` is the version whose next iterations ``rank``'s trainer judges - its slot
        kept until it is certified or another one is watched. Kept only where the job prefers certified
        versions (``recovery.marked_versions``). Returns whether it is kept and the steps every local
        rank certified or watches (the caller keeps them in the peer blocks too: the ranks' marks agree
        but for the moments between their requests, and the union keeps the step that moves from
        watched to certified)."""
        with self.lock:
            how = self.table.certify if certified else self.table.watch
            held = bool(self.cfg.recovery.marked_versions) and rank in self.table.ranks and how(rank, step)
            marked = {st for rv in self.table.ranks.values() for st in (rv.certified, rv.candidate)}
            return held, marked

    def agree(self, rank: Optional[int] = None, step: int = -1) -> int:
        """With ``rank``: ``step`` is clean on every rank of the job (its trainers agreed on it, or
        restored it). Returns the newest step every local rank agreed on (-1: none yet); the caller
        exchanges and persists it."""
        with self.lock:
            if rank is not None:
                self.table.agree(rank, step)
            return self.table.agreed_low(self.cfg.cluster.ranks_per_node)

    def protect_agreed(self, verdict) -> None:
        """The job's new verdict becomes this node's, and its agreed step, where every local rank holds
        it, the protected version - together, under the lock (the job agreement's ``protect`` hook)."""
        with self.lock:
            self.agreement.adopt_verdict(verdict)
            ranks = list(self.table.ranks)
            if (verdict.agreed < 0 or len(ranks) < self.cfg.cluster.ranks_per_node
                    or any(self.table.get(r).slot_with(verdict.agreed) is None for r in ranks)):
                return
            for r in ranks:
                self.table.agree(r, verdict.agreed)

    def newest_consistent_step(self) -> int:
        """Newest step that every local rank holds clean (preferring globally agreed steps)."""
        with self.lock:
            return self.table.newest_consistent()

    def clean_steps(self) -> dict[int, list[int]]:
        with self.lock:
            return self.table.clean_steps()

    def list_versions(self, rank: int) -> list[dict]:
        """``rank``'s clean versions, for its restarted trainer to map and read."""
        with self.lock:
            rv = self.table.ranks.get(rank)
            if rv is None:
                return []
            self.check_intact(rank)
            return [{"slot": s.index, "step": s.step, "state": snapfile.STATE_NAMES[s.state],
                     "path": self.segments[rank][s.index].path, "certified": s.step == rv.certified}
                    for s in rv.clean()]

    # ------------------------------------------------------------------ for the readers outside the lock
    def pin_step(self, step: int) -> dict[int, SlotRef]:
        """Pin every local rank's clean slot of ``step`` (KeyError if one does not hold it: none pinned)."""
        with self.lock:
            out = {}
            for rank, rv in self.table.ranks.items():
                self.check_intact(rank)
                s = rv.slot_with(step)
                if s is None:
                    raise KeyError(f"rank {rank} does not hold step {step} clean")
                out[rank] = s
            for s in out.values():
                s.pins += 1
            return {r: SlotRef(r, s.index, s.step, self.segments[r][s.index]) for r, s in out.items()}

    def unpin(self, refs: dict[int, SlotRef]) -> None:
        with self.lock:
            for r, ref in refs.items():
                rv = self.table.ranks.get(r)
                if rv is not None and ref.index < len(rv.slots):
                    s = rv.slots[ref.index]
                    s.pins = max(0, s.pins - 1)

    def clean_segment(self, rank: int, step: int) -> shm.Segment:
        """The segment of ``rank``'s clean slot of ``step`` (KeyError if not held), unpinned: a peer's
        ``get`` reads it while the version stays protected."""
        with self.lock:
            self.check_intact(rank)
            s = self.table.get(rank).slot_with(step)
            if s is None:
                raise KeyError(f"rank {rank} step {step} is not held clean on node {self.node}")
            return self.segments[rank][s.index]

    def install_recovered(self, rank: int, step: int, data) -> Optional[int]:
        """Write a container rebuilt from peers into one of ``rank``'s slots and mark it clean (the
        slots are created from the container's own layout when the rank has none). Returns the size of
        the slots it registered for that (the caller publishes it), else None. The copy runs without
        the lock, its slot pinned."""
        data = memoryview(data).cast("B")
        hdr = snapfile.read_header(data)
        g = hdr.geometry
        layout_json = bytes(data[g.layout_off: g.layout_off + g.layout_len])
        snapfile.read_version(data, hdr)  # a well-formed record, before any slot is touched
        with self.lock:
            segs = self.segments.get(rank)
            fits = bool(segs) and all(seg.size >= len(data) for seg in segs)
        size = None if fits else self.register(rank, layout_json.decode())[1]
        with self.lock:
            s = self.table.install(rank, step)
            mirror(self.segments[rank], [s])
            s.pins += 1
            seg = self.segments[rank][s.index]
        try:
            seg.mm[: len(data)] = data
            snapfile.set_state(seg.mm, snapfile.WRITING)
        finally:
            with self.lock:
                s.pins -= 1
        self.commit(rank, s.index, step)
        return size

    # ------------------------------------------------------------------ status, shutdown
    def status(self) -> dict:
        with self.lock:
            return {
                "ranks": {str(r): {"global_step": rv.agreed,
                                   "slots": [{"slot": s.index, "state": snapfile.STATE_NAMES[s.state],
                                              "step": s.step, "pins": s.pins,
                                              "bytes": self.segments[r][s.index].size}
                                             for s in rv.slots]}
                          for r, rv in sorted(self.table.ranks.items())},
                "agreement": self.agreement.status(),
                "shared_memory": self.budget.status(),
            }

    def close(self, remove_segments: bool = True) -> None:
        """At shutdown: with ``remove_segments``, every slot and its file removed (else they stay for the
        next agent of this node to adopt)."""
        with self.lock:
            if remove_segments:
                for rank in list(self.table.ranks):
                    self._drop_rank(rank)


class TransportPins:
    """The scheduled transport's pins: one per local rank at a time, on the slot its trainer's transport
    reads (pinning again moves it; repeating a request is harmless), released by :meth:`unpin` or when
    the trainer is lost or says hello again. Part of the slot store: under ``SlotStore.lock``."""

    def __init__(self, store: SlotStore):
        self._store = store
        self._pins: dict[int, SlotRef] = {}

    def pin(self, rank: int, step: int) -> SlotRef:
        """Pin ``rank``'s clean slot of ``step`` (KeyError if not held clean)."""
        st = self._store
        with st.lock:
            old = self._pins.get(rank)
            if old is not None and old.step == step:
                cur = st.table.get(rank).slots[old.index]
                if cur.state == snapfile.CLEAN and cur.step == step:
                    return old
            st.check_intact(rank)
            s = st.table.get(rank).slot_with(step)
            if s is None:
                raise KeyError(f"rank {rank} does not hold step {step} clean on node {st.node}")
            self.unpin(rank)
            s.pins += 1
            ref = self._pins[rank] = SlotRef(rank, s.index, s.step, st.segments[rank][s.index])
            return ref

    def unpin(self, rank: int) -> None:
        with self._store.lock:
            ref = self._pins.pop(rank, None)
            if ref is not None:
                self._store.unpin({rank: ref})
