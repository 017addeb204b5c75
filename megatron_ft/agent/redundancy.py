"""The agent's peer redundancy: exchange every consistent version with the group, hold what the
plan assigns this node in shared memory, and rebuild a lost node's ranks from the survivors.

Its parts, along the data path of one version ``S`` (every local rank committed it and the
trainers agreed on it):

1. sending - :class:`.exchange_sender.ExchangeSender` pins the local ranks' primary slots of ``S``
   and sends this node's contributions (copies, XOR pieces, partial RS parities) to their holders;
2. receiving - :class:`.block_store.BlockStore` writes each contribution into a block version in
   shared memory; when every block this node holds for ``S`` is complete, this node *announces*
   ``S`` to the group;
3. group completion - :class:`.group_completion.GroupCompletion` (pure) turns the announcements
   into the group's *complete* step, and says which primary slots (complete, in flight, still
   being sent by the trainers) and which block versions (complete, announced here) must be kept:
   a version being encoded can always be decoded from (REFT's clean/dirty applied to the group);
4. recovery - :class:`.peer_rebuild.PeerRebuild` executes the plans of
   :mod:`megatron_ft.redundancy.rebuild` for a replacement node's ranks.

This module wires them together and serves the group's requests (``put``, ``announce``, ``holds``,
``get``) on the peer transport (:mod:`megatron_ft.transport.wire`); for ``put`` it is the peer byte
transport's :class:`~megatron_ft.transport.peer_bytes.Landing` (:class:`ContributionLanding`).

What it knows of the other members (addresses, sizes, their holdings) is
:class:`.peer_directory.PeerDirectory`'s.

Lock order: ``PeerDirectory._asking`` (one question to the group at a time, held across its network
I/O and nothing else's), then ``Redundancy.lock`` (the completion state), then ``BlockStore.lock``, then a block
version's lock; ``ContributionLanding._lock`` (the contributions landing) is a leaf, held around a dict's
operations only. ``SlotStore.lock`` is never held with any of them (docs/architecture.md). No lock is
held across network I/O, a store call or a shared-memory allocation.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from .block_store import MAX_VERSIONS, BlockStore
from .exchange_sender import ExchangeSender
from .group_completion import GroupCompletion
from .peer_protocol import PEER_MESSAGES, Announce, Get, PutMeta
from .peer_directory import PeerDirectory
from .peer_rebuild import PeerError, PeerRebuild
from ..redundancy import exchange as xch
from ..redundancy.codecs import get_codec
from ..redundancy.plan import RedundancyPlan, plan_from_config
from .. import network
from ..transport import wire, wire_bytes
from ..transport.messages import validated
from ..transport.peer_bytes import Buffer
from ..transport.wire_bytes import PutBytes

log = logging.getLogger("megatron_ft.agent")

class Redundancy:
    """Lives inside :class:`megatron_ft.agent.server.Agent` when ``redundancy.scheme != none``; reads and
    writes the node's slots through its slot store (:class:`.slot_store.SlotStore`: ``slots``) only,
    never holding ``Redundancy.lock`` while it calls it. ``secret``: the job's, proven by every peer
    connection (both ways)."""

    def __init__(self, slots: Any, cfg: Any, node: int, secret: Optional[bytes], store: Any,
                 host: str = "127.0.0.1"):
        self.slots = slots
        self.cfg = cfg
        self.node = node
        self.secret = secret
        self.store = store
        self.plan: RedundancyPlan = plan_from_config(self.cfg)
        self.gi = self.plan.node_group[self.node]
        self.members = tuple(self.plan.groups[self.gi].members)
        self.group_ranks = [r for n in self.members for r in self.plan.topology.ranks_of(n)]
        self.lock = threading.Lock()
        self.completion = GroupCompletion(self.node, self.members)
        self.blocks = BlockStore(self.cfg.agent.shm_dir, self.cfg.run_id, self.node,
                                 MAX_VERSIONS + self.cfg.recovery.marked_versions)
        self.exchanged: list[dict] = []  # recent records (status): sends {step, sent_bytes, seconds},
        # completions {step, complete_seconds: this node's exchange start -> the group holds it}
        self._ex_cache: Optional[tuple] = None
        self._announcer = ThreadPoolExecutor(1, thread_name_prefix="announce")  # in order, off the put path
        self._aconns: dict[int, wire.Client] = {}  # the announcer's open connections
        #: where the members' contributions land (the peer byte transport's landing)
        self.landing = ContributionLanding(
            self.node, self.blocks, self.exchange_for,
            # announcing may talk to every member: not on the sender's critical path (reply first)
            lambda step, sizes: self._announcer.submit(self._maybe_announce, step, None, sizes))
        self._stop = threading.Event()
        #: the other members' addresses, sizes and answers to "what do you hold"; connections to them
        self.peers = PeerDirectory(self.cfg, self.node, self.members, self.group_ranks, store, secret, self.holds,
                                   self._stop)
        #: transport "scheduled": the trainers send their copies (sched_pin ...)
        self.scheduled = self.cfg.redundancy.transport == "scheduled"
        g = self.plan.groups[self.gi]
        #: rs parity node: its packets are all held whole by data nodes (slot_store.slots_per_rank)
        self.own_copy_is_redundant = self.plan.own_copy_is_redundant(self.node)
        self.codec = None
        if self.plan.scheme == "rs":  # the group's own k: a remainder of nodes joins a group as data nodes
            self.codec = get_codec("rs", g.k, g.m)
        self.sender = ExchangeSender(self)
        self.rebuild = PeerRebuild(self)
        port = network.peer_port(self.cfg, self.node)
        try:
            self.server = wire.Server((host, port), self, name=f"peers-n{self.node}", secret=secret).start()
        except OSError as e:
            raise OSError(e.errno, f"node {self.node}'s peer transport cannot listen on {host}:{port} ({e.strerror}): "
                                   f"another process holds the port; free it or move network.peer_port") from None
        self.address = f"{self.server.address[0]}:{self.server.address[1]}"
        self.store.publish(f"addr/{self.node}", self.address)
        log.info("agent node %d: %s, group %d %s, peer transport on %s", self.node, self.plan.label, self.gi,
                 self.members, self.address)

    # ------------------------------------------------------------------ protection (the agent's begin)
    def protected_steps(self) -> set[int]:
        """Steps whose primary slots the agent keeps (see :meth:`GroupCompletion.protected`)."""
        with self.lock:
            steps, gave_up = self.completion.protected(time.time())
        if gave_up is not None:
            log.error("agent node %d: exchange of step %d did not complete within %.0f s; giving it up",
                      self.node, gave_up, self.completion.exchange_timeout_s)
        return steps

    def sending_steps(self) -> set[int]:
        with self.lock:
            return self.completion.sending()

    @property
    def complete_step(self) -> int:
        with self.lock:
            return self.completion.complete_step

    def status(self) -> dict:
        with self.lock:
            c = self.completion
            out = {"scheme": self.plan.scheme, "group": self.gi, "members": list(self.members),
                   "complete_step": c.complete_step, "inflight_step": c.inflight_step,
                   "announced": {str(k): v for k, v in c.newest_announced().items()},
                   "address": self.address, "exchanged": self.exchanged[-3:]}
        return {**out, **self.blocks.status()}

    # ------------------------------------------------------------------ sending (one version)
    def version_global(self, step: int) -> None:
        """Every local rank agreed on ``step``: exchange it (the newest pending one wins). With the
        scheduled transport the trainers send it (:meth:`sched_pin` ...)."""
        if self.scheduled:
            return
        with self.lock:
            if not self.completion.begin(step, time.time()):
                return
        self.sender.request(step)

    def exchange_started(self, step: int, t0: float) -> None:
        with self.lock:
            self.completion.exchange_started(step, t0)

    def exchange_for(self, sizes: dict[int, int]) -> xch.GroupExchange:
        """The group's exchange for these container sizes (cached: sizes change only when a rank's
        layout does). The first time for given sizes, the shared memory this node's blocks will take
        (every version) is reserved in the agent's budget (:meth:`.shm_budget.ShmBudget.reserve_peer_blocks`), before
        anything of that exchange is sent or received: a :class:`~.shm.SharedMemoryError` when it does
        not fit."""
        key = tuple(sorted(sizes.items()))
        with self.lock:
            cached = self._ex_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        ex = xch.group_exchange(self.plan, self.gi, sizes)
        held = ex.held_by(self.node)
        self.slots.budget.reserve_peer_blocks(xch.held_bytes(held, self.blocks.max_versions), len(held),
                                       self.blocks.allocated())
        with self.lock:  # (never both locks: lock order, the class docstring)
            self._ex_cache = (key, ex)
        return ex

    def contributions_sent(self, step: int, ex: xch.GroupExchange, nbytes: int, seconds: float) -> None:
        """The sender sent every contribution of ``step``: announce it once this node's blocks are
        complete (at once when it holds none)."""
        self._announcer.submit(self._maybe_announce, step, ex)
        with self.lock:
            self.exchanged.append({"step": step, "sent_bytes": nbytes, "seconds": round(seconds, 5)})
            self.exchanged = self.exchanged[-10:]

    def sent(self, step: int, ok: bool) -> None:
        """The sender is done reading ``step``'s primary slots (``ok``: every contribution went out)."""
        with self.lock:
            self.completion.sent(step)
            if not ok:
                self.completion.failed(step)

    # ------------------------------------------------------------------ group completion
    def _maybe_announce(self, step: int, ex: Optional[xch.GroupExchange] = None,
                        sizes: Optional[dict] = None) -> None:
        """Announce ``step`` once every block this node holds for it is complete. The claim (its
        blocks are kept from then on) and the check are one step under ``Redundancy.lock``."""
        try:
            ex = ex or self.exchange_for({int(r): int(v) for r, v in sizes.items()} if sizes else self.peers.sizes())
        except Exception:
            return
        keys = [spec.key for spec in ex.held_by(self.node)]
        with self.lock:
            if not self.blocks.all_complete(keys, step) or not self.completion.claim(step):
                return
            self.blocks.keep(self.completion.kept_blocks())
        self._announce(step)

    def _announce(self, step: int) -> None:
        for n in self.members:
            if n == self.node:
                self._on_announce(self.node, step)
                continue
            try:
                cl = self._aconns.get(n)
                if cl is None:
                    cl = self._aconns[n] = self.peers.client(n)
                cl.request(**Announce(op="announce", node=self.node, step=step).fields())
            except (OSError, PeerError) as e:
                log.warning("agent node %d: could not tell node %d that step %d is held: %s", self.node, n, step, e)

    def _on_announce(self, node: int, step: int) -> None:
        with self.lock:
            done = self.completion.announce(node, step, time.perf_counter())
            if done is None:
                return
            self.blocks.keep(self.completion.kept_blocks())
            if done.seconds is not None:  # exchange start -> every member holds the version
                self.exchanged.append({"step": done.step, "complete_seconds": round(done.seconds, 5)})
        log.info("agent node %d: step %d is complete in group %d %s", self.node, done.step, self.gi, self.members)

    # ------------------------------------------------------------------ scheduled transport
    # The trainers move the bytes (megatron_ft/transport/scheduled/): a sender pins the slot of the
    # version it sends for as long as its chunks read it; a receiver writes the chunks into a block
    # version here and reports when every chunk arrived - only then is the block complete, so a
    # transfer spread over iterations (or cut by a failure) never counts as held.
    def sched_pin(self, rank: int, step: int) -> dict:
        slot = self.slots.transport.pin(rank, step)  # KeyError: not held clean
        with self.lock:
            self.completion.scheduled(step, time.time())
            self.completion.exchange_started(step, time.perf_counter())
        return {"path": slot.segment.path, "size": slot.segment.size}

    def sched_recv_begin(self, src_rank: int, step: int, length: int) -> dict:
        sizes = self.peers.wait_sizes(timeout=10.0)  # well within the trainer's 30 s request timeout
        if sizes.get(src_rank) != length:
            raise ValueError(f"rank {src_rank} sends {length} bytes but its published container size is "
                             f"{sizes.get(src_rank)}")
        self.exchange_for(sizes)  # this node's blocks fit its budget (else refused)
        key = f"{xch.COPY}.r{src_rank}"
        v = self.blocks.version_for(key, step, length, 1, {"sizes": {str(r): n for r, n in sizes.items()},
                                                           "codec": None})
        if v is None:
            return {"ignored": True}
        return {"path": v.segment.path}

    def sched_recv_done(self, src_rank: int, step: int) -> dict:
        key = f"{xch.COPY}.r{src_rank}"
        v = self.blocks.version(key, step, complete=False)
        if v is None:
            return {"ignored": True}
        self.blocks.received(v, step, self.plan.topology.node_of(src_rank))
        self._announcer.submit(self._maybe_announce, step)
        return {}

    # ------------------------------------------------------------------ serving peers
    # wire.Handler: requests from the group's agents
    def closed(self, conn: wire.Connection) -> None:
        pass

    def handle(self, conn: wire.Connection, msg: dict) -> "wire.Reply | dict":
        req = PEER_MESSAGES.parse(msg)  # a malformed request is refused here, naming the field
        if req.run_id is not None and req.run_id != self.cfg.run_id:
            raise ValueError(f"run_id {req.run_id!r} is not this agent's {self.cfg.run_id!r}")
        if isinstance(req, PutBytes):
            return wire_bytes.land(conn, req, self.landing)
        if isinstance(req, Announce):
            self._on_announce(req.node, req.step)
            return {}
        if isinstance(req, Get):
            return wire.Reply(payload=served_bytes(self.slots, self.blocks, req))
        return self.holds()

    def holds(self) -> dict:
        held = self.blocks.holdings()
        sizes = {**held["sizes"], **{str(r): n for r, n in self.slots.slot_sizes().items()}}
        return {"primary": {str(r): s for r, s in self.slots.clean_steps().items()}, "blocks": held["blocks"],
                "codecs": held["codecs"], "sizes": sizes, "complete": self.complete_step, "pid": os.getpid()}

    # ------------------------------------------------------------------ recovery (self.rebuild: candidates, recover)
    def rebuilt(self, step: int) -> None:
        """A rank of this node was rebuilt at ``step`` from the group: the group holds it; this node never
        sends it (the job's verdict that reaches a replacement names it agreed)."""
        with self.lock:
            self.completion.rebuilt(step)

    def keep_marked(self, steps: set[int]) -> None:
        """The steps this node's ranks certified or watch: keep its blocks of them, so that a lost member's
        ranks can be rebuilt at the certified version."""
        with self.lock:
            self.completion.marked(steps)
            self.blocks.keep(self.completion.kept_blocks())

    # ------------------------------------------------------------------ rewind and shutdown
    def rewind(self, step: int) -> None:
        """The job resumed from ``step``: versions newer than it (exchanged, announced, held as
        blocks or pending) are an abandoned future; the complete step goes down to ``step`` at most,
        so the next versions are exchanged and completed again."""
        self.peers.forget()
        with self.lock:
            self.completion.rewind(step)
            self.blocks.rewind(step)
            self.blocks.keep(self.completion.kept_blocks())
        self.sender.drop_newer(step)

    def close(self, remove_segments: bool = False) -> None:
        """Stop sending and serving; with ``remove_segments``, the block versions' files removed too."""
        self._stop.set()
        self.sender.close()
        self._announcer.shutdown(wait=False)
        for cl in list(self._aconns.values()):
            cl.close()
        self.server.close()
        if remove_segments:
            self.blocks.remove_segments()


