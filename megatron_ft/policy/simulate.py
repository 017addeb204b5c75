"""``megatron-ft simulate``: an event-driven simulation of a training job under random failures.

The job runs on N nodes. Each node fails after a Weibull time to failure (``failure.node_mttf_hours``,
``failure.weibull_shape``) and then starts a fresh one (a restarted process or a replacement node).
A failure is a software failure with probability ``failure.software_fraction`` (the node and its
host memory survive) and a hardware failure otherwise (the node and its memory are gone; a
standby node takes over at once if one is free, else a replacement arrives after
``failure.replacement_minutes``; the failed node returns to the provider and a new standby is
requested, which also takes that long).

Training alternates ``cell`` seconds of computation with saves: an in-memory snapshot every cell
(megatron-ft) stalling ``snapshot_stall_seconds`` and usable ``snapshot_seconds`` after it began,
and every ``persist_every`` cells a persistent checkpoint usable ``checkpoint_seconds`` after it
began. A failure rolls the job back to

* the newest usable in-memory snapshot, if the snapshot still exists: every hardware failure since
  it became usable (including this one) must be tolerated by the redundancy scheme
  (:meth:`Placement.survives`): none tolerates no hardware failure, replica/xor/rs their groups'
  limits - this is how simultaneous failures enter; else
* the newest durable persistent checkpoint (persistent-only strategies always go here),

and costs ``restart_minutes`` plus the read-back (local memory, peer memory or storage) plus
the wait for replacement nodes; a failure during that downtime starts it over. Only time moves
forward between events: the schedule inside a failure-free stretch is arithmetic, so a run costs
O(failures log) and a month on 1,000 nodes takes milliseconds.

Outputs: goodput (GEMINI's effective training time ratio: kept computation / wall time) and
wasted GPU-hours = (wall - kept computation) x N x GPUs per node, split into lost computation,
save stalls and downtime.
"""
from __future__ import annotations

import argparse
import bisect
import csv
import heapq
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import intervals
from .. import config as ftconfig
from .recoverability import Placement, gemini_corollary1, make_placement, none_placement, recoverable_counts
from .survival import Weibull

DAY = 86400.0


@dataclass(frozen=True)
class FailureModel:
    """``failure:`` in seconds."""

    node_mttf_s: float
    shape: float = 1.0
    software_fraction: float = 0.5
    replacement_s: float = 300.0
    standby: int = 0
    restart_s: float = 270.0

    @classmethod
    def from_config(cls, f: ftconfig.FailureConfig) -> "FailureModel":
        return cls(f.node_mttf_hours * 3600.0, f.weibull_shape, f.software_fraction,
                   f.replacement_minutes * 60.0, f.standby_nodes, f.restart_minutes * 60.0)

    @property
    def weibull(self) -> Weibull:
        return Weibull(self.node_mttf_s, self.shape)

    def mean_downtime(self, retrieve_s: float) -> float:
        """Restart + read-back + the replacement wait of hardware failures (no standby)."""
        wait = 0.0 if self.standby > 0 else self.replacement_s
        return self.restart_s + retrieve_s + (1.0 - self.software_fraction) * wait


@dataclass(frozen=True)
class Strategy:
    """How a job saves its state and where it restores from."""

    name: str
    cell_s: float  # computation between two saves of the fastest tier
    memory: bool = False  # in-memory snapshot after every cell
    snapshot_stall_s: float = 0.0
    snapshot_latency_s: float = 0.0
    persist_every: int = 1  # cells per persistent checkpoint; 0 = never
    persist_stall_s: float = 0.0
    persist_latency_s: float = 0.0
    local_restore_s: float = 0.0
    peer_restore_s: float = 0.0
    retrieve_s: float = 0.0
    placement: Optional[Placement] = None
    persist_pins: bool = True  # megatron-ft's agent: 2 slots per rank, one pinned while persisting
    snapshot_iterations: int = 0  # for reports
    persist_iterations: int = 0

    def __post_init__(self) -> None:
        if self.cell_s <= 0:
            raise ValueError(f"{self.name}: cell_s must be > 0")
        if self.memory and self.snapshot_latency_s > self.cell_s + self.snapshot_stall_s + 1e-9:
            raise ValueError(f"{self.name}: a snapshot ({self.snapshot_latency_s} s) must finish before the next "
                             f"starts ({self.cell_s + self.snapshot_stall_s} s later): GEMINI constraint 2")
        period = self.persist_every * (self.cell_s + self.snapshot_stall_s * self.memory) + self.persist_stall_s
        if self.persist_every and self.persist_latency_s > period + 1e-9:
            raise ValueError(f"{self.name}: a persist ({self.persist_latency_s} s) must finish before the next "
                             f"starts ({period} s later): GEMINI constraint 2")
        if self.memory and self.placement is None:
            raise ValueError(f"{self.name}: an in-memory tier needs a placement")


