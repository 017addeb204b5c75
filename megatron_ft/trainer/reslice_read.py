"""Filling a rank's data-parallel shards at a new data-parallel size from the old ranks' containers.

The bytes side of :mod:`megatron_ft.redundancy.reslice`: each old rank's container records what its
shards hold of the parameters (``extra["extents"]``, ``entry -> [[offset, param, lo, length], ...]``);
the caller says what this rank's shards at the new size must hold (``wanted``, extents of its
destination entries); :func:`plan_reslice` pairs them, and :func:`read_resliced` reads each old
container it needs once - whole, every chunk's checksum verified, as any restore reads - and copies the
planned element ranges into the destinations. Nothing is written before the plan has covered every
wanted element (a range no old rank holds is refused by name before a byte moves), and no destination
is written from a container that failed its checksums (each container is read into buffers of its own
first).

Memory: one old container's entries at a time, in buffers this function allocates and frees (about
1/DP of the state per container, DP the old size); ``direct`` entries are read straight into their
destinations instead.

Worked example: the old ranks 0 and 1 (DP 2) each saved half of a 6-element parameter ``w``; the new
single rank (DP 1) needs all of it.

>>> import os, tempfile, torch
>>> from megatron_ft.capture.state import StateTensor
>>> from megatron_ft.redundancy.reslice import Extent
>>> from megatron_ft.trainer.snapshot_file import write_snapshot_file
>>> from megatron_ft.trainer.recovery import Container
>>> d = tempfile.mkdtemp()
>>> for r in (0, 1):
...     part = torch.arange(6.0)[3 * r: 3 * r + 3]
...     write_snapshot_file(f"{d}/r{r}", 5, [StateTensor("slice", part.clone())],
...                         {"extents": {"slice": [[0, "w", 3 * r, 3]]}}, {"rank": r})
>>> sources = {r: Container(f"{d}/r{r}") for r in (0, 1)}
>>> whole = torch.zeros(6)
>>> read_resliced(sources, {"slice": whole}, [Extent("slice", 0, "w", 0, 6)])
ReslicedRead(copies=2, elements=6, containers=[0, 1])
>>> whole.tolist()
[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
>>> for c in sources.values(): c.close()
>>> for r in (0, 1): os.unlink(f"{d}/r{r}")
>>> os.rmdir(d)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from ..capture.layout import dtype_from_name
from ..capture.state import StateTensor
from ..redundancy.reslice import Copy, Extent, plan_reslice
from .recovery import Container


@dataclass(frozen=True)
class ReslicedRead:
    """What :func:`read_resliced` did: the planned copies, the elements they moved, the old ranks read."""
    copies: int
    elements: int
    containers: list[int]


def extents_of(container: Container) -> list[Extent]:
    """What the container's shards hold of the parameters (its ``extents`` record), as :class:`Extent`; a
    container written before the record existed holds none."""
    record = container.version.get("extra", {}).get("extents", {})
    return [Extent(entry, *rec) for entry, recs in record.items() for rec in recs]


def read_resliced(sources: Mapping[int, Container], targets: Mapping[str, torch.Tensor], wanted: list[Extent],
                  direct: Optional[Mapping[int, Mapping[str, StateTensor]]] = None,
                  holders: Optional[Mapping[int, list[Extent]]] = None) -> ReslicedRead:
    """Fill ``targets`` (entry name -> the flat destination tensor the ``wanted`` extents index) from the
    old ranks' containers ``sources`` (old rank -> an open container, its identity already checked).
    ``direct[r]``: entries of old rank ``r``'s container read straight into the given destinations (state
    that is not re-sliced, e.g. the RNG streams of data-parallel replica 0); every other entry of a
    container read is read into a buffer of its own (it must still pass its checksums). ``holders``: each
    old rank's :func:`extents_of`, where the caller has them already.
    Raises ``ValueError`` before reading a byte where no old rank holds a wanted range or a dtype differs,
    and :class:`~megatron_ft.capture.snapfile.SnapshotFormatError` where a container fails its checksums
    (the destinations may then hold part of the state: the caller refuses the restore). Not collective."""
    direct = direct or {}
    if holders is None:
        holders = {rank: extents_of(c) for rank, c in sources.items()}
    copies = plan_reslice(wanted, holders)
    by_rank: dict[int, list[Copy]] = {}
    for c in copies:
        by_rank.setdefault(c.src_rank, []).append(c)
    for rank, planned in by_rank.items():
        specs = {e.spec.name: e.spec for e in sources[rank].layout.entries}
        for c in planned:
            src, dst = dtype_from_name(specs[c.src_entry].dtype), targets[c.dst_entry].dtype
            if src != dst:
                raise ValueError(f"old rank {rank}'s {c.src_entry} is {src}, the destination {c.dst_entry} is {dst}")
    read = sorted(set(by_rank) | set(direct))
    for rank in read:
        container = sources[rank]
        straight = direct.get(rank, {})
        buffers = {e.spec.name: torch.empty(e.spec.shape, dtype=dtype_from_name(e.spec.dtype))
                   for e in container.layout.entries if e.spec.name not in straight}
        container.load_verified({**{n: StateTensor(n, t) for n, t in buffers.items()}, **straight})
        for c in by_rank.get(rank, []):
            src = buffers[c.src_entry].reshape(-1)[c.src_offset: c.src_offset + c.length]
            targets[c.dst_entry].reshape(-1)[c.dst_offset: c.dst_offset + c.length].copy_(src)
    return ReslicedRead(len(copies), sum(c.length for c in copies), read)
