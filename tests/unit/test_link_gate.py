"""The link gate of the scheduled transport (megatron_ft/schedule/link_gate.py) and what the planners
take from a profile about the link: when training's bytes are on it, when a chunk may go, the
windows per idle span, how a plan is cut and spread for the gate. Pure and fast; expected values
are worked by hand in the comments."""
import math

import pytest

from megatron_ft.config import ConfigError
from megatron_ft.megatron.scheduled import planning_spans
from megatron_ft.schedule.link_gate import (LinkGate, capacity_s, chunk_limit, gaps_after_calls,
                                            position_windows, training_calls)
from megatron_ft.schedule.modes import Send, SendSchedule, gated, plan_sends
from megatron_ft.schedule.spans import Event, IdleSpan, LinkModel, network_idle_spans
from megatron_ft.transport.p2p_batch import send_keys

LINK = LinkModel(100.0)  # 100 B/s: 50 B take 0.5 s


def _pairs(spans):
    return [(round(s.start, 9), round(s.end, 9)) for s in spans]


def test_a_send_holds_the_link_until_its_bytes_are_off_it():
    # a 50 B send returns after 0.1 s (buffered) but its bytes take 0.5 s: the link is busy [1, 1.5)
    ev = [Event("send", 1.0, 1.1, 50), Event("compute", 1.1, 3.0), Event("recv", 3.0, 3.1, 50)]
    assert _pairs(network_idle_spans(ev, 4.0)) == [(0, 1), (1.1, 3), (3.1, 4)]  # as recorded
    # with the link: the send to 1.5, the receive's bytes arrived from 2.6 (its end minus 0.5 s)
    assert _pairs(network_idle_spans(ev, 4.0, LINK)) == [(0, 1), (1.5, 2.6), (3.1, 4)]
    # a collective's recorded time covers its bytes (its buffer's size is not what crossed the link)
    assert _pairs(network_idle_spans([Event("collective", 1.0, 1.2, 10_000)], 2.0, LINK)) == [(0, 1), (1.2, 2)]


def test_a_link_training_saturates_leaves_no_idle_time_and_the_plan_does_not_fit():
    # 8 sends of 50 B every 0.5 s at 100 B/s: the link is never idle although each call is short
    ev = [Event("send", 0.5 * k, 0.5 * k + 0.01, 50) for k in range(8)]
    assert network_idle_spans(ev, 4.0, LINK) == ()
    spans = planning_spans((), profiled=True, iteration_s=4.0)
    assert spans == (IdleSpan(4.0, 4.0),)  # none at all, not the whole iteration
    plan = plan_sends("pipelined", 1000, 1, LINK, 400, 4, 0.9, spans)
    assert not plan.fits and plan.interval_iterations == 64  # the longest plan, everything at its end
    # only a profile that could not be read stands for one idle iteration
    assert planning_spans((), profiled=False, iteration_s=4.0) == (IdleSpan(0.0, 4.0),)


def test_the_gate_waits_for_training_to_free_the_link_and_for_a_chunk_to_fit_its_window():
    gate = LinkGate(bandwidth=100.0, window_s=0.0, quiet_s=10.0, slack_s=0.0)
    assert gate.earliest(0.0, 10) == 0.0  # training never used the link: it is quiet
    gate.begin(1.0)
    assert gate.earliest(1.05, 10) is None  # a call of training runs
    gate.end(1.0, 1.1, 50, window_s=0.5)  # its bytes are off at 1.5; the span after it: 0.5 s
    assert gate.earliest(1.2, 20) == 1.5  # 0.2 s, in the window
    gate.sent(1.5, 20)  # on the link until 1.7
    assert gate.earliest(1.6, 20) == 1.7  # after the first chunk, ends at 1.9 <= 2.0
    gate.sent(1.7, 20)
    # would end at 2.1 > 2.0: not before training's next call, or 10 s of quiet after 1.5
    assert gate.earliest(1.9, 20) == 11.5
    gate.begin(2.5)
    gate.end(2.5, 2.6, 0, window_s=0.05)  # a short span: 0.05 s
    assert gate.earliest(2.6, 20) == 2.6  # a chunk longer than the window goes only as training frees the link
    assert gate.earliest(2.7, 20) == 12.6  # then only once the link is quiet
    gate.sent(12.6, 20)
    assert gate.earliest(12.61, 20) == pytest.approx(12.8)  # quiet: chunk after chunk, each once the last is off the link


def test_the_gate_lets_a_late_sender_through_within_its_slack():
    gate = LinkGate(bandwidth=100.0, window_s=0.2, quiet_s=10.0, slack_s=0.05)
    gate.end(0.0, 1.0, 0)
    assert gate.earliest(1.04, 20) == 1.04  # ends 1.24 <= 1.0 + 0.2 + 0.05
    assert gate.earliest(1.06, 20) == 11.0  # past the slack: not before the link is quiet


def _iteration(start, calls, end):
    return {"start": start, "end": end, "events": [
        {"src": "p2p", "kind": kind, "start": a, "end": b, "bytes": n} for a, b, n, kind in calls]}


def test_windows_per_idle_span_come_from_the_same_call_of_every_iteration():
    # two iterations of 4 s, calls at 1.0 and 2.0 (50 B sent: 0.5 s on the link); the second
    # iteration's second call is 0.2 s later. Spans after call 0: 2.0 - 1.5 = 0.5, 2.2 - 1.5 = 0.7;
    # after call 1: (4 + 1.0) - 2.5 = 2.5, and in the last iteration to its end: 8 - 2.7 = 1.3
    its = [_iteration(0.0, [(1.0, 1.1, 50, "send"), (2.0, 2.1, 50, "send")], 4.0),
           _iteration(4.0, [(1.0, 1.1, 50, "send"), (2.2, 2.3, 50, "send")], 8.0)]
    gaps = gaps_after_calls(its, LINK)
    assert [[round(g, 6) for g in it] for it in gaps] == [[0.5, 2.5], [0.7, 1.3]]
    assert position_windows(gaps, 0.5) == (0.25, 0.65)  # mu times the shortest at each position
    # an iteration with another number of calls does not line up: left out
    assert position_windows(gaps + [[0.01]], 0.5) == (0.25, 0.65)
    assert position_windows([], 0.5) == ()
    with pytest.raises(ConfigError, match="mu"):
        position_windows(gaps, 1.5)


