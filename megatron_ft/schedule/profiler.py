"""Per-rank timeline profiler: records the first W iterations of a rank, writes
them as JSON, and summarises them into network idle spans and reserved pipeline bubbles with their
variance across iterations (:mod:`.spans`). No torch here: the records come from
:mod:`megatron_ft.megatron.hooks` (a :class:`Profiler` is one of its sinks) or from anything that
calls :meth:`Profiler.record`.

File ``$MFT_RUN_DIR/profile/node<N>/rank<R>.json`` (:mod:`megatron_ft.rank_files`; ``format`` ``megatron-ft-profile``, ``version`` 1)::

    {"format": "megatron-ft-profile", "version": 1, "rank": 1, "complete": true,
     "meta": {"world_size": 2, "pp_rank": 1, "pp_size": 2, ...},       # free-form, from the caller
     "snapshot_bytes": 1234567,                                        # or null: not measured
     "clock": {"wall_at_origin": 1.7e9},                               # time.time() at origin
     "iterations": [{"iteration": 0, "start": 0.0012, "end": 0.0815,   # s from origin
                     "events": [{"name": "forward-compute", "kind": "compute",
                                 "start": 0.0003, "end": 0.0101,       # s from the iteration start
                                 "bytes": 0, "src": "timer"}, ...]}, ...],
     "summary": {...}}                                                 # summarize_rank(...).to_dict()

``origin`` is the profiler's creation (``time.perf_counter()``); ``wall_at_origin`` lines ranks up
on one time axis (exact on one machine, NTP-aligned across machines). Event kinds: those of
:data:`.spans.EVENT_KINDS` (the only ones summarised), ``phase`` (enclosing or duplicate timers,
e.g. ``forward-backward``, ``forward-send``) and ``ckpt`` (checkpoint traffic actually sent).

Summary (:func:`summarize_rank`): per iteration, :func:`.spans.summarize_iteration`; spans shorter
than ``min_span_s`` are dropped (scheduling noise between two operations); the first ``warmup``
iterations are left out; :func:`.spans.average_spans` averages the idle spans over the iterations
with the most common number of them, and the bubbles likewise (the others are named in
``dropped``); the iteration time is averaged over all iterations after the warm-up. The link for the
bubbles' reservation is given, or estimated as the fastest observed P2P transfer (bytes over
recorded duration, which includes waiting: a lower bound of the real bandwidth).
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .. import rank_files
from ..config import _fail
from .spans import (EVENT_KINDS, P2P_KINDS, Event, IdleSpan, LinkModel, TimelineSummary, _mean_var, average_spans,
                    summarize_iteration)

PROFILE_FORMAT = "megatron-ft-profile"
PROFILE_VERSION = 1
#: the scheduled transport's record of a run (megatron_ft/megatron/scheduled.py writes, timeline reads)
TRANSPORT_FORMAT, TRANSPORT_VERSION = "megatron-ft-transport", 1
RECORD_KINDS = EVENT_KINDS + ("phase", "ckpt")
DEFAULT_ITERATIONS = 20  # GEMINI profiles the first 20 iterations
DEFAULT_MIN_SPAN_S = 1e-3
DEFAULT_BANDWIDTH = 1e9  # bytes/s, when a profile has no timed P2P transfer


class Profiler:
    """Collects the events of the first ``iterations`` iterations that :meth:`begin_iteration` /
    :meth:`end_iteration` delimit; events outside an iteration are ignored."""

    def __init__(self, rank: int, iterations: int = DEFAULT_ITERATIONS, meta: Optional[dict] = None) -> None:
        if not isinstance(iterations, int) or iterations < 1:
            _fail("profile.iterations", iterations, "must be an integer >= 1")
        self.rank, self.limit, self.meta = rank, iterations, dict(meta or {})
        self.origin = time.perf_counter()
        self.wall_at_origin = time.time() - (time.perf_counter() - self.origin)
        self.iterations: list[dict] = []
        self._current: Optional[dict] = None
        self._t0 = 0.0

    @property
    def done(self) -> bool:
        return len(self.iterations) >= self.limit

    def begin_iteration(self, iteration: int) -> None:
        if self.done:
            return
        self._t0 = time.perf_counter()
        self._current = {"iteration": int(iteration), "start": self._t0 - self.origin, "events": []}

    def record(self, name: str, kind: str, start: float, end: float, nbytes: int = 0, src: str = "") -> None:
        """One operation, ``time.perf_counter()`` times (the signature of a hooks sink). Checkpoint
        chunks are often seen complete only later: they go to the iteration they started in."""
        cur, t0 = self._current, self._t0
        if kind == "ckpt" and (cur is None or start < t0):
            cur = next((it for it in reversed(self.iterations) if self.origin + it["start"] <= start), None)
            if cur is None:
                return
            t0 = self.origin + cur["start"]
        if cur is None:
            return
        if kind not in RECORD_KINDS:
            _fail("event.kind", kind, f"must be one of {list(RECORD_KINDS)}")
        cur["events"].append({"name": name, "kind": kind, "start": max(0.0, start - t0),
                              "end": max(0.0, end - t0), "bytes": int(nbytes), "src": src})

    def end_iteration(self) -> bool:
        """Close the current iteration; True once ``iterations`` are recorded."""
        cur, self._current = self._current, None
        if cur is not None:
            cur["end"] = time.perf_counter() - self.origin
            self.iterations.append(cur)
        return self.done

    def to_dict(self, snapshot_bytes: Optional[int] = None, link: Optional[LinkModel] = None) -> dict:
        out = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "rank": self.rank,
               "complete": self.done, "meta": self.meta,
               "snapshot_bytes": None if snapshot_bytes is None else int(snapshot_bytes),
               "clock": {"wall_at_origin": self.wall_at_origin}, "iterations": self.iterations}
        try:
            out["summary"] = summarize_rank(out, link).to_dict()
        except ValueError as e:  # e.g. too few iterations: the raw events are still worth having
            out["summary"] = {"error": str(e)}
        return out

    def write(self, directory: str, snapshot_bytes: Optional[int] = None, node: Optional[int] = None) -> str:
        """The profile to ``directory/node<N>/rank<R>.json`` (:func:`write_rank_json`); its path."""
        return write_rank_json(directory, self.rank, self.to_dict(snapshot_bytes), node)


def write_rank_json(directory: str, rank: int, obj: dict, node: Optional[int] = None) -> str:
    """``directory/node<node>/rank<rank>.json`` (:mod:`megatron_ft.rank_files`; ``node`` None: this
    process's, :func:`~megatron_ft.rank_files.process_node`), replaced atomically (a reader never sees
    half a file); returns the path."""
    path = rank_files.rank_path(directory, rank, ".json", rank_files.process_node(rank) if node is None else node)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------ reading
def load_profile(path: str) -> dict:
    """Read and check one rank's profile file."""
    with open(path, encoding="utf-8") as f:
        prof = json.load(f)
    if not isinstance(prof, dict) or prof.get("format") != PROFILE_FORMAT:
        _fail("profile.format", prof.get("format") if isinstance(prof, dict) else type(prof).__name__,
              f"{path} is not a {PROFILE_FORMAT} file")
    if prof.get("version") != PROFILE_VERSION:
        _fail("profile.version", prof.get("version"), f"{path}: this megatron-ft reads version {PROFILE_VERSION}")
    for i, it in enumerate(prof.get("iterations", [])):
        for ev in it["events"]:
            if ev["kind"] not in RECORD_KINDS:
                _fail(f"iterations[{i}].events.kind", ev["kind"], f"must be one of {list(RECORD_KINDS)}")
    return prof


