"""Placement and coding plans: the papers' hand-worked examples, recoverability of
every plan checked against what each node holds, memory, failure counts, bad input, `megatron-ft plan`."""
import ast
import importlib.util
import io
import itertools
import math
import os
import time
from contextlib import redirect_stderr, redirect_stdout
from fractions import Fraction
from typing import List

import numpy as np
import pytest

from megatron_ft import cli, config
from megatron_ft.policy import recoverability as rec
from megatron_ft.redundancy import Piece, Topology, make_plan, plan_from_config
from megatron_ft.redundancy.echeck import (coding_group, data_groups, reduction_target_positions,
                                           rs_coding_groups, sweep_line_data_nodes)
from megatron_ft.redundancy.gemini import ReplicaGroup, mixed_placement, placement_strategy
from megatron_ft.redundancy.reft import piece_in, raim5_layout, stripe_of, xor_parity_groups
from megatron_ft.redundancy.report import fmt_ranges, parse_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = [os.path.join(REPO, "configs", f"{s}-16x8.yaml") for s in ("replica", "xor", "rs")]


# ------------------------------------------------------------------------------------- topology


def _megatron_rank_generator():
    """megatron-core's own RankGenerator, compiled from its source without importing megatron.core
    (which takes ~12 s): the class and the function it uses are self-contained."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "parallel_state.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
            and n.name in ("generate_masked_orthogonal_rank_groups", "RankGenerator")]
    assert len(body) == 2, "megatron-core's parallel_state changed shape"
    ns = {"List": List}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return ns["RankGenerator"]


@pytest.mark.parametrize("nodes, rpn, tp, pp", [(16, 8, 8, 2), (2, 2, 1, 2), (4, 8, 2, 4), (6, 4, 4, 3)])
def test_topology_matches_megatron_default_order(nodes, rpn, tp, pp):
    RankGenerator = _megatron_rank_generator()
    topo = Topology(nodes, rpn, tp, pp)
    gen = RankGenerator(tp=tp, ep=1, dp=topo.data, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    dp_groups = sorted(sorted(g) for g in gen.get_ranks("dp"))
    assert dp_groups == sorted(list(topo.sharding_group_ranks(s)) for s in range(tp * pp))
    for group in gen.get_ranks("tp"):
        assert len({topo.coords(r)[1:] for r in group}) == 1 and [topo.coords(r)[0] for r in group] == list(range(tp))
    for group in gen.get_ranks("pp"):
        assert [topo.coords(r)[2] for r in group] == list(range(pp))
    for r in range(topo.world_size):
        assert topo.rank_of(*topo.coords(r)) == r


@pytest.mark.parametrize("nodes, rpn, tp, pp, ep", [(2, 2, 1, 1, 2), (4, 1, 1, 1, 4), (4, 8, 2, 2, 4), (16, 8, 8, 2, 2)])
def test_expert_layout_matches_megatron_expert_rank_generator(nodes, rpn, tp, pp, ep):
    RankGenerator = _megatron_rank_generator()
    topo = Topology(nodes, rpn, tp, pp, ep)
    assert topo.expert_data * ep == topo.data
    gen = RankGenerator(tp=tp, ep=ep, dp=topo.expert_data, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    edp_groups = sorted(sorted(g) for g in gen.get_ranks("dp"))
    assert edp_groups == sorted(list(g) for g in {topo.expert_sharding_group_ranks(r) for r in range(topo.world_size)})
    for group in gen.get_ranks("ep"):
        assert [topo.expert_coords(r)[1] for r in group] == list(range(ep))
        assert len({topo.expert_coords(r)[::2] + topo.expert_coords(r)[3:] for r in group}) == 1  # etp, edp, pp
    # EDP = 1: every expert once in the job
    assert Topology(4, 1, 1, 1, 4).expert_sharding_group_ranks(2) == (2,)
    with pytest.raises(ValueError, match="expert=3 does not divide the data-parallel size 4"):
        Topology(2, 2, 1, 1, 3)


def test_topology_worked_example():
    topo = Topology(16, 8, 8, 2)
    assert topo.data == 8 and topo.coords(77) == (5, 1, 1) and topo.node_of(77) == 9
    assert topo.sharding_group_ranks(topo.sharding_group(77)) == tuple(range(69, 128, 8))
    with pytest.raises(ValueError, match="does not divide"):
        Topology(2, 2, 1, 3)
    with pytest.raises(ValueError, match="nodes=0"):
        Topology(0, 8)


# ------------------------------------------------------------------------------------- GEMINI


def test_gemini_algorithm1_figure3():
    assert placement_strategy(4, 2) == (((0, 1), (2, 3)), "group")  # figure 3a
    assert placement_strategy(5, 2) == (((0, 1), (2, 3, 4)), "mixed")  # figure 3c: group + ring of 3
    assert placement_strategy(7, 3) == (((0, 1, 2), (3, 4, 5, 6)), "mixed")
    assert placement_strategy(3, 3) == (((0, 1, 2),), "group")
    ring = mixed_placement(5, 2)[1]
    assert ring.ring and [ring.holders(n) for n in (2, 3, 4)] == [(2, 3), (3, 4), (4, 2)]
    assert [ring.held(n) for n in (2, 3, 4)] == [(2, 4), (3, 2), (4, 3)]
    g = mixed_placement(7, 3)
    assert g[1].holders(5) == (5, 6, 3) and g[1].holders(6) == (6, 3, 4) and g[0].holders(1) == (1, 0, 2)
    for bad in [(1, 2), (4, 0), (0, 1)]:
        with pytest.raises(ValueError, match="1 <= m <= N"):
            placement_strategy(*bad)


def test_gemini_group_beats_ring_and_corollary1():
    # figure 3a/3b, N = 4, m = 2, two failures: group placement loses 2 of the 6 pairs, a ring 4.
    group = make_plan(Topology(4, 1), "replica", replicas=2)
    assert group.survivable_counts(2)[2] == 4
    assert rec.recoverable_counts(rec.ring_placement(4, 2), 2)[2] == 2
    assert [p for p in itertools.combinations(range(4), 2) if not group.survives(p)] == [(0, 1), (2, 3)]
    # Corollary 1, N = 16, m = 2: 93.3 % for k = 2 and 80.0 % for k = 3 (exact for k < 2m), a lower bound after
    plan = make_plan(Topology(16, 8, 8, 2), "replica", replicas=2)
    assert plan.recover_probability(2) == Fraction(14, 15) and plan.recover_probability(3) == Fraction(4, 5)
    for k in range(1, 9):
        bound = rec.gemini_corollary1(16, 2, k)
        p = float(plan.recover_probability(k))
        assert p == pytest.approx(bound) if k < 4 else p >= bound
    # figure 3c: N = 5, m = 2 -> 6 of the 10 two-node failures are survived (none of the ring's pairs)
    assert make_plan(Topology(5, 1), "replica").survivable_counts(2) == [1, 5, 6]


# ------------------------------------------------------------------------------------- REFT


def test_raim5_figure7():
    # node 0 holds b_2, c_1, d_0 and p_a (stripes a, b, c, d = 0, 1, 2, 3)
    assert [stripe_of(0, p, 4) for p in range(3)] == [3, 2, 1]
    layout = raim5_layout(4)
    assert layout[0] == ((1, 0), (2, 1), (3, 2))  # p_a = a_0 ^ a_1 ^ a_2 on nodes 1, 2, 3
    # node 0 lost: b_2 = p_b ^ b_0 ^ b_1 with p_b on node 1, b_0 on node 2, b_1 on node 3
    assert dict((p, i) for i, p in layout[1]) == {0: 2, 1: 3, 2: 0}
    for n in range(2, 9):  # every member holds one parity and one piece of every other stripe
        lay = raim5_layout(n)
        for i in range(n):
            assert sorted(p for s in range(n) for (j, p) in lay[s] if j == i) == list(range(n - 1))
        assert sorted(s for s in range(n) for (j, _) in lay[s] if j == 0) == list(range(1, n))
    with pytest.raises(ValueError, match="at least 2"):
        raim5_layout(1)
    with pytest.raises(ValueError, match="holds the parity"):
        piece_in(2, 2, 4)


def test_raim5_bytes_rebuild_any_single_node():
    """The layout on real bytes: XOR the pieces into each stripe, drop a node, rebuild its data."""
    rng = np.random.default_rng(0)
    for n, size in [(4, 12), (3, 7), (5, 1), (2, 5)]:
        data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
        piece_len = -(-size // (n - 1))
        pieces = [[np.pad(d[p * piece_len:(p + 1) * piece_len], (0, piece_len - len(d[p * piece_len:(p + 1) * piece_len])))
                   for p in range(n - 1)] for d in data]
        parity = [np.bitwise_xor.reduce([pieces[i][p] for i, p in raim5_layout(n)[s]]) for s in range(n)]
        for lost in range(n):
            rebuilt = []
            for p in range(n - 1):
                s = stripe_of(lost, p, n)
                others = [pieces[i][q] for i, q in raim5_layout(n)[s] if i != lost]
                rebuilt.append(np.bitwise_xor.reduce([parity[s], *others]))
            assert np.array_equal(np.concatenate(rebuilt)[:size], data[lost])


def test_xor_groups_follow_sharding_groups():
    topo = Topology(16, 8, 8, 2)
    groups = xor_parity_groups(topo)
    assert [g.members for g in groups] == [tuple(range(8)), tuple(range(8, 16))]
    assert all(g.same_sharding_group for g in groups)
    assert groups[0].lanes[5] == topo.sharding_group_ranks(5)  # lane 5 = sharding group (pp 0, tp 5)
    assert [g.members for g in xor_parity_groups(topo, 4)] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert [g.members for g in xor_parity_groups(topo, 3)][:2] == [(0, 1, 2), (3, 4, 5, 6, 7)]  # remainder joins
    # TP 1, 8 ranks per node: a node holds 8 dp ranks of the sharding group; lanes still stay inside it
    g = xor_parity_groups(Topology(4, 8, 1, 2))
    assert [x.members for x in g] == [(0, 1), (2, 3)] and g[0].lanes[3] == (3, 11) and g[0].same_sharding_group
    # local CPU default: each sharding group lives on one node -> one mixed group, lanes (0, 2), (1, 3)
    g = xor_parity_groups(Topology(2, 2, 1, 2))
    assert [(x.members, x.lanes, x.same_sharding_group) for x in g] == [((0, 1), ((0, 2), (1, 3)), False)]
    # a lone node (its own class) joins the last group
    g = xor_parity_groups(Topology(5, 4, 2, 2))
    assert [x.members for x in g] == [(0, 1), (2, 3, 4)] and g[0].same_sharding_group and not g[1].same_sharding_group
    with pytest.raises(ValueError, match="group_size=1"):
        xor_parity_groups(topo, 1)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        xor_parity_groups(Topology(1, 8, 8, 1))


# ------------------------------------------------------------------------------------- ECHECK


def test_echeck_sweep_line_figures():
    assert sweep_line_data_nodes([(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 6)]) == (0, 2)  # figure 9
    assert sweep_line_data_nodes([(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 2), (2, 4)]) == (0, 2)  # figure 6
    assert sweep_line_data_nodes([(0, 4), (4, 5), (5, 9)], [(0, 3), (3, 6), (6, 9)]) == (0, 1, 2)  # distinct
    assert data_groups(10, 4) == ((0, 2), (2, 5), (5, 7), (7, 10))
    with pytest.raises(ValueError, match="sorted"):
        sweep_line_data_nodes([(2, 4), (0, 2)], [(0, 4)])
    with pytest.raises(ValueError, match="distinct nodes"):
        sweep_line_data_nodes([(0, 4)], [(0, 2), (2, 4)])
    # figure 9a: node 1 as parity -> 3 transfers (2 data packets, 1 parity); 9b: node 2 as parity -> 4
    a = coding_group((0, 1, 2), ((0, 1), (2, 3), (4, 5)), 2, 1)
    assert (a.data_nodes, a.parity_nodes, a.transfers()) == ((0, 2), (1,), (2, 1))
    b = coding_group((0, 1, 2), ((0, 1), (2, 3), (4, 5)), 2, 1, data_nodes=(0, 1))
    assert sum(b.transfers()) == 4
    assert len(a.reduction_groups()) * a.m == 3  # W/k * m XOR reductions


def _data_transfers(workers, data_nodes, k):
    owner = {r: i for i, w in enumerate(workers) for r in w}
    packets = [r for w in workers for r in w]
    return sum(1 for j, (lo, hi) in enumerate(data_groups(len(packets), k)) for r in packets[lo:hi]
               if owner[r] != data_nodes[j])


def test_echeck_sweep_line_minimises_data_transfers():
    for n in range(2, 7):
        for g in range(1, 5):
            workers = tuple(tuple(range(i * g, (i + 1) * g)) for i in range(n))
            for k in range(1, n):
                chosen = coding_group(range(n), workers, k, n - k)
                best = min(_data_transfers(workers, perm, k) for perm in itertools.permutations(range(n), k))
                assert _data_transfers(workers, chosen.data_nodes, k) == best == chosen.transfers()[0], (n, g, k)


def test_echeck_reduction_targets():
    assert reduction_target_positions(2, 2) == (0, 1)  # k = m
    assert reduction_target_positions(4, 2) == (0, 2) and reduction_target_positions(5, 2) == (0, 2)  # k > m
    assert reduction_target_positions(6, 4) == (0, 1, 2, 3)
    assert reduction_target_positions(2, 3) == (0, 1, 0) and reduction_target_positions(1, 3) == (0, 0, 0)  # k < m
    # figure 6: group {d0, d2} has no parity worker -> p0 on worker 0, p2 on worker 2; {d1, d3} on 1 and 3
    fig6 = coding_group(range(4), ((0,), (1,), (2,), (3,)), 2, 2)
    assert (fig6.data_nodes, fig6.parity_nodes) == ((0, 2), (1, 3))
    assert [(r.ranks, r.targets) for r in fig6.reduction_groups()] == [((0, 2), (0, 2)), ((1, 3), (1, 3))]
    # 16 x 8, k = 4, m = 2, nodes 0-5 (the worked example in echeck.py)
    g = rs_coding_groups(16, 8, 4, 2)[0]
    assert (g.data_nodes, g.parity_nodes) == ((0, 2, 3, 5), (1, 4))
    rgs = g.reduction_groups()
    assert len(rgs) == 12 and rgs[0].targets == (12, 36) and rgs[9].targets == (9, 33)
    assert [rgs[r].targets for r in range(4, 8)] == [(r, 24 + r) for r in range(4, 8)]  # every floor(k/m)=2nd
    assert sum(1 for x in rgs if not any(g.owner(t) in g.parity_nodes for t in x.ranks)) == 12 - 8  # W/k - g
    # k < m: 5 single-GPU nodes, k = 2, m = 3: groups without a parity worker use round robin
    small = coding_group(range(5), [(i,) for i in range(5)], 2, 3)
    for x in small.reduction_groups():
        for i, t in enumerate(x.targets):
            if x.ranks[0] != t and small.parity_nodes[i] not in x.ranks:
                assert t == x.ranks[reduction_target_positions(len(x.ranks), 3)[i]]
    assert [(x.members, x.k, x.m) for x in rs_coding_groups(16, 8, 4, 2)] == [(tuple(range(6)), 4, 2),
                                                                              (tuple(range(6, 16)), 8, 2)]
    with pytest.raises(ValueError, match="at least k\\+m=6"):
        rs_coding_groups(5, 8, 4, 2)
    with pytest.raises(ValueError, match="m=0"):
        rs_coding_groups(8, 8, 4, 0)


# ------------------------------------------------------------------------------------- plans

SMALL = [Topology(4, 1), Topology(5, 1), Topology(7, 2, 2, 1), Topology(8, 2, 2, 2), Topology(6, 4, 4, 3),
         Topology(2, 2, 1, 2), Topology(5, 4, 2, 2), Topology(9, 1)]
SCHEMES = [("none", {}), ("replica", {"replicas": 2}), ("replica", {"replicas": 3}), ("xor", {}),
           ("xor", {"group_size": 2}), ("xor", {"group_size": 3}), ("rs", {"k": 2, "m": 1}),
           ("rs", {"k": 2, "m": 2}), ("rs", {"k": 3, "m": 2}), ("rs", {"k": 1, "m": 3})]


def _plans():
    for topo in SMALL:
        for scheme, kw in SCHEMES:
            try:
                yield make_plan(topo, scheme, **kw)
            except ValueError:
                assert scheme != "none"  # too few nodes for this scheme


def test_every_plan_survives_its_tolerance_and_matches_the_counts():
    """Exhaustively, against what every survivor holds: any `tolerance` failures lose nothing
    (1 for replica/xor, m for rs), the group rules agree with the holdings for every failure set,
    and the exact counts behind P(recover) match the enumeration."""
    seen = set()
    for plan in _plans():
        n = plan.topology.nodes
        seen.add(plan.scheme)
        counts = [0] * (n + 1)
        for size in range(n + 1):
            for failed in itertools.combinations(range(n), size):
                lost = plan.lost_ranks(failed)
                assert (not lost) == plan.survives(failed), (plan.label, plan.topology, failed)
                if size <= plan.tolerance():
                    assert not lost, (plan.label, plan.topology, failed)
                if lost:  # only ranks of failed nodes are ever lost
                    assert {plan.topology.node_of(r) for r in lost} <= set(failed)
                counts[size] += not lost
        assert counts == plan.survivable_counts(n), (plan.label, plan.topology)
        expected = {"none": 0, "replica": plan.replicas - 1, "xor": 1, "rs": plan.m}[plan.scheme]
        assert all(g.tolerance == expected for g in plan.groups)
    assert seen == {"none", "replica", "xor", "rs"}


def test_rs_groups_survive_exactly_m():
    plan = make_plan(Topology(12, 2), "rs", k=4, m=2)
    assert [len(g.members) for g in plan.groups] == [6, 6]
    for failed in itertools.combinations(range(6), 3):
        assert plan.lost_ranks(failed)  # any 3 of one group lose data
    assert not plan.lost_ranks((0, 1, 6, 7))  # 2 in each group is fine


def test_holdings_worked_examples():
    plan = make_plan(Topology(5, 2), "replica", replicas=2)  # ring (2, 3, 4): node 2 holds node 4's ranks
    assert plan.holdings(2).primary == (4, 5) and plan.holdings(2).copies == (8, 9)
    assert plan.holdings(0).copies == (2, 3) and plan.holdings(0).roles() == ("primary", "replica")
    xor = make_plan(Topology(16, 8, 8, 2), "xor")
    h = xor.holdings(0)
    assert len(h.parity) == 8 and h.roles() == ("primary", "parity")
    assert h.parity[0].sources[0] == Piece(8, 0, 7) and {p.rank for p in h.parity[5].sources} == set(range(13, 64, 8))
    rs = make_plan(Topology(16, 8, 8, 2), "rs", k=4, m=2)
    assert rs.holdings(0).data_chunk == 0 and rs.holdings(0).copies == (8, 9, 10, 11)
    assert rs.holdings(1).parity[0].index == 0 and rs.holdings(4).parity[0].index == 1
    assert [Piece(9, i, 3).byte_range(100) for i in range(3)] == [(0, 34), (34, 68), (68, 100)]
    with pytest.raises(ValueError, match="node=16"):
        rs.holdings(16)


def test_memory_per_node_worked_examples():
    topo = Topology(16, 8, 8, 2)
    s = 7 << 20  # divisible by 7 so xor pieces are exact
    rep = make_plan(topo, "replica").memory(s)
    assert all((m.primary, m.redundancy) == (8 * s, 8 * s) for m in rep)
    xor = make_plan(topo, "xor").memory(s)
    assert all(m.redundancy == 8 * s // 7 for m in xor)  # 1/(n-1) of the node's share
    rs = make_plan(topo, "rs", k=4, m=2).memory(s)
    assert [rs[n].total // s for n in range(6)] == [12, 20, 12, 12, 20, 12]
    # (k+m)/k x the node's share on every data node; a parity node holds a whole chunk of W/k packets
    assert rs[0].total == pytest.approx(6 / 4 * 8 * s) and rs[1].redundancy == 12 * s
    # unequal ranks: xor pieces are padded to the longest contributor of the lane
    sizes = [100] * 128
    sizes[8] = 700
    assert make_plan(topo, "xor").memory(sizes)[3].redundancy == 100 + 7 * math.ceil(100 / 7)
    assert make_plan(topo, "none").memory(s)[0].redundancy == 0
    with pytest.raises(ValueError, match="one per rank"):
        make_plan(topo, "xor").memory([1, 2])


def test_plan_16384_ranks_completes():
    """2048 nodes x 8 GPUs (TP 8, PP 16, DP 128): every scheme plans, sizes and counts."""
    topo = Topology(2048, 8, 8, 16)
    assert topo.world_size == 16384
    for scheme, kw in [("replica", {"replicas": 2}), ("replica", {"replicas": 3}), ("xor", {}),
                       ("xor", {"group_size": 8}), ("rs", {"k": 4, "m": 2})]:
        t0 = time.perf_counter()
        plan = make_plan(topo, scheme, **kw)
        mem = plan.memory(1 << 30)
        counts = plan.survivable_counts(4)
        elapsed = time.perf_counter() - t0
        assert len(mem) == 2048 and counts[1] == 2048 and plan.tolerance() >= 1
        print(f"{scheme} {kw}: planned 16384 ranks in {elapsed:.3f} s")
    assert len(make_plan(topo, "xor").groups) == 16  # one parity group per pipeline stage


def test_make_plan_bad_input():
    topo = Topology(4, 8)
    for args, match in [(("raid6",), "scheme='raid6' is invalid: must be one of none, replica, xor, rs"),
                        (("replica",), None), (("replica", 5), "replicas=5 is invalid: a replica group needs nodes >= replicas"),
                        (("replica", 1), "replicas=1 is invalid: must be an integer >= 2")]:
        if match is None:
            make_plan(topo, *args)
            continue
        with pytest.raises(ValueError, match=match):
            make_plan(topo, *args)
    with pytest.raises(ValueError, match="at least k\\+m=6 nodes"):
        make_plan(topo, "rs", k=4, m=2)
    with pytest.raises(ValueError, match="failed nodes \\[7\\]"):
        make_plan(topo, "replica").survives([7])
    with pytest.raises(ValueError, match="k=9"):
        make_plan(topo, "replica").recover_probability(9)


# ------------------------------------------------------------------------------------- config + CLI


@pytest.mark.parametrize("section, match", [
    ({"scheme": "raid6"}, r"redundancy.scheme='raid6' is invalid: must be one of none, replica, xor, rs"),
    ({"scheme": "replica", "replicas": 1}, r"redundancy.replicas=1 is invalid: must be an integer >= 2"),
    ({"scheme": "replica", "replicas": 3}, r"redundancy.replicas=3 is invalid: a replica group needs cluster.nodes >= "
                                           r"redundancy.replicas, but cluster.nodes=2"),
    ({"scheme": "rs"}, r"redundancy.k=4 is invalid: a coding group needs cluster.nodes >= redundancy.k \+ "
                       r"redundancy.m = 6, but cluster.nodes=2"),
    ({"scheme": "rs", "k": 0}, r"redundancy.k=0 is invalid: must be an integer >= 1"),
    ({"scheme": "rs", "m": "two"}, r"redundancy.m='two' is invalid"),
    ({"scheme": "xor", "group_size": 1}, r"redundancy.group_size=1 is invalid: must be 0 \(a whole sharding group\)"),
    ({"scheme": "xor", "group_size": 3}, r"redundancy.group_size=3 is invalid: must be <= cluster.nodes=2"),
    ({"scheme": "xor", "ranks": 2}, r"unknown key\(s\) \['redundancy.ranks'\]"),
])
def test_redundancy_config_errors(section, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict({"redundancy": section})


def test_redundancy_config_defaults_and_single_node_xor():
    assert config.load().redundancy.scheme == "none"
    with pytest.raises(config.ConfigError, match=r"redundancy.scheme='xor' is invalid: xor parity needs cluster.nodes >= 2"):
        config.from_dict({"cluster": {"nodes": 1}, "redundancy": {"scheme": "xor"}})
    cfg = config.from_dict({"cluster": {"nodes": 6, "ranks_per_node": 2}, "parallel": {"pipeline": 1},
                            "redundancy": {"scheme": "rs", "k": 4, "m": 2}})
    assert plan_from_config(cfg).groups[0].members == tuple(range(6))
    assert config.from_dict(cfg.to_dict()) == cfg  # what the launcher writes per node reads back


def _run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("path", EXAMPLES)
def test_cli_plan_validates_example_configs(path):
    cfg = config.load(path)
    assert (cfg.cluster.nodes, cfg.cluster.ranks_per_node, cfg.parallel.tensor) == (16, 8, 8)
    rc, out, _ = _run_cli("plan", "--config", path, "--state-bytes-per-rank", "2GiB", "--node-failure-prob", "0.01")
    assert rc == 0, out
    assert "who holds what" in out and "node 0: primary ranks 0-7" in out and "k=8" in out
    if cfg.redundancy.scheme == "replica":
        assert "replicas of node 1 (ranks 8-15)" in out and "nodes 0-15: 32.00 GiB" in out
        assert "k=2   0.933333" in out and "Corollary 1: 0.933333 (exact)" in out
    elif cfg.redundancy.scheme == "xor":
        assert "XOR of rank[piece] 8[0], 16[1], 24[2]" in out and "k=2   0.533333" in out
    else:
        assert "data nodes 0,2-3,5 (sweep line), parity nodes 1,4" in out and "k=2   1.000000" in out
        assert "P0 on rank 4 (node 0 -> 1), P1 on rank 28 (node 3 -> 4)" in out
    assert "ECHECK eq. 1-2" in out


def test_cli_plan_default_scheme_override_and_errors(tmp_path):
    rc, out, _ = _run_cli("plan")
    assert rc == 0 and "scheme: none" in out and "k=1   0.000000" in out
    rc, out, _ = _run_cli("plan", "--scheme", "xor", "--max-failures", "1")
    assert rc == 0 and "MIXING sharding groups" in out and "mirror" in out
    rc, _, err = _run_cli("plan", "--scheme", "rs")
    assert rc == 2 and "redundancy.k=4 is invalid" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {nodes: 3}\nredundancy: {scheme: replica, replicas: 4}\n")
    rc, _, err = _run_cli("plan", "--config", str(bad))
    assert rc == 2 and "redundancy.replicas=4" in err
    rc, _, err = _run_cli("plan", "--max-failures", "0")
    assert rc == 2 and "--max-failures=0" in err
    with pytest.raises(SystemExit):
        _run_cli("plan", "--state-bytes-per-rank", "lots")


def test_parse_and_format_helpers():
    assert parse_bytes("1073741824") == 1 << 30 and parse_bytes("2GiB") == 2 << 30 and parse_bytes("500MB") == 500 * 10**6
    assert fmt_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11" and fmt_ranges([]) == "-"