def test_a_call_is_one_record_per_interval_and_only_the_hooks_calls_count():
    calls = training_calls([
        {"src": "p2p", "kind": "send", "start": 1.0, "end": 2.0, "bytes": 30},  # send_next and recv_next:
        {"src": "p2p", "kind": "recv", "start": 1.0, "end": 2.0, "bytes": 40},  # one call, 30 B sent
        {"src": "timer", "kind": "collective", "start": 3.0, "end": 3.1, "bytes": 0},  # not a hooked call
        {"src": "ddp", "kind": "collective", "start": 4.0, "end": 4.5, "bytes": 99}])
    assert calls == [(1.0, 2.0, 30), (4.0, 4.5, 0)]


def test_chunks_are_half_a_typical_window_and_the_capacity_counts_whole_chunks():
    link = LinkModel(25e6)
    assert chunk_limit(0.010, link) == 125_000
    assert chunk_limit(0.0001, link) == 64 << 10  # never below the floor
    # chunks of 5 ms: windows 10, 4, 25 ms take 2, 0 and 5 of them
    assert capacity_s([0.010, 0.004, 0.025], 0.005) == 0.035
    assert capacity_s([0.01], 0.0) == 0.0


def _plan(n_sends=3, size=300_000, interval=1):
    sends = tuple(Send(0, i % interval, 0.01 * i, i * size, size, i % 2) for i in range(n_sends))
    return SendSchedule("pipelined", sends, 2, size, interval, False, 0.1, True)


def test_gating_cuts_every_send_and_keeps_the_keys_unique():
    g = gated(_plan(), 0.008, LinkModel(25e6))  # chunks of 100 kB
    assert g.gate_window_s == 0.008 and len(g.sends) == 9
    assert [s.offset for s in g.sends] == list(range(0, 900_000, 100_000))  # contiguous, in order
    assert {s.size for s in g.sends} == {100_000}
    keys = send_keys([(s.iteration, s.at) for s in g.sends])
    assert len(set(keys)) == len(keys)  # pieces of one send: the same time, numbered by seq
    assert g.to_dict()["gate_window_s"] == 0.008


def test_gating_spreads_a_transfer_the_windows_cannot_carry_in_its_interval():
    link = LinkModel(25e6)
    # 900 kB = 36 ms of link; the gate gives 10 ms an iteration: 4 iterations, a quarter each
    g = gated(_plan(), 0.008, link, capacity_s=0.010)
    assert g.interval_iterations == 4
    assert [s.iteration for s in g.sends] == [0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert sum(s.size for s in g.sends) == 900_000
    # enough capacity: the plan's own interval stays
    assert gated(_plan(), 0.008, link, capacity_s=1.0).interval_iterations == 1
    # at most MAX_ITERATIONS
    assert gated(_plan(), 0.008, link, capacity_s=1e-5).interval_iterations == 64


def test_schedules_where_training_waits_and_a_zero_window_are_not_gated():
    blocking = plan_sends("blocking", 1000, 1, LINK, 400, 4)
    assert gated(blocking, 0.5, LINK) is blocking
    plan = _plan()
    assert gated(plan, 0.0, LINK) is plan
    assert math.isclose(gated(plan, 0.008, LinkModel(25e6)).planned_transfer_s, 900_000 / 25e6)


def test_the_sender_is_woken_only_by_a_call_that_lets_its_chunk_go():
    """GateClock (the gate on the clock, two threads): training's calls whose windows a waiting chunk
    does not fit leave the sender asleep (a wake-up is a thread switch on a core training may need);
    the call that opens a window it fits wakes it at once. Timing-free: the quiet time (10 s) is far
    beyond the test, so the sender never wakes by itself."""
    import threading
    import time

    from megatron_ft.transport.scheduled import GateClock

    clock = GateClock(bandwidth=1e6, quiet_s=10.0, max_wait_s=20.0)  # a 100 kB chunk: 0.1 s on the wire
    clock.gate.sent(time.perf_counter(), 500_000)  # the chunks before it hold the link for 0.5 s more
    clock.begin()  # training is on the link when the sender starts to wait
    sent = threading.Event()
    sender = threading.Thread(target=lambda: (clock.wait(100_000), sent.set()), daemon=True)
    sender.start()
    deadline = time.monotonic() + 10
    while clock._waiting is None and time.monotonic() < deadline:
        time.sleep(0.001)
    start = time.perf_counter()
    clock.end(start, 0, window_s=0.001)  # 1 ms windows: behind the earlier chunks it never fits one
    for _ in range(49):  # a call every 2 ms: time enough for a woken sender to run between them
        time.sleep(0.002)
        clock.begin()
        clock.end(time.perf_counter(), 0, window_s=0.001)
    time.sleep(0.05)
    assert not sent.is_set() and clock.wakeups <= 1, clock.wakeups  # the first end(): its own wake time
    clock.begin()
    clock.end(time.perf_counter(), 0, window_s=2.0)  # a window of 2 s: it goes once the earlier chunks are off
    assert sent.wait(5.0) and clock.wakeups <= 3 and clock.forced == 0, (clock.wakeups, clock.forced)
