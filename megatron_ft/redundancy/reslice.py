"""Re-slicing data-parallel shards for another data-parallel size: pure planning over the parameters'
global offsets, apart from the code that moves the bytes.

A data-parallel rank saves slices of state that the data-parallel group shards: its slice of every DDP
bucket's parameter storage, and the distributed optimizer's shard of every parameter (main parameter,
``exp_avg``, ``exp_avg_sq``). Which elements a slice holds depends on the data-parallel size: megatron-core
pads each bucket to a multiple of it and cuts the bucket into that many equal slices, so at DP' the slices,
their padding and their sizes all differ, and a slice of one size is no slice of the other. What does not
change with DP is the parameters themselves. So every saved slice is described by what it holds *of the
parameters* - :class:`Extent`: entry elements ``[offset, offset + length)`` hold elements
``[lo, lo + length)`` of parameter ``param`` (flattened) - and a rank at DP' is built by intersecting the
extents of the slices it needs (``targets``) with the extents the old ranks saved (``sources``), parameter
by parameter (:func:`plan_reslice`). Padding belongs to no parameter: it is in no extent and is never
copied (a target's padding is zero-filled by whoever fills the target).

Every target element of a parameter must be covered by exactly one source element: a gap (a parameter
range no source holds - e.g. the lost ranks' slices not yet rebuilt) or an overlap of targets is refused
with the parameter and the range named, before a byte moves.

Worked example: one bucket of two parameters (``w``: 5 elements, ``b``: 2) padded to a multiple of DP.
At DP = 3 the 7 elements are padded to 9, three slices of 3; at DP' = 2 padded to 8, two slices of 4.
Rank 0 at DP' = 2 needs ``w[0:4]``; the old rank 0 holds ``w[0:3]``, the old rank 1 ``w[3:5] b[0:1]``:

>>> old = {0: [Extent("bucket", 0, "w", 0, 3)],
...        1: [Extent("bucket", 0, "w", 3, 2), Extent("bucket", 2, "b", 0, 1)],
...        2: [Extent("bucket", 0, "b", 1, 1)]}
>>> new_rank0 = [Extent("bucket", 0, "w", 0, 4)]
>>> for c in plan_reslice(new_rank0, old):
...     print(c)
Copy(src_rank=0, src_entry='bucket', src_offset=0, dst_entry='bucket', dst_offset=0, length=3)
Copy(src_rank=1, src_entry='bucket', src_offset=0, dst_entry='bucket', dst_offset=3, length=1)
>>> new_rank1 = [Extent("bucket", 0, "w", 4, 1), Extent("bucket", 1, "b", 0, 2)]
>>> [(c.src_rank, c.src_offset, c.dst_offset, c.length) for c in plan_reslice(new_rank1, old)]
[(1, 1, 0, 1), (1, 2, 1, 1), (2, 0, 2, 1)]

The same shard without the old rank 2 (lost, not rebuilt) leaves ``b[1:2]`` uncovered:

>>> plan_reslice(new_rank1, {r: old[r] for r in (0, 1)})
Traceback (most recent call last):
...
ValueError: no source holds elements [1, 2) of parameter 'b' (target 'bucket' at 2)
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple


@dataclass(frozen=True, order=True)
class Extent:
    """Elements ``[offset, offset + length)`` of entry ``entry`` hold elements ``[lo, lo + length)`` of
    ``param`` (flattened; the entry and it share a dtype). ``param`` names one state of one parameter:
    its value (``decoder.fc1.weight``), or an optimizer state of it (``decoder.fc1.weight:exp_avg``)."""
    entry: str
    offset: int
    param: str
    lo: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.lo < 0 or self.length <= 0:
            raise ValueError(f"extent {self}: offset and lo must be >= 0, length > 0")

    @property
    def hi(self) -> int:
        return self.lo + self.length


class Copy(NamedTuple):
    """``length`` elements from ``src_rank``'s entry ``src_entry`` at ``src_offset`` to the target entry
    ``dst_entry`` at ``dst_offset``."""
    src_rank: int
    src_entry: str
    src_offset: int
    dst_entry: str
    dst_offset: int
    length: int


def extents_of_slice(entry: str, slice_lo: int, slice_hi: int,
                     params: Iterable[tuple[str, int, int]]) -> list[Extent]:
    """The extents of a slice ``[slice_lo, slice_hi)`` of a buffer (a bucket's storage) in which parameter
    ``name`` occupies ``[start, end)`` (``params``: ``(name, start, end)``, megatron-core's
    ``param_index_map`` in the bucket's coordinates); the slice's element ``i`` is the buffer's
    ``slice_lo + i``. Padding (no parameter) gives no extent.

    >>> extents_of_slice("k0", 3, 6, [("w", 0, 5), ("b", 5, 7)])
    [Extent(entry='k0', offset=0, param='w', lo=3, length=2), Extent(entry='k0', offset=2, param='b', lo=0, length=1)]
    >>> extents_of_slice("k0", 6, 9, [("w", 0, 5), ("b", 5, 7)])  # 2 of the 3 elements are padding
    [Extent(entry='k0', offset=0, param='b', lo=1, length=1)]
    """
    out = []
    for name, start, end in sorted(params, key=lambda p: p[1]):
        lo, hi = max(start, slice_lo), min(end, slice_hi)
        if lo < hi:
            out.append(Extent(entry, lo - slice_lo, name, lo - start, hi - lo))
    return out


def plan_reslice(targets: Iterable[Extent], sources: Mapping[int, Iterable[Extent]]) -> list[Copy]:
    """The copies that fill ``targets`` (the extents a rank at the new size needs) from ``sources`` (the
    extents each old rank saved, by rank), in target order. Each target element comes from exactly one
    source element; where old ranks' extents of a parameter overlap (they should not), the lowest rank's
    is used. ValueError names a parameter range no source holds, or two targets that overlap."""
    by_param: dict[str, list[tuple[int, int, int, Extent]]] = {}
    for rank in sorted(sources):
        for e in sources[rank]:
            by_param.setdefault(e.param, []).append((e.lo, e.hi, rank, e))
    for v in by_param.values():
        v.sort(key=lambda t: (t[0], t[2]))
    _no_overlap(targets)
    copies: list[Copy] = []
    for t in sorted(targets, key=lambda e: (e.entry, e.offset)):
        have = by_param.get(t.param, [])
        los = [h[0] for h in have]
        at = t.lo
        i = max(0, bisect.bisect_right(los, at) - 1)
        while at < t.hi:
            while i < len(have) and have[i][1] <= at:
                i += 1
            if i >= len(have) or have[i][0] > at:
                end = min(t.hi, have[i][0]) if i < len(have) else t.hi
                raise ValueError(f"no source holds elements [{at}, {end}) of parameter {t.param!r} "
                                 f"(target {t.entry!r} at {t.offset + at - t.lo})")
            lo, hi, rank, src = have[i]
            n = min(hi, t.hi) - at
            copies.append(Copy(rank, src.entry, src.offset + at - lo, t.entry, t.offset + at - t.lo, n))
            at += n
    return copies


def _no_overlap(targets: Iterable[Extent]) -> None:
    """Targets fill disjoint element ranges of their entries, and disjoint ranges of each parameter."""
    for key, what in (((lambda e: (e.entry, e.offset, e.offset + e.length)), "entry"),
                      ((lambda e: (e.param, e.lo, e.hi)), "parameter")):
        spans = sorted(key(e) for e in targets)
        for (n1, lo1, hi1), (n2, lo2, hi2) in zip(spans, spans[1:]):
            if n1 == n2 and lo2 < hi1:
                raise ValueError(f"targets overlap in {what} {n1!r}: [{lo1}, {hi1}) and [{lo2}, {hi2})")
