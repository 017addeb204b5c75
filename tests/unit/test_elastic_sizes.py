"""Which smaller data-parallel sizes a job fits after losing nodes (megatron_ft/policy/elastic.py): the
rules (whole model-parallel groups, the minimum, the expert parallelism, the global batch), the refusal's
words, Megatron-LM's rank order, and the old replicas a new rank restores from."""
import pytest

from megatron_ft.policy.elastic import coordinates, elastic_refusal, rank_of, replicas_of, shrink_sizes


@pytest.mark.parametrize("shape, batch, sizes", [
    ((3, 2, 1, 2, 1), (12, 2), {2: 2, 1: 1}),
    ((4, 8, 2, 2, 1), (64, 1), {2: 4, 1: 2}),  # DP 8 -> 6 does not divide the batch of 64
])
def test_sizes_follow_the_rules(shape, batch, sizes):
    nodes, rpn, tp, pp, ep = shape
    got = shrink_sizes(nodes, rpn, tp, pp, ep, *batch)
    assert got == sizes
    for n, dp in got.items():  # every listed size fits every rule
        assert n * rpn == dp * tp * pp and dp % ep == 0 and batch[0] % (dp * batch[1]) == 0
    for n in range(1, nodes):  # and every size that fits is listed
        ranks = n * rpn
        fits = ranks % (tp * pp) == 0 and batch[0] % (ranks // (tp * pp) * batch[1]) == 0
        assert (n in got) == fits, (n, got)


def test_the_minimum_and_the_expert_parallelism():
    assert shrink_sizes(4, 4, 1, 1, global_batch=48, micro_batch=1) == {3: 12, 2: 8, 1: 4}
    assert shrink_sizes(4, 4, 1, 1, global_batch=48, micro_batch=1, min_data_parallel=8) == {3: 12, 2: 8}
    assert shrink_sizes(4, 4, 1, 1, expert=8) == {2: 8}


def test_the_refusal_names_the_rule_that_fails():
    assert elastic_refusal(3, 2, 1, 2, global_batch=12, micro_batch=2) is None
    assert elastic_refusal(1, 8, 1, 1) == "a job of one node has no node to lose and go on without"
    assert elastic_refusal(2, 2, 1, 4) == "losing one node leaves 2 ranks at TP1 x PP4: 2 ranks are not a multiple of TP1 x PP4 = 4"
    assert elastic_refusal(3, 2, 1, 1, min_data_parallel=5) == ("losing one node leaves 4 ranks at TP1 x PP1: DP 4 is "
                                                                "below cluster.elastic.min_data_parallel=5")
    assert "expert parallelism 3" in elastic_refusal(3, 2, 1, 1, expert=3)


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 5), (2, 3, 4), (4, 2, 1), (1, 8, 3)])
def test_coordinates_follow_megatron_s_order(tp, pp, dp):
    seen = set()
    for r in range(tp * pp * dp):
        t, d, p = coordinates(r, tp, pp, dp)
        assert rank_of(t, d, p, tp, dp) == r and r == t + tp * d + tp * dp * p
        seen.add((t, d, p))
    assert len(seen) == tp * pp * dp
    with pytest.raises(ValueError, match="outside a world"):
        coordinates(tp * pp * dp, tp, pp, dp)


@pytest.mark.parametrize("tp, pp, old_dp, new_dp", [(1, 2, 3, 2), (2, 2, 4, 3), (1, 1, 8, 5), (4, 1, 2, 3)])
def test_a_new_rank_restores_from_the_replicas_of_its_coordinate(tp, pp, old_dp, new_dp):
    for r in range(tp * pp * new_dp):
        t, _, p = coordinates(r, tp, pp, new_dp)
        got = replicas_of(r, tp, pp, old_dp, new_dp)
        assert got == [o for o in range(tp * pp * old_dp) if coordinates(o, tp, pp, old_dp)[::2] == (t, p)]
        assert coordinates(got[0], tp, pp, old_dp)[1] == 0  # replica 0 first