def load_profiles(run_dir: str) -> list[dict]:
    """Every rank's profile under ``RUN_DIR/profile`` (or ``RUN_DIR`` itself): ``node<N>/rank<R>.json``,
    or the flat ``rank<R>.json`` of earlier versions (:func:`megatron_ft.rank_files.rank_files`), by rank."""
    directory = os.path.join(run_dir, "profile")
    if not os.path.isdir(directory):
        directory = run_dir
    paths = [p for _, p in rank_files.rank_files(directory, ".json")]
    if not paths:
        _fail("run_dir", run_dir, "holds no profile/node*/rank*.json (run with --inmem-ckpt-profile-iterations W)")
    return sorted((load_profile(p) for p in paths), key=lambda p: p["rank"])


# ------------------------------------------------------------------------------ summary
def iteration_events(iteration: dict) -> list[Event]:
    """The summarised events of one recorded iteration (kinds of :data:`.spans.EVENT_KINDS`)."""
    return [Event(e["kind"], e["start"], e["end"], e["bytes"]) for e in iteration["events"]
            if e["kind"] in EVENT_KINDS]


def iteration_length(iteration: dict) -> float:
    return max(iteration["end"] - iteration["start"], max((e["end"] for e in iteration["events"]), default=0.0))


def estimate_link(profiles: Sequence[dict]) -> LinkModel:
    """The fastest observed P2P transfer (bytes / recorded seconds) over the profiles, alpha 0."""
    best = 0.0
    for prof in profiles:
        for it in prof["iterations"]:
            for e in it["events"]:
                if e["kind"] in P2P_KINDS and e["bytes"] > 0 and e["end"] > e["start"]:
                    best = max(best, e["bytes"] / (e["end"] - e["start"]))
    return LinkModel(best if best > 0 else DEFAULT_BANDWIDTH)


