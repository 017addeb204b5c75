"""Checkpoint-traffic planners: GEMINI Algorithm 2, BAFT Algorithms 1 and 2, span
and bubble derivation. Pure and fast. Expected values are worked by hand in the comments."""
import itertools
import math
import random

import pytest

from megatron_ft.schedule.baft import (best_layers, plan_pipeline, plan_stage, plan_transfer,
                                       shared_bubbles)
from megatron_ft.schedule.gemini import checkpoint_partition, fitting_interval
from megatron_ft.schedule.spans import (Event, IdleSpan, LinkModel, TimelineSummary, average_spans,
                                        network_idle_spans, pipeline_bubbles, summarize_iteration,
                                        summarize_profile)

# ------------------------------------------------------------------------------- spans and bubbles

# one rank, one iteration (module docstring of spans.py)
EVENTS = [Event("compute", 0, 2), Event("send", 2, 2.5, 50), Event("recv", 2.5, 5, 50),
          Event("compute", 5, 8), Event("collective", 8, 9, 1000), Event("optimizer", 9, 10)]


def _pairs(spans):
    return [(round(s.start, 9), round(s.end, 9)) for s in spans]


def test_network_idle_spans_are_the_gaps_between_communications():
    # communication covers [2, 2.5) u [2.5, 5) = [2, 5) and [8, 9); the rest of [0, 10) is idle
    assert _pairs(network_idle_spans(EVENTS)) == [(0, 2), (5, 8), (9, 10)]
    # an explicit, later iteration end leaves a trailing span [10, 12)
    assert _pairs(network_idle_spans(EVENTS, 12.0))[-1] == (9, 12)


def test_bubble_reserves_regular_traffic_at_both_ends():
    # the device waits in [2, 5); the send (middle 2.25 < 3.5) reserves 50/100 = 0.5 s at the start,
    # the receive (middle 3.75) 0.5 s at the end
    assert _pairs(pipeline_bubbles(EVENTS, LinkModel(100.0))) == [(2.5, 4.5)]
    # at 25 B/s each reservation is 2 s: 2 + 2 > 3, nothing is left
    assert pipeline_bubbles(EVENTS, LinkModel(25.0)) == ()
    # with alpha = 0.25 s each reservation is 0.75 s: [2.75, 4.25)
    assert _pairs(pipeline_bubbles(EVENTS, LinkModel(100.0, 0.25))) == [(2.75, 4.25)]


def test_summary_over_iterations_has_mean_and_variance():
    link = LinkModel(100.0)
    one = summarize_iteration(3, EVENTS, link)
    assert one.iteration_s == 10 and _pairs(one.bubbles) == [(2.5, 4.5)]
    # iteration 2: everything after the backward pass 0.2 s later: idle span 1 is [5, 8.2) (length
    # 3.2 vs 3.0: mean 3.1, variance 0.01), the iteration 10.2 s (mean 10.1, variance 0.01)
    late = [Event(e.kind, e.start + (0.2 if e.start >= 8 else 0), e.end + (0.2 if e.end >= 8 else 0), e.bytes)
            for e in EVENTS]
    late[3] = Event("compute", 5, 8.2)
    prof = summarize_profile([one, summarize_iteration(3, late, link)])
    assert prof.iterations == 2 and prof.iteration_s == pytest.approx(10.1)
    assert prof.iteration_variance == pytest.approx(0.01)
    span = prof.idle_spans[1]
    assert (span.start, span.end, span.variance) == pytest.approx((5, 8.1, 0.01))
    assert prof.idle_spans[0].variance == 0


def test_average_spans_names_the_iteration_that_differs():
    with pytest.raises(ValueError, match=r"spans\[1\]=.*1 spans.*same number of spans as iteration 0 \(2\)"):
        average_spans([[IdleSpan(0, 1), IdleSpan(2, 3)], [IdleSpan(0, 1)]])


# ------------------------------------------------------------------------------- GEMINI Algorithm 2

LINK = LinkModel(bandwidth=100.0, alpha_s=0.1)  # f(s) = 0.1 + s/100; f(100) = 1.1 s
SPANS = [IdleSpan(0, 5), IdleSpan(6, 7), IdleSpan(8, 10)]  # lengths 5, 1, 2 s


def _chunks(plan):
    return [(c.copy, c.iteration, c.span, c.offset, c.size, c.buffer) for c in plan.chunks]


