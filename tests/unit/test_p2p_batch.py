"""The scheduled transport's p2p order (megatron_ft/transport/p2p_batch.py): keys, batches, the data
group's timeout, and a small model of NCCL's rule for point-to-point operations showing the
planned order cannot block while the transport's former interleaving could.

The model (:func:`run_streams`): each rank issues its batches one after the other on one stream (as
NCCL does for one communicator); an operation completes once its peer's stream has reached the
batch holding the matching operation (the n-th send from a to b matches the n-th receive on b from
a); a batch is done when all its operations are. Large chunks are assumed (no eager buffering). What
only real GPUs show is in tests/gpu/test_scheduled_nccl.py."""
from __future__ import annotations

import math
import random

import pytest

from megatron_ft.schedule.modes import AT_END, plan_sends
from megatron_ft.schedule.spans import IdleSpan, LinkModel
from megatron_ft.transport.p2p_batch import (AT_END_MS, END_BOUND, RECV, SEND, Op, batch_p2p, data_timeout_s,
                                             plan_transfer, release_bound, send_keys)
from megatron_ft.transport.scheduled import schedule_timeout_s


# ---------------------------------------------------------------------------------- the model
def run_streams(streams: dict[int, list[list[tuple[int, str]]]]) -> dict[int, int]:
    """Run every rank's batches ``[(peer, direction), ...]`` under the pair rule; the number of
    batches each rank completed (all of them unless it blocked)."""
    index: dict[tuple, int] = {}  # (rank, peer, direction, n) -> batch index on rank
    for r, batches in streams.items():
        count: dict[tuple, int] = {}
        for b, batch in enumerate(batches):
            for peer, d in batch:
                n = count.get((peer, d), 0)
                count[(peer, d)] = n + 1
                index[(r, peer, d, n)] = b
    at = {r: 0 for r in streams}
    nth: dict[tuple, int] = {}  # (rank, batch, position) -> n of its (peer, direction)
    for r, batches in streams.items():
        count = {}
        for b, batch in enumerate(batches):
            for i, (peer, d) in enumerate(batch):
                nth[(r, b, i)] = count.get((peer, d), 0)
                count[(peer, d)] = nth[(r, b, i)] + 1
    moved = True
    while moved:
        moved = False
        for r, batches in streams.items():
            b = at[r]
            if b >= len(batches):
                continue
            ok = True
            for i, (peer, d) in enumerate(batches[b]):
                other = (peer, r, RECV if d == SEND else SEND, nth[(r, b, i)])
                if index.get(other) is None or at[peer] < index[other]:  # the peer is not there yet
                    ok = False
            if ok:  # every match is in the peer's current batch (or one it already finished)
                at[r] += 1
                moved = True
    return at


def completes(streams) -> bool:
    return run_streams(streams) == {r: len(b) for r, b in streams.items()}


def test_the_model_blocks_two_large_sends_issued_first_and_passes_them_batched():
    # the former transport: a sender thread and a receiver thread per rank, ungrouped, sends first
    assert not completes({0: [[(1, SEND)], [(1, RECV)]], 1: [[(0, SEND)], [(0, RECV)]]})
    # the same operations, one batch each
    assert completes({0: [[(1, SEND), (1, RECV)]], 1: [[(0, RECV), (0, SEND)]]})


def test_draining_whatever_is_pending_can_block_where_keys_cannot():
    """A receive posted as soon as its header arrived, batched with what was pending then, waits for
    a send its peer issues only after a receive that waits for this rank: both stop. Ordered by keys
    (chunk j0 of rank 0 at 0 ms, k1 of rank 1 at 5 ms) the same four operations complete."""
    drained = {0: [[(1, RECV)], [(1, SEND)]],  # rank 0: k1 posted early, then its own j0
               1: [[(0, RECV)], [(0, SEND)]]}  # rank 1: j0 posted early, then its own k1
    assert not completes(drained)
    plans = {0: plan_transfer([((0, 0, 0), 1, 0, 8)], {1: [((0, 5, 0), 0, 8)]}),
             1: plan_transfer([((0, 5, 0), 0, 0, 8)], {0: [((0, 0, 0), 0, 8)]})}
    assert completes({r: [[(o.peer, o.direction) for o in b] for b in batch_p2p(p)] for r, p in plans.items()})


