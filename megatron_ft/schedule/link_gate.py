"""When a chunk of checkpoint traffic may use a rank's link: right after training's own use of it,
for no longer than the shortest idle span the profile saw there. Pure: times are passed in, no
clock, no lock, no I/O (:mod:`megatron_ft.transport.scheduled` holds the lock and the clock).

Why not the plan's offsets alone. A GEMINI plan puts each chunk at a planned time after the start
of the iteration, inside a profiled idle span. Where the iteration's timing moves by milliseconds
(a loaded host, a slower micro-batch) the offsets do not move with it: a chunk starts while training
is about to send, and on a link with one queue training's bytes wait behind the chunk's - on the
pipeline's critical path. Measured on the multi-host test bed (two hosts, PP = 2, 200 Mbit/s):
training's sends moved by 5-20 ms between iterations and the plan's chunks cost about their own
wire time in iteration time (docs/benchmarks.md). The gate ties each chunk to the event that
opens the idle span instead: training reports each of its network calls as it begins and ends,
and a chunk starts only once training's bytes are off the link, ending within the window of that
idle span - mu times the shortest span the profiled iterations had at that position, after the
same call of the iteration (:func:`gaps_after_calls`, :func:`position_windows`). Chunks are cut to
half a typical window (:func:`chunk_limit`), and a transfer is spread over as many iterations as
the windows need (:func:`capacity_s`, :func:`megatron_ft.schedule.modes.gated`).

Worked example (link 100 B/s, window 0.5 s, quiet after 2 s): training sends 50 B from t = 1.0 to
1.1 (its bytes leave the link at 1.5). A 40 B chunk (0.4 s) asked for at 1.2 waits for 1.5 and
ends at 1.9 <= 1.5 + 0.5; a second 40 B chunk would end at 2.3, past 2.0: it waits for training's
next call, or for the link to be quiet (nothing of training's since 1.5 for 2 s: from 3.5 on).

>>> gate = LinkGate(bandwidth=100.0, window_s=0.5, quiet_s=2.0)
>>> gate.begin(1.0); gate.end(1.0, 1.1, 50)
>>> gate.earliest(1.2, 40)
1.5
>>> gate.sent(1.5, 40); gate.earliest(1.6, 40)
3.5
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import _check_num
from .spans import _EPS, NETWORK_KINDS, SEND, Event, LinkModel, link_occupancy

CALL_SOURCES = ("p2p", "ddp")  # the hooks' records of the calls that report to the gate
MIN_CHUNK_BYTES = 64 << 10  # no chunk is cut smaller (per-chunk cost); a window shorter than its time
# lets such a chunk start only right as training frees the link
WAKE_SLACK_S = 1e-3  # the sender wakes this late after training frees the link, on a loaded host


@dataclass
class LinkGate:
    """The state of one rank's link as its checkpoint sender sees it.

    * :meth:`begin` / :meth:`end`: training's network operation (a pipeline send or receive, a
      gradient or parameter collective) started / finished; ``end`` gets the operation's start, its
      end and the bytes this rank sent in it: those hold the link until ``start + bytes / bandwidth``
      if that is later than the call's end (a call returns once its bytes are buffered).
    * :meth:`earliest`: when a chunk of ``nbytes`` may start (>= now) if training does not use the
      link before, or None while one of training's calls runs. Open when no call of training runs,
      training's bytes and the chunks already sent are off the link, and the chunk ends within
      ``window_s`` of training's bytes leaving (a chunk longer than the window only right then); and
      also once training has not used the link for ``quiet_s`` (longer than any idle span the
      profile saw: an evaluation, an ``off`` segment, the end of training), chunk after chunk. ``slack_s``: how late past the last fitting start a
      chunk may still go (the sender wakes up after training frees the link, not at that instant).
    * :meth:`sent`: a chunk of ``nbytes`` went out at ``start``.
    """

    bandwidth: float  # bytes / s
    window_s: float  # the window of the idle span training's last call opened
    quiet_s: float
    slack_s: float = WAKE_SLACK_S  # a chunk may start this much past the latest time that fits the window
    running: int = 0
    free_at: float = -math.inf  # training's bytes off the link
    chunks_until: float = -math.inf  # the chunks' bytes off the link

    def __post_init__(self) -> None:
        _check_num("gate.bandwidth", self.bandwidth, 0.0, strict=True)
        _check_num("gate.window_s", self.window_s, 0.0)
        _check_num("gate.quiet_s", self.quiet_s, 0.0)

    def begin(self, now: float) -> None:
        self.running += 1

    def end(self, start: float, now: float, nbytes: int = 0, window_s: Optional[float] = None) -> None:
        self.running = max(0, self.running - 1)
        if window_s is not None:
            self.window_s = window_s
        self.free_at = max(self.free_at, now, start + nbytes / self.bandwidth)

    def earliest(self, now: float, nbytes: int) -> Optional[float]:
        if self.running:
            return None
        wire = nbytes / self.bandwidth
        t = max(now, self.free_at, self.chunks_until)
        if t + wire <= self.free_at + max(self.window_s, wire) + self.slack_s + _EPS:
            return t
        return max(now, self.free_at + self.quiet_s, self.chunks_until)  # unless training calls first

    def sent(self, start: float, nbytes: int) -> None:
        self.chunks_until = max(self.chunks_until, start) + nbytes / self.bandwidth


def training_calls(events: Sequence[dict]) -> list[tuple[float, float, int]]:
    """Training's network calls in one recorded iteration, in order, as ``(start, end, bytes sent)``:
    the records of the pipeline hooks' point-to-point calls (``src`` ``p2p``: one record per
    direction, all over the call's interval) and data-parallel syncs (``src`` ``ddp``) - exactly
    the calls that report to the gate while training runs. A collective's bytes are not counted:
    it returns only once every byte has arrived, so its recorded time covers them.

    >>> training_calls([{"src": "p2p", "kind": "send", "start": 1.0, "end": 1.1, "bytes": 50},
    ...                 {"src": "p2p", "kind": "recv", "start": 1.0, "end": 1.1, "bytes": 50},
    ...                 {"src": "timer", "kind": "compute", "start": 1.1, "end": 2.0, "bytes": 0},
    ...                 {"src": "ddp", "kind": "collective", "start": 2.5, "end": 2.6, "bytes": 400}])
    [(1.0, 1.1, 50), (2.5, 2.6, 0)]
    """
    calls: dict[tuple[float, float], int] = {}
    for e in events:
        if e.get("src") in CALL_SOURCES and e["kind"] in NETWORK_KINDS:
            key = (e["start"], e["end"])
            calls[key] = calls.get(key, 0) + (int(e["bytes"]) if e["kind"] == SEND else 0)
    return [(a, b, n) for (a, b), n in sorted(calls.items())]


def gaps_after_calls(iterations: Sequence[dict], link: LinkModel) -> list[list[float]]:
    """Per recorded iteration (the profile's ``{"start", "end", "events"}``, consecutive): the idle
    span after each of training's calls (:func:`training_calls`), from its bytes being off the link
    (:func:`~.spans.link_occupancy` of what it sent) to the next call's start -
    for the iteration's last call, the next iteration's first (the last iteration's last: its end).
    Never negative.

    >>> its = [{"start": 0.0, "end": 3.0, "events": [
    ...            {"src": "p2p", "kind": "send", "start": 1.0, "end": 1.1, "bytes": 50},
    ...            {"src": "p2p", "kind": "send", "start": 2.0, "end": 2.1, "bytes": 50}]},
    ...        {"start": 3.0, "end": 6.0, "events": [
    ...            {"src": "p2p", "kind": "send", "start": 0.5, "end": 0.6, "bytes": 50}]}]
    >>> [[round(g, 6) for g in it] for it in gaps_after_calls(its, LinkModel(100.0))]
    [[0.5, 1.0], [2.0]]
    """
    timeline = []  # per iteration: absolute (start, free) per call
    for it in iterations:
        base = it["start"]
        timeline.append([(base + a, base + link_occupancy(Event(SEND, a, b, n), link)[1])
                         for a, b, n in training_calls(it["events"])])
    out = []
    for i, calls in enumerate(timeline):
        nxt = next((t[0][0] for t in timeline[i + 1:] if t), iterations[i]["end"] if i == len(timeline) - 1 else None)
        gaps = []
        for k, (_, free) in enumerate(calls):
            following = calls[k + 1][0] if k + 1 < len(calls) else nxt
            if following is None:
                following = iterations[-1]["end"]
            gaps.append(max(0.0, following - free))
        out.append(gaps)
    return out


def position_windows(per_iteration: Sequence[Sequence[float]], mu: float) -> tuple[float, ...]:
    """The gate's window after each of training's calls: mu times the shortest idle span at that
    position, over the iterations with the most common number of calls (others are left out: their
    positions do not line up). Empty without any call.

    >>> position_windows([[0.02, 0.05], [0.03, 0.04], [0.01]], 0.5)
    (0.01, 0.02)
    """
    _check_num("mu", mu, 0.0, 1.0, strict=True)
    counts = Counter(len(g) for g in per_iteration if g)
    if not counts:
        return ()
    n = max(counts, key=lambda c: (counts[c], c))
    rows = [g for g in per_iteration if len(g) == n]
    return tuple(round(mu * min(col), 9) for col in zip(*rows))


def chunk_limit(window_s: float, link: LinkModel, min_bytes: int = MIN_CHUNK_BYTES) -> int:
    """The chunk size for gate windows of typically ``window_s`` (the median): the bytes of half
    of it at ``link``'s rate (the other half absorbs a sender that starts late), at least
    ``min_bytes``.

    >>> chunk_limit(0.01, LinkModel(25e6)), chunk_limit(0.0001, LinkModel(25e6))
    (125000, 65536)
    """
    return max(min_bytes, link.bytes_within(window_s / 2))


def capacity_s(windows: Sequence[float], chunk_s: float) -> float:
    """The link time per iteration the gate gives checkpoint traffic in chunks of ``chunk_s``: as
    many whole chunks as fit each window.

    >>> capacity_s([0.01, 0.004, 0.025], 0.005)
    0.035
    """
    if chunk_s <= 0:
        return 0.0
    return round(sum(math.floor(w / chunk_s + _EPS) * chunk_s for w in windows), 9)
