"""The agent's peer redundancy: exchange every consistent version with the group, hold what the
plan assigns this node in shared memory, and rebuild a lost node's ranks from the survivors.

Data path of one version ``S`` (every local rank committed it and the trainers agreed on it):

1. :meth:`Redundancy.exchange` pins the local ranks' slots of ``S`` and sends this node's
   contributions (:func:`megatron_ft.redundancy.exchange.group_exchange`): whole containers for
   copies, byte ranges for XOR pieces, partial RS parities encoded here (zeros for packets owned
   elsewhere, this node's packets of a row pre-reduced) - straight from the shared-memory slot.
2. Holders receive into a block version in shared memory (two per block: the newest version the
   whole group holds is never overwritten), XOR-ing contributions as they arrive. When every block
   this node holds for ``S`` is complete, it *announces* ``S`` to the group.
3. ``S`` is *complete* on a node once every group member announced it; until then the agent
   protects both the primary slot of the previous complete version and that of ``S`` (so a
   version being encoded can always be decoded from: REFT's clean/dirty applied to the group).

Recovery (:meth:`candidates`, :meth:`recover`): a replacement node's agent asks the group which
versions every survivor holds (``holds``), finds for each step a recipe - a whole copy
(``peer_memory``), or XOR / Reed-Solomon decoding from survivors' primaries and parity blocks
(``decoded``) - and writes the rebuilt container into a local slot, where the trainer restores it
with every checksum verified, as from local memory.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from . import shm
from .. import faultpoints
from ..redundancy import exchange as xch
from ..redundancy import rebuild
from ..redundancy.codecs import get_codec
from ..redundancy.plan import RedundancyPlan, plan_from_config
from ..transport import wire

log = logging.getLogger("megatron_ft.agent")

EXCHANGE_TIMEOUT_S = 60.0
RECOVERY_WAIT_S = 15.0  # for the group's holdings after a failover; within a trainer's request timeout (30 s)


class PeerError(wire.RemoteError):
    """A peer agent refused a request (the message says why), or could not be found."""
SCHEDULED_TIMEOUT_S = 3600.0  # a scheduled transfer spreads over iterations: protect its step longer


@dataclass
class BlockVersion:
    segment: shm.Segment
    step: int = -1
    got: set = field(default_factory=set)  # contributor nodes received
    expect: int = 0
    meta: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def complete(self) -> bool:
        return self.step >= 0 and self.expect > 0 and len(self.got) >= self.expect


class _RowPipeline:
    """ECHECK's encode -> send pipeline for one version: this node's rows (reduction groups) in
    sending order; while row i's partial parities are sent, row i+1 is encoded on the encoder
    thread (the codecs release the GIL). At most two rows of partials are alive at a time."""

    def __init__(self, red: "Redundancy", contribs: list, slots: dict):
        self.red, self.slots = red, slots
        self.rows: list[str] = []  # row id = block key without the parity part
        self.first: dict[str, tuple] = {}
        for c, length in contribs:
            rid = _row_id(c.key)
            if rid not in self.first:
                self.rows.append(rid)
                self.first[rid] = (c, length)
        self.futures: dict[str, Any] = {}

    def _start(self, i: int) -> None:
        if i < len(self.rows) and self.rows[i] not in self.futures:
            c, length = self.first[self.rows[i]]
            self.futures[self.rows[i]] = self.red._encoder.submit(self.red._encode_row, c, length, self.slots)

    def partials(self, key: str) -> list:
        i = self.rows.index(_row_id(key))
        self._start(i)
        self._start(i + 1)
        for old in self.rows[:i]:
            self.futures.pop(old, None)
        return self.futures[self.rows[i]].result()


def _remove(seg: shm.Segment) -> None:
    seg.close()
    try:
        os.unlink(seg.path)
    except FileNotFoundError:
        pass


def _row_id(key: str) -> str:
    """``rs.g0.p1.row3`` -> ``rs.g0.row3`` (the same row of every parity)."""
    head, row = key.rsplit(".row", 1)
    return head.rsplit(".p", 1)[0] + ".row" + row


class Redundancy:
    """Lives inside :class:`megatron_ft.agent.server.Agent` when ``redundancy.scheme != none``."""

    def __init__(self, agent: Any, store: Any, host: str = "127.0.0.1"):
        self.agent = agent
        self.cfg = agent.cfg
        self.node = agent.node
        self.store = store
        self.plan: RedundancyPlan = plan_from_config(self.cfg)
        self.gi = self.plan.node_group[self.node]
        self.members = tuple(self.plan.groups[self.gi].members)
        self.group_ranks = [r for n in self.members for r in self.plan.topology.ranks_of(n)]
        self.lock = threading.RLock()
        self.blocks: dict[str, list[BlockVersion]] = {}
        self.announced: dict[int, int] = {}  # member -> newest step it announced holding
        self.complete_step = -1
        self.inflight_step = -1  # being exchanged (its primary slots stay protected)
        self.sending_step = -1  # its contributions are still being read from the primary slots
        self.inflight_since = 0.0
        self.exchanged: list[dict] = []  # recent records (status): sends {step, sent_bytes, seconds},
        # completions {step, complete_seconds: this node's exchange start -> the group holds it}
        self._cv = threading.Condition(self.lock)
        self._pending: Optional[int] = None
        self._stop = threading.Event()
        self._conns: dict[int, wire.Client] = {}  # the exchange thread's open connections to peers
        self._ex_cache: Optional[tuple] = None
        self._serial = 0  # block version files created (their names' suffix)
        self._started: dict[int, float] = {}  # step -> when this node began exchanging it
        self._announcer = ThreadPoolExecutor(1, thread_name_prefix="announce")  # in order, off the put path
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="encode")  # encodes row r+1 while r is sent
        self._aconns: dict[int, wire.Client] = {}  # the announcer's open connections
        #: transport "scheduled": the trainers send their copies; steps whose transfer
        #: started here -> when; their primary slots stay protected until the group holds them
        self.scheduled = self.cfg.redundancy.transport == "scheduled"
        self._sched_sending: dict[int, float] = {}
        g = self.plan.groups[self.gi]
        #: rs parity node: its packets are all held whole by data nodes (Agent.slots_per_rank)
        self.own_copy_is_redundant = self.plan.scheme == "rs" and g.role(self.node)[0] == "parity"
        self._codec = None
        if self.plan.scheme == "rs":  # the group's own k: a remainder of nodes joins a group as data nodes
            self._codec = get_codec("rs", g.k, g.m)
        self.server = wire.Server((host, 0), self, name=f"peers-n{self.node}").start()
        self.address = f"{self.server.address[0]}:{self.server.address[1]}"
        self.store.publish(f"addr/{self.node}", self.address)
        self._thread = threading.Thread(target=self._loop, name="exchange", daemon=True)
        self._thread.start()
        log.info("agent node %d: %s, group %d %s, peer transport on %s", self.node, self.plan.label, self.gi,
                 self.members, self.address)

    # ------------------------------------------------------------------ protection (agent.begin)
    def protected_steps(self) -> set[int]:
        with self.lock:
            if self.inflight_step >= 0 and time.time() - self.inflight_since > EXCHANGE_TIMEOUT_S:
                log.error("agent node %d: exchange of step %d did not complete within %.0f s; giving it up",
                          self.node, self.inflight_step, EXCHANGE_TIMEOUT_S)
                self.inflight_step = -1
            for st, since in list(self._sched_sending.items()):
                if st <= self.complete_step or time.time() - since > SCHEDULED_TIMEOUT_S:
                    del self._sched_sending[st]
            return {s for s in (self.complete_step, self.inflight_step) if s >= 0} | set(self._sched_sending)

    def sending_steps(self) -> set[int]:
        with self.lock:
            return {self.sending_step} if self.sending_step >= 0 else set()

    def status(self) -> dict:
        with self.lock:
            return {"scheme": self.plan.scheme, "group": self.gi, "members": list(self.members),
                    "complete_step": self.complete_step, "inflight_step": self.inflight_step,
                    "announced": {str(k): v for k, v in self.announced.items()},
                    "blocks": {k: [(v.step, v.complete, os.path.basename(v.segment.path)) for v in vs]
                               for k, vs in sorted(self.blocks.items())},
                    "block_bytes": sum(v.segment.size for vs in self.blocks.values() for v in vs),
                    "address": self.address, "exchanged": self.exchanged[-3:]}

    # ------------------------------------------------------------------ sizes and addresses
    def publish_size(self, rank: int, nbytes: int) -> None:
        try:
            self.store.publish(f"size/{rank}", str(nbytes))
        except Exception as e:
            log.warning("agent node %d: could not publish the size of rank %d: %s", self.node, rank, e)

    def sizes(self, holds: Optional[dict] = None) -> dict[int, int]:
        """Container size of every rank of the group: from the store, else (a lost rank whose
        size went with a lost root store) from the sizes the survivors' blocks were built with."""
        out = {}
        known: dict[str, int] = {}
        for h in (holds or {}).values():
            known.update(h.get("sizes", {}))
        for r in self.group_ranks:
            v = known.get(str(r))
            if v is None:
                v = self.store.get(f"size/{r}")
            if v is None:
                raise RuntimeError(f"the container size of rank {r} is not known yet")
            out[r] = int(v)
        return out

    def _wait_sizes(self, timeout: float = 30.0, ask_group: bool = False) -> tuple[dict, dict[int, int]]:
        """(the group's holdings if ``ask_group`` else {}, every rank's container size). Every rank of
        a consistent step has registered, but its agent may publish a moment later; and just after a
        root failover the new store and the survivors' addresses fill as their heartbeats re-publish,
        so while a group member does not answer, the holdings (whose blocks know the lost ranks'
        sizes) are asked for again."""
        deadline = time.time() + timeout
        while True:
            holds = self._group_holds() if ask_group else {}
            try:
                return holds, self.sizes(holds)
            except RuntimeError:
                everyone_answered = ask_group and len(holds) == len(self.members) - 1  # no one left to wait for
                if everyone_answered or time.time() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.2 if ask_group else 0.05)

    def addr(self, node: int) -> tuple[str, int]:
        # after a root failover the new store fills as the agents' next heartbeats re-publish; the
        # failover itself takes up to the health timeout (longer on a loaded machine)
        h = self.cfg.health
        deadline = time.time() + h.timeout_s + 4 * h.heartbeat_s + 1.0
        while (v := self.store.get(f"addr/{node}")) is None and time.time() < deadline:
            time.sleep(0.05)
        if v is None:
            raise PeerError(f"node {node} has not published its peer address")
        host, port = v.rsplit(":", 1)
        return host, int(port)

    def _client(self, node: int) -> wire.Client:
        """A connection to ``node``'s agent (its address looked up at each (re)connect: a restarted
        agent listens on a new port); bounded by ``agent.request_timeout_s``."""
        return wire.Client(lambda: self.addr(node), self.cfg.agent.request_timeout_s, error=PeerError)

    def _send(self, node: int, msg: dict, payload: Optional[memoryview] = None,
              conns: Optional[dict] = None) -> dict:
        """A request on a kept-open connection to ``node`` (``conns``: one dict per thread - the
        exchange thread's by default, the announcer's); the wire re-opens it once if the peer restarted."""
        conns = self._conns if conns is None else conns
        cl = conns.get(node)
        if cl is None:
            cl = conns[node] = self._client(node)
        return cl.request(**msg, payload=payload)

    # ------------------------------------------------------------------ sending (one version)
    def version_global(self, step: int) -> None:
        """Every local rank agreed on ``step``: exchange it (the newest pending one wins). With the
        scheduled transport the trainers send it (:meth:`sched_pin` ...)."""
        if self.scheduled:
            return
        with self.lock:
            if step <= max(self.complete_step, self.inflight_step):
                return
            self.inflight_step, self.inflight_since = step, time.time()
            self.sending_step = step
            self._pending = step
            self._cv.notify_all()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                while self._pending is None and not self._stop.is_set():
                    self._cv.wait(timeout=0.5)
                step, self._pending = self._pending, None
            if step is None:
                continue
            try:
                self.exchange(step)
            except Exception as e:  # a failed exchange never stops the agent or training
                log.error("agent node %d: exchange of step %d failed: %s", self.node, step, e)
                with self.lock:
                    if self.inflight_step == step:
                        self.inflight_step = -1
            finally:
                with self.lock:
                    if self.sending_step == step:
                        self.sending_step = -1

    def exchange(self, step: int) -> None:
        t0 = time.perf_counter()
        with self.lock:
            self._started[step] = t0
        _, sizes = self._wait_sizes()
        ex = self._exchange_for(sizes)
        meta = {"sizes": {str(r): s for r, s in sizes.items()},
                "codec": self._codec.descriptor.to_dict() if self._codec else None}
        slots = self.agent.pin_step(step)  # rank -> Slot (pinned) or KeyError
        sent = 0
        try:
            mine = ex.sent_by(self.node)
            rs = _RowPipeline(self, [(c, ex.block(c.key, c.dst).length) for c in mine if c.kind == xch.RS], slots)
            for c in mine:
                spec = ex.block(c.key, c.dst)
                payload = self._payload(c, spec, slots, rs)
                msg = {"op": "put", "key": c.key, "kind": c.kind, "step": step, "length": spec.length,
                       "src": self.node, "expect": len(spec.contributors), "meta": meta}
                if c.dst == self.node:
                    self._receive(msg, memoryview(payload).cast("B"))
                else:
                    self._send(c.dst, msg, memoryview(payload).cast("B"))
                    faultpoints.reached("mid-exchange", step)
                sent += len(payload)
        finally:
            self.agent.unpin(slots)
        send_seconds = time.perf_counter() - t0
        if not ex.held_by(self.node):
            self._announcer.submit(self._announce, step)
        else:
            self._announcer.submit(self._maybe_announce, step, ex)
        with self.lock:
            self.exchanged.append({"step": step, "sent_bytes": sent, "seconds": round(send_seconds, 5)})
            self.exchanged = self.exchanged[-10:]

    def _payload(self, c: xch.Contribution, spec: xch.BlockSpec, slots: dict, rs: "_RowPipeline") -> Any:
        """The bytes of contribution ``c``: a view of the slot (copy, xor), or this node's partial
        parity of its row (rs, from the encode pipeline)."""
        if c.kind in (xch.COPY, xch.XOR):
            (p,) = c.parts
            return memoryview(slots[p.rank].segment.mm)[p.lo:p.hi]
        return rs.partials(spec.key)[c.parity]

    def _encode_row(self, c: xch.Contribution, length: int, slots: dict) -> list[np.ndarray]:
        """This node's packets of one row as data shards (the others zero) -> its m partial parities."""
        codec = self._codec
        zero = np.zeros(length, np.uint8)
        data = [zero] * codec.k
        for p in c.parts:
            buf = np.zeros(length, np.uint8)
            buf[: p.hi - p.lo] = np.frombuffer(slots[p.rank].segment.mm, np.uint8, p.hi - p.lo, p.lo)
            data[p.index] = buf
        out = [np.empty(length, np.uint8) for _ in range(codec.m)]
        codec.encode(data, out)
        return out

    # ------------------------------------------------------------------ receiving
    def _version_for(self, key: str, step: int, length: int, expect: int, meta: dict) -> Optional[BlockVersion]:
        """The block version receiving ``step`` of ``key`` (None: a stale contribution). Two versions
        per block: the one of the newest step the group holds is never reused. A new segment is
        created and pre-faulted outside ``Redundancy.lock`` (which ``Agent.begin`` reads through
        ``protected_steps``), and an XOR block is zeroed under the version's own lock only."""
        fresh: Optional[shm.Segment] = None
        try:
            while True:
                with self.lock:
                    vs = self.blocks.setdefault(key, [])
                    for v in vs:
                        if v.step == step:
                            return v
                    if any(v.step > step for v in vs):
                        return None  # stale contribution
                    v = None if len(vs) < 2 else min((v for v in vs if v.step != self.complete_step),
                                                     key=lambda b: b.step)
                    if v is not None and v.segment.size < length:  # too small for this version: replaced
                        vs.remove(v)
                        _remove(v.segment)
                        v = None
                    if v is None and fresh is not None:
                        v, fresh = BlockVersion(fresh), None
                        vs.append(v)
                    if v is not None:
                        v.step, v.got, v.expect, v.meta = step, set(), expect, meta
                        xor = not key.startswith(xch.COPY + ".")  # accumulated: starts from zeros
                        if xor:
                            v.lock.acquire()  # lock order: Redundancy.lock, then the version's
                        break
                    self._serial += 1  # a name never used before by this agent: no live version has it
                    path = os.path.join(self.cfg.agent.shm_dir,
                                        shm.block_segment_name(self.cfg.run_id, self.node, key, self._serial))
                fresh = shm.create(path, max(length, 1))
        finally:
            if fresh is not None:  # not needed after all (another thread set the version up)
                _remove(fresh)
        if xor:
            try:
                v.segment.array[:length] = 0
            finally:
                v.lock.release()
        return v

    def _receive(self, msg: dict, payload: Optional[memoryview], conn: Optional[wire.Connection] = None) -> dict:
        """One contribution to a block version: ``payload`` in memory (this node's own), or still on
        ``conn`` (a peer's put), read straight into the block's shared memory."""
        key, step, length, src = msg["key"], int(msg["step"]), int(msg["length"]), int(msg["src"])
        n = int(msg.get("nbytes", len(payload) if payload is not None else 0))
        if n > length:
            raise ValueError(f"contribution of {n} bytes to block {key} of {length} bytes")
        v = self._version_for(key, step, length, int(msg["expect"]), msg.get("meta") or {})
        if v is None:
            if conn is not None:
                conn.skip()
            return {"ignored": True}
        dst = v.segment.array
        if msg["kind"] == xch.COPY:
            if conn is not None:
                conn.read_into(memoryview(v.segment.mm)[:n])
            else:
                dst[:n] = np.frombuffer(payload, np.uint8)
        else:
            if conn is not None:
                tmp = np.empty(n, np.uint8)
                conn.read_into(memoryview(tmp))
            else:
                tmp = np.frombuffer(payload, np.uint8)
            with v.lock:
                np.bitwise_xor(dst[:n], tmp, out=dst[:n])
        with self.lock:
            if v.step == step:
                v.got.add(src)
        # announcing may talk to every member: not on the sender's critical path (reply first)
        self._announcer.submit(self._maybe_announce, step, None, (msg.get("meta") or {}).get("sizes"))
        return {}

    def _exchange_for(self, sizes: dict[int, int]) -> xch.GroupExchange:
        """The group's exchange for these container sizes (cached: sizes change only when a rank's
        layout does)."""
        key = tuple(sorted(sizes.items()))
        with self.lock:
            if self._ex_cache is None or self._ex_cache[0] != key:
                self._ex_cache = (key, xch.group_exchange(self.plan, self.gi, sizes))
            return self._ex_cache[1]

    def _maybe_announce(self, step: int, ex: Optional[xch.GroupExchange] = None,
                        sizes: Optional[dict] = None) -> None:
        """Announce ``step`` once every block this node holds for it is complete."""
        try:
            ex = ex or self._exchange_for({int(r): int(v) for r, v in sizes.items()} if sizes else self.sizes())
        except Exception:
            return
        with self.lock:
            for spec in ex.held_by(self.node):
                v = next((v for v in self.blocks.get(spec.key, []) if v.step == step), None)
                if v is None or not v.complete:
                    return
            if self.announced.get(self.node, -1) >= step:
                return
        self._announce(step)

    def _announce(self, step: int) -> None:
        for n in self.members:
            if n == self.node:
                self._on_announce(self.node, step)
                continue
            try:
                self._send(n, {"op": "announce", "node": self.node, "step": step}, conns=self._aconns)
            except (OSError, PeerError) as e:
                log.warning("agent node %d: could not tell node %d that step %d is held: %s", self.node, n, step, e)

    def _on_announce(self, node: int, step: int) -> None:
        with self.lock:
            self.announced[node] = max(self.announced.get(node, -1), step)
            low = min(self.announced.get(n, -1) for n in self.members)
            if low > self.complete_step:
                self.complete_step = low
                t0 = self._started.pop(low, None)
                for old in [s for s in self._started if s < low]:
                    del self._started[old]
                if t0 is not None:  # exchange start -> every member holds the version
                    self.exchanged.append({"step": low, "complete_seconds": round(time.perf_counter() - t0, 5)})
                if self.inflight_step <= low:
                    self.inflight_step = -1
                log.info("agent node %d: step %d is complete in group %d %s", self.node, low, self.gi, self.members)

    # ------------------------------------------------------------------ scheduled transport
    # The trainers move the bytes (megatron_ft/transport/scheduled.py): a sender pins the slot of the
    # version it sends for as long as its chunks read it; a receiver writes the chunks into a block
    # version here and reports when every chunk arrived - only then is the block complete, so a
    # transfer spread over iterations (or cut by a failure) never counts as held.
    def sched_pin(self, rank: int, step: int) -> dict:
        slot = self.agent.pin_rank_step(rank, step)  # KeyError: not held clean
        with self.lock:
            self._sched_sending.setdefault(step, time.time())
            self._started.setdefault(step, time.perf_counter())
        return {"path": slot.segment.path, "size": slot.segment.size}

    def sched_recv_begin(self, src_rank: int, step: int, length: int) -> dict:
        _, sizes = self._wait_sizes(timeout=10.0)  # well within the trainer's 30 s request timeout
        if sizes.get(src_rank) != length:
            raise ValueError(f"rank {src_rank} sends {length} bytes but its published container size is "
                             f"{sizes.get(src_rank)}")
        key = f"{xch.COPY}.r{src_rank}"
        v = self._version_for(key, step, length, 1, {"sizes": {str(r): n for r, n in sizes.items()}, "codec": None})
        if v is None:
            return {"ignored": True}
        return {"path": v.segment.path}

    def sched_recv_done(self, src_rank: int, step: int) -> dict:
        key = f"{xch.COPY}.r{src_rank}"
        with self.lock:
            v = next((v for v in self.blocks.get(key, []) if v.step == step), None)
            if v is None:
                return {"ignored": True}
            v.got.add(self.plan.topology.node_of(src_rank))
        self._announcer.submit(self._maybe_announce, step)
        return {}

    # ------------------------------------------------------------------ serving peers
    # wire.Handler: requests from the group's agents
    def closed(self, conn: wire.Connection) -> None:
        pass

    def handle(self, conn: wire.Connection, msg: dict) -> "wire.Reply | dict":
        op = msg.get("op")
        if msg.get("run_id", self.cfg.run_id) != self.cfg.run_id:
            raise ValueError(f"run_id {msg.get('run_id')!r} is not this agent's {self.cfg.run_id!r}")
        if op == "put":
            return self._receive(msg, None, conn)
        if op == "announce":
            self._on_announce(int(msg["node"]), int(msg["step"]))
            return {}
        if op == "holds":
            return self.holds()
        if op == "get":
            return wire.Reply(payload=self._serve_get(msg))
        raise ValueError(f"unknown peer op {op!r}")

    def holds(self) -> dict:
        with self.lock:
            blocks = {k: [v.step for v in vs if v.complete] for k, vs in self.blocks.items()}
            codecs = {k: v.meta.get("codec") for k, vs in self.blocks.items() for v in vs
                      if v.complete and v.meta.get("codec")}
            sizes = {}
            for vs in self.blocks.values():
                for v in vs:
                    if v.complete:
                        sizes.update(v.meta.get("sizes", {}))
        sizes.update({str(r): n for r, n in self.agent.slot_sizes().items()})
        return {"primary": {str(r): s for r, s in self.agent.clean_steps().items()}, "blocks": blocks,
                "codecs": codecs, "sizes": sizes,
                "complete": self.complete_step, "pid": os.getpid()}

    def _serve_get(self, msg: dict) -> memoryview:
        step, lo, hi = int(msg["step"]), int(msg["lo"]), int(msg["hi"])
        if msg["what"] == "primary":
            mm = self.agent.clean_segment(int(msg["rank"]), step).mm  # KeyError if gone
        else:
            with self.lock:
                v = next((v for v in self.blocks.get(msg["key"], []) if v.step == step and v.complete), None)
            if v is None:
                raise KeyError(f"block {msg['key']} step {step} is not held here")
            mm = v.segment.mm
        if not 0 <= lo <= hi <= len(mm):
            raise ValueError(f"range [{lo}, {hi}) outside the {len(mm)}-byte buffer")
        return memoryview(mm)[lo:hi]

    # ------------------------------------------------------------------ recovery
    def _group_holds(self) -> dict[int, dict]:
        out = {}
        for n in self.members:
            if n == self.node:
                continue
            try:
                cl = self._client(n)
                try:
                    out[n] = cl.request("holds")
                finally:
                    cl.close()
            except (OSError, PeerError) as e:
                log.info("agent node %d: node %d unreachable for recovery (%s)", self.node, n, e)
        return out

    def candidates(self, rank: int) -> list[dict]:
        """Steps of ``rank`` this node can rebuild from its group, newest first (planned by
        :func:`megatron_ft.redundancy.rebuild.rebuildable`)."""
        holds, sizes = self._wait_sizes(RECOVERY_WAIT_S, ask_group=True)
        return rebuild.rebuildable(self.plan, holds, rank, sizes)

    def _fetch(self, node: int, what: str, ident: Any, step: int, lo: int, hi: int, dst: memoryview) -> None:
        cl = self._client(node)
        try:
            msg = {"op": "get", "what": what, "step": step, "lo": lo, "hi": hi}
            msg["rank" if what == "primary" else "key"] = ident
            cl.request(**msg, into=dst)
        finally:
            cl.close()

    def _fetch_whole(self, holds: dict, rank: int, step: int, lo: int, hi: int, dst: memoryview) -> None:
        where = rebuild.whole_at(holds, rank, step)
        if where is None:
            raise PeerError(f"no survivor holds rank {rank} step {step}")
        node, what, key = where
        self._fetch(node, what, rank if what == "primary" else key, step, lo, hi, dst)

    def recover(self, rank: int, step: int) -> dict:
        """Rebuild ``rank``'s container of ``step`` into a local slot; returns the source tier."""
        t0 = time.perf_counter()
        holds, sizes = self._wait_sizes(RECOVERY_WAIT_S, ask_group=True)
        how = rebuild.plan_rebuild(self.plan, holds, rank, step, sizes)
        if how is None:
            raise PeerError(f"rank {rank} step {step} cannot be rebuilt from the surviving group members")
        source, rec = how
        buf = np.zeros(sizes[rank], np.uint8)
        mv = memoryview(buf)
        if isinstance(rec, xch.CopyRecipe):
            self._fetch(rec.block.holder, "block", rec.block.key, step, 0, sizes[rank], mv)
        elif isinstance(rec, xch.XorRecipe):
            for x in rec.pieces:
                acc = np.zeros(x.parity.length, np.uint8)
                self._fetch(x.parity.holder, "block", x.parity.key, step, 0, x.parity.length, memoryview(acc))
                for _, p in x.others:
                    part = np.empty(p.hi - p.lo, np.uint8)
                    self._fetch_whole(holds, p.rank, step, p.lo, p.hi, memoryview(part))
                    np.bitwise_xor(acc[: len(part)], part, out=acc[: len(part)])
                buf[x.lo:x.hi] = acc[: x.hi - x.lo]
        else:
            self._decode_rs(holds, rec, step, buf)
        self.agent.install_recovered(rank, step, buf)
        dt = time.perf_counter() - t0
        log.warning("agent node %d: rebuilt rank %d step %d from the group (%s) in %.3f s", self.node, rank, step,
                    source, dt)
        return {"source": source, "seconds": dt}

    def _decode_rs(self, holds: dict, rec: xch.RsRecipe, step: int, buf: np.ndarray) -> None:
        desc = None
        avail: dict[int, np.ndarray] = {}
        for j, d in enumerate(rec.data):
            if j == rec.index or len(avail) >= rec.k:
                continue
            if d is None:
                avail[j] = np.zeros(rec.length, np.uint8)
            elif rebuild.whole_at(holds, d[0], step):
                a = np.zeros(rec.length, np.uint8)
                self._fetch_whole(holds, d[0], step, 0, d[1], memoryview(a)[: d[1]])
                avail[j] = a
        for i, b in enumerate(rec.parity):
            if len(avail) >= rec.k:
                break
            if b.holder in holds and rebuild.has_block(holds[b.holder], b.key, step):
                a = np.zeros(rec.length, np.uint8)
                self._fetch(b.holder, "block", b.key, step, 0, rec.length, memoryview(a))
                avail[rec.k + i] = a
                desc = holds[b.holder].get("codecs", {}).get(b.key) or desc
        # the codec recorded with the parity decodes it (a mismatching build refuses, by name)
        codec = get_codec(desc) if desc else self._codec or get_codec("rs", rec.k, rec.m)
        out = np.zeros(rec.length, np.uint8)
        codec.decode(avail, [rec.index], {rec.index: out})
        buf[:] = out[: rec.size]

    def close(self) -> None:
        self._stop.set()
        self._announcer.shutdown(wait=False)
        self._encoder.shutdown(wait=False)
        for cl in list(self._conns.values()) + list(self._aconns.values()):
            cl.close()
        with self.lock:
            self._cv.notify_all()
        self.server.close()

    def remove_segments(self) -> None:
        with self.lock:
            for vs in self.blocks.values():
                for v in vs:
                    _remove(v.segment)
            self.blocks.clear()

    # ------------------------------------------------------------------ rewind
    def rewind(self, step: int) -> None:
        """The job resumed from ``step``: versions newer than it (exchanged, announced, held as
        blocks or pending) are an abandoned future; the complete step goes down to ``step`` at most,
        so the next versions are exchanged and completed again."""
        with self.lock:
            self.complete_step = min(self.complete_step, step)
            self.announced = {n: min(s, step) for n, s in self.announced.items()}
            if self.inflight_step > step:
                self.inflight_step = -1
            if self._pending is not None and self._pending > step:
                self._pending = None
            for st in [st for st in self._sched_sending if st > step]:
                del self._sched_sending[st]
            for vs in self.blocks.values():
                for v in vs:
                    if v.step > step:
                        v.step, v.got, v.expect = -1, set(), 0
