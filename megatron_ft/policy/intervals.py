"""Optimal snapshot and persist intervals (REFT section 5 / appendix A, Young, Daly) and the exact
goodput of periodic checkpointing under Poisson failures.

REFT appendix A, literally (functions ``reft_eq*``):

* eq. 4  O_total = O_save * T_total / T_save + O_restart * T_total * lambda
* eq. 5  T_save = sqrt(2 O_save / lambda)                               (Young's interval)
* eq. 7  lambda_re = 1 - (1-lambda)^n - n lambda (1-lambda)^(n-1)       (2+ of n nodes fail)
* eq. 8  O_save = (|T_ft - T_comp| + T_ft - T_comp) / 2 = max(0, T_ft - T_comp)
* eq. 9  T_re_sn  = sqrt((|T_sn - T_comp| + T_sn - T_comp) / lambda_nd)
* eq. 10 T_ckpt   = sqrt((|T_ckpt - T_comp| + T_ckpt - T_comp) / lambda_nd)
* eq. 11 T_re_ckpt = sqrt((|T_sn - T_comp| + T_sn - T_comp) / lambda_re)

Where we differ, deliberately (docs/policy.md): a job stops when *any* of its N nodes fails, so
the rate that matters for the snapshot interval is N / MTTF, not one node's rate (REFT eq. 6 sets
them equal); eq. 7 treats lambda as a probability, so :func:`disk_failure_rate` evaluates it as
the probability that a failed node's group loses another member within the window in which the
group is not yet rebuilt, times the hardware failure rate. The persist cost in eq. 11 is the
snapshot overhead (the agent persists from memory, off the training path), and when that is
zero the interval is set by GEMINI's constraint 2 (no faster than one persist takes); to it we add
the cost of megatron-ft's agent pausing snapshots while it persists (:func:`persist_cost`).

Exact goodput (renewal argument, :func:`goodput_single_tier`): a job computes ``tau`` seconds,
stalls ``C`` seconds to save, and the save is usable ``t`` seconds after it started (t >= C). A
failure (Poisson, rate L) rolls back to the newest usable save and costs ``D`` seconds of
downtime (failures during the downtime restart it). Between two saves becoming usable the job
needs a failure-free stretch of S = tau + C; after a failure it needs tau + t from the restart.
Solving the two renewal equations gives

    goodput = L tau exp(-L (tau + t + D)) / (1 - exp(-L (tau + C)))

which for small L is (tau/S) (1 - L (t + tau/2 - C/2 + D)) - GEMINI eq. 1 with 1/f = S, less
the stall C that a restart does not repeat. Example: tau = 3600 s, C = 60 s, t = 600 s,
D = 600 s, one failure a day: 86400^-1 * 3600 * exp(-4800/86400) / (1 - exp(-3660/86400)) =
0.9503 (the failure-free ratio is 3600/3660 = 0.9836).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .recoverability import Placement, unrecoverable_fraction

# ------------------------------------------------------------------------------------ REFT literal


def reft_eq4_total_overhead(o_save: float, t_total: float, t_save: float, o_restart: float, lam: float) -> float:
    """REFT eq. 4: saving overhead plus restart overhead over a run of length t_total."""
    return o_save * t_total / t_save + o_restart * t_total * lam


def reft_restart_overhead(t_save: float, t_sch: float, t_load: float) -> float:
    """O_restart in eq. 4: average recomputation T_save/2 + rescheduling + loading."""
    return t_save / 2.0 + t_sch + t_load


def young_interval(o_save: float, lam: float) -> float:
    """REFT eq. 5 / Young (1974): sqrt(2 O_save / lambda), the minimiser of eq. 4.

    >>> round(young_interval(60.0, 1 / 86400), 1)       # 60 s saves, one failure a day
    3219.9
    """
    if o_save < 0 or lam < 0:
        raise ValueError("o_save and lam must be >= 0")
    if lam == 0:
        return math.inf
    return math.sqrt(2.0 * o_save / lam)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly (2006) higher-order optimum compute time between checkpoints of cost delta:
    sqrt(2 delta M) [1 + sqrt(delta/2M)/3 + (delta/2M)/9] - delta for delta < 2M, else M."""
    if delta < 0 or mtbf <= 0:
        raise ValueError("delta >= 0 and mtbf > 0 required")
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def reft_eq7(lam_nd: float, n: int) -> float:
    """REFT eq. 7: probability that two or more of a sharding group's n nodes fail (lam_nd read as
    one node's failure probability over the period considered)."""
    return 1.0 - (1.0 - lam_nd) ** n - n * lam_nd * (1.0 - lam_nd) ** (n - 1)


