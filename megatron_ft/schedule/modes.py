"""Send schedules of the scheduled transport, one per mode (GEMINI figure 16,
BAFT section 4). Pure: profiled spans and sizes in, a :class:`SendSchedule` out.

A schedule lists the :class:`Send` s of one checkpoint transfer: which bytes of the container go to
which remote copy, in which iteration of the transfer (0 .. n - 1), at what time within that
iteration (seconds after the iteration starts; :data:`AT_END` = after the optimizer step), through
which buffer. The executor (:mod:`megatron_ft.transport.scheduled`) starts a transfer every n
iterations (``interval_iterations``).

| mode | chunks | buffers | training waits |
|---|---|---|---|
| ``pipelined`` | GEMINI Algorithm 2 in the idle spans (:func:`idle_spans`; :func:`.gemini.fitting_interval`) | p of R/p | no |
| ``one-buffer`` | Algorithm 2 with p = 1 ("interleave without pipeline") | 1 of R | no |
| ``naive`` | one chunk per idle span, as large as mu times the span carries | 1 of the largest chunk (can exceed R) | no |
| ``blocking`` | everything at the start of the iteration, chunks of R/p | p of R/p | yes |
| ``bubble`` | BAFT Algorithm 1: the bubbles shared with the receiving node, chunks of <= R/p | p of R/p | no |
| ``end`` | everything after the optimizer step, chunks of R/p | p of R/p | yes |

Worked example (link 100 B/s, alpha 0, R = 200 B, p = 2, mu = 0.5, a 300 B container, one remote
copy, idle spans [0, 5), [6, 7), [8, 10)):

| mode | sends (at s: bytes) | buffers |
|---|---|---|
| ``pipelined`` | 0: 100, 1: 100, 2: 50 (span 0's budget 2.5 s), 6: 50 | 2 x 100 B, used 0, 1, 0, 1 |
| ``one-buffer`` | 0: 200, 2: 50, 6: 50 | 1 x 200 B |
| ``naive`` | 0: 250 (2.5 s of span 0), 6: 50 | 1 x 250 B: more than R |
| ``blocking`` | 0: 100, 1: 100, 2: 100, training waits | 2 x 100 B |

``bubble`` with sender bubbles [1, 3), [6, 7) and receiver bubbles [0, 2), [5, 8) (shared: [1, 2)
and [6, 7), 100 B each): 100 B at 1 s and 100 B at 6 s in iteration 0, 100 B at 1 s in iteration 1:
a checkpoint every 2 iterations.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from . import baft, gemini, link_gate
from ..config import ScheduleConfig, _check_int, _fail
from .spans import _EPS, IdleSpan, LinkModel

AT_END = math.inf  # Send.at: after the iteration's optimizer step
MODES = ScheduleConfig.MODES
MAX_ITERATIONS = 64  # a plan spreading one checkpoint over more iterations is not worth having


@dataclass(frozen=True)
class Send:
    copy: int  # remote copy 0 .. m - 2 (which receiver)
    iteration: int  # of the transfer, 0 .. n - 1
    at: float  # seconds after the iteration starts; AT_END: after its optimizer step
    offset: int
    size: int
    buffer: int


@dataclass(frozen=True)
class SendSchedule:
    mode: str
    sends: tuple[Send, ...]
    buffers: int
    buffer_bytes: int
    interval_iterations: int
    blocking: bool  # training waits until every send of the iteration is done
    planned_transfer_s: float  # sum of f(size) over the sends
    fits: bool  # every send inside (mu times) an idle span / shared bubble
    #: > 0: the sends of an iteration go when the link gate opens (:mod:`.link_gate`, this window),
    #: in their order, not at their planned offsets; 0: at their offsets
    gate_window_s: float = 0.0

    @property
    def memory_bytes(self) -> int:
        """Sender-side buffer memory (the receiver allocates the same)."""
        return self.buffers * self.buffer_bytes

    def of_iteration(self, iteration: int) -> tuple[Send, ...]:
        return tuple(s for s in self.sends if s.iteration == iteration)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "buffers": self.buffers, "buffer_bytes": self.buffer_bytes,
                "memory_bytes": self.memory_bytes,
                "interval_iterations": self.interval_iterations, "blocking": self.blocking,
                "planned_transfer_s": self.planned_transfer_s, "fits": self.fits,
                "gate_window_s": self.gate_window_s,
                "sends": [[s.copy, s.iteration, None if s.at == AT_END else s.at, s.offset, s.size, s.buffer]
                          for s in self.sends]}


def _back_to_back(nbytes: int, copies: int, chunk: int, buffers: int, at: float, link: LinkModel) -> list[Send]:
    out: list[Send] = []
    t = 0.0
    for c in range(copies):
        for off in range(0, nbytes, chunk):
            size = min(chunk, nbytes - off)
            out.append(Send(c, 0, at if at == AT_END else at + t, off, size, len(out) % buffers))
            t += link.time(size)
    return out


def _naive(spans: Sequence[IdleSpan], nbytes: int, copies: int, link: LinkModel, mu: float) -> tuple[list[Send], bool]:
    """One chunk per span (what mu times the span carries), copy after copy; the last span of the last
    iteration is unbounded and takes whatever is left of every copy (one chunk per copy). The fewest
    iterations for which that last span fits too."""
    total = nbytes * copies
    for n in range(1, MAX_ITERATIONS + 1):
        out: list[Send] = []
        done = 0
        order = [(it, k) for it in range(n) for k in range(len(spans))]
        for i, (it, k) in enumerate(order[:-1]):
            if done >= total:
                break
            c, off = divmod(done, nbytes)
            size = min(nbytes - off, link.bytes_within(mu * spans[k].length))
            if size > 0:
                out.append(Send(c, it, spans[k].start, off, size, 0))
                done += size
        it, k = order[-1]
        last_s = 0.0
        while done < total:  # the unbounded last span
            c, off = divmod(done, nbytes)
            out.append(Send(c, it, spans[k].start + last_s, off, nbytes - off, 0))
            last_s += link.time(nbytes - off)
            done += nbytes - off
        fits = last_s <= mu * spans[k].length + _EPS
        if fits or n == MAX_ITERATIONS:
            return out, fits
    raise AssertionError("unreachable")


def free_share_of_waits(cores: int, ranks_on_host: int) -> float:
    """The share of a rank's wait in which a core of its host is free for checkpoint traffic, when
    the host's cores both train and move the bytes (CPU): while one of ``r`` ranks waits, the other
    ``r - 1`` keep up to ``r - 1`` cores busy. Two ranks on two cores: 1.0 (the waiting rank's core
    is free); four ranks on two cores: 0.0 (the other three take both). Hand-checked values are in
    ``tests/unit/test_schedule_modes.py``."""
    _check_int("cores", cores, 1)
    _check_int("ranks_on_host", ranks_on_host, 1)
    return float(max(0, min(1, cores - (ranks_on_host - 1))))


def idle_spans(idle: str, on_gpu: bool, network: Sequence[IdleSpan], bubbles: Sequence[IdleSpan],
               free_share: float = 1.0) -> tuple[str, tuple[IdleSpan, ...]]:
    """The spans the GEMINI modes fill for ``schedule.idle`` (``network`` | ``device`` | ``auto``), and
    which they are: ``auto`` is ``device`` on a CPU-only job (the cores that move the bytes are the
    ones that compute: only the rank's waits are free) and ``network`` on GPUs. ``device`` keeps
    ``free_share`` of every bubble (:func:`free_share_of_waits`: a wait frees a core only when the
    host has one to spare); without a single bubble left (PP = 1, or more ranks than cores) it
    falls back to the network spans, named ``"network (no free bubbles)"``.

    Worked example (the module's: network [0, 5), [6, 7), [8, 10), bubbles [1, 3), [6, 7)): on CPU
    ``auto`` gives the bubbles; ``pipelined`` with mu = 0.5 then fits 100 B + 50 B per iteration
    (the last bubble takes what is left of its iteration's share) and spreads the 300 B over 2
    iterations: 0-100 at 1 s and 100-150 at 6 s, then 150-250 and 250-300."""
    if idle not in ScheduleConfig.IDLE:
        _fail("schedule.idle", idle, f"must be one of {', '.join(ScheduleConfig.IDLE)}")
    if not 0.0 <= free_share <= 1.0:
        _fail("free_share", free_share, "must be a number >= 0 and <= 1")
    if idle == "auto":
        idle = "network" if on_gpu else "device"
    if idle == "device":
        kept = tuple(IdleSpan(b.start, b.start + free_share * b.length, b.variance) for b in bubbles
                     if free_share * b.length > _EPS)
        if kept:
            return "device", kept
        return "network (no free bubbles)", tuple(network)
    return "network", tuple(network)


def plan_sends(mode: str, nbytes: int, copies: int, link: LinkModel, reserved_bytes: int, sub_buffers: int,
               mu: float = 0.9, spans: Sequence[IdleSpan] = (), bubbles: Sequence[IdleSpan] = (),
               peer_bubbles: Sequence[IdleSpan] = ()) -> SendSchedule:
    """The schedule of ``mode`` for a container of ``nbytes`` sent to ``copies`` receivers.

    ``spans``: this rank's network idle spans (``pipelined``, ``one-buffer``, ``naive``; the last is
    unbounded); ``bubbles`` / ``peer_bubbles``: this rank's and the receiver's reserved bubbles
    (``bubble``). Raises ``ConfigError`` naming the bad input; for ``bubble`` also when the two share
    no bubble (the caller falls back to another mode)."""
    if mode not in MODES:
        _fail("schedule.mode", mode, f"must be one of {', '.join(MODES)}")
    _check_int("nbytes", nbytes, 1)
    _check_int("copies", copies, 1)
    _check_int("sub_buffers", sub_buffers, 1)
    _check_int("reserved_bytes", reserved_bytes, sub_buffers)
    chunk = reserved_bytes // sub_buffers
    if mode in ("blocking", "end"):
        sends = _back_to_back(nbytes, copies, chunk, sub_buffers, 0.0 if mode == "blocking" else AT_END, link)
        return _schedule(mode, sends, sub_buffers, chunk, True, link, True)
    if mode in ("pipelined", "one-buffer", "naive"):
        if not spans:
            _fail("spans", list(spans), f"mode {mode!r} needs the profiled network idle spans (none given)")
        if mode == "naive":
            sends, fits = _naive(spans, nbytes, copies, link, mu)
            return _schedule(mode, sends, 1, max(s.size for s in sends), False, link, fits)
        p = sub_buffers if mode == "pipelined" else 1
        plan = gemini.fitting_interval(spans, nbytes, copies + 1, reserved_bytes, p, link, mu, MAX_ITERATIONS)
        sends = [Send(c.copy, c.iteration, c.start, c.offset, c.size, c.buffer) for c in plan.chunks]
        return _schedule(mode, sends, p, plan.sub_buffer_bytes, False, link, plan.fits)
    # bubble (BAFT): every copy goes through the bubbles shared with the receiver
    tp = baft.plan_transfer(bubbles, peer_bubbles, nbytes * copies, link, max_iterations=MAX_ITERATIONS)
    sends, done = [], 0
    for slot in tp.slots:
        t, left = slot.start, slot.capacity
        while left > 0 and done < nbytes * copies:
            c, off = divmod(done, nbytes)
            size = min(chunk, left, nbytes - off)
            sends.append(Send(c, slot.iteration, t, off, size, len(sends) % sub_buffers))
            t += link.time(size)
            left -= size
            done += size
    return _schedule(mode, sends, sub_buffers, chunk, False, link, True)


def plan_sends_every(min_interval: int, mode: str, nbytes: int, copies: int, link: LinkModel, reserved_bytes: int,
                     sub_buffers: int, mu: float = 0.9, spans: Sequence[IdleSpan] = (),
                     bubbles: Sequence[IdleSpan] = (), peer_bubbles: Sequence[IdleSpan] = ()) -> SendSchedule:
    """:func:`plan_sends`, a checkpoint at most every ``min_interval`` (N) iterations
    (``schedule.min_interval``): a span-filling plan that needs n < N iterations is planned again
    with mu * n / N, so each iteration carries n/N of what it could and the checkpoint takes about
    N iterations (GEMINI: "reduce the checkpoint frequency to amortize"); a plan that already
    needs N or more is kept. Plans without spans (``blocking``, ``end``, ``bubble``) keep their
    sends and start every N iterations.

    Worked example (the module's, ``pipelined``, mu = 0.5, N = 3): the plan fits in 1 iteration,
    so it is planned again with mu = 0.5 / 3 and spreads the 300 B over 3 iterations."""
    _check_int("schedule.min_interval", min_interval, 1)
    sched = plan_sends(mode, nbytes, copies, link, reserved_bytes, sub_buffers, mu, spans, bubbles, peer_bubbles)
    n = sched.interval_iterations
    if mode in ("pipelined", "one-buffer", "naive") and n < min_interval:
        sched = plan_sends(mode, nbytes, copies, link, reserved_bytes, sub_buffers, mu * n / min_interval, spans,
                           bubbles, peer_bubbles)
    if sched.interval_iterations < min_interval:
        sched = dataclasses.replace(sched, interval_iterations=min_interval)
    return sched


def gated(schedule: SendSchedule, window_s: float, link: LinkModel, capacity_s: float = math.inf) -> SendSchedule:
    """``schedule`` executed through the link gate whose windows are typically ``window_s``: every send
    cut into chunks of half that (:func:`.link_gate.chunk_limit`), each piece keeping its send's copy, planned
    time and buffer (pieces of one send share a key's time and are numbered by its ``seq``). Where
    the gate gives less link time per iteration (``capacity_s``, :func:`.link_gate.capacity_s`) than
    the plan uses, the transfer is spread over as many iterations as the gate needs (at most
    :data:`MAX_ITERATIONS`), the chunks in order, an equal share of the bytes in each. Schedules in
    which training waits (``blocking``, ``end``) are returned as they are.

    >>> s = SendSchedule("pipelined", (Send(0, 0, 0.5, 0, 300000, 0), Send(0, 1, 0.0, 300000, 1000, 1)),
    ...                  2, 300000, 2, False, 0.03, True)
    >>> g = gated(s, 0.008, LinkModel(25e6))  # 100 kB in half of 8 ms at 25 MB/s
    >>> [(x.iteration, x.at, x.offset, x.size) for x in g.sends], g.gate_window_s
    ([(0, 0.5, 0, 100000), (0, 0.5, 100000, 100000), (0, 0.5, 200000, 100000), (1, 0.0, 300000, 1000)], 0.008)
    >>> g = gated(s, 0.008, LinkModel(25e6), capacity_s=0.004)  # 4 ms a iteration: 12.04 ms need 4
    >>> [x.iteration for x in g.sends], g.interval_iterations
    ([0, 1, 2, 3], 4)
    """
    if schedule.blocking or window_s <= 0:
        return schedule
    limit = link_gate.chunk_limit(window_s, link)
    out = []
    for s in schedule.sends:
        for off in range(0, s.size, limit):
            out.append(dataclasses.replace(s, offset=s.offset + off, size=min(limit, s.size - off)))
    transfer_s = sum(link.time(s.size) for s in out)
    n = schedule.interval_iterations
    if capacity_s > 0 and transfer_s > n * capacity_s + _EPS:
        n = min(MAX_ITERATIONS, math.ceil(transfer_s / capacity_s - _EPS))
        done, spread = 0.0, []
        for s in out:
            spread.append(dataclasses.replace(s, iteration=min(n - 1, int(done / transfer_s * n))))
            done += link.time(s.size)
        out = spread
    return dataclasses.replace(schedule, sends=tuple(out), gate_window_s=window_s, planned_transfer_s=transfer_s,
                               interval_iterations=max(n, schedule.interval_iterations))


def _schedule(mode: str, sends: list[Send], buffers: int, buffer_bytes: int, blocking: bool, link: LinkModel,
              fits: bool) -> SendSchedule:
    n = max((s.iteration for s in sends), default=0) + 1
    return SendSchedule(mode, tuple(sends), buffers, buffer_bytes, n, blocking,
                        sum(link.time(s.size) for s in sends), fits)
