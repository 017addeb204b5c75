"""Finding the embedded store's root costs each agent a constant number of probes, not one per node:
a slow root must not set N agents asking N servers each (the scale bed saw that collapse at 2,048 nodes)."""
from __future__ import annotations

import uuid

import pytest

from megatron_ft.health import store as st
from megatron_ft.testing import helpers


def counting(answers: dict):
    asked: list[int] = []
    return (lambda j: asked.append(j) or answers[j]), asked


@pytest.mark.parametrize("nodes", [4, 2048])
def test_a_slow_root_costs_two_probes_whatever_the_size(nodes):
    """Node 0 is the root and too slow to answer; every other node says it follows node 0: the search
    ends after node 1's answer (None: ask again later) instead of asking every node."""
    ask, asked = counting({0: st.SILENT, **{j: 0 for j in range(1, nodes)}})
    assert st.find_root(ask, nodes) is None
    assert asked == [0, 1]


def test_a_failover_asks_past_the_old_root_and_waits_for_the_lowest_answering_node():
    nodes = 2048
    # node 1 has not taken the role yet and still names the old root: ask again later, two probes
    ask, asked = counting({1: 0, **{j: 0 for j in range(2, nodes)}})
    assert st.find_root(ask, nodes, first=0, exclude={0, 7}) is None and asked == [1]
    # then it has
    ask, asked = counting({1: st.ROOT, **{j: 1 for j in range(2, nodes)}})
    assert st.find_root(ask, nodes, first=0, exclude={0, 7}) == 1 and asked == [1]


def test_dead_low_nodes_cost_one_probe_each_then_a_hint_is_followed():
    answers = {0: st.SILENT, 1: st.SILENT, 2: 5, 5: st.ROOT}
    ask, asked = counting(answers)
    assert st.find_root(ask, 8) == 5 and asked == [0, 1, 2, 5]
    # a named root that does not confirm (it moved on): no scan of the rest
    ask, asked = counting({0: st.SILENT, 1: 3, 3: st.ANSWERS})
    assert st.find_root(ask, 2048) is None and asked == [0, 1, 3]


def test_real_stores_connect_and_fail_over_with_few_probes(monkeypatch):
    """Six real embedded stores on loopback: each joins the root with at most two probes; once the root
    ends, the survivors elect node 1 and each finds it with at most a few probes per round (not one per
    node per round)."""
    n = 6
    run, port = f"t{uuid.uuid4().hex[:8]}", helpers.free_port_range(n)
    probes: list[int] = []
    real = st.probe_node
    monkeypatch.setattr(st, "probe_node", lambda *a, **k: probes.append(a[2]) or real(*a, **k))
    stores = [st.EmbeddedStore(run, j, n, [], port, timeout_s=2.0) for j in range(n)]
    try:
        assert stores[0].connect(10) == 0
        probes.clear()
        for s in stores[1:]:
            assert s.connect(10) == 0
        assert len(probes) <= 2 * (n - 1)
        assert stores[3]._server.local(stores[3].prefix).get(st.FOLLOWS_KEY) == "0"
        stores[0].close()
        probes.clear()
        assert stores[1].failover() == 1
        for s in stores[2:]:
            assert s.failover() == 1
        # node 1 checks the nodes below it by port; each other survivor: node 1 (and at most a retry)
        assert len(probes) <= 3 * (n - 2), probes
        assert stores[4].get("root") == "1"
    finally:
        for s in stores[1:]:
            s.close()
