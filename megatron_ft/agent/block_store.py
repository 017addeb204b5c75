"""The receiving side of the peer redundancy: the block versions this node holds for its group, in
shared memory.

A *block* is what the plan gives one holder (a whole copy of a rank's container, an XOR parity
piece, a Reed-Solomon parity row), named by its key (``copy.r3``, ``xor.g0.p1``, ``rs.g0.p1.row2``).
Each block has up to :data:`MAX_VERSIONS` versions, one per step; contributions to a version arrive
from the group's senders (a copy is written, XOR and RS partials are XOR-ed in) until it has one
from every contributor: then it is *complete*.

Which versions must survive is not decided here: the owner says which steps to keep
(:meth:`BlockStore.keep`, from :class:`.group_completion.GroupCompletion`), and a new step reuses
the oldest version not kept, or a new segment while fewer than :data:`MAX_VERSIONS` exist. With every
version kept, a newer contribution is ignored (a stale or refused contribution reads
``None``: the sender's put is answered ``ignored``).

Segments: each version's file in ``agent.shm_dir`` has a name no live version has (a per-store
serial, :func:`.shm.block_segment_name`); a version too small for its new step is unlinked and
replaced; :meth:`BlockStore.remove_segments` unlinks all. New segments are created and pre-faulted
outside the store's lock.

Lock order: the owner's lock (``Redundancy.lock``), then ``BlockStore.lock``, then a version's
``BlockVersion.lock``. ``BlockStore.lock`` is never held across a segment allocation, a network
read or a store call; a version's lock is held while its bytes are XOR-ed or zeroed.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from . import shm
from ..redundancy import exchange as xch

#: versions per block: the complete one, one this node announced that the group has not completed
#: yet, and the one receiving
MAX_VERSIONS = 3


@dataclass
class BlockVersion:
    segment: shm.Segment
    step: int = -1
    got: set = field(default_factory=set)  # contributor nodes received
    expect: int = 0
    meta: dict = field(default_factory=dict)  # {"sizes": {rank: bytes}, "codec": descriptor or None}
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: contributors XOR-ed in (under ``lock``): a contribution sent again - a restarted agent sending a
    #: version the group already holds - is dropped, or it would cancel itself out of the parity
    applied: set = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.step >= 0 and self.expect > 0 and len(self.got) >= self.expect


def _remove(seg: shm.Segment) -> None:
    seg.close()
    try:
        os.unlink(seg.path)
    except FileNotFoundError:
        pass


class BlockStore:
    """The block versions of one agent (``run_id``, ``node``) under ``shm_dir``."""

    def __init__(self, shm_dir: str, run_id: str, node: int, max_versions: int = MAX_VERSIONS):
        self.shm_dir, self.run_id, self.node = shm_dir, run_id, node
        self.max_versions = max_versions  # + recovery.marked_versions (the certified and the watched step)
        self.lock = threading.Lock()
        self.blocks: dict[str, list[BlockVersion]] = {}
        self._keep: set[int] = set()
        self._serial = 0  # block version files created (their names' suffix)

    def keep(self, steps: set[int]) -> None:
        """The steps whose versions are never reused (set by the owner under its lock)."""
        with self.lock:
            self._keep = set(steps)

    # ------------------------------------------------------------------ receiving
    def version_for(self, key: str, step: int, length: int, expect: int, meta: dict) -> Optional[BlockVersion]:
        """The version receiving ``step`` of ``key``, reset for it if it is new (None: a stale
        contribution - a newer version exists - or every version is kept). An XOR or RS block
        starts from zeros (zeroed under the version's lock, outside the store's)."""
        fresh: Optional[shm.Segment] = None
        try:
            while True:
                with self.lock:
                    vs = self.blocks.setdefault(key, [])
                    for v in vs:
                        if v.step == step:
                            return v
                    if any(v.step > step for v in vs):
                        return None
                    free = [v for v in vs if v.step not in self._keep]
                    v = None
                    if free and len(vs) >= 2:  # two versions before any is reused; a third only when both are kept
                        v = min(free, key=lambda b: b.step)
                        if v.segment.size < length:  # too small for this version: replaced
                            vs.remove(v)
                            _remove(v.segment)
                            v = None
                    elif len(vs) >= self.max_versions:
                        return None  # every version is kept: this step is not taken here
                    if v is None and fresh is not None:
                        v, fresh = BlockVersion(fresh), None
                        vs.append(v)
                    if v is not None:
                        v.step, v.got, v.expect, v.meta, v.applied = step, set(), expect, meta, set()
                        accumulated = not key.startswith(xch.COPY + ".")
                        if accumulated:
                            v.lock.acquire()  # lock order: BlockStore.lock, then the version's
                        break
                    self._serial += 1  # a name never used before by this store: no live version has it
                    path = os.path.join(self.shm_dir, shm.block_segment_name(self.run_id, self.node, key, self._serial))
                fresh = shm.create(path, max(length, 1))
        finally:
            if fresh is not None:  # not needed after all (another thread set the version up)
                _remove(fresh)
        if accumulated:
            try:
                v.segment.array[:length] = 0
            finally:
                v.lock.release()
        return v

    @staticmethod
    def destination(v: BlockVersion, kind: str, n: int) -> memoryview:
        """Where ``n`` bytes of one contribution to ``v`` land: a copy in the block itself (one
        contributor, who sends its steps in order); XOR/RS partials in a buffer of their own, XOR-ed in
        by :meth:`apply`."""
        if kind == xch.COPY:
            return memoryview(v.segment.mm)[:n]
        return memoryview(np.empty(n, np.uint8))

    @staticmethod
    def apply(v: BlockVersion, step: int, kind: str, landed: memoryview, src: int) -> bool:
        """Node ``src``'s contribution to ``step``, landed in :meth:`destination`'s view: a copy is in
        already; an XOR/RS partial is XOR-ed in under the version's lock, unless ``v`` was reset for a
        newer step meanwhile (it belongs to no live version) or ``src``'s contribution to this version
        is in already (XOR-ed twice it would cancel out): then it is dropped. Whether it went in."""
        if kind == xch.COPY:
            return True
        n = len(landed)
        dst = v.segment.array
        with v.lock:
            if v.step != step or src in v.applied:
                return False
            np.bitwise_xor(dst[:n], np.frombuffer(landed, np.uint8), out=dst[:n])
            v.applied.add(src)
            return True

    def received(self, v: BlockVersion, step: int, src: int) -> None:
        """``src``'s contribution to ``v`` (for ``step``) is in (ignored if ``v`` moved on)."""
        with self.lock:
            if v.step == step:
                v.got.add(src)

    # ------------------------------------------------------------------ reading
    def version(self, key: str, step: int, complete: bool = True) -> Optional[BlockVersion]:
        """The version of ``key`` holding ``step`` (only a complete one unless ``complete`` is False)."""
        with self.lock:
            return next((v for v in self.blocks.get(key, []) if v.step == step and (v.complete or not complete)),
                        None)

    def all_complete(self, keys: list[str], step: int) -> bool:
        with self.lock:
            return all(any(v.step == step and v.complete for v in self.blocks.get(k, [])) for k in keys)

    def holdings(self) -> dict[str, Any]:
        """``{"blocks": key -> complete steps, "codecs": key -> codec descriptor, "sizes": rank -> bytes}``."""
        with self.lock:
            complete = [(k, v) for k, vs in self.blocks.items() for v in vs if v.complete]
            blocks: dict[str, list[int]] = {k: [] for k in self.blocks}
            codecs, sizes = {}, {}
            for k, v in complete:
                blocks[k].append(v.step)
                if v.meta.get("codec"):
                    codecs[k] = v.meta["codec"]
                sizes.update(v.meta.get("sizes", {}))
        return {"blocks": blocks, "codecs": codecs, "sizes": sizes}

    def allocated(self) -> int:
        """Bytes of shared memory the store's versions hold now."""
        with self.lock:
            return sum(v.segment.size for vs in self.blocks.values() for v in vs)

    def status(self) -> dict:
        with self.lock:
            return {"blocks": {k: [(v.step, v.complete, os.path.basename(v.segment.path)) for v in vs]
                               for k, vs in sorted(self.blocks.items())},
                    "block_bytes": sum(v.segment.size for vs in self.blocks.values() for v in vs)}

    # ------------------------------------------------------------------ rewind and removal
    def rewind(self, step: int) -> None:
        """Versions newer than ``step`` are an abandoned future: emptied for reuse."""
        with self.lock:
            for vs in self.blocks.values():
                for v in vs:
                    if v.step > step:
                        v.step, v.got, v.expect = -1, set(), 0

    def remove_segments(self) -> None:
        with self.lock:
            for vs in self.blocks.values():
                for v in vs:
                    _remove(v.segment)
            self.blocks.clear()
