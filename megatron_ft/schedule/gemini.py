"""GEMINI's checkpoint partition into network idle spans (SOSP '23, section 5.3, Algorithm 2).

A checkpoint of C bytes is sent to m - 1 remote peers through a reserved buffer of R bytes split
into p sub-buffers (so no chunk is larger than R/p); a chunk of s bytes takes f(s) = alpha + s/B.
The paper's pseudo-code (d idle spans t_1..t_d, mu in (0, 1)):

.. code-block:: text

     1  Function checkpoint_partition():
     2    t[d] = +inf
     3    partitions = []
     4    cpkt_id = 0
     5    remain_size = C
     6    foreach t in T do
     7      remain_span = mu * t
     8      while remain_span > 0 do
     9        if remain_span >= f(R/p) then
    10          size = R/p
    11        else
    12          size = max{0, (remain_span - alpha) B}
    13        end
    14        size = min{remain_size, size}
    15        if size > 0 then
    16          remain_size = remain_size - size
    17          remain_span =
    18            remain_span - f(remain_size)
    19          partitions.add(size)
    20        end
    21        if remain_size == 0 then
    22          if cpkt_id < m - 1 then
    23            cpkt_id = cpkt_id + 1
    24            remain_size = C
    25          else
    26            return partitions
    27          end
    28        end
    29      end
    30    end
    31    return partitions

Implemented line by line, with three repairs (docs/scheduling.md, "Where the papers are ambiguous"):

* line 18 subtracts f(remain_size), the bytes *still to send*, which makes no sense (the prose:
  "it accordingly updates remain_span"); we subtract f(size), the time of the chunk just added;
* with cpkt_id starting at 0, lines 22-24 partition m checkpoints, but the input says "m - 1 is the
  number of checkpoints for communications" (one replica stays local): we send exactly m - 1;
* when 0 < remain_span <= alpha, line 12 gives size 0 and the while loop never ends: we move on to
  the next span. Sizes are whole bytes: line 12 is floor((remain_span - alpha) B).

Worked example (the test ``test_gemini_hand_example``): B = 100 B/s, alpha = 0.1 s, R = 200 B,
p = 2 (R/p = 100 B, f(100) = 1.1 s), mu = 0.5, C = 300 B, m = 2 (one remote copy), idle spans of
5 s, 1 s and 2 s:

* span 0: remain_span = 2.5 >= 1.1 -> 100 B (1.4 s left), 100 B (0.3 s left); 0.3 < 1.1 ->
  floor((0.3 - 0.1) 100) = 20 B, f(20) = 0.3 s, nothing left.   remain_size = 300 - 220 = 80
* span 1: remain_span = 0.5 -> floor(0.4 * 100) = 40 B.            remain_size = 40
* span 2: the last, unbounded: min(40, 100) = 40 B, f(40) = 0.5 s, done.
* chunks 100, 100, 20, 40, 40 B in sub-buffers 0, 1, 0, 1, 0; transfer time 1.1 + 1.1 + 0.3 + 0.5 +
  0.5 = 3.5 s; the last span uses 0.5 s <= mu * 2 = 1 s: the checkpoint fits in one iteration.

With m = 3 (600 B to send) the second copy follows in the unbounded last span: 100, 100, 100 B,
0.5 + 3 * 1.1 = 3.8 s there, 2.8 s beyond mu * 2 s (``overflow_s``) and 1.8 s beyond the span's
real 2 s (``stall_s``, the iteration is prolonged). Spread over two iterations instead
(``iterations=2``, the last span of the first iteration now bounded at mu * 2 = 1 s): iteration 0
sends 100, 100, 20 | 40 | 40 (copy 0 done, 0.5 s left) then 40 of copy 1 (= floor(0.4 * 100)),
iteration 1 sends 100, 100, 20 | 40: copy 1 completes in span 1 and nothing overflows, so
:func:`fitting_interval` gives a checkpoint every 2 iterations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..config import _check_int, _check_num, _fail
from .spans import _EPS, IdleSpan, LinkModel


@dataclass(frozen=True)
class Chunk:
    """One transfer: bytes ``[offset, offset + size)`` of remote copy ``copy`` (0 .. m - 2) sent in
    idle span ``span`` of iteration ``iteration`` of the plan, through sub-buffer ``buffer`` (chunks
    rotate over the p sub-buffers), from ``start`` to ``end`` seconds within that iteration."""

    copy: int
    iteration: int
    span: int
    offset: int
    size: int
    buffer: int
    start: float
    end: float


@dataclass(frozen=True)
class GeminiPlan:
    """The chunks of Algorithm 2 and what they cost. The final span of the final iteration is
    unbounded (line 2): ``overflow_s`` is the time used there beyond ``mu * length``, ``stall_s`` beyond
    its real length (the iteration grows by about that much)."""

    chunks: tuple[Chunk, ...]
    spans: tuple[IdleSpan, ...]
    link: LinkModel
    checkpoint_bytes: int
    replicas: int
    sub_buffers: int
    sub_buffer_bytes: int
    mu: float
    iterations: int

    @property
    def remote_copies(self) -> int:
        return self.replicas - 1

    @property
    def total_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    @property
    def transfer_s(self) -> float:
        """Time the link spends on checkpoint traffic: the sum of f(size)."""
        return sum(c.end - c.start for c in self.chunks)

    @property
    def interval_iterations(self) -> int:
        """A checkpoint completes every this many iterations (1 when it fits in one)."""
        return max((c.iteration for c in self.chunks), default=0) + 1

    def used_s(self, iteration: int, span: int) -> float:
        return sum(c.end - c.start for c in self.chunks if c.iteration == iteration and c.span == span)

    @property
    def overflow_s(self) -> float:
        last = self.spans[-1]
        return max(0.0, self.used_s(self.iterations - 1, len(self.spans) - 1) - self.mu * last.length)

    @property
    def stall_s(self) -> float:
        last = self.spans[-1]
        return max(0.0, self.used_s(self.iterations - 1, len(self.spans) - 1) - last.length)

    @property
    def fits(self) -> bool:
        """True when every chunk runs inside mu times its span: no interference with training."""
        return self.overflow_s <= _EPS


def _validate(spans: Sequence[IdleSpan], checkpoint_bytes: int, replicas: int, sub_buffers: int,
              reserved_bytes: int, mu: float, iterations: int) -> tuple[IdleSpan, ...]:
    spans = tuple(spans)
    if not spans:
        _fail("spans", list(spans), "must hold at least one idle span (the last one is unbounded)")
    for i, s in enumerate(spans):
        if not isinstance(s, IdleSpan):
            _fail(f"spans[{i}]", s, "must be an IdleSpan")
        if i and s.start + _EPS < spans[i - 1].end:
            _fail(f"spans[{i}].start", s.start, f"must be >= spans[{i - 1}].end={spans[i - 1].end!r} "
                                                "(spans in time order, not overlapping)")
    _check_int("checkpoint_bytes", checkpoint_bytes, 1)
    _check_int("replicas", replicas, 1)
    _check_int("sub_buffers", sub_buffers, 1)
    _check_int("reserved_bytes", reserved_bytes, sub_buffers)
    _check_num("mu", mu, 0.0, 1.0, strict=True)
    _check_int("iterations", iterations, 1)
    return spans


def checkpoint_partition(spans: Sequence[IdleSpan], checkpoint_bytes: int, replicas: int,
                         reserved_bytes: int, sub_buffers: int, link: LinkModel, mu: float = 0.9,
                         iterations: int = 1) -> GeminiPlan:
    """Algorithm 2 over ``spans`` (one iteration's network idle spans, in time order), repeated for
    ``iterations`` iterations; only the last span of the last iteration is unbounded. ``replicas`` is
    GEMINI's m (m - 1 copies go over the network); sub-buffers of ``reserved_bytes // sub_buffers``."""
    spans = _validate(spans, checkpoint_bytes, replicas, sub_buffers, reserved_bytes, mu, iterations)
    if not isinstance(link, LinkModel):
        _fail("link", link, "must be a LinkModel(bandwidth, alpha_s)")
    chunk_max = reserved_bytes // sub_buffers  # R/p
    full_chunk_s = link.time(chunk_max)  # f(R/p)
    plan = dict(spans=spans, link=link, checkpoint_bytes=checkpoint_bytes, replicas=replicas,
                sub_buffers=sub_buffers, sub_buffer_bytes=chunk_max, mu=mu, iterations=iterations)
    chunks: list[Chunk] = []
    if replicas == 1:  # no remote copy
        return GeminiPlan(tuple(chunks), **plan)
    cpkt_id, remain_size = 0, checkpoint_bytes  # lines 4-5
    order = [(it, k) for it in range(iterations) for k in range(len(spans))]
    for n, (it, k) in enumerate(order):  # line 6
        unbounded = n == len(order) - 1  # line 2
        remain_span = math.inf if unbounded else mu * spans[k].length  # line 7
        at = spans[k].start
        while remain_span > 0:  # line 8
            if remain_span + _EPS >= full_chunk_s:  # line 9
                size = chunk_max  # line 10
            else:
                size = link.bytes_within(remain_span)  # line 12
            size = min(remain_size, size)  # line 14
            if size <= 0:
                break  # repair: the literal loop spins forever once remain_span <= alpha
            remain_size -= size  # line 16
            remain_span -= link.time(size)  # lines 17-18 with f(size)
            chunks.append(Chunk(cpkt_id, it, k, checkpoint_bytes - remain_size - size, size,
                                len(chunks) % sub_buffers, at, at + link.time(size)))  # line 19
            at += link.time(size)
            if remain_size == 0:  # line 21
                if cpkt_id < replicas - 2:  # line 22, m - 1 copies in all
                    cpkt_id, remain_size = cpkt_id + 1, checkpoint_bytes
                else:
                    return GeminiPlan(tuple(chunks), **plan)
    raise AssertionError("unreachable: the last span is unbounded")


def fitting_interval(spans: Sequence[IdleSpan], checkpoint_bytes: int, replicas: int, reserved_bytes: int,
                     sub_buffers: int, link: LinkModel, mu: float = 0.9, max_iterations: int = 64) -> GeminiPlan:
    """The plan over the fewest iterations (<= ``max_iterations``) whose chunks all fit in mu times
    their spans - a checkpoint every ``plan.interval_iterations`` iterations, without interference.
    When none fits, the ``max_iterations`` plan: as much as its spans hold, the rest stalling in its
    last span, once every ``max_iterations`` iterations ("GEMINI can reduce the checkpoint frequency
    to amortize" it; a one-iteration plan would stall every iteration for the whole transfer)."""
    _check_int("max_iterations", max_iterations, 1)
    args = (spans, checkpoint_bytes, replicas, reserved_bytes, sub_buffers, link, mu)
    plan = None
    for n in range(1, max_iterations + 1):
        plan = checkpoint_partition(*args, iterations=n)
        if plan.fits:
            return plan
    return plan
