"""Tests of the synthetic dataset and the Megatron-style sampler (megatron_ft.testing.data)."""

from __future__ import annotations

import itertools
from typing import Dict, List

import numpy as np
import pytest
import torch

from megatron_ft.testing.data import (
    PretrainingSampler,
    SyntheticTokenDataset,
    build_data_iterator,
)


def _take(it, n: int) -> List[Dict[str, torch.Tensor]]:
    return list(itertools.islice(it, n))


def _assert_batches_equal(a: List[Dict[str, torch.Tensor]], b: List[Dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_sample_shapes_and_ranges() -> None:
    ds = SyntheticTokenDataset(vocab_size=50, seq_length=32, seed=3)
    s = ds[5]
    assert s["tokens"].shape == s["labels"].shape == (32,)
    assert s["tokens"].dtype == s["labels"].dtype == torch.int64
    assert torch.equal(s["tokens"][1:], s["labels"][:-1])  # labels are next tokens
    assert torch.equal(s["position_ids"], torch.arange(32))
    assert torch.equal(s["loss_mask"], torch.ones(32))
    for i in range(200):
        seq = ds.sequence(i)
        assert seq.min() >= 0 and seq.max() < 50


def test_determinism_and_seed_dependence() -> None:
    a = SyntheticTokenDataset(vocab_size=128, seq_length=32, seed=1234)
    b = SyntheticTokenDataset(vocab_size=128, seq_length=32, seed=1234)
    c = SyntheticTokenDataset(vocab_size=128, seq_length=32, seed=1235)
    for i in [0, 1, 17, 10_000, 2**40]:
        assert np.array_equal(a.sequence(i), b.sequence(i))
    # Order of access does not matter.
    forward = [a.sequence(i) for i in range(20)]
    backward = [b.sequence(i) for i in reversed(range(20))][::-1]
    assert all(np.array_equal(x, y) for x, y in zip(forward, backward))
    assert any(not np.array_equal(a.sequence(i), c.sequence(i)) for i in range(10))
    assert not np.array_equal(a.sequence(0), a.sequence(1))
    # A known value pins the generator against silent changes (e.g. numpy's PCG64).
    assert a.sequence(0)[:12].tolist() == [78, 101, 123, 122, 33, 114, 56, 32, 78, 1, 11, 97]
    assert a.sequence(99)[:12].tolist() == [126, 48, 21, 118, 13, 33, 61, 7, 20, 87, 5, 85]


def test_learnable_structure() -> None:
    """Most next tokens are predictable from the pattern table: bigram entropy is low."""
    ds = SyntheticTokenDataset(vocab_size=128, seq_length=64, seed=0, noise_prob=0.05)
    seqs = np.stack([ds.sequence(i) for i in range(500)])
    pairs = seqs[:, :-1] * 128 + seqs[:, 1:]
    counts = np.bincount(pairs.ravel(), minlength=128 * 128).reshape(128, 128)
    rows = counts.sum(1, keepdims=True)
    p = counts / np.maximum(rows, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(p > 0, p * np.log(p), 0.0)).sum(1)
    cond_entropy = float((h * rows[:, 0]).sum() / rows.sum())
    assert cond_entropy < 0.5 * np.log(128), cond_entropy


def test_sampler_dp_sharding_is_disjoint_and_complete() -> None:
    mbs, dp, steps = 2, 4, 25
    per_rank = [
        list(itertools.islice(iter(PretrainingSampler(0, mbs, r, dp)), steps)) for r in range(dp)
    ]
    for step in range(steps):
        group = [per_rank[r][step] for r in range(dp)]
        flat = [i for idx in group for i in idx]
        assert len(set(flat)) == len(flat) == mbs * dp
        assert sorted(flat) == list(range(step * mbs * dp, (step + 1) * mbs * dp))
        # Megatron layout: rank r takes the r-th contiguous slice.
        for r in range(dp):
            start = step * mbs * dp + r * mbs
            assert group[r] == list(range(start, start + mbs))


def test_sampler_total_samples_and_validation() -> None:
    assert len(list(PretrainingSampler(0, 2, 1, 2, total_samples=16))) == 4
    assert len(list(PretrainingSampler(8, 2, 0, 2, total_samples=16))) == 2
    with pytest.raises(ValueError):
        PretrainingSampler(3, 2, 0, 2)  # not a multiple of mbs * dp
    with pytest.raises(ValueError):
        PretrainingSampler(0, 2, 2, 2)  # rank out of range
    with pytest.raises(ValueError):
        PretrainingSampler(32, 2, 0, 2, total_samples=16)


@pytest.mark.parametrize("dp_rank,dp_size", [(0, 1), (0, 2), (1, 2), (2, 4)])
@pytest.mark.parametrize("resume_steps", [0, 1, 4, 9])
def test_iterator_resumes_exactly(dp_rank: int, dp_size: int, resume_steps: int) -> None:
    ds = SyntheticTokenDataset(vocab_size=64, seq_length=16, seed=11)
    mbs = 2
    per_step = mbs * dp_size
    full = build_data_iterator(ds, 0, mbs, dp_rank, dp_size)
    uninterrupted = _take(full, 12)
    assert full.consumed_samples == 12 * per_step

    consumed = resume_steps * per_step
    resumed_it = build_data_iterator(ds, consumed, mbs, dp_rank, dp_size)
    assert resumed_it.consumed_samples == consumed
    resumed = _take(resumed_it, 12 - resume_steps)
    _assert_batches_equal(uninterrupted[resume_steps:], resumed)
    assert resumed_it.consumed_samples == 12 * per_step


def test_iterator_batches_hold_the_sampled_indices() -> None:
    ds = SyntheticTokenDataset(vocab_size=64, seq_length=8, seed=5)
    it = build_data_iterator(ds, 8, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2)
    batch = next(it)
    assert batch["tokens"].shape == (2, 8)
    # consumed 8 -> group [8..12): rank 1 gets samples 10 and 11.
    assert torch.equal(batch["tokens"][0], ds[10]["tokens"])
    assert torch.equal(batch["tokens"][1], ds[11]["tokens"])


def test_global_batches_identical_for_any_dp_layout() -> None:
    """The samples of a global batch do not depend on how DP splits them."""
    gbs = 8

    def global_batch_indices(dp: int, mbs: int, step: int) -> List[int]:
        out: List[int] = []
        for r in range(dp):
            sampler = PretrainingSampler(step * gbs, mbs, r, dp)
            out += [i for idx in itertools.islice(iter(sampler), gbs // (mbs * dp)) for i in idx]
        return sorted(out)

    for step in range(3):
        ref = list(range(step * gbs, (step + 1) * gbs))
        assert global_batch_indices(1, 2, step) == ref
        assert global_batch_indices(2, 2, step) == ref
        assert global_batch_indices(4, 1, step) == ref