# ---------------------------------------------------------------------------------- keys and batches
def test_batch_p2p_keeps_the_order_per_peer_and_direction_and_pairs_a_send_with_a_receive():
    ops = [Op(1, SEND, "a", (0, 0, 0)), Op(1, RECV, "b", (0, 0, 0)), Op(2, SEND, "c", (0, 3, 0)),
           Op(1, SEND, "d", (0, 3, 0)), Op(1, SEND, "e", (0, 3, 0)), Op(1, RECV, "f", (0, -1, 0))]
    batches = batch_p2p(ops)
    assert [[o.tensor for o in b] for b in batches] == [["f"], ["a", "b"], ["c", "d", "e"]]
    assert [o.tensor for b in batches for o in b if (o.peer, o.direction) == (1, SEND)] == ["a", "d", "e"]
    assert batch_p2p([]) == []


def test_send_keys_are_unique_per_sender_and_put_after_the_optimizer_step_first():
    sends = [(0, math.inf), (0, 0.0), (0, 0.0), (0, 0.0019), (0, math.inf), (1, 0.25), (1, 0.2501)]
    keys = send_keys(sends)
    assert keys == [(0, -1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, -1, 1), (1, 250, 0), (1, 250, 1)]
    assert len(set(keys)) == len(keys)
    with pytest.raises(ValueError):
        send_keys([(0, -0.5)])


def test_the_releases_cut_the_keys_in_order_and_cover_all():
    keys = sorted([(0, AT_END_MS, 0), (0, 0, 0), (0, 7, 2), (1, AT_END_MS, 0), (1, 3, 0), (2, 1, 0)])
    bounds = [release_bound(None), release_bound(0), release_bound(1), release_bound(2), END_BOUND]
    lower, parts = None, []
    for b in bounds:
        parts.append([k for k in keys if (lower is None or k >= lower) and k < b])
        lower = b
    assert parts == [[(0, -1, 0)], [(0, 0, 0), (0, 7, 2)], [(1, -1, 0), (1, 3, 0)], [(2, 1, 0)], []]


def test_plan_transfer_refuses_a_key_twice_for_one_peer_and_direction():
    with pytest.raises(ValueError, match="unique"):
        plan_transfer([((0, 0, 0), 1, 0, 4), ((0, 0, 0), 1, 4, 4)], {})


# ---------------------------------------------------------------------------------- whole transfers
LINK = LinkModel(100.0)
SPANS = [IdleSpan(0, 5), IdleSpan(6, 7), IdleSpan(8, 10)]


def schedule_rows(mode: str, copies: int, nbytes: int, seed: int):
    """(iteration, at, copy, offset, size) of a real plan, its spans shifted a little per rank."""
    shift = random.Random(seed).uniform(0, 0.003)
    spans = [IdleSpan(s.start + shift, s.end + shift) for s in SPANS]
    s = plan_sends(mode, nbytes, copies, LINK, 200, 2, 0.5, spans, spans, spans)
    return [(x.iteration, x.at, x.copy, x.offset, x.size) for x in s.sends], s.interval_iterations


def executed(ranks: dict[int, tuple], dsts: dict[int, list[int]]):
    """Each rank's batches over one transfer, released as the transport releases them: per rank
    ``(rows, interval)`` of its schedule; ``dsts[r]``: its receivers by copy."""
    srcs = {r: [s for s in ranks if r in dsts[s]] for r in ranks}
    tables = {}
    own = {}
    for r, (rows, _) in ranks.items():
        keys = send_keys([(it, at) for it, at, *_ in rows])
        own[r] = [(k, dsts[r][c], off, size) for k, (_, _, c, off, size) in zip(keys, rows)]
        for c, d in enumerate(dsts[r]):
            tables[(r, d)] = [(k, off, size) for k, (_, _, cc, off, size) in zip(keys, rows) if cc == c]
    n = max(interval for _, interval in ranks.values())
    streams, data = {}, {}
    for r in ranks:
        plan = plan_transfer(own[r], {s: tables[(s, r)] for s in srcs[r]})
        bounds = [release_bound(None)] + [release_bound(i) for i in range(n)] + [END_BOUND]
        out, cursor = [], 0
        for b in bounds:
            todo = []
            while cursor < len(plan) and plan[cursor].key < b:
                todo.append(plan[cursor])
                cursor += 1
            out.extend(batch_p2p(todo))
        assert cursor == len(plan)
        streams[r] = [[(p.peer, p.direction) for p in batch] for batch in out]
        data[r] = [(p.peer, p.direction, p.offset, p.size) for batch in out for p in batch]
    return streams, data


