"""Wasted time per failure and the checkpoint-frequency constraint (GEMINI section 2.1).

A failure costs the work done since the newest *complete* checkpoint plus the time to read it
back. With checkpoints every 1/f seconds that take t_ckpt to complete and failures uniformly
spread between two checkpoints, the average wasted time is (GEMINI eq. 1)

    T_wasted = t_ckpt + 1 / (2 f) + t_rtol

and one checkpoint cannot start before the previous one is complete, nor more than once per
iteration (constraint 2):

    1 / f >= max(t_ckpt, T_iter)

Worked example (GEMINI 2.2): MT-NLG's model states take 42 minutes to reach remote storage at
20 Gbps. At the highest allowed frequency (1/f = 42 min) and t_rtol = 42 min, T_wasted =
42 + 21 + 42 = 105 minutes per failure. GEMINI's HighFreq baseline checkpoints every
ceil(t_ckpt / T_iter) iterations: 558 s / 62 s -> every 9 iterations.
"""
from __future__ import annotations

import math


def average_wasted_time(t_ckpt: float, interval: float, t_rtol: float) -> float:
    """GEMINI eq. 1 with ``interval`` = 1/f (same unit for all three)."""
    if min(t_ckpt, interval, t_rtol) < 0:
        raise ValueError("times must be >= 0")
    return t_ckpt + interval / 2.0 + t_rtol


def min_interval(t_ckpt: float, t_iter: float) -> float:
    """GEMINI constraint 2: the shortest allowed time between checkpoints."""
    return max(t_ckpt, t_iter)


def satisfies_constraint(interval: float, t_ckpt: float, t_iter: float) -> bool:
    return interval >= min_interval(t_ckpt, t_iter) * (1 - 1e-12)


def highfreq_iterations(t_ckpt: float, t_iter: float) -> int:
    """GEMINI's HighFreq baseline: checkpoint every ceil(t_ckpt / T_iter) iterations (>= 1)."""
    return max(1, math.ceil(t_ckpt / t_iter - 1e-12))
