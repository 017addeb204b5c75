"""A job's generations when it shrinks and grows back (megatron_ft/policy/generations.py): the surviving
slots renumbered in order, the size the rules fit with the rest idle, growing never past generation 0,
where each new rank's sources are (its own host, a surviving peer, a lost slot), and the trigger's
decisions from losses, claims, returns and the clock."""
import itertools
import random

import pytest

from megatron_ft.policy.elastic import coordinates, shrink_sizes
from megatron_ft.policy.generations import LOCAL, LOST, PEER, Generation, ShrinkRefused, ShrinkTrigger


@pytest.mark.parametrize("nodes, rpn, tp, pp, batch", [(3, 2, 1, 2, (12, 2)), (4, 8, 2, 2, (64, 1)),
                                                       (5, 4, 1, 1, (60, 1)), (4, 2, 2, 1, (None, None))])
def test_a_shrink_keeps_the_most_survivors_the_rules_fit_and_idles_the_rest(nodes, rpn, tp, pp, batch):
    g0 = Generation.first(nodes, rpn, tp, pp)
    for k in range(1, nodes):
        for lost in itertools.combinations(range(nodes), k):
            fits = shrink_sizes(nodes - k + 1, rpn, tp, pp, 1, *batch)  # sizes up to the survivors' count
            if not fits:
                with pytest.raises(ShrinkRefused, match="cannot go on"):
                    g0.shrink(lost, *batch)
                continue
            g1 = g0.shrink(lost, *batch)
            survivors = [s for s in range(nodes) if s not in lost]
            assert len(g1.slots) == max(fits) and g1.number == 1
            assert set(g1.slots) | set(g1.idle) == set(survivors) and not set(g1.slots) & set(g1.idle)
            assert list(g1.slots) == sorted(g1.slots) and g1.data_parallel == fits[len(g1.slots)]


def test_growing_back_takes_the_idle_slots_first_and_never_passes_generation_0():
    g0 = Generation.first(4, 8, 2, 2)
    g1 = g0.shrink({3}, global_batch=64, micro_batch=1)  # 24 ranks: DP6 does not divide 64 -> 2 nodes, DP4
    assert (g1.slots, g1.idle, g1.data_parallel) == ((0, 1), (2,), 4)
    same = g1.grow(set(), global_batch=64, micro_batch=1)  # nothing back: DP6 still does not fit
    assert same.number == 1 and same.slots == (0, 1) and same.idle == (2,)
    g2 = g1.grow({3}, global_batch=64, micro_batch=1)
    assert (g2.number, g2.slots, g2.idle, g2.data_parallel) == (2, (0, 1, 2, 3), (), 8)
    big = Generation.first(2, 2).shrink({1}).grow({1, 5, 6})
    assert big.slots == (0, 1) and big.idle == (5, 6)  # at most generation 0's 2 nodes


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1), (1, 1), (2, 2)])
def test_each_new_rank_s_sources_are_its_coordinate_s_replicas_tagged_by_where_they_are(tp, pp):
    rng = random.Random(tp * 10 + pp)
    for _ in range(40):
        rpn = tp * pp * rng.choice([1, 2])
        nodes = rng.randint(2, 6)
        g0 = Generation.first(nodes, rpn, tp, pp)
        lost = set(rng.sample(range(nodes), rng.randint(1, nodes - 1)))
        g1 = g0.shrink(lost)
        for r in range(g1.world_size):
            t, _, p = coordinates(r, tp, pp, g1.data_parallel)
            got = g1.sources(g0, r, lost)
            assert [o for o, _ in got] == [o for o in range(g0.world_size)
                                            if coordinates(o, tp, pp, g0.data_parallel)[::2] == (t, p)]
            for o, where in got:
                slot = g0.slot_of_rank(o)
                assert where == (LOST if slot in lost else LOCAL if slot == g1.slot_of_rank(r) else PEER)


def test_the_trigger_waits_for_claims_batches_close_losses_and_asks_to_grow_for_returns():
    t = ShrinkTrigger(after_s=30.0)
    t.lost(1, now=0.0)
    t.claimed(1)  # a standby took it: nothing to decide
    assert t.due(now=100.0) is None
    t.lost(2, now=100.0)
    t.lost(2, now=110.0)  # the first loss counts
    assert t.due(now=129.9) is None
    t.lost(0, now=125.0)
    assert t.due(now=130.0) == ("shrink", (0, 2))
    t.shrunk({0, 2})
    assert t.due(now=500.0) is None
    t.returned(4)  # never out: nothing to grow by
    t.returned(2)
    assert t.due(now=501.0) == ("grow", (2,))
    t.grown({2})
    assert t.due(now=502.0) is None
    off = ShrinkTrigger(after_s=0.0)
    off.lost(1, now=0.0)
    assert off.due(now=1e9) is None


def test_a_rank_outside_the_generation_is_refused_naming_it():
    g = Generation.first(2, 2, 1, 2)
    with pytest.raises(ValueError, match="rank 4 is outside generation 0's 4 ranks"):
        g.slot_of_rank(4)
    with pytest.raises(ValueError, match="does not fit its layout"):
        Generation.first(3, 1, 1, 2)
