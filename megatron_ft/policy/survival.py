"""Weibull survival of nodes and of the whole job, with and without in-memory protection (REFT section 5).

REFT's assumption 1: nodes fail independently, time to failure Weibull. With failure rate
parameter lambda and shape c, a node survives to time t with probability (eq. 1)

    P(t) = exp(-lambda * t^c)          (scale eta = lambda^(-1/c), MTTF = eta * Gamma(1 + 1/c))

A job on k nodes protected only by checkpoints on disk is intact only while every node is
healthy, hardware (P_s) and software (P_tr) alike (eq. 3):

    P_ck(t) = P_s(t)^k * P_tr(t)^k

With REFT's snapshots in the memory of a separate process (software failures leave them intact)
and XOR parity over sharding groups of n nodes, the snapshot survives while no group has lost two
nodes (eq. 2, with the snapshot process's own survival P_re, ~1):

    P_re(t) = (P_s^n + n (1 - P_s) P_s^(n-1))^(k/n) * P_re^k

:func:`job_survival_inmemory` generalises eq. 2 to any placement of
:mod:`megatron_ft.policy.recoverability` (replica groups, rings, k+m coding).

Worked example (REFT figure 8): k = 3072, n = 6, lambda_hw = 1e-4 and lambda_sw = 1e-5 per
day^c, c = 1.3. Checkpoints only: P_ck = exp(-3072 * 1.1e-4 * t^1.3) falls to 0.9 at
t = (0.10536 / 0.33792)^(1/1.3) = 0.41 days. With REFT, 1 - P_s ~ 1e-4 t^1.3 per node and a
group of 6 is lost with probability ~ C(6,2) (1 - P_s)^2, so 0.9 is reached when
512 * 15 * (1e-4 t^1.3)^2 = 0.105, t^1.3 = 37.0, t = 16.1 days (the paper: 16.22 days, "a
checkpoint only once every 16.22 days" vs "every 0.5 days").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .recoverability import Placement, group_survival


@dataclass(frozen=True)
class Weibull:
    """One node's time to failure: MTTF (any time unit) and shape c.

    >>> w = Weibull(mttf=1600.0, shape=1.0)     # hours; exponential
    >>> round(w.lam, 6), round(w.survival(24.0), 4)   # 1/1600 per hour; exp(-24/1600)
    (0.000625, 0.9851)
    """

    mttf: float
    shape: float = 1.0

    def __post_init__(self) -> None:
        if not (self.mttf > 0 and self.shape > 0):
            raise ValueError(f"Weibull needs mttf > 0 and shape > 0, got {self.mttf}, {self.shape}")

    @classmethod
    def from_rate(cls, lam: float, shape: float = 1.0) -> "Weibull":
        """From REFT's lambda (P = exp(-lambda t^c))."""
        scale = lam ** (-1.0 / shape)
        return cls(scale * math.gamma(1.0 + 1.0 / shape), shape)

    @property
    def scale(self) -> float:
        return self.mttf / math.gamma(1.0 + 1.0 / self.shape)

    @property
    def lam(self) -> float:
        """REFT's lambda_fail: P(t) = exp(-lam * t^c)."""
        return self.scale ** (-self.shape)

    def survival(self, t: float) -> float:
        """REFT eq. 1."""
        return math.exp(-self.lam * max(t, 0.0) ** self.shape)

    def failure_probability(self, t: float) -> float:
        return -math.expm1(-self.lam * max(t, 0.0) ** self.shape)


def job_survival_checkpoint(t: float, nodes: int, hardware: Weibull, software: Optional[Weibull] = None) -> float:
    """REFT eq. 3: P_s^k * P_tr^k (every node intact, hardware and software)."""
    p = hardware.survival(t) ** nodes
    if software is not None:
        p *= software.survival(t) ** nodes
    return p


def reft_eq2(p_s: float, n: int, k: int, p_re: float = 1.0) -> float:
    """REFT eq. 2 literally: (P_s^n + n (1-P_s) P_s^(n-1))^(k/n) * P_re^k."""
    return (p_s ** n + n * (1 - p_s) * p_s ** (n - 1)) ** (k / n) * p_re ** k


def job_survival_inmemory(t: float, placement: Placement, hardware: Weibull, smp: Optional[Weibull] = None) -> float:
    """Eq. 2 for any placement: every group still recoverable at t (software failures never lose
    the in-memory snapshot), times the snapshot processes' own survival P_re^k."""
    q = hardware.failure_probability(t)
    p = 1.0
    cache: dict = {}
    for g in placement.groups:
        key = (g.size, g.tolerance, g.window)
        if key not in cache:
            cache[key] = group_survival(g, q)
        p *= cache[key]
    if smp is not None:
        p *= smp.survival(t) ** placement.nodes
    return p


def time_to_survival(survival: Callable[[float], float], threshold: float, hi: float = 1.0,
                     rel_tol: float = 1e-9) -> float:
    """The time at which a decreasing survival curve falls to ``threshold`` (bisection).

    This is REFT's reading of figure 8: persist once the in-memory snapshot's survival probability
    would drop below the threshold."""
    if not 0 < threshold < 1:
        raise ValueError(f"threshold={threshold} must be in (0, 1)")
    lo = 0.0
    while survival(hi) > threshold:
        lo, hi = hi, hi * 2
        if hi > 1e15:
            return math.inf
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if survival(mid) > threshold:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