def save_overhead(t_ft: float, t_comp: float) -> float:
    """REFT eq. 8: the part of a save that does not hide behind computation.

    >>> save_overhead(0.3, 1.0), save_overhead(1.5, 1.0)
    (0.0, 0.5)
    """
    return 0.5 * (abs(t_ft - t_comp) + t_ft - t_comp)


def reft_eq9(t_sn: float, t_comp: float, lam_nd: float) -> float:
    """REFT eq. 9: snapshot interval (= Young with O = eq. 8 and the node failure rate)."""
    return math.sqrt((abs(t_sn - t_comp) + t_sn - t_comp) / lam_nd)


def reft_eq10(t_ckpt: float, t_comp: float, lam_nd: float) -> float:
    """REFT eq. 10: checkpoint interval without in-memory protection."""
    return math.sqrt((abs(t_ckpt - t_comp) + t_ckpt - t_comp) / lam_nd)


def reft_eq11(t_sn: float, t_comp: float, lam_nd: float, n: int) -> float:
    """REFT eq. 11: persist interval with in-memory protection (rate of eq. 7)."""
    return math.sqrt((abs(t_sn - t_comp) + t_sn - t_comp) / reft_eq7(lam_nd, n))


# ------------------------------------------------------------------------------------ exact goodput


def goodput_single_tier(period: float, stall: float, latency: float, downtime: float, rate: float) -> float:
    """Exact long-run fraction of wall time that ends up as kept computation (see module doc).

    ``period``: compute seconds between saves; ``stall``: training time lost per save;
    ``latency``: seconds from the start of a save until it can be restored (>= stall);
    ``downtime``: restart + retrieval per failure; ``rate``: failures per second (Poisson).
    """
    if period <= 0 or stall < 0 or latency < stall or downtime < 0 or rate < 0:
        raise ValueError("need period > 0, 0 <= stall <= latency, downtime >= 0, rate >= 0")
    if latency > period + stall + 1e-9:
        raise ValueError(f"latency {latency} s > period + stall {period + stall} s: one save would start "
                         f"before the previous one is usable (GEMINI constraint 2)")
    s = period + stall
    if rate == 0:
        return period / s
    return rate * period * math.exp(-rate * (period + latency + downtime)) / -math.expm1(-rate * s)


def goodput_first_order(period: float, stall: float, latency: float, downtime: float, rate: float) -> float:
    """First-order expansion of :func:`goodput_single_tier` in rate."""
    s = period + stall
    return period / s * (1.0 - rate * (latency + period / 2.0 - stall / 2.0 + downtime))


@dataclass(frozen=True)
class IntervalChoice:
    """An interval in iterations with the numbers behind it."""

    iterations: int  # 0 = never periodically (only at breakpoints)
    seconds: float  # iterations * iteration time
    young_s: float  # the unconstrained optimum sqrt(2 O / lambda)
    min_iterations: int  # GEMINI constraint 2 (and multiple-of-snapshot for persists)
    rate_per_s: float
    overhead_s: float


def _argmin_interval(cost_s: float, rate: float, iteration_s: float, n_min: int, step: int,
                     n_max: int) -> int:
    """Integer n (multiple of ``step``, n_min <= n <= n_max) minimising the waste per second of
    computation cost/(n T) + rate n T / 2 (eq. 4 divided by T_total)."""
    if rate <= 0:
        return n_max
    if cost_s <= 0:
        return n_min
    ideal = young_interval(cost_s, rate) / iteration_s
    cands = {n_min, n_max}
    for x in (math.floor(ideal / step) * step, math.ceil(ideal / step) * step):
        cands.add(min(max(int(x), n_min), n_max))

    def waste(n: int) -> float:
        return cost_s / (n * iteration_s) + rate * n * iteration_s / 2.0

    return min(sorted(cands), key=waste)


def choose_snapshot_interval(iteration_s: float, overhead_s: float, snapshot_s: float, rate: float,
                             n_max: int = 1_000_000) -> IntervalChoice:
    """Snapshot interval in iterations: Young/REFT eq. 9 with the job's failure rate, rounded to
    the better neighbouring integer, no shorter than GEMINI constraint 2 (ceil(snapshot/iteration)).

    >>> choose_snapshot_interval(1.0, 0.0, 0.3, 1e-4).iterations     # free snapshots: every iteration
    1
    >>> choose_snapshot_interval(1.0, 0.5, 0.3, 1e-4).iterations     # sqrt(2*0.5/1e-4) = 100 s
    100
    """
    if iteration_s <= 0:
        raise ValueError("iteration_s must be > 0")
    n_min = max(1, math.ceil(snapshot_s / iteration_s - 1e-9))
    n = _argmin_interval(overhead_s, rate, iteration_s, n_min, 1, max(n_max, n_min))
    young = young_interval(overhead_s, rate) if rate > 0 else math.inf
    return IntervalChoice(n, n * iteration_s, young, n_min, rate, overhead_s)