def _long(spans: Sequence[IdleSpan], min_span_s: float) -> tuple[IdleSpan, ...]:
    return tuple(s for s in spans if s.length >= min_span_s)


@dataclass(frozen=True)
class RankSummary:
    """What :func:`summarize_rank` found: ``summary.idle_spans`` averages the iterations in
    ``used_idle``, ``summary.bubbles`` those in ``used_bubbles``, ``summary.iteration_s`` all
    iterations after the warm-up."""

    rank: int
    link: LinkModel
    summary: TimelineSummary
    used_idle: tuple[int, ...]  # iteration numbers
    used_bubbles: tuple[int, ...]
    dropped: tuple[tuple[int, str], ...] = field(default=())  # (iteration, why), warm-up included
    min_span_s: float = DEFAULT_MIN_SPAN_S

    def to_dict(self) -> dict:
        def spans(xs):
            return [{"start": s.start, "end": s.end, "length": s.length, "variance": s.variance} for s in xs]

        s = self.summary
        return {"rank": self.rank, "bandwidth": self.link.bandwidth, "alpha_s": self.link.alpha_s,
                "min_span_s": self.min_span_s, "iterations_used_idle": list(self.used_idle),
                "iterations_used_bubbles": list(self.used_bubbles),
                "iterations_dropped": [{"iteration": i, "why": why} for i, why in self.dropped],
                "iteration_s": s.iteration_s, "iteration_variance": s.iteration_variance,
                "network_idle_spans": spans(s.idle_spans), "bubbles": spans(s.bubbles)}


def _modal(per_it: Sequence[tuple[int, tuple[IdleSpan, ...]]], what: str, dropped: list) -> list:
    """The iterations whose span count is the most common one (ties: the earliest such count)."""
    counts = Counter(len(spans) for _, spans in per_it)
    best = max(counts.values())
    count = next(len(spans) for _, spans in per_it if counts[len(spans)] == best)
    for n, spans in per_it:
        if len(spans) != count:
            dropped.append((n, f"{len(spans)} {what}, most iterations have {count}"))
    return [(n, spans) for n, spans in per_it if len(spans) == count]


def summarize_rank(profile: dict, link: Optional[LinkModel] = None, min_span_s: float = DEFAULT_MIN_SPAN_S,
                   warmup: int = 1) -> RankSummary:
    """Network idle spans and reserved bubbles of one rank, averaged over its profiled iterations
    (see the module docstring). Idle spans and bubbles are averaged separately, each over the
    iterations that have the most common number of them (CPU jitter moves short spans across
    ``min_span_s``)."""
    link = link or estimate_link([profile])
    its = profile["iterations"]
    planned = (profile.get("meta") or {}).get("planned_iterations")
    if planned:  # a scheduled-transport run: the iterations after these carry checkpoint traffic
        its = its[:planned]
    if not its:
        _fail("profile.iterations", 0, f"rank {profile['rank']} recorded no complete iteration")
    warmup = max(0, min(warmup, len(its) - 1))  # keep at least one
    dropped: list[tuple[int, str]] = [(it["iteration"], "warm-up") for it in its[:warmup]]
    per_it = [(it["iteration"], summarize_iteration(profile["rank"], iteration_events(it), link,
                                                    iteration_length(it))) for it in its[warmup:]]
    idle = _modal([(n, _long(t.idle_spans, min_span_s)) for n, t in per_it], "network idle spans", dropped)
    bubbles = _modal([(n, _long(t.bubbles, min_span_s)) for n, t in per_it], "bubbles", dropped)
    iteration_s, variance = _mean_var([t.iteration_s for _, t in per_it])
    idle_avg = average_spans([s for _, s in idle], "profile.idle_spans")
    bubble_avg = average_spans([s for _, s in bubbles], "profile.bubbles")
    # a span averaged over fewer iterations may end (by float noise or a short iteration mix) past the mean
    iteration_s = max([iteration_s] + [s.end for s in idle_avg + bubble_avg])
    summary = TimelineSummary(profile["rank"], iteration_s, idle_avg, bubble_avg, iterations=len(per_it),
                              iteration_variance=variance)
    return RankSummary(profile["rank"], link, summary, tuple(n for n, _ in idle), tuple(n for n, _ in bubbles),
                       tuple(dropped), min_span_s)