def test_gemini_hand_example():
    # R = 200, p = 2 -> R/p = 100; mu = 0.5; C = 300; m = 2 (one remote copy)
    plan = checkpoint_partition(SPANS, 300, 2, 200, 2, LINK, mu=0.5)
    # span 0: remain 2.5 s -> 100 (1.4 left), 100 (0.3 left), floor((0.3 - 0.1) * 100) = 20 (0 left)
    # span 1: remain 0.5 s -> floor(0.4 * 100) = 40;  span 2 (unbounded): the remaining 40
    assert _chunks(plan) == [(0, 0, 0, 0, 100, 0), (0, 0, 0, 100, 100, 1), (0, 0, 0, 200, 20, 0),
                             (0, 0, 1, 220, 40, 1), (0, 0, 2, 260, 40, 0)]
    # times: 1.1 + 1.1 + 0.3 in span 0 (ends at 2.5 = mu * 5), 0.5 from 6, 0.5 from 8
    assert [(round(c.start, 9), round(c.end, 9)) for c in plan.chunks] == [
        (0, 1.1), (1.1, 2.2), (2.2, 2.5), (6, 6.5), (8, 8.5)]
    assert plan.transfer_s == pytest.approx(3.5)
    assert plan.fits and plan.overflow_s == 0 and plan.stall_s == 0 and plan.interval_iterations == 1


def test_gemini_second_copy_overflows_the_last_span_or_spreads_over_two_iterations():
    # m = 3: copy 1 (300 B) goes into the unbounded last span as 100, 100, 100 after copy 0's 40:
    # 0.5 + 3.3 = 3.8 s there, 3.8 - mu*2 = 2.8 s beyond the budget, 3.8 - 2 = 1.8 s beyond the span
    plan = checkpoint_partition(SPANS, 300, 3, 200, 2, LINK, mu=0.5)
    assert [(c.copy, c.span, c.size) for c in plan.chunks][-4:] == [(0, 2, 40), (1, 2, 100), (1, 2, 100), (1, 2, 100)]
    assert plan.overflow_s == pytest.approx(2.8) and plan.stall_s == pytest.approx(1.8) and not plan.fits
    # two iterations: the first's last span is now bounded at mu*2 = 1 s: 40 (0.5 s) ends copy 0, then
    # floor((0.5 - 0.1) * 100) = 40 of copy 1; iteration 1: 100, 100, 20 | 40 -> copy 1 done in span 1
    best = fitting_interval(SPANS, 300, 3, 200, 2, LINK, mu=0.5)
    assert best.iterations == 2 and best.interval_iterations == 2 and best.fits
    assert [(c.copy, c.iteration, c.span, c.offset, c.size) for c in best.chunks][4:] == [
        (0, 0, 2, 260, 40), (1, 0, 2, 0, 40), (1, 1, 0, 40, 100), (1, 1, 0, 140, 100), (1, 1, 0, 240, 20),
        (1, 1, 1, 260, 40)]


def test_gemini_single_replica_sends_nothing_and_short_spans_are_skipped():
    assert checkpoint_partition(SPANS, 300, 1, 200, 2, LINK).chunks == ()
    # mu * 1 s = 0.05 s <= alpha: the literal loop would spin; the span is skipped instead
    plan = checkpoint_partition([IdleSpan(0, 0.1), IdleSpan(1, 2)], 50, 2, 200, 2, LINK, mu=0.5)
    assert [(c.span, c.size) for c in plan.chunks] == [(1, 50)]


