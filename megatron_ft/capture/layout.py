"""Snapshot layout: where every tensor lives in a rank's flat snapshot area (pure planning).

A rank's state is a list of named tensors. The layout packs them, 64-byte aligned and in a
fixed order, into one flat byte area cut into fixed-size chunks (the copy and checksum unit).
The layout is computed once per run from names, dtypes and shapes, so every snapshot of a
rank has the same byte positions; only the data, the chunk checksums and a small JSON record
of non-tensor state change from one step to the next.

Worked example (chunk_size = 4096, alignment = 64)::

    a: float32[1000]  -> offset     0, nbytes 4000
    b: int64[3]       -> offset  4032, nbytes   24    (4000 rounded up to 64)
    data_nbytes = 4056 -> chunks: [0, 4096)            (one chunk, checksummed as a whole)

    with chunk_size = 2048: chunks [0, 2048) and [2048, 4056); chunk 1 holds the end of
    ``a`` and all of ``b``.

REFT sharding: a tensor replicated across the data-parallel group may be saved as a slice
(``ShardSpec(index=r, count=DP, full_numel=n)``): replica r keeps elements
``[r*ceil(n/DP), min((r+1)*ceil(n/DP), n))``, so the group together holds one full copy.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

ALIGNMENT = 64
LAYOUT_FORMAT = "megatron-ft-layout"
LAYOUT_VERSION = 1

# dtype name -> bytes per element (planning needs no torch; the agent never imports it)
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1,
}


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} cannot be snapshotted; supported: {sorted(ITEMSIZE)}")
    return name


def dtype_from_name(name: str):
    """``"float32"`` -> ``torch.float32``."""
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(ITEMSIZE)}")
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class ShardSpec:
    """This entry is slice ``index`` of ``count`` of a tensor with ``full_numel`` elements."""

    index: int
    count: int
    full_numel: int

    def bounds(self) -> tuple[int, int]:
        return shard_bounds(self.full_numel, self.index, self.count)


def shard_bounds(numel: int, index: int, count: int) -> tuple[int, int]:
    """Element range of slice ``index`` of ``count`` (ceil-sized slices; the last ones may be short or empty).

    >>> shard_bounds(10, 0, 4), shard_bounds(10, 3, 4)
    ((0, 3), (9, 10))
    """
    per = -(-numel // count)
    start = min(index * per, numel)
    return start, min(start + per, numel)


@dataclass(frozen=True)
class TensorSpec:
    """What the state adapter declares: a name, dtype, shape (of what is saved) and optional shard."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: Optional[ShardSpec] = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"unknown dtype name {self.dtype!r}; supported: {sorted(ITEMSIZE)}")
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TensorEntry:
    spec: TensorSpec
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


@dataclass(frozen=True)
class Piece:
    """Part of a chunk: bytes ``[src_start, src_end)`` of entry ``entry_index`` at ``dst_offset`` of the area."""

    entry_index: int
    src_start: int
    src_end: int
    dst_offset: int


@dataclass(frozen=True)
class Layout:
    entries: tuple[TensorEntry, ...]
    chunk_size: int
    data_nbytes: int
    identity: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.data_nbytes // self.chunk_size))

    def chunk_bounds(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_size
        return start, min(start + self.chunk_size, self.data_nbytes)

    def pieces(self, chunk: int) -> list[Piece]:
        """The tensor byte ranges that fall in ``chunk``, in address order."""
        lo, hi = self.chunk_bounds(chunk)
        out = []
        for idx, e in enumerate(self.entries):
            if e.end <= lo or e.offset >= hi or e.spec.nbytes == 0:
                continue
            s, t = max(lo, e.offset), min(hi, e.end)
            out.append(Piece(idx, s - e.offset, t - e.offset, s))
        return out

    def all_pieces(self) -> list[list[Piece]]:
        """``pieces(i)`` for every chunk in one sweep over the tensors (O(tensors + chunks)); a
        snapshot engine computes this once per layout, not per snapshot."""
        out: list[list[Piece]] = [[] for _ in range(self.num_chunks)]
        cs = self.chunk_size
        for idx, e in enumerate(self.entries):
            pos, end = e.offset, e.end
            while pos < end:
                chunk = pos // cs
                stop = min(end, (chunk + 1) * cs)
                out[chunk].append(Piece(idx, pos - e.offset, stop - e.offset, pos))
                pos = stop
        return out

    def by_name(self) -> dict[str, TensorEntry]:
        return {e.spec.name: e for e in self.entries}

    def fingerprint(self) -> str:
        """Hash of everything that fixes byte positions (not the identity): names, dtypes, shapes, offsets."""
        h = hashlib.sha256()
        h.update(f"{LAYOUT_VERSION}|{self.chunk_size}|{self.data_nbytes}".encode())
        for e in self.entries:
            s = e.spec
            shard = f"{s.shard.index}/{s.shard.count}/{s.shard.full_numel}" if s.shard else "-"
            h.update(f"|{s.name}|{s.dtype}|{s.shape}|{shard}|{e.offset}".encode())
        return h.hexdigest()[:32]

    # ---------------------------------------------------------------- JSON record
    def to_json(self) -> bytes:
        rec = {
            "format": LAYOUT_FORMAT,
            "version": LAYOUT_VERSION,
            "chunk_size": self.chunk_size,
            "data_nbytes": self.data_nbytes,
            "fingerprint": self.fingerprint(),
            "identity": self.identity,
            "tensors": [
                {
                    "name": e.spec.name, "dtype": e.spec.dtype, "shape": list(e.spec.shape),
                    "offset": e.offset,
                    **({"shard": [e.spec.shard.index, e.spec.shard.count, e.spec.shard.full_numel]}
                       if e.spec.shard else {}),
                }
                for e in self.entries
            ],
        }
        return json.dumps(rec, separators=(",", ":"), sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes) -> "Layout":
        rec = json.loads(raw)
        if rec.get("format") != LAYOUT_FORMAT or rec.get("version") != LAYOUT_VERSION:
            raise ValueError(f"not a {LAYOUT_FORMAT} v{LAYOUT_VERSION} record: "
                             f"format={rec.get('format')!r} version={rec.get('version')!r}")
        entries = []
        for t in rec["tensors"]:
            shard = ShardSpec(*t["shard"]) if "shard" in t else None
            entries.append(TensorEntry(TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), shard), t["offset"]))
        layout = Layout(tuple(entries), rec["chunk_size"], rec["data_nbytes"], rec.get("identity", {}))
        if layout.fingerprint() != rec["fingerprint"]:
            raise ValueError("layout record fingerprint mismatch: the record is corrupt")
        return layout


def plan_layout(specs: Sequence[TensorSpec], chunk_size: int, identity: Optional[dict] = None) -> Layout:
    """Pack ``specs`` in order, each at a 64-byte aligned offset. Names must be unique."""
    if chunk_size <= 0 or chunk_size % ALIGNMENT:
        raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of {ALIGNMENT}")
    seen: set[str] = set()
    entries = []
    offset = 0
    for s in specs:
        if s.name in seen:
            raise ValueError(f"duplicate tensor name {s.name!r} in snapshot layout")
        seen.add(s.name)
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        entries.append(TensorEntry(s, offset))
        offset += s.nbytes
    return Layout(tuple(entries), chunk_size, offset, dict(identity or {}))
