"""The byte-level exchange plan (megatron_ft.redundancy.exchange), in memory: apply every node's
contributions to random containers of unequal sizes, lose nodes, and rebuild every lost rank with
its recipe from the survivors only - for several topologies of each scheme."""
import itertools

import numpy as np
import pytest

from megatron_ft.redundancy import exchange as xch
from megatron_ft.redundancy.codecs import get_codec
from megatron_ft.redundancy.plan import make_plan
from megatron_ft.redundancy.topology import Topology


def build(plan, data):
    """What every holder ends up with: block key -> bytes (as the agents compute them)."""
    held = {}
    codecs = {}
    for gi in range(len(plan.groups)):
        ex = xch.group_exchange(plan, gi, {r: len(d) for r, d in data.items()})
        assert all(len(b.contributors) == sum(1 for c in ex.contributions if (c.key, c.dst) == (b.key, b.holder))
                   for b in ex.blocks)
        for b in ex.blocks:
            held[(b.key, b.holder)] = np.zeros(b.length, np.uint8)
        for c in ex.contributions:
            dst = held[(c.key, c.dst)]
            if c.kind in (xch.COPY, xch.XOR):
                (p,) = c.parts
                piece = data[p.rank][p.lo:p.hi]
                dst[: len(piece)] ^= piece
            else:  # rs: this node's packets as data shards, the others zero
                k, m = plan.groups[gi].k, plan.groups[gi].m  # a remainder enlarges a group's k
                codec = codecs.setdefault((k, m), get_codec("rs", k, m))
                shards = [np.zeros(len(dst), np.uint8) for _ in range(k)]
                for p in c.parts:
                    shards[p.index][: p.hi - p.lo] = data[p.rank][p.lo:p.hi]
                out = [np.zeros(len(dst), np.uint8) for _ in range(m)]
                codec.encode(shards, out)
                dst ^= out[c.parity]
    return held


def rebuild(plan, rec, data, held, down):
    """Run ``rec`` with only the survivors' primaries and blocks; None if it needs a lost node."""
    topo = plan.topology

    def whole(rank):
        if topo.node_of(rank) not in down:
            return data[rank]
        return next((b for (k, h), b in held.items() if k == f"copy.r{rank}" and h not in down), None)

    def block(spec):
        return held[(spec.key, spec.holder)]

    if isinstance(rec, xch.CopyRecipe):
        return block(rec.block).copy() if rec.block.holder not in down else None
    if isinstance(rec, xch.XorRecipe):
        out = np.zeros(len(data[rec.rank]), np.uint8)
        for x in rec.pieces:
            if x.parity.holder in down:
                return None
            acc = block(x.parity).copy()
            for _, p in x.others:
                w = whole(p.rank)
                if w is None:
                    return None
                acc[: p.hi - p.lo] ^= w[p.lo:p.hi]
            out[x.lo:x.hi] = acc[: x.hi - x.lo]
        return out
    avail = {}
    for j, d in enumerate(rec.data):
        if j == rec.index:
            continue
        if d is None:
            avail[j] = np.zeros(rec.length, np.uint8)
        elif whole(d[0]) is not None:
            a = np.zeros(rec.length, np.uint8)
            a[: d[1]] = whole(d[0])
            avail[j] = a
    for i, b in enumerate(rec.parity):
        if b.holder not in down:
            avail[rec.k + i] = block(b)
    if len(avail) < rec.k:
        return None
    out = np.zeros(rec.length, np.uint8)
    get_codec("rs", rec.k, rec.m).decode(dict(itertools.islice(avail.items(), rec.k)), [rec.index], {rec.index: out})
    return out[: rec.size]


