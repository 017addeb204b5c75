"""Inputs of the checkpoint-traffic planners: idle spans, recorded events, the alpha-beta link
model, and how profiled iterations become network idle spans (GEMINI section 5.4) and pipeline
bubbles (BAFT section 4.1 and 4.2.2), as pure functions.

Times are seconds from the start of the iteration. One rank, one iteration, worked by hand
(the example of docs/scheduling.md; link at 100 B/s):

=====================  ==========  =======
event                  [start, end)  bytes
=====================  ==========  =======
compute (forward)      [0, 2)
send (activation)      [2, 2.5)      50
recv (gradient)        [2.5, 5)      50      (recorded time includes the wait for the peer)
compute (backward)     [5, 8)
collective (grad a-r)  [8, 9)
optimizer              [9, 10)
=====================  ==========  =======

* *Network idle spans* (GEMINI: "timestamps the start and the end time of all communication
  operations in an iteration"): the communication events cover [2, 5) and [8, 9), so the link is
  idle in [0, 2), [5, 8) and [9, 10).
* *Pipeline bubble* (BAFT: the device waits; no compute, optimizer or collective runs): [2, 5).
  BAFT "calculates the time required for regular communication according to the communication's
  volume and network bandwidth and reserves the corresponding time at the start and the end of the
  bubble": the send (its middle 2.25 lies in the first half of the bubble) reserves 50/100 = 0.5 s
  at the start, the receive (middle 3.75, second half) 0.5 s at the end: usable bubble [2.5, 4.5).

Across iterations (:func:`average_spans`): the i-th span of every iteration is averaged (start,
end) and the population variance of its length kept, e.g. lengths 2.0 and 2.2 s -> mean 2.1,
variance 0.01. GEMINI measures a normalised standard deviation below 10 % and covers it with mu.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..config import _check_int, _check_num, _fail

COMPUTE, SEND, RECV, COLLECTIVE, OPTIMIZER = "compute", "send", "recv", "collective", "optimizer"
EVENT_KINDS = (COMPUTE, SEND, RECV, COLLECTIVE, OPTIMIZER)
NETWORK_KINDS = frozenset((SEND, RECV, COLLECTIVE))  # GEMINI: the link is busy
DEVICE_KINDS = frozenset((COMPUTE, OPTIMIZER, COLLECTIVE))  # BAFT: the device is not waiting
P2P_KINDS = frozenset((SEND, RECV))  # regular pipeline traffic reserved inside a bubble

_EPS = 1e-9  # seconds / bytes of float slack when comparing or flooring


def _check_finite(field: str, value, minimum: float = 0.0) -> None:
    _check_num(field, value, minimum)
    if math.isinf(value):
        _fail(field, value, f"must be a finite number >= {minimum}")


@dataclass(frozen=True)
class IdleSpan:
    """``[start, end)`` seconds within an iteration in which checkpoint traffic may run; ``variance``
    is the variance (s^2) of its length across the profiled iterations (0 when measured once)."""

    start: float
    end: float
    variance: float = 0.0

    def __post_init__(self) -> None:
        _check_finite("span.start", self.start)
        _check_finite("span.end", self.end)
        if self.end < self.start:
            _fail("span.end", self.end, f"must be >= span.start={self.start!r} (a span cannot be negative)")
        _check_finite("span.variance", self.variance)

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class LinkModel:
    """The alpha-beta cost of sending ``s`` bytes: ``f(s) = alpha + s / B`` (GEMINI section 5.3).
    BAFT sizes bubbles by "duration and bandwidth" only: ``alpha_s = 0``.

    >>> LinkModel(bandwidth=100.0, alpha_s=0.1).time(100), LinkModel(100.0, 0.1).bytes_within(0.3)
    (1.1, 20)
    """

    bandwidth: float  # bytes per second
    alpha_s: float = 0.0  # start-up time of one transfer

    def __post_init__(self) -> None:
        _check_num("link.bandwidth", self.bandwidth, 0.0, strict=True)
        if math.isinf(self.bandwidth):
            _fail("link.bandwidth", self.bandwidth, "must be a finite number > 0 (bytes per second)")
        _check_finite("link.alpha_s", self.alpha_s)

    def time(self, size: int) -> float:
        """f(size) in seconds."""
        return self.alpha_s + size / self.bandwidth

    def bytes_within(self, seconds: float) -> int:
        """The largest whole number of bytes one transfer moves in ``seconds`` (finite):
        floor((t - alpha) B), 0 when ``t <= alpha``."""
        return max(0, math.floor((seconds - self.alpha_s) * self.bandwidth + _EPS))


@dataclass(frozen=True)
class Event:
    """One recorded operation of a rank in one iteration: ``kind`` in :data:`EVENT_KINDS`, ``[start,
    end)`` seconds from the start of the iteration, ``bytes`` moved (send/recv/collective)."""

    kind: str
    start: float
    end: float
    bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            _fail("event.kind", self.kind, f"must be one of {list(EVENT_KINDS)}")
        _check_finite("event.start", self.start)
        _check_finite("event.end", self.end)
        if self.end < self.start:
            _fail("event.end", self.end, f"must be >= event.start={self.start!r}")
        _check_int("event.bytes", self.bytes, 0)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + _EPS:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _gaps(busy: Iterable[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of ``[start, end)`` that no busy interval covers, in order."""
    gaps, t = [], start
    for s, e in _union(busy):
        if s > t + _EPS:
            gaps.append((t, min(s, end)))
        t = max(t, e)
    if end > t + _EPS:
        gaps.append((t, end))
    return [(s, e) for s, e in gaps if e > s + _EPS]


