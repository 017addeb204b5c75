"""The scheduled transport's send schedules (megatron_ft/schedule/modes.py): the worked example of
the module docstring, mode by mode, and the invariants every schedule keeps."""
import math

import pytest

from megatron_ft.config import ConfigError
from megatron_ft.schedule.modes import AT_END, MODES, free_share_of_waits, idle_spans, plan_sends, plan_sends_every
from megatron_ft.schedule.spans import IdleSpan, LinkModel

LINK = LinkModel(100.0)
SPANS = [IdleSpan(0, 5), IdleSpan(6, 7), IdleSpan(8, 10)]


def table(s):
    return [(x.iteration, x.at, x.offset, x.size, x.buffer) for x in s.sends]


def test_pipelined_uses_p_sub_buffers_of_r_over_p():
    s = plan_sends("pipelined", 300, 1, LINK, 200, 2, 0.5, SPANS)
    assert table(s) == [(0, 0, 0, 100, 0), (0, 1.0, 100, 100, 1), (0, 2.0, 200, 50, 0), (0, 6, 250, 50, 1)]
    assert (s.buffers, s.buffer_bytes, s.memory_bytes, s.interval_iterations, s.blocking, s.fits) == \
        (2, 100, 200, 1, False, True)
    assert s.planned_transfer_s == pytest.approx(3.0)


def test_one_buffer_sends_chunks_of_r_through_one_buffer():
    s = plan_sends("one-buffer", 300, 1, LINK, 200, 2, 0.5, SPANS)
    assert table(s) == [(0, 0, 0, 200, 0), (0, 2.0, 200, 50, 0), (0, 6, 250, 50, 0)]
    assert (s.buffers, s.buffer_bytes) == (1, 200)


def test_naive_sends_one_chunk_per_span_and_can_exceed_r():
    s = plan_sends("naive", 300, 1, LINK, 200, 2, 0.5, SPANS)
    assert table(s) == [(0, 0, 0, 250, 0), (0, 6, 250, 50, 0)]
    assert s.memory_bytes == 250 > 200


def test_blocking_and_end_send_everything_at_once_and_make_training_wait():
    b = plan_sends("blocking", 300, 1, LINK, 200, 2, 0.5, SPANS)
    assert table(b) == [(0, 0.0, 0, 100, 0), (0, 1.0, 100, 100, 1), (0, 2.0, 200, 100, 0)] and b.blocking
    e = plan_sends("end", 300, 1, LINK, 200, 2)  # needs no profile
    assert [x.at for x in e.sends] == [AT_END] * 3 and e.blocking
    assert e.to_dict()["sends"][0][2] is None  # JSON has no infinity


def test_bubble_mode_follows_baft_algorithm_1_over_shared_bubbles():
    s = plan_sends("bubble", 300, 1, LINK, 200, 2, bubbles=[IdleSpan(1, 3), IdleSpan(6, 7)],
                   peer_bubbles=[IdleSpan(0, 2), IdleSpan(5, 8)])
    assert table(s) == [(0, 1, 0, 100, 0), (0, 6, 100, 100, 1), (1, 1, 200, 100, 0)]
    assert s.interval_iterations == 2
    with pytest.raises(ConfigError, match="share no bubble"):
        plan_sends("bubble", 300, 1, LINK, 200, 2, bubbles=[IdleSpan(0, 1)], peer_bubbles=[IdleSpan(2, 3)])


def test_spreading_over_iterations_when_the_spans_are_too_short():
    s = plan_sends("pipelined", 1000, 1, LINK, 200, 2, 0.5, SPANS)  # 10 s of traffic, 3.5 s budget/iteration
    assert s.interval_iterations > 1 and s.fits
    n = plan_sends("naive", 1000, 1, LINK, 200, 2, 0.5, SPANS)
    assert n.interval_iterations > 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("copies", [1, 2])
def test_every_mode_covers_every_byte_of_every_copy_once(mode, copies):
    nbytes = 1234
    s = plan_sends(mode, nbytes, copies, LinkModel(1000.0, 0.01), 256, 4, 0.9, SPANS, SPANS, SPANS)
    for c in range(copies):
        ranges = sorted((x.offset, x.offset + x.size) for x in s.sends if x.copy == c)
        assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert all(x.size <= s.buffer_bytes and 0 <= x.buffer < s.buffers for x in s.sends)
    if mode != "naive":
        assert s.memory_bytes <= 256  # R
    assert all(0 <= x.iteration < s.interval_iterations for x in s.sends)
    assert all(x.at == AT_END or (math.isfinite(x.at) and x.at >= 0) for x in s.sends)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="fast"), r"schedule.mode='fast' is invalid: must be one of pipelined"),
    (dict(nbytes=0), r"nbytes=0 is invalid"),
    (dict(reserved_bytes=1, sub_buffers=4), r"reserved_bytes=1 is invalid: must be an integer >= 4"),
    (dict(spans=[]), r"mode 'pipelined' needs the profiled network idle spans"),
])
def test_bad_input_is_named(kwargs, match):
    args = dict(mode="pipelined", nbytes=300, copies=1, link=LINK, reserved_bytes=200, sub_buffers=2, mu=0.5,
                spans=SPANS)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        plan_sends(**args)


