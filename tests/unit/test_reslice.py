"""Re-slicing data-parallel shards (``megatron_ft/redundancy/reslice.py``) against the real thing done by
hand: buffers of parameters padded and cut the way megatron-core's DDP cuts them, at DP and at DP', the
DP' slices built from the DP slices by the plan equal to the DP' slices cut from the whole buffers."""
from __future__ import annotations

import random

import numpy as np
import pytest

from megatron_ft.redundancy.reslice import Extent, extents_of_slice, plan_reslice


def padded(numel: int, dp: int) -> int:
    return -(-numel // dp) * dp


def buckets_of(rng: random.Random, nbuckets: int) -> list[list[tuple[str, int, int]]]:
    """Per bucket, its parameters as (name, start, end) in the bucket's coordinates."""
    out = []
    for b in range(nbuckets):
        at, params = 0, []
        for p in range(rng.randint(1, 5)):
            n = rng.randint(1, 37)
            params.append((f"b{b}.p{p}", at, at + n))
            at += n
        out.append(params)
    return out


def slices(buckets, dp: int, rank: int, states=("",)):
    """A rank's saved extents at ``dp``: its slice of every bucket (the parameters' values) and, for each
    optimizer state, the same elements of that state (the distributed optimizer's shard)."""
    ext = []
    for k, params in enumerate(buckets):
        n = padded(params[-1][2], dp) // dp
        for state in states:
            named = [(f"{name}{state}", s, e) for name, s, e in params]
            ext += extents_of_slice(f"k{k}{state}", rank * n, (rank + 1) * n, named)
    return ext


def full_values(buckets, states) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"{name}{state}": rng.standard_normal(e - s).astype(np.float32)
            for params in buckets for name, s, e in params for state in states}


def materialize(ext: list[Extent], values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The entries a rank holds, filled from the parameters' values (padding 0)."""
    size: dict[str, int] = {}
    for e in ext:
        size[e.entry] = max(size.get(e.entry, 0), e.offset + e.length)
    out = {k: np.zeros(n, np.float32) for k, n in size.items()}
    for e in ext:
        out[e.entry][e.offset:e.offset + e.length] = values[e.param][e.lo:e.hi]
    return out


@pytest.mark.parametrize("seed,dp,dp2", [(1, 3, 2), (2, 2, 3), (3, 4, 3), (4, 8, 5), (5, 3, 1), (6, 1, 4)])
def test_the_plan_rebuilds_every_slice_at_the_new_size(seed, dp, dp2):
    rng = random.Random(seed)
    buckets = buckets_of(rng, rng.randint(1, 4))
    states = ("", ":exp_avg", ":exp_avg_sq")
    values = full_values(buckets, states)
    old = {r: slices(buckets, dp, r, states) for r in range(dp)}
    held = {r: materialize(old[r], values) for r in range(dp)}
    for r2 in range(dp2):
        targets = slices(buckets, dp2, r2, states)
        want = materialize(targets, values)
        got = {k: np.zeros_like(v) for k, v in want.items()}
        for c in plan_reslice(targets, old):
            got[c.dst_entry][c.dst_offset:c.dst_offset + c.length] = \
                held[c.src_rank][c.src_entry][c.src_offset:c.src_offset + c.length]
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"rank {r2} entry {k}")


def test_every_target_element_is_copied_exactly_once():
    rng = random.Random(11)
    buckets = buckets_of(rng, 3)
    old = {r: slices(buckets, 3, r) for r in range(3)}
    for r2 in range(2):
        targets = slices(buckets, 2, r2)
        copies = plan_reslice(targets, old)
        assert sum(c.length for c in copies) == sum(t.length for t in targets)
        written = [(c.dst_entry, i) for c in copies for i in range(c.dst_offset, c.dst_offset + c.length)]
        assert len(written) == len(set(written))


def test_a_lost_ranks_slice_is_a_gap_named_before_any_copy():
    rng = random.Random(3)
    buckets = buckets_of(rng, 2)
    old = {r: slices(buckets, 3, r) for r in (0, 2)}  # rank 1 lost, not rebuilt
    with pytest.raises(ValueError, match=r"no source holds elements \[\d+, \d+\) of parameter 'b\d\.p\d'"):
        for r2 in range(2):
            plan_reslice(slices(buckets, 2, r2), old)


def test_overlapping_targets_are_refused():
    with pytest.raises(ValueError, match=r"targets overlap in entry 'k0': \[0, 4\) and \[2, 5\)"):
        plan_reslice([Extent("k0", 0, "w", 0, 4), Extent("k0", 2, "v", 0, 3)], {0: [Extent("k0", 0, "w", 0, 4)]})
    with pytest.raises(ValueError, match=r"targets overlap in parameter 'w'"):
        plan_reslice([Extent("k0", 0, "w", 0, 4), Extent("k1", 0, "w", 3, 2)], {0: [Extent("k0", 0, "w", 0, 5)]})


def test_an_extent_must_hold_something():
    with pytest.raises(ValueError, match="length > 0"):
        Extent("k0", 0, "w", 0, 0)