@dataclass
class RunResult:
    duration_s: float
    progress_s: float = 0.0  # kept computation at the end
    compute_s: float = 0.0
    lost_s: float = 0.0  # computation rolled back
    stall_s: float = 0.0  # saves on the training path
    down_s: float = 0.0  # restarts, read-backs, replacement waits
    failures: int = 0
    hardware_failures: int = 0
    memory_recoveries: int = 0
    disk_recoveries: int = 0

    @property
    def goodput(self) -> float:
        return self.progress_s / self.duration_s


def simulate_run(s: Strategy, nodes: int, fm: FailureModel, duration_s: float, seed: int = 0) -> RunResult:
    """One simulated run of ``duration_s`` wall seconds (see the module docstring)."""
    return _Simulation(s, nodes, fm, duration_s, seed).run()


@dataclass
class _Schedule:
    """The arithmetic schedule of one phase (a failure-free stretch of training) that began from cell
    ``J0``: blocks of ``tau`` computation followed by a ``unit - tau`` snapshot stall, and a ``ps``
    persist stall after every cell whose index is a multiple of ``P`` (``P`` = 0: never). Offsets
    ``x`` are seconds since the phase began."""

    tau: float
    unit: float
    ps: float
    P: int
    J0: int = 0

    def block_end(self, j: int) -> float:
        """Offset of the end of the j-th block of the current phase."""
        return j * self.unit + (self.ps * ((self.J0 + j) // self.P - self.J0 // self.P) if self.P else 0.0)

    def blocks_done(self, x: float) -> int:
        """How many blocks (stalls included) have ended by offset ``x``."""
        lo, hi = 0, int(x // self.unit) + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.block_end(mid) <= x:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def computed(self, x: float) -> float:
        """Seconds of computation done by offset ``x`` (the rest of ``x`` went to save stalls)."""
        j = self.blocks_done(x)
        return j * self.tau + min(x - self.block_end(j), self.tau)

    def newest_usable(self, x: float, latency: float, step: int) -> int:
        """Largest j >= 1, J0 + j a multiple of ``step``, whose save is usable by offset x; 0 if none."""
        lo_i = self.J0 // step + 1
        hi_i = (self.J0 + int(x // self.unit) + 2) // step
        best = 0
        while lo_i <= hi_i:
            mid = (lo_i + hi_i) // 2
            j = mid * step - self.J0
            if self.block_end(j - 1) + self.tau + latency <= x:
                best, lo_i = j, mid + 1
            else:
                hi_i = mid - 1
        return best


class _Simulation:
    """The state of one :func:`simulate_run`, advanced failure by failure (the events of a heap of
    each node's next failure time)."""

    def __init__(self, s: Strategy, nodes: int, fm: FailureModel, duration_s: float, seed: int):
        self.s, self.fm, self.duration_s = s, fm, duration_s
        self.rng = np.random.default_rng(seed)
        self.scale, self.shape = fm.weibull.scale, fm.shape
        self.res = RunResult(duration_s)
        self.tau = s.cell_s
        ss = s.snapshot_stall_s if s.memory else 0.0
        self.sched = _Schedule(self.tau, self.tau + ss, s.persist_stall_s, s.persist_every)

        self.heap = [(float(self.rng.weibull(self.shape)) * self.scale, n) for n in range(nodes)]
        heapq.heapify(self.heap)
        self.spares = [0.0] * fm.standby  # when each standby node is (again) available
        self.hw_times: list[float] = []
        self.hw_nodes: list[int] = []

        self.running = True
        # phase start, when the restored state was protected (the cell index restored is sched.J0)
        self.t0, self.base_c = 0.0, 0.0
        self.durable = 0
        self.target_J, self.target_c, self.target_mem = 0, 0.0, True
        self.resume_at = self.down_mark = 0.0
        self.pending_ready = -math.inf

    def run(self) -> RunResult:
        while True:
            tf, node = self.heap[0]
            if not self.running and self.resume_at <= min(tf, self.duration_s):
                self._resume()
            if tf >= self.duration_s:
                break
            self._fail(tf, node)
        if self.running:
            self.res.progress_s = self._account_phase(self.duration_s)
        else:
            self.res.down_s += self.duration_s - self.down_mark
            self.res.progress_s = self.target_J * self.tau
        return self.res

    def _resume(self) -> None:
        """The downtime ends at ``resume_at``: a new phase begins from the restore target."""
        self.res.down_s += self.resume_at - self.down_mark
        self.running, self.t0, self.sched.J0, self.base_c, self.pending_ready = (
            True, self.resume_at, self.target_J, self.resume_at, -math.inf)

    def _fail(self, tf: float, node: int) -> None:
        """Node ``node`` fails at ``tf``: draw its next failure and whether this one is hardware, roll
        the job back and start (or start over) the downtime."""
        heapq.heapreplace(self.heap, (tf + float(self.rng.weibull(self.shape)) * self.scale, node))
        hardware = self.rng.random() >= self.fm.software_fraction
        self.res.failures += 1
        cand: Optional[tuple[int, float]] = None  # in-memory snapshot: (cell index, when it became usable)
        if self.running:
            progress = self._account_phase(tf)
            if self.s.memory:
                cand = self._snapshot_candidate(tf - self.t0)
            if self.sched.P:
                j = self.sched.newest_usable(tf - self.t0, self.s.persist_latency_s, self.sched.P)
                if j:
                    self.durable = max(self.durable, self.sched.J0 + j)
        else:
            self.res.down_s += tf - self.down_mark
            progress = self.target_J * self.tau
            if self.target_mem:
                cand = (self.target_J, self.target_c)
        if hardware:
            self._lose_node(tf, node)
        self._roll_back(tf, progress, cand)

    def _account_phase(self, t: float) -> float:
        """Add the running phase's computation and save stalls up to wall time ``t``; return the job's
        progress (computation since the start, nothing rolled back) at ``t``."""
        x = t - self.t0
        comp = self.sched.computed(x)
        self.res.compute_s += comp
        self.res.stall_s += x - comp
        return self.sched.J0 * self.tau + comp

    def _snapshot_candidate(self, x: float) -> tuple[int, float]:
        """The newest in-memory snapshot usable at offset ``x`` of the running phase (a persist in
        progress pins a slot: one newer snapshot at most), else the state this phase began from:
        (cell index, wall time it became usable)."""
        s, sched = self.s, self.sched
        j = sched.newest_usable(x, s.snapshot_latency_s, 1)
        if sched.P and s.persist_pins:
            jp = sched.newest_usable(x, 0.0, sched.P)
            if jp and sched.block_end(jp - 1) + sched.tau + s.persist_latency_s > x:
                j = min(j, jp + 1)
        if j:
            return sched.J0 + j, self.t0 + sched.block_end(j - 1) + sched.tau + s.snapshot_latency_s
        return sched.J0, self.base_c

    def _lose_node(self, tf: float, node: int) -> None:
        """A hardware failure: record it, and take a standby (or wait for a replacement)."""
        self.res.hardware_failures += 1
        self.hw_times.append(tf)
        self.hw_nodes.append(node)
        heapq.heappush(self.spares, tf + self.fm.replacement_s)  # the provider's replacement / new standby
        self.pending_ready = max(self.pending_ready, tf, heapq.heappop(self.spares))

    def _memory_read_back(self, cand: Optional[tuple[int, float]]) -> Optional[float]:
        """Seconds to read the in-memory snapshot ``cand`` back (local or from peers), or None if it
        is gone: every hardware failure since it became usable must be tolerated by the placement."""
        if cand is None:
            return None
        lost_nodes = set(self.hw_nodes[bisect.bisect_left(self.hw_times, cand[1]):])
        if not lost_nodes:
            return self.s.local_restore_s
        if self.s.placement is not None and self.s.placement.survives(lost_nodes):
            return self.s.peer_restore_s
        return None

    def _roll_back(self, tf: float, progress: float, cand: Optional[tuple[int, float]]) -> None:
        """Restore from ``cand`` if it survived, else from the newest durable checkpoint; the job is
        down from ``tf`` until the restart and read-back (after any replacement wait) are done."""
        read_back = self._memory_read_back(cand)
        if read_back is not None:
            assert cand is not None
            (self.target_J, self.target_c), self.target_mem = cand, True
            self.res.memory_recoveries += 1
        else:
            self.target_J, self.target_mem = self.durable, False
            read_back = self.s.retrieve_s
            self.res.disk_recoveries += 1
        self.res.lost_s += progress - self.target_J * self.tau
        self.running, self.down_mark = False, tf
        self.resume_at = max(tf, self.pending_ready) + self.fm.restart_s + read_back


# ------------------------------------------------------------------------------------ strategies

SCHEMES = ftconfig.SCHEMES


def placement_for(scheme: str, nodes: int, sim: ftconfig.SimulateConfig) -> Placement:
    if scheme == "none":
        return none_placement(nodes)
    if scheme == "replica":
        return make_placement("replica", nodes, sim.replicas)
    if scheme == "xor":
        return make_placement("xor", nodes, sim.xor_group)
    if scheme == "rs":
        return make_placement("rs", nodes, sim.rs_k, sim.rs_m)
    raise ValueError(scheme)


def strategies_for(sim: ftconfig.SimulateConfig, fm: FailureModel, nodes: int) -> list[Strategy]:
    """The six strategies of the comparison, with their intervals chosen for ``nodes`` nodes."""
    T = sim.iteration_seconds
    rate = intervals.job_failure_rate(nodes, fm.node_mttf_s)
    lat, stall = sim.checkpoint_seconds, sim.checkpoint_stall_seconds
    n_min = max(1, math.ceil((lat - stall) / T - 1e-9))  # constraint 2
    n_fixed = max(n_min, round(sim.fixed_interval_hours * 3600.0 / T))
    n_best, _ = intervals.best_checkpoint_iterations(T, stall, lat, fm.mean_downtime(sim.retrieve_seconds), rate)
    out = [
        Strategy(f"persistent, every {sim.fixed_interval_hours:g} h", n_fixed * T, persist_stall_s=stall,
                 persist_latency_s=lat, retrieve_s=sim.retrieve_seconds, persist_iterations=n_fixed),
        Strategy("persistent, best interval", n_best * T, persist_stall_s=stall, persist_latency_s=lat,
                 retrieve_s=sim.retrieve_seconds, persist_iterations=n_best),
    ]
    snap = intervals.choose_snapshot_interval(T, sim.snapshot_stall_seconds, sim.snapshot_seconds, rate)
    n_s = snap.iterations
    for scheme in SCHEMES:
        try:
            pl = placement_for(scheme, nodes, sim)
        except ValueError:
            continue  # too few nodes for this scheme
        if sim.persist_interval_hours == ftconfig.AUTO:
            window = fm.restart_s + (0.0 if fm.standby else fm.replacement_s) + n_s * T + sim.snapshot_seconds
            disk_rate = intervals.disk_failure_rate(pl, fm.node_mttf_s, fm.software_fraction, window)
            cost = intervals.persist_cost(sim.snapshot_stall_seconds, lat, rate - disk_rate)
            n_p = intervals.choose_persist_interval(T, n_s, cost, lat, disk_rate).iterations
        else:
            n_p = max(round(sim.persist_interval_hours * 3600.0 / T), math.ceil(lat / T - 1e-9), n_s)
            n_p = math.ceil(n_p / n_s) * n_s
        out.append(Strategy(f"megatron-ft, {pl.label}", n_s * T, memory=True,
                            snapshot_stall_s=sim.snapshot_stall_seconds, snapshot_latency_s=sim.snapshot_seconds,
                            persist_every=n_p // n_s, persist_latency_s=lat,
                            local_restore_s=sim.memory_restore_seconds, peer_restore_s=sim.peer_restore_seconds,
                            retrieve_s=sim.retrieve_seconds, placement=pl, snapshot_iterations=n_s,
                            persist_iterations=n_p))
    return out


def closed_form(s: Strategy, nodes: int, fm: FailureModel) -> Optional[float]:
    """Exact expected goodput for persistent-only strategies (Poisson failures, mean downtime)."""
    if s.memory:
        return None
    rate = intervals.job_failure_rate(nodes, fm.node_mttf_s)
    return intervals.goodput_single_tier(s.cell_s, s.persist_stall_s, s.persist_latency_s,
                                         fm.mean_downtime(s.retrieve_s), rate)


# ------------------------------------------------------------------------------------ sweep + output

FIELDS = ["nodes", "strategy", "snapshot_every_iters", "persist_every_iters", "runs", "days", "goodput",
          "goodput_min", "goodput_max", "closed_form", "failures_per_day", "memory_recoveries_per_day",
          "disk_recoveries_per_day", "wasted_gpu_hours_per_day", "lost_gpu_hours_per_day",
          "stall_gpu_hours_per_day", "down_gpu_hours_per_day", "memory_factor"]


def run_point(sim: ftconfig.SimulateConfig, fm: FailureModel, nodes: int, s: Strategy) -> dict:
    days = sim.days
    runs = [simulate_run(s, nodes, fm, days * DAY, seed=sim.seed + r * 7919 + nodes) for r in range(sim.runs)]
    g = [r.goodput for r in runs]
    gpu = nodes * sim.gpus_per_node / 3600.0 / days  # seconds of wall -> GPU-hours per day

    def mean(attr: str) -> float:
        return sum(getattr(r, attr) for r in runs) / len(runs)

    cf = closed_form(s, nodes, fm)
    return {
        "nodes": nodes, "strategy": s.name, "snapshot_every_iters": s.snapshot_iterations or "",
        "persist_every_iters": s.persist_iterations, "runs": len(runs), "days": days,
        "goodput": round(sum(g) / len(g), 5), "goodput_min": round(min(g), 5), "goodput_max": round(max(g), 5),
        "closed_form": "" if cf is None else round(cf, 5),
        "failures_per_day": round(mean("failures") / days, 3),
        "memory_recoveries_per_day": round(mean("memory_recoveries") / days, 3),
        "disk_recoveries_per_day": round(mean("disk_recoveries") / days, 3),
        "wasted_gpu_hours_per_day": round((days * DAY - mean("progress_s")) * gpu, 2),
        "lost_gpu_hours_per_day": round(mean("lost_s") * gpu, 2),
        "stall_gpu_hours_per_day": round(mean("stall_s") * gpu, 2),
        "down_gpu_hours_per_day": round(mean("down_s") * gpu, 2),
        "memory_factor": round(s.placement.memory_factor, 3) if s.placement is not None else "",
    }


def sweep(cfg: ftconfig.FTConfig) -> list[dict]:
    fm = FailureModel.from_config(cfg.failure)
    rows = []
    for n in cfg.simulate.nodes:
        for s in strategies_for(cfg.simulate, fm, n):
            rows.append(run_point(cfg.simulate, fm, n, s))
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def plot_available() -> tuple[bool, str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False, "matplotlib is not installed (pip install 'megatron-ft[plot]')"
    return True, ""


def write_png(rows: list[dict], path: str, title: str, sim: Optional[ftconfig.SimulateConfig] = None) -> None:
    """Goodput and wasted GPU-hours per day against the number of nodes, and (with ``sim``) the
    probability that each scheme recovers k simultaneous failures from memory at the largest size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["strategy"] for r in rows))
    styles = ["s--", "D--", "v-", "o-", "^-", "P-"]
    fig, axes = plt.subplots(1, 3 if sim is not None else 2, figsize=(17 if sim is not None else 12, 5.2))
    ax1, ax2 = axes[0], axes[1]
    for i, name in enumerate(names):
        rs = [r for r in rows if r["strategy"] == name]
        xs = [r["nodes"] for r in rs]
        ys = [r["goodput"] for r in rs]
        err = [[r["goodput"] - r["goodput_min"] for r in rs], [r["goodput_max"] - r["goodput"] for r in rs]]
        st = styles[i % len(styles)]
        ax1.errorbar(xs, ys, yerr=err, fmt=st, capsize=3, label=name, markersize=5)
        if all(r["closed_form"] != "" for r in rs):
            ax1.plot(xs, [r["closed_form"] for r in rs], ":", color="gray", linewidth=1)
        ax2.plot(xs, [max(r["wasted_gpu_hours_per_day"], 1e-3) for r in rs], st, label=name, markersize=5)
    ax1.plot([], [], ":", color="gray", label="closed form (persistent-only)")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("nodes (instances)")
        ax.grid(True, which="both", alpha=0.3)
        xt = sorted({r["nodes"] for r in rows})
        ax.set_xticks(xt)
        ax.set_xticklabels([str(x) for x in xt])
    ax1.set_ylabel("effective training time ratio (goodput)")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=8, loc="lower left")
    ax2.set_yscale("log")
    ax2.set_ylabel("wasted GPU-hours per day")
    same = [n for n in names if n.startswith("megatron-ft") and ", none" not in n]
    spread = [max(gs) - min(gs) for n in {r["nodes"] for r in rows}
              for gs in [[r["goodput"] for r in rows if r["nodes"] == n and r["strategy"] in same]] if len(gs) > 1]
    if spread and max(spread) < 0.005:
        ax1.text(0.03, 0.55, "the redundancy schemes coincide: two failures in one\ngroup before it is rebuilt are "
                 "rare at this rate", transform=ax1.transAxes, ha="left", va="center", fontsize=8, color="dimgray")
    if sim is not None:
        ax3 = axes[2]
        n = max(sim.nodes)
        kmax = max(2, min(n, 200))
        ks = list(range(1, kmax + 1))
        curves = [("replica", (sim.replicas,), f"replica m={sim.replicas} (GEMINI mixed)"),
                  ("ring", (sim.replicas,), f"ring m={sim.replicas} (GEMINI's comparison)"),
                  ("xor", (sim.xor_group,), f"xor n={sim.xor_group} (REFT RAIM5)"),
                  ("rs", (sim.rs_k, sim.rs_m), f"rs {sim.rs_k}+{sim.rs_m} (ECHECK)")]
        for scheme, param, label in curves:
            try:
                pl = make_placement(scheme, n, *param)
            except ValueError:
                continue
            c = recoverable_counts(pl, kmax)
            ax3.plot(ks, [c[k] / math.comb(n, k) for k in ks], label=label)
        if n % sim.replicas == 0:
            ax3.plot(ks, [gemini_corollary1(n, sim.replicas, k) for k in ks], ":", color="gray",
                     label="GEMINI Corollary 1 (lower bound)")
        ax3.set_xlabel(f"k simultaneous node failures (N = {n})")
        ax3.set_ylabel("P(recover from memory), exact")
        ax3.set_ylim(0, 1.02)
        ax3.grid(True, alpha=0.3)
        ax3.legend(fontsize=8)
    fig.suptitle(title.replace("; iteration", ";\niteration"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(cfg: ftconfig.FTConfig) -> str:
    f, s = cfg.failure, cfg.simulate
    per_day = 24.0 / f.node_mttf_hours * 100
    return (f"{per_day:.2g}% of nodes fail per day (MTTF {f.node_mttf_hours:g} h, Weibull c={f.weibull_shape:g}), "
            f"{f.software_fraction:.0%} software, {f.standby_nodes} standby, replacement {f.replacement_minutes:g} min, "
            f"restart {f.restart_minutes:g} min; iteration {s.iteration_seconds:g} s, checkpoint {s.checkpoint_seconds:g} s "
            f"({s.checkpoint_stall_seconds:g} s stall), snapshot {s.snapshot_seconds:g} s; {s.days:g} days x {s.runs} runs")


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("simulate", help="goodput of checkpointing strategies under random failures (CSV + PNG)")
    p.add_argument("--config", default=None, help="YAML with failure: and simulate: sections (default: embedded)")
    p.add_argument("--out", default="megatron-ft-simulate", help="directory for goodput.csv and goodput.png")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cfg = ftconfig.load(args.config)
    os.makedirs(args.out, exist_ok=True)
    rows = sweep(cfg)
    csv_path = os.path.join(args.out, "goodput.csv")
    write_csv(rows, csv_path)
    width = max(len(r["strategy"]) for r in rows)
    print(f"# {describe(cfg)}")
    print(f"{'nodes':>6}  {'strategy':<{width}}  {'snap':>5} {'persist':>7}  {'goodput':>7}  {'closed':>6}  "
          f"{'fail/d':>6}  {'wasted GPU-h/d':>14}")
    for r in rows:
        cf = f"{r['closed_form']:.3f}" if r["closed_form"] != "" else ""
        print(f"{r['nodes']:>6}  {r['strategy']:<{width}}  {str(r['snapshot_every_iters']):>5} "
              f"{r['persist_every_iters']:>7}  {r['goodput']:>7.3f}  {cf:>6}  {r['failures_per_day']:>6.1f}  "
              f"{r['wasted_gpu_hours_per_day']:>14.1f}")
    print(f"wrote {csv_path}")
    ok, why = plot_available()
    if ok:
        png = os.path.join(args.out, "goodput.png")
        write_png(rows, png, describe(cfg), cfg.simulate)
        print(f"wrote {png}")
    else:
        print(f"no PNG: {why}", file=sys.stderr)
    return 0