def persist_cost(snapshot_overhead_s: float, persist_s: float, memory_rate: float) -> float:
    """Training time one persist costs: REFT eq. 11's snapshot overhead (the agent persists from
    memory, off the training path), plus - megatron-ft's agent keeps two slots per rank and pins one
    while persisting it - the memory tier frozen for ``persist_s``: a failure recovered from memory
    in that window loses on average persist_s/2 more, so ``memory_rate * persist_s^2 / 2``.

    >>> round(persist_cost(0.0, 60.0, 1e-4), 6)       # 1e-4 * 3600 / 2
    0.18
    """
    return snapshot_overhead_s + max(memory_rate, 0.0) * persist_s ** 2 / 2.0


def choose_persist_interval(iteration_s: float, snapshot_every: int, cost_s: float, persist_s: float,
                            disk_rate: float, n_max: int = 100_000_000) -> IntervalChoice:
    """Persist interval in iterations (a multiple of the snapshot interval): Young/REFT eq. 11 with
    the rate of failures the memory tier cannot absorb, no faster than one persist takes (GEMINI
    constraint 2). ``disk_rate == 0`` -> 0: persist only at breakpoints.

    ``cost_s`` is the training time one persist costs (:func:`persist_cost`).

    >>> choose_persist_interval(1.0, 1, 0.0, 30.0, 1e-6).iterations   # free: as fast as the disk allows
    30
    >>> choose_persist_interval(1.0, 4, 0.5, 30.0, 1e-6).iterations   # sqrt(2*0.5/1e-6) = 1000 s
    1000
    """
    if disk_rate <= 0:
        return IntervalChoice(0, 0.0, math.inf, 0, 0.0, cost_s)
    step = max(1, snapshot_every)
    n_min = max(step, math.ceil(persist_s / iteration_s - 1e-9))
    n_min = math.ceil(n_min / step) * step
    n = _argmin_interval(cost_s, disk_rate, iteration_s, n_min, step, max(n_max, n_min))
    return IntervalChoice(n, n * iteration_s, young_interval(cost_s, disk_rate), n_min, disk_rate, cost_s)


def best_checkpoint_iterations(iteration_s: float, stall: float, latency: float, downtime: float,
                               rate: float, n_max: int = 100_000) -> tuple[int, float]:
    """The persistent-only checkpoint interval (iterations) that maximises
    :func:`goodput_single_tier`, subject to constraint 2 (period + stall >= latency)."""
    n_min = max(1, math.ceil((latency - stall) / iteration_s - 1e-9))
    if rate <= 0:
        return n_max, goodput_single_tier(n_max * iteration_s, stall, latency, downtime, rate)
    # goodput is unimodal in the period: scan geometrically, then refine around the best
    best_n, best_g = n_min, -1.0
    n = n_min
    while n <= n_max:
        g = goodput_single_tier(n * iteration_s, stall, latency, downtime, rate)
        if g > best_g:
            best_n, best_g = n, g
        n = max(n + 1, int(n * 1.05))
    lo, hi = max(n_min, int(best_n / 1.06) - 1), min(n_max, int(best_n * 1.06) + 2)
    for n in range(lo, hi + 1):
        g = goodput_single_tier(n * iteration_s, stall, latency, downtime, rate)
        if g > best_g:
            best_n, best_g = n, g
    return best_n, best_g


# ------------------------------------------------------------------------------------ failure rates


def job_failure_rate(nodes: int, node_mttf_s: float) -> float:
    """Failures per second of a job on ``nodes`` nodes (any node's failure stops it). For a
    renewal process this is the long-run rate whatever the Weibull shape."""
    return nodes / node_mttf_s


def disk_failure_rate(placement: Placement, node_mttf_s: float, software_fraction: float, window_s: float) -> float:
    """Failures per second that the in-memory tier cannot absorb, so that training falls back to
    the newest persisted checkpoint: hardware failures (rate (1 - s) N / MTTF) whose group
    already lost enough members within ``window_s`` (the time until a lost node's share is rebuilt)
    - REFT eq. 7 made a rate. Software failures never need the disk (the agent keeps the snapshot).
    """
    mu = (1.0 - software_fraction) / node_mttf_s
    if mu <= 0:
        return 0.0
    q = -math.expm1(-mu * max(window_s, 0.0))
    return placement.nodes * mu * unrecoverable_fraction(placement, q)