def served_bytes(slots: Any, blocks: BlockStore, req: Get) -> memoryview:
    """What a peer's ``get`` asks for: bytes [lo, hi) of a clean primary slot of ``slots`` or of a complete
    block version of ``blocks`` (KeyError if neither holds it any more; ValueError for a range outside it)."""
    step, lo, hi = req.step, req.lo, req.hi
    if req.what == "primary":
        if req.rank is None:
            raise ValueError("peer op 'get' of a primary names its rank")
        mm = slots.clean_segment(req.rank, step).mm  # KeyError if gone
    else:
        v = blocks.version(req.key or "", step)
        if v is None:
            raise KeyError(f"block {req.key} step {step} is not held here")
        mm = v.segment.mm
    if not 0 <= lo <= hi <= len(mm):
        raise ValueError(f"range [{lo}, {hi}) outside the {len(mm)}-byte buffer")
    return memoryview(mm)[lo:hi]


class ContributionLanding:
    """The receiving side of the exchange: the peer byte transport's
    :class:`~megatron_ft.transport.peer_bytes.Landing` of node ``node``: contributions land in ``blocks``;
    ``exchange_for(sizes)`` checks the sender's sizes against this node's budget (raises to refuse);
    ``announce(step, sizes)`` queues the check whether this node now holds ``step`` whole (off the
    sender's critical path). ``_lock`` is a leaf: held around its table's operations only."""

    def __init__(self, node: int, blocks: BlockStore, exchange_for: Callable[[dict], Any],
                 announce: Callable[[int, dict], None]):
        self.node, self.blocks, self.exchange_for, self.announce = node, blocks, exchange_for, announce
        self._landing: dict[tuple[int, str], tuple] = {}  # (src, key) -> (step, version, meta, view) landing
        self._lock = threading.Lock()

    def open(self, src: int, buffer: Buffer, length: int) -> Optional[memoryview]:
        """Where node ``src``'s contribution of ``length`` bytes to block ``buffer.key`` of ``buffer.step``
        lands (:meth:`.block_store.BlockStore.destination`), or None when no version of the block takes it
        (every version kept). Raises - the put is refused - on a malformed ``meta``, a contribution longer
        than its block, or sizes whose blocks do not fit this node's budget."""
        m = validated(PutMeta, buffer.meta, "peer op 'put' meta")
        if length > m.length:
            raise ValueError(f"contribution of {length} bytes to block {buffer.key} of {m.length} bytes")
        sizes = {int(r): int(b) for r, b in m.sizes.items()}
        if sizes:  # the sender's sizes: this node's blocks for them fit its budget, or the put is refused
            self.exchange_for(sizes)
        v = self.blocks.version_for(buffer.key, buffer.step, m.length, m.expect, {"sizes": m.sizes, "codec": m.codec})
        if v is None:
            return None
        view = self.blocks.destination(v, m.kind, length)
        with self._lock:  # one contribution per sender and block lands at a time
            self._landing[(src, buffer.key)] = (buffer.step, v, m, view)
        return view

    def landed(self, src: int, buffer: Buffer) -> None:
        """Node ``src``'s contribution is in :meth:`open`'s view: applied to its block version, which then
        counts ``src`` as in (dropped if the version moved on, or ``src``'s partial is in already)."""
        with self._lock:
            step, v, m, view = self._landing.pop((src, buffer.key))
        if not self.blocks.apply(v, step, m.kind, view, src):
            log.info("agent node %d: dropped node %d's contribution to block %s step %d (in already, or the block "
                     "moved on)", self.node, src, buffer.key, step)
            return
        self.blocks.received(v, step, src)
        self.announce(step, m.sizes)

    def abandoned(self, src: int, buffer: Buffer) -> None:
        """Node ``src``'s contribution was cut short: nothing of it counts (the block stays incomplete)."""
        with self._lock:
            self._landing.pop((src, buffer.key), None)

