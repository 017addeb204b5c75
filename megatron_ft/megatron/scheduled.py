"""The scheduled transport in a megatron-core training loop: profile the first W
iterations through :mod:`.hooks`, plan the sends of ``schedule.mode``
(:func:`megatron_ft.schedule.modes.plan_sends_every`), then run them every iteration
(:class:`megatron_ft.transport.scheduled.ScheduledTransport`). With network idle spans, the plan
goes through the transport's link gate (:mod:`megatron_ft.schedule.link_gate`): this module feeds it
training's network calls from the hooks (``p2p``, ``grad_sync``, ``param_sync``; removed at
:meth:`ScheduledHooks.close`).

Files under ``$MFT_RUN_DIR`` (when set; one directory per node, :mod:`megatron_ft.rank_files`):
``profile/node<N>/rank<R>.json`` (the profiled iterations, as ``--inmem-ckpt-profile-iterations``
writes them) and ``transport/node<N>/rank<R>.json`` (format
``megatron-ft-transport`` v1: the schedule, and per transfer iteration the planned and the actual
chunk times; ``iteration_s``: ``[iteration, mode, seconds, newest agreed snapshot step]``; ``gate``:
the chunks the link gate let go only after its longest wait, and its total wait, or null; ``cpu_s``:
the CPU time of the transport's driver and receiver threads) for
``megatron-ft timeline`` and ``benchmarks/scheduling.py``.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any, Optional

import torch

from . import hooks as mhooks
from ..agent import shm
from ..agent.protocol import AgentClient
from ..config import ScheduleConfig
from ..schedule.link_gate import capacity_s, chunk_limit, gaps_after_calls, position_windows
from ..schedule.modes import SendSchedule, free_share_of_waits, gated, idle_spans, plan_sends_every
from ..schedule.profiler import TRANSPORT_FORMAT, TRANSPORT_VERSION, Profiler, summarize_rank, write_rank_json
from ..schedule.spans import IdleSpan, LinkModel
from ..transport.scheduled import ScheduledTransport
from .profiling import end_profile

log = logging.getLogger("megatron_ft.transport")

TRAFFIC_ITERATIONS = 3  # iterations profiled from the first transfer on, with its chunks (for the timeline)
WAIT_ITERATIONS = 20  # at most this many iterations after the plan wait for the first transfer
MAX_ACTUAL, MAX_ITERATIONS_KEPT = 4096, 20000  # bounded records for the transport file


def planning_spans(spans: tuple, profiled: bool, iteration_s: float) -> tuple:
    """The idle spans the plan fills: ``spans`` when there are any; without any, one span of the whole
    iteration if the profile could not be used, and none at all (one of no length at the iteration's
    end, where every chunk then lands: the plan does not fit) if the profile saw the link never idle."""
    if spans:
        return tuple(spans)
    return (IdleSpan(iteration_s, iteration_s),) if profiled else (IdleSpan(0.0, iteration_s),)


class ScheduledHooks:
    def __init__(self, cfg: Any, ckpt: Any, objs: Any):
        self.cfg, self.ckpt = cfg, ckpt
        self.rank = ckpt.rank
        hello = {"rank": ckpt.rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "pid": os.getpid(),
                 "run_id": cfg.run_id, "role": "transport"}

        def connect() -> AgentClient:  # one connection to this node's agent per caller thread
            client = AgentClient(ckpt.client.socket_path, cfg.agent.request_timeout_s)
            client.connect(hello)
            return client

        self.transport = ScheduledTransport(cfg, ckpt.rank, connect, shm.open_segment,
                                            lambda: ckpt.engine.last_agreed, emit=self._actual)
        self.planned_after = cfg.schedule.profile_iterations  # plan from these (no checkpoint traffic yet)
        # the profile ends TRAFFIC_ITERATIONS after the first transfer started (the first snapshot
        # agreed after the plan can come a few iterations late, on a loaded machine; the limit then
        # shrinks), or at most WAIT_ITERATIONS later
        self.profiler: Optional[Profiler] = Profiler(
            self.rank, self.planned_after + WAIT_ITERATIONS + TRAFFIC_ITERATIONS,
            {"planned_iterations": self.planned_after})
        self.traffic_seen = False
        mhooks.install(objs.config, objs.optimizer).add_sink(self.profiler.record)
        self.iteration_start = 0.0
        self.iteration = -1  # the current iteration (0-based), and the transport's mode in it
        self.label = ""
        self.plan_info: Optional[dict] = None  # set once planned
        self.rotation: list[tuple[str, Optional[SendSchedule]]] = []  # schedule.compare_modes (benchmarks)
        self.rotation_index = 0
        self.segment_end = -1
        self.actual: list[dict] = []  # chunks sent: iteration, start, end (s from its start), bytes
        self.iteration_s: list[float] = []
        self.run_dir = os.environ.get("MFT_RUN_DIR")
        self._gate_hooks: list = []  # callbacks feeding the transport's link gate (removed at close)

    @property
    def planned(self) -> bool:
        return self.plan_info is not None

    @property
    def snapshots_off(self) -> bool:
        """In a ``compare_modes`` segment of ``off``: no snapshot is taken (every rank switches at
        the same step, so the snapshot agreement stays collective)."""
        return self.transport.label == "off"

    def _actual(self, name: str, kind: str, start: float, end: float, nbytes: int = 0, src: str = "") -> None:
        if self.profiler is not None:
            self.profiler.record(name, kind, start, end, nbytes, src)
        if len(self.actual) < MAX_ACTUAL:  # the first chunks are enough to look at
            self.actual.append({"iteration": self.iteration, "start": start - self.iteration_start,
                            "end": end - self.iteration_start, "bytes": nbytes})

    def before_iteration(self, iteration: int) -> None:
        now = time.perf_counter()
        if self.iteration >= 0 and self.label and len(self.iteration_s) < MAX_ITERATIONS_KEPT:
            # the previous iteration, start to start: its snapshot and "end" sends count; and the
            # newest snapshot step all ranks hold (it stays put through an "off" segment)
            self.iteration_s.append([self.iteration, self.label, now - self.iteration_start,
                                     self.ckpt.engine.last_agreed])
        self.iteration, self.iteration_start = iteration, now
        self.label = self.transport.label if self.planned else ""
        if self.profiler is not None:
            self.profiler.begin_iteration(iteration)
        mhooks.HOOKS.begin_iteration(iteration)
        self.transport.begin_iteration()

    def after_iteration(self, step: int) -> None:
        mhooks.HOOKS.end_iteration()
        if self.profiler is not None:
            self.profiler.end_iteration()
            if len(self.profiler.iterations) == self.planned_after and not self.planned:
                self._plan(step)
        if self.rotation and step == self.segment_end:
            self.rotation_index = (self.rotation_index + 1) % len(self.rotation)
            mode, sched = self.rotation[self.rotation_index]
            self.transport.use(sched, step, mode)
            self.segment_end = step + self._segment(sched)
        self.transport.end_iteration(step)  # finishes the last transfer: its chunks reach the profile
        if self.profiler is not None:
            if not self.traffic_seen and self.transport.last_step >= 0:  # the first transfer started:
                self.traffic_seen = True  # its chunks go out from the next iteration on
                self.profiler.limit = len(self.profiler.iterations) + TRAFFIC_ITERATIONS
            if self.profiler.done:
                self._write_profile()

    # ------------------------------------------------------------------ planning (collective)
    def _container_bytes(self) -> int:
        try:
            versions = self.ckpt.client.request("list", rank=self.rank)["versions"]
            return os.path.getsize(versions[0]["path"]) if versions else 0
        except Exception as e:
            log.warning("rank %d: container size unknown: %s", self.rank, e)
            return 0

    def _write_profile(self) -> None:
        prof, self.profiler = self.profiler, None
        end_profile(prof, os.path.join(self.run_dir, "profile") if self.run_dir else None, node=self.ckpt.node)

    def _plan(self, step: int) -> None:
        sc = self.cfg.schedule
        link = LinkModel(sc.bandwidth_mib_s * 2**20, sc.alpha_s) if sc.bandwidth_mib_s else None
        data = self.profiler.to_dict()  # the first W iterations: no checkpoint traffic yet
        spans, bubbles = [], []
        profiled = False
        try:
            summ = summarize_rank(data, link)
            link = link or LinkModel(summ.link.bandwidth, sc.alpha_s)
            spans, bubbles = list(summ.summary.idle_spans), list(summ.summary.bubbles)
            iteration_s = summ.summary.iteration_s
            profiled = True
        except Exception as e:  # every rank must still reach the collectives below
            log.warning("rank %d: profile not usable (%s): one idle span per iteration", self.rank, e)
            link = link or LinkModel(1e9, sc.alpha_s)
            iteration_s = 1.0
        on_gpu = torch.cuda.is_available()
        share = 1.0
        if sc.idle != "network" and not on_gpu:  # the same on every rank: the exchange is collective
            share = free_share_of_waits(len(os.sched_getaffinity(0)), self.transport.groups.ranks_on_my_host())
        idle, spans = idle_spans(sc.idle, on_gpu, spans, bubbles, share)
        spans = planning_spans(spans, profiled, iteration_s)
        wants_bubbles = "bubble" in (sc.compare_modes or (sc.mode,))
        peer = self.transport.groups.exchange_bubbles([(b.start, b.end) for b in bubbles]) if wants_bubbles else {}
        window, capacity = (self._gate_window(data, link, iteration_s) if idle.startswith("network") and profiled
                            else (0.0, 0.0))
        nbytes = self._container_bytes()
        modes = sc.compare_modes or (sc.mode,)
        if sc.mode in modes:  # the configured mode first: the profiled iterations after the plan show it
            modes = (sc.mode,) + tuple(m for m in modes if m != sc.mode)
        agreed = []
        for mode in modes:  # the same order on every rank: agree() is collective
            if mode in ScheduleConfig.BASELINES:
                agreed.append((mode, None))
                continue
            sched = self._schedule(mode, nbytes, link, spans, bubbles, peer)
            agreed.append((mode, self.transport.groups.agree(gated(sched, window, link, capacity) if sched else None)))
        if sc.compare_modes:
            self.rotation, self.rotation_index = agreed, 0
            self.segment_end = step + self._segment(agreed[0][1])
        self.transport.use(agreed[0][1], step, agreed[0][0])
        self.plan_info = {"link_bandwidth": link.bandwidth, "alpha_s": link.alpha_s, "nbytes": nbytes,
                          "idle": idle, "free_share": share, "spans": [[s.start, s.end] for s in spans],
                          "bubbles": [[b.start, b.end] for b in bubbles],
                          "profiled_iteration_s": iteration_s, "planned_at_step": step, "gate_window_s": window,
                          "schedules": {m: (s.to_dict() if s else None) for m, s in agreed}}

    def _gate_window(self, profile: dict, link: LinkModel, iteration_s: float) -> tuple[float, float]:
        """Send through the transport's link gate (:mod:`megatron_ft.schedule.link_gate`), fed from
        here on by the pipeline hooks: its window after each of training's network calls, from the
        profiled iterations (the first left out, as in the summary). Returns the median window (the
        chunks are cut to half of it) and the link time per iteration the gate gives; (0.0, 0.0),
        chunks at their planned offsets, when the profile saw no such call."""
        its = profile["iterations"][1:self.planned_after] or profile["iterations"][:self.planned_after]
        try:
            windows = position_windows(gaps_after_calls(its, link), self.cfg.schedule.mu)
        except Exception as e:  # every rank must still reach the planning collectives
            log.warning("rank %d: no link gate, the profile's network calls are not usable: %s", self.rank, e)
            return 0.0, 0.0
        if not windows or max(windows) <= 0:
            return 0.0, 0.0
        typical = statistics.median(windows)
        capacity = capacity_s(windows, link.time(chunk_limit(typical, link)))
        gate = self.transport.use_link(link.bandwidth, max(iteration_s, max(windows)))
        calls = {"started": [], "ended": 0}

        def before(point: str, info: dict) -> None:
            calls["started"].append(time.perf_counter())
            gate.begin()

        def after(point: str, info: dict) -> None:
            start = calls["started"].pop() if calls["started"] else time.perf_counter()
            sent = int(info.get("send_next") or 0) + int(info.get("send_prev") or 0) if point == "p2p.after" else 0
            k = calls["ended"]
            calls["ended"] = k + 1
            gate.end(start, sent, windows[k] if k < len(windows) else min(windows))

        def new_iteration(point: str, info: dict) -> None:
            calls["ended"] = 0

        self._gate_hooks.append(mhooks.HOOKS.add_callback("iteration.begin", new_iteration))
        for op in ("p2p", "grad_sync", "param_sync"):
            self._gate_hooks.append(mhooks.HOOKS.add_callback(op + ".before", before))
            self._gate_hooks.append(mhooks.HOOKS.add_callback(op + ".after", after))
        log.info("rank %d: link gate, %d windows of %.1f-%.1f ms, %.1f ms of link a iteration", self.rank,
                 len(windows), min(windows) * 1e3, max(windows) * 1e3, capacity * 1e3)
        return typical, capacity

    def _segment(self, sched: Optional[SendSchedule]) -> int:
        """Iterations a mode runs before the next (``compare_iterations``, made whole transfers)."""
        k = self.cfg.schedule.compare_iterations
        n = sched.interval_iterations if sched is not None else 1
        return -(-k // n) * n

    def _schedule(self, mode: str, nbytes: int, link: LinkModel, spans: list, bubbles: list,
                  peer: dict) -> Optional[SendSchedule]:
        sc = self.cfg.schedule
        if not nbytes or not self.transport.dsts:
            return None
        every = sc.min_interval
        try:
            pb = [IdleSpan(a, b) for a, b in peer.get(self.transport.dsts[0], [])]
            return plan_sends_every(every, mode, nbytes, len(self.transport.dsts), link, sc.reserved_bytes,
                                    sc.sub_buffers, sc.mu, spans, bubbles, pb)
        except ValueError as e:  # e.g. no bubble shared with the receiver
            if mode != "pipelined" and spans:  # GEMINI's plan over the idle spans: training does not wait
                log.warning("rank %d: %s plan impossible (%s): the pipelined plan over the idle spans instead",
                            self.rank, mode, e)
                return self._schedule("pipelined", nbytes, link, spans, bubbles, peer)
            log.warning("rank %d: %s plan impossible (%s): sending at the end of the iteration", self.rank, mode, e)
            try:
                return plan_sends_every(every, "end", nbytes, len(self.transport.dsts), link, sc.reserved_bytes,
                                        sc.sub_buffers)
            except ValueError as e2:
                log.error("rank %d: no schedule at all (%s)", self.rank, e2)
                return None

    def close(self) -> None:
        for handle in self._gate_hooks:
            mhooks.HOOKS.remove_callback(handle)
        self._gate_hooks.clear()
        try:
            self.transport.close()
        finally:
            if self.profiler is not None:
                self._write_profile()
            self._write()

    def _write(self) -> None:
        if not self.run_dir or not self.planned:
            return
        out = {"format": TRANSPORT_FORMAT, "version": TRANSPORT_VERSION, "rank": self.rank,
               "dsts": self.transport.dsts, "srcs": self.transport.srcs,
               "schedule": (self.plan_info["schedules"].get(self.cfg.schedule.mode) or next(
                   (v for v in self.plan_info["schedules"].values() if v), None)), "plan": self.plan_info,
               "transfers": self.transport.records, "stall_s": self.transport.stall_s,
               "stall_by_mode": self.transport.stall_by_mode, "cpu_s": self.transport.cpu_s,
               "iteration_s": self.iteration_s, "actual": self.actual,
               "gate": ({"forced": self.transport.gate.forced, "waited_s": self.transport.gate.waited_s,
                         "wakeups": self.transport.gate.wakeups}
                        if self.transport.gate is not None else None)}
        write_rank_json(os.path.join(self.run_dir, "transport"), self.rank, out, self.ckpt.node)