@pytest.mark.parametrize("seed", range(40))
def test_gemini_properties(seed):
    rng = random.Random(seed)
    spans, t = [], 0.0
    for _ in range(rng.randint(1, 6)):
        t += rng.uniform(0, 1)
        spans.append(IdleSpan(t, t + rng.uniform(0, 3)))
        t = spans[-1].end
    link = LinkModel(rng.choice([50.0, 100.0, 1000.0]), rng.choice([0.0, 0.01, 0.2]))
    p = rng.randint(1, 4)
    reserved = rng.randint(p, 600)
    size, replicas, mu = rng.randint(1, 2000), rng.randint(1, 4), rng.uniform(0.1, 1.0)
    iterations = rng.randint(1, 3)
    plan = checkpoint_partition(spans, size, replicas, reserved, p, link, mu, iterations)
    last = (iterations - 1, len(spans) - 1)
    # every byte of every remote copy, once, in order
    for copy in range(replicas - 1):
        mine = [c for c in plan.chunks if c.copy == copy]
        assert [c.offset for c in mine] == list(itertools.accumulate([0] + [c.size for c in mine]))[:-1]
        assert sum(c.size for c in mine) == size
    assert {c.copy for c in plan.chunks} == set(range(replicas - 1))
    assert plan.total_bytes == size * (replicas - 1)
    for i, c in enumerate(plan.chunks):
        assert 1 <= c.size <= reserved // p  # never larger than a sub-buffer
        assert c.buffer == i % p  # rotating sub-buffers
        assert c.end - c.start == pytest.approx(link.time(c.size))
        span = spans[c.span]
        assert c.start >= span.start - 1e-9
        if (c.iteration, c.span) != last:  # within mu * span, except the unbounded last span
            assert c.end <= span.start + mu * span.length + 1e-6
    for it in range(iterations):
        for k in range(len(spans)):
            if (it, k) != last:
                assert plan.used_s(it, k) <= mu * spans[k].length + 1e-6
    assert plan.fits == (plan.used_s(*last) <= mu * spans[-1].length + 1e-9)


# ------------------------------------------------------------------------------- BAFT

SENDER = [IdleSpan(1, 3), IdleSpan(6, 7), IdleSpan(9, 10)]
RECEIVER = [IdleSpan(0, 2), IdleSpan(5, 8), IdleSpan(9.5, 12)]
LAYERS = [70, 50, 40, 40, 30, 30, 30, 60, 80, 70, 50, 50]  # 600 B


def test_baft_algorithm1_spills_into_following_iterations():
    link = LinkModel(100.0)
    # shared: [1, 2), [6, 7), [9.5, 10) -> 100, 100, 50 B
    assert _pairs(shared_bubbles(SENDER, RECEIVER)) == [(1, 2), (6, 7), (9.5, 10)]
    plan = plan_transfer(SENDER, RECEIVER, 600, link)
    # m = 100, 200, 250 | 350, 450, 500 | 600: 7 slots, n = 3
    assert [(s.iteration, s.bubble, s.capacity) for s in plan.slots] == [
        (0, 0, 100), (0, 1, 100), (0, 2, 50), (1, 0, 100), (1, 1, 100), (1, 2, 50), (2, 0, 100)]
    assert plan.interval_iterations == 3 and plan.send_plan == plan.recv_plan == plan.slots
    assert plan_transfer(SENDER, RECEIVER, 250, link).interval_iterations == 1  # exactly one iteration
    assert plan_transfer(SENDER, RECEIVER, 251, link).interval_iterations == 2


def test_baft_hand_example():
    plan = plan_stage(SENDER, RECEIVER, LAYERS, LinkModel(100.0))
    # slot 1 {0,4}=70+30; slot 2 {1,10}=50+50; slot 3 {11}=50; slot 4 {2,5,6}=40+30+30 (before {2,7});
    # slot 5 {3,7}=40+60; slot 6: 80 and 70 left, neither fits 50; slot 7 {8}=80; then one more
    # bubble (iteration 2, bubble 1) for layer 9
    assert [(a.slot.iteration, a.slot.bubble, a.layers, a.bytes) for a in plan.assignments] == [
        (0, 0, (0, 4), 100), (0, 1, (1, 10), 100), (0, 2, (11,), 50), (1, 0, (2, 5, 6), 100),
        (1, 1, (3, 7), 100), (1, 2, (), 0), (2, 0, (8,), 80), (2, 1, (9,), 70)]
    assert plan.fluid_interval_iterations == 3 and plan.interval_iterations == 3
    # every layer exactly once
    assert sorted(i for a in plan.assignments for i in a.layers) == list(range(len(LAYERS)))


def _brute_best(sizes, cap):
    best = ()
    for r in range(len(sizes) + 1):
        for combo in itertools.combinations(range(len(sizes)), r):
            tot = sum(sizes[i] for i in combo)
            if tot <= cap and (tot > sum(sizes[i] for i in best) or tot == sum(sizes[i] for i in best) and combo < best):
                best = combo
    return best


@pytest.mark.parametrize("seed", range(60))
def test_baft_dp_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    sizes = [rng.randint(1, 40) for _ in range(rng.randint(0, 9))]
    cap = rng.randint(0, 120)
    got = best_layers(sizes, cap)
    want = _brute_best(sizes, cap)
    assert sum(sizes[i] for i in got) <= cap
    assert sum(sizes[i] for i in got) == sum(sizes[i] for i in want)
    assert got == want  # same tie-break: the earliest layers


