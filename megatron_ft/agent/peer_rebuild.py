"""Rebuilding a lost rank's container from the group: the executor of the plans in
:mod:`megatron_ft.redundancy.rebuild`.

A replacement node's agent asks the group which versions every survivor holds (``holds``);
:func:`~megatron_ft.redundancy.rebuild.rebuildable` lists the steps a rank can be rebuilt at, and
:func:`~megatron_ft.redundancy.rebuild.plan_rebuild` the recipe for one: a whole copy
(``peer_memory``), or XOR / Reed-Solomon decoding from the survivors' primaries and parity blocks
(``decoded``). This module only moves bytes as the recipe says - ranged ``get`` requests to the
holders, one connection per request (bounded by ``agent.request_timeout_s``) - and installs the
result in a local slot, where the trainer restores it with every checksum verified, as from
local memory. No lock is held while it runs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

from ..redundancy import exchange as xch
from ..redundancy import rebuild
from ..redundancy.codecs import get_codec
from ..transport import wire
from .peer_protocol import Get

log = logging.getLogger("megatron_ft.agent")

class PeerError(wire.RemoteError):
    """A peer agent refused a request (the message says why), or could not be found."""


@dataclass(frozen=True)
class GroupHoldings:
    """What the group's members hold (``holds``: node -> its ``holds`` reply, the asking node's own
    included), every
    group rank's container size (``sizes``; None when nobody knows one: nobody holds that rank's
    data) and who did not answer in time (``unanswered``: ``"node N"`` or ``"store"`` -> why). With
    anyone unanswered, what the group can rebuild is *unknown*, not empty."""
    holds: dict[int, dict]
    sizes: Optional[dict[int, int]]
    unanswered: dict[str, str] = field(default_factory=dict)


class RebuildOwner(Protocol):
    """What the rebuild needs from its owner (:class:`.redundancy.Redundancy`)."""
    node: int
    plan: Any  # RedundancyPlan
    slots: Any  # the node's SlotStore: install_recovered(rank, step, buf)
    codec: Any
    peers: Any  # the PeerDirectory: group_holdings(wait_s) -> GroupHoldings, client(node), publish_size(rank, n)


class PeerRebuild:
    def __init__(self, owner: RebuildOwner):
        self.owner = owner

    def candidates(self, rank: int, wait_s: float) -> dict:
        """``{"versions": [{step, source}, ...], "unanswered": {node: why}}``: the steps of ``rank``
        this node can rebuild from its group, newest first, waiting up to ``wait_s`` for every member
        to answer. ``unanswered`` non-empty: the list may lack versions those members hold."""
        g = self.owner.peers.group_holdings(wait_s)
        versions = [] if g.sizes is None else rebuild.rebuildable(self.owner.plan, g.holds, rank, g.sizes)
        return {"versions": versions, "unanswered": g.unanswered}

    def recover(self, rank: int, step: int, wait_s: float) -> dict:
        """Rebuild ``rank``'s container of ``step`` into a local slot; returns the source tier."""
        owner = self.owner
        t0 = time.perf_counter()
        g = owner.peers.group_holdings(wait_s)
        holds, sizes = g.holds, g.sizes
        how = None if sizes is None else rebuild.plan_rebuild(owner.plan, holds, rank, step, sizes)
        if how is None or sizes is None:
            missing = f" (no answer from {', '.join(sorted(g.unanswered))})" if g.unanswered else ""
            raise PeerError(f"rank {rank} step {step} cannot be rebuilt from the surviving group members{missing}")
        source, rec = how
        decode_peak = 0
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
            decode_peak = self._decode_rs(holds, rec, step, buf)
        size = owner.slots.install_recovered(rank, step, buf)
        if size is not None:  # the rank's slots were made for it: the group learns their size
            owner.peers.publish_size(rank, size)
        dt = time.perf_counter() - t0
        log.warning("agent node %d: rebuilt rank %d step %d from the group (%s) in %.3f s", owner.node, rank, step,
                    source, dt)
        out = {"source": source, "seconds": dt}
        if isinstance(rec, xch.RsRecipe):
            out["decode_buffers_peak"] = decode_peak
        return out

    def _fetch(self, node: int, what: str, ident: Any, step: int, lo: int, hi: int, dst: memoryview) -> None:
        cl = self.owner.peers.client(node)
        try:
            get = Get(op="get", what=what, step=step, lo=lo, hi=hi, **{"rank" if what == "primary" else "key": ident})
            cl.request(**get.fields(), into=dst)
        finally:
            cl.close()

    def _fetch_whole(self, holds: dict, rank: int, step: int, lo: int, hi: int, dst: memoryview) -> None:
        where = rebuild.whole_at(holds, rank, step)
        if where is None:
            raise PeerError(f"no survivor holds rank {rank} step {step}")
        node, what, key = where
        self._fetch(node, what, rank if what == "primary" else key, step, lo, hi, dst)

    def _decode_rs(self, holds: dict, rec: xch.RsRecipe, step: int, buf: np.ndarray) -> int:
        """Data shard ``rec.index`` of the row into ``buf``, decoded piece by piece: each piece of
        :func:`decode_piece_bytes` fetches the same range of k surviving shards (one connection per
        source, kept for the whole decode), so the heap holds k + 1 pieces, never k shards. Returns the
        largest number of bytes its buffers held at once."""
        desc = None
        sources: dict[int, Optional[tuple]] = {}  # shard index -> (node, what, ident, valid bytes) or None (zeros)
        for j, d in enumerate(rec.data):
            if j == rec.index or len(sources) >= rec.k:
                continue
            if d is None:
                sources[j] = None
            elif (where := rebuild.whole_at(holds, d[0], step)) is not None:
                node, what, key = where
                sources[j] = (node, what, d[0] if what == "primary" else key, d[1])
        for i, b in enumerate(rec.parity):
            if len(sources) >= rec.k:
                break
            if b.holder in holds and rebuild.has_block(holds[b.holder], b.key, step):
                sources[rec.k + i] = (b.holder, "block", b.key, rec.length)
                desc = holds[b.holder].get("codecs", {}).get(b.key) or desc
        # the codec recorded with the parity decodes it (a mismatching build refuses, by name)
        codec = get_codec(desc) if desc else self.owner.codec or get_codec("rs", rec.k, rec.m)
        piece = decode_piece_bytes(codec.piece_align)
        clients = {n: self.owner.peers.client(n) for n in {s[0] for s in sources.values() if s is not None}}
        try:
            peak = 0
            for lo in range(0, rec.size, piece):
                hi = min(lo + piece, rec.length)
                avail = {j: np.zeros(hi - lo, np.uint8) for j in sources}
                for j, src in sources.items():
                    if src is None or src[3] <= lo:
                        continue  # zero padding beyond the shard's bytes
                    node, what, ident, valid = src
                    get = Get(op="get", what=what, step=step, lo=lo, hi=min(hi, valid),
                              **{"rank" if what == "primary" else "key": ident})
                    clients[node].request(**get.fields(), into=memoryview(avail[j])[: min(hi, valid) - lo])
                out = np.zeros(hi - lo, np.uint8)
                codec.decode(avail, [rec.index], {rec.index: out})
                peak = max(peak, (len(avail) + 1) * (hi - lo))
                end = min(hi, rec.size)
                buf[lo:end] = out[: end - lo]
            return peak
        finally:
            for cl in clients.values():
                cl.close()


#: how much of each shard an rs rebuild decodes at a time (rounded up to the codec's piece alignment)
DECODE_PIECE = 4 << 20


def decode_piece_bytes(align: int) -> int:
    """:data:`DECODE_PIECE` rounded up to a multiple of ``align`` (a bit-matrix codec's ``8 x packet``).

    >>> decode_piece_bytes(1), decode_piece_bytes(8 * 3000)
    (4194304, 4200000)
    """
    return -(-DECODE_PIECE // align) * align