def _iteration_end(events: Sequence[Event], iteration_end: Optional[float]) -> float:
    last = max((e.end for e in events), default=0.0)
    if iteration_end is None:
        return last
    _check_finite("iteration_end", iteration_end)
    if iteration_end + _EPS < last:
        _fail("iteration_end", iteration_end, f"must be >= the last event's end {last!r}")
    return iteration_end


def link_occupancy(event: Event, link: Optional[LinkModel]) -> tuple[float, float]:
    """The part of the iteration in which ``event`` (a send, receive or collective) holds the link: its
    recorded ``[start, end)``, and for a point-to-point transfer at least the time its bytes need at
    ``link``'s rate - from its start for a send (the bytes leave from then on), up to its end for a
    receive (the last byte arrives at its end). A send that returns before its bytes are on the wire
    (a socket buffer, a shaper's burst allowance) does not free the link: the bytes still take their
    time. A collective returns only once every byte has arrived: its recorded time covers them (and
    its recorded bytes are its buffer's, not what crossed this link - none with one rank).

    >>> link = LinkModel(bandwidth=100.0)
    >>> link_occupancy(Event("send", 2.0, 2.1, 50), link), link_occupancy(Event("recv", 3.0, 3.2, 50), link)
    ((2.0, 2.5), (2.7, 3.2))
    >>> link_occupancy(Event("recv", 2.5, 5.0, 50), link)  # waited for the peer: the recorded time
    (2.5, 5.0)
    >>> link_occupancy(Event("collective", 8.0, 9.0, 1000), link)
    (8.0, 9.0)
    """
    if link is None or not event.bytes or event.kind not in P2P_KINDS:
        return event.start, event.end
    need = link.time(event.bytes)
    if event.kind == RECV:
        return max(0.0, min(event.start, event.end - need)), event.end
    return event.start, max(event.end, event.start + need)


def network_idle_spans(events: Sequence[Event], iteration_end: Optional[float] = None,
                       link: Optional[LinkModel] = None) -> tuple[IdleSpan, ...]:
    """GEMINI: the parts of ``[0, iteration_end)`` in which no send, receive or collective holds the
    link (``iteration_end`` defaults to the last event's end). With ``link``, each holds it for at
    least its bytes' time (:func:`link_occupancy`); a transfer whose bytes outlast the iteration
    leaves no idle time at its end."""
    end = _iteration_end(events, iteration_end)
    busy = [link_occupancy(e, link) for e in events if e.kind in NETWORK_KINDS]
    return tuple(IdleSpan(s, e) for s, e in _gaps(busy, 0.0, end))