CASES = [
    ("replica", Topology(2, 2, 1, 2), {"replicas": 2}, 1),
    ("replica", Topology(5, 1), {"replicas": 2}, 1),          # group (0,1) + ring (2,3,4)
    ("replica", Topology(6, 1), {"replicas": 3}, 2),
    ("xor", Topology(3, 2, 1, 2), {}, 1),                     # mixed lanes, pieces of 1/2
    ("xor", Topology(4, 4, 4, 1), {}, 1),                     # REFT: TP in a node, DP across
    ("rs", Topology(4, 1, 1, 2), {"k": 2, "m": 2}, 2),
    ("rs", Topology(3, 2, 1, 2), {"k": 2, "m": 1}, 1),        # ECHECK figure 9 shape
    ("rs", Topology(7, 2, 1, 1), {"k": 4, "m": 2}, 2),        # a remainder node joins as data
]


@pytest.mark.parametrize("scheme,topo,params,tolerance", CASES,
                         ids=[f"{c[0]}-{c[1].nodes}x{c[1].ranks_per_node}-{c[2]}" for c in CASES])
def test_every_tolerated_loss_rebuilds_every_lost_rank(scheme, topo, params, tolerance):
    plan = make_plan(topo, scheme, **params)
    rng = np.random.default_rng(topo.nodes * 31 + tolerance)
    data = {r: rng.integers(0, 256, int(rng.integers(50, 400)), dtype=np.uint8) for r in range(topo.world_size)}
    held = build(plan, data)
    sizes = {r: len(d) for r, d in data.items()}
    checked = 0
    for down in itertools.combinations(range(topo.nodes), tolerance):
        if not plan.survives(down):
            continue
        for node in down:
            for rank in topo.ranks_of(node):
                got = None
                for rec in xch.recipes(plan, rank, sizes):
                    got = rebuild(plan, rec, data, held, set(down))
                    if got is not None:
                        break
                assert got is not None, f"rank {rank} not rebuildable after losing nodes {down}"
                assert np.array_equal(got, data[rank]), f"rank {rank} rebuilt wrong after losing {down}"
                checked += 1
    assert checked


def test_beyond_tolerance_some_rank_has_no_recipe():
    plan = make_plan(Topology(3, 1), "xor")
    data = {r: np.full(64, r + 1, np.uint8) for r in range(3)}
    held = build(plan, data)
    recs = xch.recipes(plan, 0, {r: 64 for r in range(3)})
    assert all(rebuild(plan, rec, data, held, {0, 1}) is None for rec in recs)


def test_rs_lost_data_node_is_decoded_at_the_groups_complete_step_only():
    """rs k=2 m=2 on 4 nodes x 1 rank (the demo's shape): data node 2 lost. Every survivor holds step
    5 (complete in the group); step 6 only in node 0's primary and a parity node's single slot (the
    exchange of 6 never completed): rank 2 is decoded at 5, never at 6. With a second node of the
    group lost (m=2) step 5 is still decodable; with a third it is not."""
    from megatron_ft.redundancy import rebuild
    from megatron_ft.redundancy.plan import make_plan
    from megatron_ft.redundancy.topology import Topology

    plan = make_plan(Topology(4, 1), "rs", k=2, m=2)
    assert plan.groups[0].role(2) == ("data", 1)
    sizes = {r: 1000 for r in range(4)}
    ex = xch.group_exchange(plan, 0, sizes)
    holds = {n: {"primary": {str(n): [5]}, "blocks": {b.key: [5] for b in ex.held_by(n)}} for n in (0, 1, 3)}
    holds[0]["primary"]["0"] = [6, 5]
    holds[1]["primary"]["1"] = [6]  # a parity node's single slot already took the unfinished step
    got = rebuild.rebuildable(plan, holds, 2, sizes)
    assert got == [{"step": 5, "source": "decoded"}], got
    assert rebuild.plan_rebuild(plan, {n: holds[n] for n in (0, 1)}, 2, 5, sizes)[0] == "decoded"
    assert rebuild.plan_rebuild(plan, {0: holds[0]}, 2, 5, sizes) is None
