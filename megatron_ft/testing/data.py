"""Deterministic synthetic token data for training runs made by the project itself.

Nothing is downloaded. :class:`SyntheticTokenDataset` is an unbounded, indexable stream
of token sequences: sample ``i`` depends only on ``(seed, i)``, so any sample can be
produced at any time, in any process, bit for bit the same. The sequences are built from
a fixed set of random n-gram *patterns* (plus a little noise), so a language model can
learn them and the loss goes down.

:class:`PretrainingSampler` mirrors Megatron-LM's ``MegatronPretrainingSampler``: samples
are consumed in index order, ``micro_batch_size * data_parallel_size`` at a time, and each
data-parallel rank takes its own contiguous slice of every such group. It is resumable:
a sampler built at ``consumed_samples=k`` yields exactly what an uninterrupted sampler
yields after ``k`` samples.

:func:`build_data_iterator` combines both into the micro-batch iterator that megatron-core's
``forward_backward_func`` consumes (``num_microbatches`` ``next()`` calls per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch

__all__ = [
    "SyntheticTokenDataset",
    "PretrainingSampler",
    "MicroBatchIterator",
    "build_data_iterator",
    "collate",
]

# Stream identifiers mixed into the numpy seed sequence, so the pattern table and the
# samples come from independent streams.
_PATTERN_STREAM = 0
_SAMPLE_STREAM = 1


@dataclass(frozen=True)
class SyntheticTokenDataset:
    """Unbounded deterministic dataset of token sequences with learnable structure.

    Each sample is a run of patterns drawn from a fixed table of ``num_patterns`` random
    n-grams of length ``pattern_length``; each token is replaced by a uniformly random
    token with probability ``noise_prob``. A sample has ``seq_length + 1`` tokens, split
    into inputs ``tokens = seq[:-1]`` and next-token targets ``labels = seq[1:]``.

    Args:
        vocab_size: number of distinct token ids (ids are in ``[0, vocab_size)``).
        seq_length: tokens per training sequence.
        seed: determines the pattern table and every sample.
        num_patterns: number of n-grams in the pattern table.
        pattern_length: length of each n-gram.
        noise_prob: per-token probability of a random replacement.
    """

    vocab_size: int
    seq_length: int
    seed: int = 1234
    num_patterns: int = 16
    pattern_length: int = 8
    noise_prob: float = 0.05

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        if self.num_patterns < 1 or self.pattern_length < 1:
            raise ValueError("num_patterns and pattern_length must be >= 1")
        if not 0.0 <= self.noise_prob <= 1.0:
            raise ValueError(f"noise_prob must be in [0, 1], got {self.noise_prob}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        rng = np.random.Generator(np.random.PCG64([self.seed, _PATTERN_STREAM]))
        patterns = rng.integers(
            0, self.vocab_size, size=(self.num_patterns, self.pattern_length), dtype=np.int64
        )
        # frozen dataclass: set the derived table once.
        object.__setattr__(self, "_patterns", patterns)

    @property
    def patterns(self) -> np.ndarray:
        """The ``(num_patterns, pattern_length)`` n-gram table (a copy)."""
        return self._patterns.copy()  # type: ignore[attr-defined]

    def sequence(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` raw tokens of sample ``index`` (int64)."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        n = self.seq_length + 1
        rng = np.random.Generator(np.random.PCG64([self.seed, _SAMPLE_STREAM, index]))
        num_chunks = -(-n // self.pattern_length) + 1
        choice = rng.integers(0, self.num_patterns, size=num_chunks)
        offset = int(rng.integers(0, self.pattern_length))
        seq = self._patterns[choice].reshape(-1)[offset : offset + n].copy()  # type: ignore[attr-defined]
        noise = rng.random(n) < self.noise_prob
        seq[noise] = rng.integers(0, self.vocab_size, size=int(noise.sum()))
        return seq

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        """Sample ``index`` as Megatron GPT inputs: tokens, labels, loss_mask, position_ids."""
        seq = torch.from_numpy(self.sequence(index))
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack a list of samples into a micro-batch (leading batch dimension)."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class PretrainingSampler:
    """Megatron-style sequential sampler, sharded across data-parallel ranks.

    Yields lists of ``micro_batch_size`` sample indices: this rank's share of each group
    of ``micro_batch_size * data_parallel_size`` consecutive samples, starting at sample
    ``consumed_samples``. Like Megatron's ``MegatronPretrainingSampler``, rank ``r`` gets
    indices ``[start + r * mbs, start + (r + 1) * mbs)`` of the group beginning at
    ``start``.

    Args:
        consumed_samples: global samples already consumed (all DP ranks together); must
            be a multiple of ``micro_batch_size * data_parallel_size``.
        micro_batch_size: samples per micro-batch per rank.
        data_parallel_rank: this rank's index in its data-parallel group.
        data_parallel_size: size of the data-parallel group.
        total_samples: stop before this global sample index (``None``: never stop).
    """

    def __init__(
        self,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        total_samples: Optional[int] = None,
    ) -> None:
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError("micro_batch_size and data_parallel_size must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
            )
        step = micro_batch_size * data_parallel_size
        if consumed_samples < 0 or consumed_samples % step != 0:
            raise ValueError(
                f"consumed_samples ({consumed_samples}) must be a non-negative multiple of "
                f"micro_batch_size * data_parallel_size ({step})"
            )
        if total_samples is not None and total_samples < consumed_samples:
            raise ValueError("total_samples must be >= consumed_samples")
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.total_samples = total_samples

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.data_parallel_size
        first = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while self.total_samples is None or start + step <= self.total_samples:
            yield list(range(start + first, start + first + self.micro_batch_size))
            start += step


class MicroBatchIterator:
    """Iterator of collated micro-batches; ``consumed_samples`` tracks the global position.

    ``consumed_samples`` advances by ``micro_batch_size * data_parallel_size`` per
    micro-batch, i.e. it counts the samples consumed by all data-parallel ranks together,
    as Megatron's ``args.consumed_samples`` does.
    """

    def __init__(self, dataset: SyntheticTokenDataset, sampler: PretrainingSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.consumed_samples = sampler.consumed_samples
        self._indices = iter(sampler)

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        indices = next(self._indices)
        self.consumed_samples += self.sampler.micro_batch_size * self.sampler.data_parallel_size
        return collate([self.dataset[i] for i in indices])


def build_data_iterator(
    dataset: SyntheticTokenDataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    total_samples: Optional[int] = None,
) -> MicroBatchIterator:
    """Micro-batch iterator for one data-parallel rank, starting at ``consumed_samples``."""
    sampler = PretrainingSampler(
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
        total_samples=total_samples,
    )
    return MicroBatchIterator(dataset, sampler)