def test_baft_dp_granularity_stays_feasible():
    # g = 10: 45 -> 5 units, 55 -> 6, capacity 100 -> 10 units: {45, 55} (11 units) no longer fits,
    # 45 alone (5) or 55 alone (6) -> 55; exact (g = 1) would take both
    assert best_layers([45, 55], 100) == (0, 1)
    assert best_layers([45, 55], 100, granularity=10) == (1,)


def test_baft_pipeline_ring_and_interval():
    link = LinkModel(100.0)
    # 3 stages; stage 0 -> stage 2 (ring), 1 -> 0, 2 -> 1. All share [0, 1) each iteration (100 B).
    bubbles = [[IdleSpan(0, 1)], [IdleSpan(0, 1), IdleSpan(4, 5)], [IdleSpan(0, 2)]]
    plan = plan_pipeline(bubbles, [[100], [60, 60, 60], [100, 100]], link)
    assert [(s.transfer.sender, s.transfer.receiver) for s in plan.stages] == [(0, 2), (1, 0), (2, 1)]
    # stage 1 and 0 share only [0, 1): 60 per iteration -> 3 iterations; stage 2 and 1 share [0, 1)
    # (100 B) -> 2 iterations; stage 0 and 2 share [0, 1) -> 1
    assert [s.interval_iterations for s in plan.stages] == [1, 3, 2]
    assert plan.interval_iterations == 3


# ------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("make, field, value", [
    (lambda: IdleSpan(-1.0, 2.0), "span.start", "-1.0"),
    (lambda: IdleSpan(3.0, 2.0), "span.end", "2.0"),
    (lambda: IdleSpan(0.0, math.inf), "span.end", "inf"),
    (lambda: IdleSpan(0.0, 1.0, -0.5), "span.variance", "-0.5"),
    (lambda: LinkModel(0.0), "link.bandwidth", "0.0"),
    (lambda: LinkModel(-5.0), "link.bandwidth", "-5.0"),
    (lambda: LinkModel(10.0, -0.1), "link.alpha_s", "-0.1"),
    (lambda: Event("sleep", 0, 1), "event.kind", "'sleep'"),
    (lambda: Event("send", 0, 1, -1), "event.bytes", "-1"),
    (lambda: checkpoint_partition(SPANS, 300, 2, 200, 0, LINK), "sub_buffers", "0"),
    (lambda: checkpoint_partition(SPANS, 300, 2, 200, 2, LINK, mu=0.0), "mu", "0.0"),
    (lambda: checkpoint_partition(SPANS, 300, 2, 200, 2, LINK, mu=1.5), "mu", "1.5"),
    (lambda: checkpoint_partition(SPANS, 0, 2, 200, 2, LINK), "checkpoint_bytes", "0"),
    (lambda: checkpoint_partition(SPANS, 300, 0, 200, 2, LINK), "replicas", "0"),
    (lambda: checkpoint_partition(SPANS, 300, 2, 1, 2, LINK), "reserved_bytes", "1"),
    (lambda: checkpoint_partition([], 300, 2, 200, 2, LINK), "spans", r"\[\]"),
    (lambda: checkpoint_partition([IdleSpan(2, 3), IdleSpan(1, 4)], 30, 2, 200, 2, LINK), r"spans\[1\].start", "1"),
    (lambda: plan_stage(SENDER, RECEIVER, [70, 0], LinkModel(100.0)), r"layer_bytes\[1\]", "0"),
    (lambda: plan_stage(SENDER, RECEIVER, [101], LinkModel(100.0)), r"layer_bytes\[0\]", "101"),
    (lambda: plan_transfer([IdleSpan(0, 1)], [IdleSpan(2, 3)], 10, LinkModel(100.0)), "bubbles", r"\[\]"),
    (lambda: plan_pipeline([[IdleSpan(0, 1)]], [[1]], LinkModel(100.0)), "stages", "1"),
])
def test_bad_inputs_name_field_value_and_what_is_allowed(make, field, value):
    with pytest.raises(ValueError, match=rf"^{field}={value} is invalid: (must|the|do|too)"):
        make()


def test_timeline_spans_must_end_within_the_iteration():
    with pytest.raises(ValueError, match=r"timeline.bubbles=.* must end by timeline.iteration_s=1.0"):
        TimelineSummary(0, 1.0, (), (IdleSpan(0, 2),))