def pipeline_bubbles(events: Sequence[Event], link: LinkModel,
                     iteration_end: Optional[float] = None) -> tuple[IdleSpan, ...]:
    """BAFT: the parts of ``[0, iteration_end)`` in which the device neither computes, updates nor
    runs a collective, each shrunk by the regular point-to-point traffic it contains - every send or
    receive overlapping the bubble reserves ``link.time(bytes)`` at the end of the bubble nearer to
    its middle (the send that opens a bubble at its start, the receive that closes it at its end).
    Bubbles left empty are dropped."""
    end = _iteration_end(events, iteration_end)
    busy = [(e.start, e.end) for e in events if e.kind in DEVICE_KINDS]
    out = []
    for s, e in _gaps(busy, 0.0, end):
        mid, head, tail = (s + e) / 2.0, 0.0, 0.0
        for ev in events:
            inside = ev.start < e and ev.end > s or ev.start == ev.end and s <= ev.start <= e
            if ev.kind in P2P_KINDS and inside:
                if (ev.start + ev.end) / 2.0 < mid:
                    head += link.time(ev.bytes)
                else:
                    tail += link.time(ev.bytes)
        if e - tail > s + head + _EPS:
            out.append(IdleSpan(s + head, e - tail))
    return tuple(out)


@dataclass(frozen=True)
class TimelineSummary:
    """What one rank's timeline offers in one iteration (or, from :func:`summarize_profile`, on
    average over several: ``iterations`` > 1 and the spans carry variances)."""

    rank: int
    iteration_s: float
    idle_spans: tuple[IdleSpan, ...]  # network idle (GEMINI)
    bubbles: tuple[IdleSpan, ...]  # reserved pipeline bubbles (BAFT)
    iterations: int = 1
    iteration_variance: float = 0.0

    def __post_init__(self) -> None:
        _check_int("timeline.rank", self.rank, 0)
        _check_finite("timeline.iteration_s", self.iteration_s)
        _check_int("timeline.iterations", self.iterations, 1)
        _check_finite("timeline.iteration_variance", self.iteration_variance)
        for name in ("idle_spans", "bubbles"):
            for span in getattr(self, name):
                if not isinstance(span, IdleSpan):
                    _fail(f"timeline.{name}", span, "must hold IdleSpan values")
                if span.end > self.iteration_s + _EPS:
                    _fail(f"timeline.{name}", span, f"must end by timeline.iteration_s={self.iteration_s!r}")


def summarize_iteration(rank: int, events: Sequence[Event], link: LinkModel,
                        iteration_end: Optional[float] = None) -> TimelineSummary:
    """One iteration of one rank: idle spans and reserved bubbles (see the module example)."""
    end = _iteration_end(events, iteration_end)
    return TimelineSummary(rank, end, network_idle_spans(events, end, link), pipeline_bubbles(events, link, end))


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, sum((x - mean) ** 2 for x in xs) / len(xs)


def average_spans(per_iteration: Sequence[Sequence[IdleSpan]], field: str = "spans") -> tuple[IdleSpan, ...]:
    """Span i of the result: mean start and end of span i of every iteration, and the population
    variance of its length. Every iteration must have the same number of spans (GEMINI: the timeline
    is "almost constant across iterations"); otherwise the iteration that differs is named.

    >>> s = average_spans([[IdleSpan(1.0, 3.0)], [IdleSpan(1.0, 3.2)]])[0]
    >>> round(s.end, 6), round(s.length, 6), round(s.variance, 6)
    (3.1, 2.1, 0.01)
    """
    if not per_iteration:
        _fail(field, per_iteration, "must hold at least one profiled iteration")
    count = len(per_iteration[0])
    for i, spans in enumerate(per_iteration):
        if len(spans) != count:
            _fail(f"{field}[{i}]", f"{len(spans)} spans", f"every profiled iteration must have the same number of "
                  f"spans as iteration 0 ({count}); drop outlier iterations or filter short spans first")
    out = []
    for k in range(count):
        column = [spans[k] for spans in per_iteration]
        start, _ = _mean_var([s.start for s in column])
        end, _ = _mean_var([s.end for s in column])
        _, var = _mean_var([s.length for s in column])
        out.append(IdleSpan(start, max(start, end), var))
    return tuple(out)


def summarize_profile(iterations: Sequence[TimelineSummary]) -> TimelineSummary:
    """Mean and variance over profiled iterations of one rank (GEMINI profiles 20 iterations)."""
    if not iterations:
        _fail("profile", iterations, "must hold at least one TimelineSummary")
    ranks = {t.rank for t in iterations}
    if len(ranks) != 1:
        _fail("profile.rank", sorted(ranks), "all profiled iterations must come from one rank")
    mean_it, var_it = _mean_var([t.iteration_s for t in iterations])
    return TimelineSummary(
        iterations[0].rank, mean_it,
        average_spans([t.idle_spans for t in iterations], "profile.idle_spans"),
        average_spans([t.bubbles for t in iterations], "profile.bubbles"),
        iterations=len(iterations), iteration_variance=var_it)