def test_naive_sends_every_copy_even_when_one_span_holds_a_whole_copy():
    s = plan_sends("naive", 300, 2, LINK, 200, 2, 0.5, [IdleSpan(0, 100)])
    assert table(s) == [(0, 0, 0, 300, 0), (0, 3.0, 0, 300, 0)] and [x.copy for x in s.sends] == [0, 1]
    assert s.fits  # 6 s of traffic in mu x 100 s


def test_idle_device_fills_the_bubbles_and_auto_picks_them_on_cpu():
    """schedule.idle: the worked example of idle_spans() (network spans of the module example,
    bubbles [1, 3) and [6, 7)): pipelined over the bubbles needs 2 iterations."""
    net, bub = [IdleSpan(0, 5), IdleSpan(6, 7), IdleSpan(8, 10)], [IdleSpan(1, 3), IdleSpan(6, 7)]
    assert idle_spans("auto", False, net, bub) == ("device", tuple(bub))
    assert idle_spans("auto", True, net, bub) == ("network", tuple(net))
    assert idle_spans("network", False, net, bub) == ("network", tuple(net))
    assert idle_spans("device", True, net, bub) == ("device", tuple(bub))
    assert idle_spans("device", False, net, []) == ("network (no free bubbles)", tuple(net))
    # a host with fewer spare cores than waiting ranks: half of each bubble, or none
    assert idle_spans("device", False, net, bub, 0.5) == ("device", (IdleSpan(1, 2), IdleSpan(6, 6.5)))
    assert idle_spans("auto", False, net, bub, 0.0) == ("network (no free bubbles)", tuple(net))
    s = plan_sends("pipelined", 300, 1, LinkModel(100.0), 200, 2, 0.5, spans=idle_spans("auto", False, net, bub)[1])
    assert s.interval_iterations == 2 and s.fits
    assert [(x.iteration, x.at, x.offset, x.size, x.buffer) for x in s.sends] == [
        (0, 1, 0, 100, 0), (0, 6, 100, 50, 1), (1, 1, 150, 100, 0), (1, 6, 250, 50, 1)]
    with pytest.raises(ConfigError, match=r"schedule.idle='gpu' is invalid: must be one of network, device, auto"):
        idle_spans("gpu", False, net, bub)


@pytest.mark.parametrize("cores, ranks, share", [(2, 1, 1.0), (2, 2, 1.0), (2, 3, 0.0), (2, 4, 0.0), (16, 8, 1.0),
                                                 (4, 5, 0.0), (4, 4, 1.0)])
def test_a_wait_frees_a_core_only_when_the_host_has_one_to_spare(cores, ranks, share):
    """PP=2 on this 2-core machine: the waiting rank's core is free; PP=4: the three others take both."""
    assert free_share_of_waits(cores, ranks) == share


def test_free_share_bad_input_is_named():
    with pytest.raises(ConfigError, match=r"cores=0 is invalid"):
        free_share_of_waits(0, 2)
    with pytest.raises(ConfigError, match=r"free_share=1.5 is invalid: must be a number >= 0 and <= 1"):
        idle_spans("device", False, [], [IdleSpan(0, 1)], 1.5)


def test_min_interval_spreads_a_short_plan_over_n_iterations_without_compounding():
    """schedule.min_interval N: the module example fits in 1 iteration; N = 3 plans it again with
    mu / 3 (3 iterations, a third of each span's budget), a plan already N long is kept (no mu / N
    on top), and blocking keeps its sends and starts every N iterations."""
    s = plan_sends_every(3, "pipelined", 300, 1, LINK, 200, 2, 0.5, SPANS)
    assert s.interval_iterations == 3 and s.fits
    assert table(s) == [(0, 0, 0, 83, 0), (0, 6, 83, 16, 1), (0, 8, 99, 33, 0), (1, 0, 132, 83, 1),
                        (1, 6, 215, 16, 0), (1, 8, 231, 33, 1), (2, 0, 264, 36, 0)]
    long = plan_sends("pipelined", 1000, 1, LINK, 200, 2, 0.5, SPANS)
    assert long.interval_iterations >= 3
    assert plan_sends_every(3, "pipelined", 1000, 1, LINK, 200, 2, 0.5, SPANS) == long
    assert plan_sends_every(1, "pipelined", 300, 1, LINK, 200, 2, 0.5, SPANS) == plan_sends(
        "pipelined", 300, 1, LINK, 200, 2, 0.5, SPANS)
    b = plan_sends_every(3, "blocking", 300, 1, LINK, 200, 2, 0.5, SPANS)
    assert b.interval_iterations == 3 and table(b) == table(plan_sends("blocking", 300, 1, LINK, 200, 2))
    with pytest.raises(ConfigError, match=r"schedule.min_interval=0 is invalid"):
        plan_sends_every(0, "pipelined", 300, 1, LINK, 200, 2, 0.5, SPANS)
