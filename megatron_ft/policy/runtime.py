"""``interval: auto``: measure the first snapshots, then choose the snapshot and persist intervals.

The checkpointer (``megatron_ft/trainer/checkpointer.py``) consults an :class:`AutoIntervals`:

* while measuring it snapshots every iteration (or at the fixed interval if only the persist
  interval is automatic) and records, per snapshot, the time ``snapshot()`` held the training
  thread (capture), the background copy time, the time the next optimizer step waited for the
  copy (stall), the snapshot's size, and the wall time of every iteration;
* after ``snapshot.measure_iterations`` snapshots every rank takes the median of each quantity,
  the ranks agree on the maximum (the slowest rank sets the pace; a MAX all-reduce, so the
  decision is identical everywhere and the snapshot collectives stay aligned), and
  :func:`decide` picks the intervals:

  - snapshot: Young / REFT eq. 9 with the snapshot overhead O = capture + max(0, copy - compute)
    (REFT eq. 8) and the job failure rate N / MTTF, no shorter than GEMINI constraint 2;
  - persist: Young / REFT eq. 11 with the rate of failures that the in-memory tier cannot absorb
    (hardware failures that the redundancy scheme does not tolerate, :func:`disk_failure_rate`),
    no faster than one persist takes (node bytes / ``persist.bandwidth_mib_s``), a multiple of
    the snapshot interval; the trainers then ask their agents to persist the newest agreed step
    every that many iterations (the agents' own ``persist.interval`` is 0 under ``auto``).

One line with the numbers is printed by rank 0 and logged, e.g. (2 nodes, MTTF 1600 h, half of
the failures hardware, 40 MiB per node at 500 MiB/s)::

    [megatron-ft] auto intervals: snapshot every 1 it, persist every 850 it | measured 5 snapshots
    (slowest rank): iteration 0.200 s, snapshot 0.002 s on the training thread + 0.050 s copy
    behind 0.198 s of compute -> overhead 0.002 s (REFT eq. 8) | ...
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .. import config as ftconfig
from .intervals import (IntervalChoice, choose_persist_interval, choose_snapshot_interval, disk_failure_rate,
                        job_failure_rate, persist_cost, save_overhead)
from .recoverability import Placement, make_placement, none_placement

MIB = float(1 << 20)


@dataclass(frozen=True)
class Measurement:
    """Medians over the measured snapshots (maximum over ranks)."""

    iteration_s: float
    capture_s: float  # snapshot() on the training thread
    copy_s: float  # background copy, begin .. commit
    stall_s: float  # the next optimizer step waited this long for the copy
    snapshot_bytes: int  # one rank's snapshot
    samples: int = 0

    @property
    def compute_s(self) -> float:
        return max(self.iteration_s - self.capture_s - self.stall_s, 1e-9)

    @property
    def overhead_s(self) -> float:
        """Training time one snapshot costs: the synchronous part plus REFT eq. 8 for the copy."""
        return self.capture_s + save_overhead(self.copy_s, self.compute_s)


@dataclass(frozen=True)
class Decision:
    snapshot_every: int
    persist_every: int  # 0: only at breakpoints
    snapshot: Optional[IntervalChoice]
    persist: Optional[IntervalChoice]
    scheme: str
    line: str


def placement_from_config(cfg: ftconfig.FTConfig) -> Placement:
    """The job's redundancy placement over its nodes, from the ``redundancy:`` section
    (``scheme``, ``replicas``, ``group_size``, ``k``, ``m``); ``none`` without one (a hardware failure
    loses that node's snapshot). xor's ``group_size: 0`` (a whole sharding group) is taken as all nodes."""
    nodes = cfg.cluster.nodes
    red = getattr(cfg, "redundancy", None)
    scheme = getattr(red, "scheme", None) if red is not None else None
    try:
        if scheme == "replica":
            return make_placement("replica", nodes, int(getattr(red, "replicas", 2)))
        if scheme == "xor":
            return make_placement("xor", nodes, int(getattr(red, "group_size", 0) or nodes))
        if scheme == "rs":
            return make_placement("rs", nodes, int(getattr(red, "k")), int(getattr(red, "m")))
    except (ValueError, TypeError, AttributeError):
        pass
    return none_placement(nodes)


def _rate_text(rate_per_s: float) -> str:
    if rate_per_s <= 0:
        return "never"
    hours = 1.0 / rate_per_s / 3600.0
    return f"1 per {hours:.3g} h"


def decide(m: Measurement, cfg: ftconfig.FTConfig, placement: Optional[Placement] = None) -> Decision:
    """The intervals for this job given the measurement (pure; see the module docstring)."""
    f = cfg.failure
    nodes = cfg.cluster.nodes
    mttf_s = f.node_mttf_hours * 3600.0
    rate = job_failure_rate(nodes, mttf_s)
    T = max(m.iteration_s, 1e-9)
    O = m.overhead_s
    pl = placement if placement is not None else placement_from_config(cfg)
    parts = [f"measured {m.samples} snapshots (slowest rank): iteration {m.iteration_s:.3f} s, snapshot "
             f"{m.capture_s:.3f} s on the training thread + {m.copy_s:.3f} s copy behind {m.compute_s:.3f} s of "
             f"compute -> overhead {O:.4f} s (REFT eq. 8)"]
    snap: Optional[IntervalChoice] = None
    if cfg.snapshot.auto:
        snap = choose_snapshot_interval(T, O, m.capture_s + m.copy_s, rate)
        n_s = snap.iterations
        young = "inf" if math.isinf(snap.young_s) else f"{snap.young_s:.4g} s"
        parts.append(f"snapshot: {nodes} nodes / {f.node_mttf_hours:g} h MTTF = {_rate_text(rate)}, "
                     f"sqrt(2*{O:.4f} s/rate) = {young} (Young, REFT eq. 9) -> every {n_s} it "
                     f"(>= {snap.min_iterations} by GEMINI constraint 2)")
    else:
        n_s = cfg.snapshot.interval
        parts.append(f"snapshot: every {n_s} it (configured)")
    pers: Optional[IntervalChoice] = None
    if cfg.persist.auto:
        node_bytes = m.snapshot_bytes * cfg.cluster.ranks_per_node
        persist_s = node_bytes / (cfg.persist.bandwidth_mib_s * MIB)
        window = (f.restart_minutes * 60.0 + (0.0 if f.standby_nodes else f.replacement_minutes * 60.0)
                  + n_s * T + m.capture_s + m.copy_s)
        disk_rate = disk_failure_rate(pl, mttf_s, f.software_fraction, window)
        cost = persist_cost(O, persist_s, rate - disk_rate)
        pers = choose_persist_interval(T, n_s, cost, persist_s, disk_rate)
        n_p = pers.iterations
        if n_p == 0:
            parts.append(f"persist: no failure needs the disk ({f.software_fraction:.0%} software) -> only at "
                         f"breakpoints")
        else:
            parts.append(f"persist: {1 - f.software_fraction:.0%} hardware failures, {pl.label} loses memory in "
                         f"{disk_rate / max(rate * (1 - f.software_fraction), 1e-300):.3g} of them -> disk needed "
                         f"{_rate_text(disk_rate)}; cost {cost:.4g} s per persist ({node_bytes / MIB:.1f} MiB/node at "
                         f"{cfg.persist.bandwidth_mib_s:g} MiB/s = {persist_s:.3g} s, snapshots paused meanwhile), "
                         f"sqrt(2*cost/rate) = {pers.young_s:.4g} s (REFT eq. 11) -> every {n_p} it "
                         f"(>= {pers.min_iterations}: one persist at a time, multiple of {n_s})")
    else:
        n_p = cfg.persist.interval
        parts.append(f"persist: every {n_p} it (configured)" if n_p else "persist: only at breakpoints (configured)")
    line = f"auto intervals: snapshot every {n_s} it, persist every {n_p} it | " + " | ".join(parts)
    return Decision(n_s, n_p, snap, pers, pl.label, line)


class AutoIntervals:
    """The checkpointer's policy object: measure, decide once, then answer "snapshot now?" and
    "persist which step?". No processes, no torch: ``reduce_max`` (a MAX all-reduce over ranks)
    and ``clock`` are injected."""

    def __init__(self, cfg: ftconfig.FTConfig, reduce_max: Optional[Callable[[list[float]], list[float]]] = None,
                 placement: Optional[Placement] = None, clock: Callable[[], float] = time.perf_counter):
        self.cfg = cfg
        self.reduce_max = reduce_max
        self.placement = placement
        self.clock = clock
        self.measure = cfg.snapshot.measure_iterations
        self.decision: Optional[Decision] = None
        self._iteration_s: list[float] = []
        self._snapshots: list[tuple[float, float, float, int, bool]] = []  # stall, capture, copy, bytes, ok
        self._last_tick: Optional[float] = None
        self._next_persist: Optional[int] = None

    @property
    def snapshot_every(self) -> int:
        if self.decision is not None:
            return self.decision.snapshot_every
        return 1 if self.cfg.snapshot.auto else self.cfg.snapshot.interval

    def snapshot_due(self, iteration: int) -> bool:
        return iteration % self.snapshot_every == 0

    def waited(self, stall_s: float, stats: Any) -> None:
        """Before the optimizer step: the pending snapshot's stats and how long we waited for it."""
        if self.decision is None and stats is not None:
            self._snapshots.append((stall_s, float(stats.capture_s), float(stats.copy_s), int(stats.nbytes),
                                    bool(stats.ok)))

    def tick(self) -> Optional[Decision]:
        """After every iteration (on every rank, before deciding whether to snapshot). Returns the
        decision on the iteration it is made (all ranks make it at the same iteration)."""
        if self.decision is not None:
            return None
        now = self.clock()
        if self._last_tick is not None:
            self._iteration_s.append(now - self._last_tick)
        self._last_tick = now
        if len(self._snapshots) < self.measure or len(self._iteration_s) < self.measure:
            return None
        self.decision = decide(self.measurement(), self.cfg, self.placement)
        return self.decision

    def measurement(self) -> Measurement:
        ok = [s for s in self._snapshots if s[4]] or self._snapshots
        vals = [statistics.median(self._iteration_s), statistics.median(s[1] for s in ok),
                statistics.median(s[2] for s in ok), statistics.median(s[0] for s in self._snapshots),
                float(max(s[3] for s in ok))]
        if self.reduce_max is not None:
            vals = list(self.reduce_max(vals))
        return Measurement(vals[0], vals[1], vals[2], vals[3], int(vals[4]), len(self._snapshots))

    def persist_step(self, last_agreed: int) -> Optional[int]:
        """The step to ask the agent to persist now, if one is due (``persist.interval: auto``)."""
        d = self.decision
        if d is None or not self.cfg.persist.auto or d.persist_every <= 0 or last_agreed < 0:
            return None
        if self._next_persist is None:
            self._next_persist = last_agreed + d.persist_every
            return None
        if last_agreed >= self._next_persist:
            self._next_persist = last_agreed + d.persist_every
            return last_agreed
        return None
