"""The order in which the scheduled transport moves its chunks, so that every pair of ranks posts
matching operations in matching batches: pure planning, no process group, no threads
(:mod:`megatron_ft.transport.scheduled` executes it).

Why an order at all. On NCCL every batched point-to-point operation of a process group runs on one
communicator and one stream, in the order it was issued: an operation waits for its peer to reach the
matching one, and everything issued after it on that stream waits too. Two ranks that each issue a
large send to the other before the matching receive wait for each other for ever, and so do two that
each wait for a receive whose sender has not got to it yet. The transport therefore never posts an
operation because it happens to be pending: every chunk of a transfer gets a **key** that both of its
ends compute from the same numbers, and every rank issues its chunks in key order, as batches of equal
keys (:func:`batch_p2p`; one ``torch.distributed.batch_isend_irecv`` each, so a send and a receive of
the same key, to the same peer or not, go out together and cannot block each other).

A key is ``(iteration, at_ms, seq)``: the transfer iteration of the send, its planned start within
the iteration in whole milliseconds (:data:`AT_END_MS` for "after the optimizer step", which happens
before the iteration's timed sends: the transfer's iteration 0 starts right after the optimizer
step that starts the transfer), and ``seq`` numbering the sender's sends that share both (so a rank
sends at most one chunk per key). The sender computes its keys (:func:`send_keys`) and ships them in
the chunk table; the receiver takes them from there. Keys are totally ordered and the same at both
ends, so by induction over the keys no rank can wait for an operation its peer issues after one that
waits for it: the plan cannot deadlock, on NCCL or on gloo. Two peers whose plans put a chunk in the
same millisecond exchange them in one batch (both directions at once); otherwise one after the other.

A transfer is released to the executor in pieces, each "every planned chunk with a key below a bound"
(:func:`release_bound`): at its start (the after-the-optimizer-step sends of iteration 0), at the
start of each of its iterations (that iteration's sends), and when it is finished early (the rest).
Every rank releases the same bounds in the same order, so each executes its plan in key order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

SEND, RECV = "send", "recv"
Key = tuple  # (iteration, at_ms, seq): see the module docstring
AT_END_MS = -1  # a send "after the optimizer step" sorts before the iteration's timed sends
END_BOUND: Key = (math.inf, math.inf, math.inf)  # above every key: the whole rest of a transfer
TIMEOUT_FLOOR_S = 60.0
TIMEOUT_CHUNKS = 10.0


def send_keys(sends: Sequence[tuple[int, float]]) -> list[Key]:
    """The key of each send, given as ``(iteration, at)`` in schedule order (``at`` in seconds,
    ``math.inf`` for after the optimizer step).

    >>> send_keys([(0, 0.0), (0, 0.0004), (0, 1.5), (0, math.inf), (0, math.inf), (1, 0.0)])
    [(0, 0, 0), (0, 0, 1), (0, 1500, 0), (0, -1, 0), (0, -1, 1), (1, 0, 0)]
    """
    seen: dict[tuple[int, int], int] = {}
    out = []
    for iteration, at in sends:
        ms = AT_END_MS if math.isinf(at) else int(math.floor(at * 1000.0))
        if ms < AT_END_MS:
            raise ValueError(f"a send at {at} s: a planned start is >= 0 or after the optimizer step")
        seq = seen.get((iteration, ms), 0)
        seen[(iteration, ms)] = seq + 1
        out.append((int(iteration), ms, seq))
    return out


def release_bound(iteration: Optional[int]) -> Key:
    """The bound released at the start of a transfer (``None``: its iteration 0's sends after the
    optimizer step) or at the start of its iteration ``i`` (everything of iteration ``i``).

    >>> [k < release_bound(None) for k in [(0, -1, 5), (0, 0, 0)]]
    [True, False]
    >>> [k < release_bound(0) for k in [(0, 0, 0), (0, 9999, 3), (1, -1, 0)]]
    [True, True, False]
    """
    return (0, 0, 0) if iteration is None else (iteration + 1, AT_END_MS, 0)


@dataclass(frozen=True)
class Planned:
    """One chunk of a transfer as this rank executes it: ``peer`` is the receiver of a send or the
    sender of a receive; ``offset`` / ``size`` locate it in the container."""
    key: Key
    peer: int
    direction: str  # SEND | RECV
    offset: int
    size: int


def plan_transfer(own: Iterable[tuple[Key, int, int, int]],
                  incoming: Mapping[int, Iterable[tuple[Key, int, int]]]) -> list[Planned]:
    """This rank's chunks of one transfer, in execution order: its own sends ``(key, dst, offset,
    size)`` and, per source rank, the rows of that source's table ``(key, offset, size)``.

    >>> [(p.key, p.direction, p.peer) for p in plan_transfer(
    ...     [((0, 5, 0), 1, 0, 10), ((0, 0, 0), 1, 10, 10)], {1: [((0, 0, 0), 0, 10), ((0, 2, 0), 10, 10)]})]
    [((0, 0, 0), 'send', 1), ((0, 0, 0), 'recv', 1), ((0, 2, 0), 'recv', 1), ((0, 5, 0), 'send', 1)]
    """
    out = [Planned(tuple(k), dst, SEND, off, size) for k, dst, off, size in own]
    for src in sorted(incoming):
        out.extend(Planned(tuple(k), src, RECV, off, size) for k, off, size in incoming[src])
    seen = set()
    for p in out:
        if (p.key, p.peer, p.direction) in seen:
            raise ValueError(f"two chunks with key {p.key} {p.direction} rank {p.peer}: a sender's keys are unique")
        seen.add((p.key, p.peer, p.direction))
    out.sort(key=lambda p: (p.key, p.direction != SEND, p.peer))
    return out


@dataclass(eq=False)
class Op:
    """One point-to-point operation handed to the executor (the thread that owns the data group).

    ``tensor`` is what goes on the wire (GPU: a device staging buffer); ``host`` the host window it
    is staged from (a send) or copied to (a receive) on the GPU path, None where ``tensor`` is the
    host memory itself (CPU) or a received chunk has nowhere to go. ``due``: the earliest
    ``time.perf_counter()`` to issue it. ``on_done(issued, finished)`` runs on the executor's thread
    once it completed (a failed batch raises on that thread instead: the executor's caller sees it)."""
    peer: int
    direction: str  # SEND | RECV
    tensor: Any
    key: Key = (0, 0, 0)
    due: float = 0.0
    host: Any = None
    on_done: Optional[Callable[[float, float], None]] = None


def batch_p2p(ops: Sequence[Any]) -> list[list[Any]]:
    """The batches in which ``ops`` (anything with a ``key``) are issued, one after the other: sorted
    by key, one batch per key. The sort is stable, so operations of one (peer, direction) keep the
    order they were given in, which is the order both ends must agree on.

    >>> ops = [Op(1, SEND, "s1", (0, 3, 0)), Op(1, SEND, "s0", (0, 0, 0)), Op(1, RECV, "r0", (0, 0, 0)),
    ...        Op(2, RECV, "r1", (0, 7, 0)), Op(1, SEND, "s2", (0, 7, 0))]
    >>> [[o.tensor for o in b] for b in batch_p2p(ops)]  # a send and a receive to rank 1 in one batch
    [['s0', 'r0'], ['s1'], ['r1', 's2']]
    """
    out: list[list[Any]] = []
    for op in sorted(ops, key=lambda o: o.key):
        if out and out[-1][0].key == op.key:
            out[-1].append(op)
        else:
            out.append([op])
    return out


def data_timeout_s(chunk_bytes: int, rate_bytes_s: float, floor_s: float = TIMEOUT_FLOOR_S,
                   chunks: float = TIMEOUT_CHUNKS) -> int:
    """The timeout of the transport's data group: ``max(floor_s, chunks x`` the time the largest chunk
    needs at the planned rate ``)``, rounded up to whole minutes (schedules that differ a little
    share a group). A batch waits for its own chunk and for its peer to reach the same key: the
    peers start each iteration at nearly the same time (training keeps them in step), so the floor
    covers that skew; a larger chunk on a slow link gets ten times its planned time.

    >>> data_timeout_s(64 << 20, 10e9)     # 6.7 ms a chunk: the floor
    60
    >>> data_timeout_s(256 << 20, 100e6)   # 2.7 s a chunk: 27 s, still the floor
    60
    >>> data_timeout_s(1 << 30, 100e6)     # 10.7 s a chunk: 107 s, whole minutes: 120
    120
    """
    if chunk_bytes < 0 or not rate_bytes_s > 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}, rate_bytes_s={rate_bytes_s}: need >= 0 and > 0")
    seconds = max(floor_s, chunks * chunk_bytes / rate_bytes_s)
    return int(math.ceil(seconds / 60.0) * 60)