def matched_chunks_agree(data) -> bool:
    """The n-th chunk a sends b is the n-th chunk b receives from a (same offset and size)."""
    for a, ops in data.items():
        for b in data:
            sent = [(o, s) for p, d, o, s in ops if (p, d) == (b, SEND)]
            got = [(o, s) for p, d, o, s in data[b] if (p, d) == (a, RECV)]
            if sent != got:
                return False
    return True


@pytest.mark.parametrize("modes", [("pipelined", "pipelined"), ("end", "end"), ("blocking", "naive"),
                                   ("end", "pipelined"), ("bubble", "one-buffer")])
def test_two_ranks_that_copy_to_each_other_never_block(modes):
    ranks = {r: schedule_rows(m, 1, 300, seed=r) for r, m in enumerate(modes)}
    streams, data = executed(ranks, {0: [1], 1: [0]})
    assert completes(streams) and matched_chunks_agree(data)


def test_equal_plans_exchange_each_chunk_pair_in_one_batch():
    rows, n = schedule_rows("end", 1, 300, seed=0)
    streams, _ = executed({0: (rows, n), 1: (rows, n)}, {0: [1], 1: [0]})
    assert streams[0] == [[(1, SEND), (1, RECV)]] * len(rows) and completes(streams)


def test_random_rings_and_three_copies_never_block():
    rnd = random.Random(7)
    for trial in range(200):
        world = rnd.choice([2, 3, 4])
        copies = 1 if world == 2 else rnd.choice([1, 2])
        dsts = {r: [(r + 1 + c) % world for c in range(copies)] for r in range(world)}
        ranks = {}
        for r in range(world):
            rows = []
            for c in range(copies):
                for j in range(rnd.randint(1, 5)):
                    at = AT_END if rnd.random() < 0.2 else rnd.choice([0.0, 0.001, 0.5, rnd.uniform(0, 3)])
                    rows.append((rnd.randint(0, 2), at, c, j * 10, 10))
            ranks[r] = (rows, 3)
        streams, data = executed(ranks, dsts)
        assert completes(streams), (trial, ranks, dsts)
        assert matched_chunks_agree(data), (trial, ranks)


# ---------------------------------------------------------------------------------- timeouts
def test_data_timeout_is_a_minute_unless_a_chunk_needs_more_than_six_seconds():
    assert data_timeout_s(0, 1e9) == 60
    assert data_timeout_s(600_000_000, 100e6) == 60  # 6 s a chunk: exactly the floor
    assert data_timeout_s(600_000_001, 100e6) == 120
    assert data_timeout_s(1 << 30, 1e6) == 10740  # 1074 s a chunk: ten times, whole minutes up
    assert data_timeout_s(1, 1e9, floor_s=5, chunks=2) == 60  # rounded up to a minute
    with pytest.raises(ValueError):
        data_timeout_s(1, 0.0)


def test_schedule_timeout_uses_the_largest_chunk_at_the_planned_rate():
    slow = plan_sends("end", 6_000, 1, LinkModel(10.0), 4_000, 2)  # 2000 B chunks at 10 B/s: 200 s each
    assert schedule_timeout_s(slow) == 2040  # 10 x 200 s, whole minutes up
    fast = plan_sends("pipelined", 300, 1, LINK, 200, 2, 0.5, SPANS)
    assert schedule_timeout_s(fast) == 60
    with_alpha = plan_sends("end", 6_000, 1, LinkModel(10.0, alpha_s=100.0), 4_000, 2)  # 300 s a chunk planned
    assert schedule_timeout_s(with_alpha) == 3000
