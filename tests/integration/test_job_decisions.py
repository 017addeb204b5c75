"""The agents' job-wide agreement and decisions over the real embedded store (in process: the store
servers on loopback, the agents' JobAgreement threads): reports aggregated at the root as they arrive,
every node learning the verdict from its watch, a restore's decisions combined per node and job with
the contributions absorbed, a late node bounded by the wait, a root that fails over."""
import random
import threading
import uuid

import pytest

from megatron_ft.agent import reductions
from megatron_ft.agent.agreement import NodeReport, Verdict
from megatron_ft.agent.job_agreement import JobAgreement
from megatron_ft.health.store import EmbeddedStore
from megatron_ft.testing.helpers import free_port_range

SECRET = b"k" * 32


@pytest.fixture
def cluster():
    """Three nodes' stores (node 0 the root) and their agreements; each node's verdicts recorded."""
    nodes = 3
    port = free_port_range(nodes)
    run = f"t{uuid.uuid4().hex[:8]}"
    stores = [EmbeddedStore(run, n, nodes, [], port, timeout_s=2.0, secret=SECRET) for n in range(nodes)]
    for s in stores:
        s.connect(10.0)
    seen: list[list[Verdict]] = [[] for _ in range(nodes)]
    events = [threading.Event() for _ in range(nodes)]
    agreements = []
    for n, s in enumerate(stores):
        def protect(v, n=n):
            agreements[n].verdict = v
            seen[n].append(v)
            events[n].set()
        agreements.append(JobAgreement(n, nodes, s, protect, lambda: None, poll_s=0.5))
    for a in agreements:
        a.start()
    yield stores, agreements, seen, events
    for a in agreements:
        a.close()
    for s in stores:
        s.close()


def wait_for(events, seen, want, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s and s[-1] == want for s in seen):
            return
        for e in events:
            e.wait(0.05)
            e.clear()
    raise AssertionError(f"verdicts {[s[-1] if s else None for s in seen]}, wanted {want}")


def test_every_node_learns_the_verdict_the_root_derives_from_the_reports(cluster):
    stores, agreements, seen, events = cluster
    for n, a in enumerate(agreements):
        a.report(NodeReport((1, 2) if n else (1,), 2 if n else 1))
    wait_for(events, seen, Verdict(1, ()))
    agreements[0].report(NodeReport((1, 2), 2))
    wait_for(events, seen, Verdict(2, ()))
    agreements[1].report(NodeReport((2,), 3))  # node 1 skipped 3; node 2 then takes it: abandoned
    agreements[2].report(NodeReport((2, 3), 3))
    wait_for(events, seen, Verdict(2, (3,)))
    # one message per report at most (a report superseded before its thread sent it is dropped), at
    # least one per node
    assert 3 <= sum(a.reports_sent for a in agreements) <= 6
    assert all(stores[0].get(f"agree/{n}") for n in range(3))


def test_a_restores_decisions_combine_every_node_and_leave_no_key_behind(cluster):
    stores, agreements, _, _ = cluster
    results: dict = {}

    def decide(n, key, how, values):
        results[(n, key)] = agreements[n].decide(key, how, values, wait_s=10.0)

    for i, (how, per_node, want) in enumerate([("intersect", [[9, 8, 7], [8, 7], [8, 7, 6]], [7, 8]),
                                               ("min", [[1, 1], [1, 0], [1, 1]], [1, 0]),
                                               ("max", [[3], [12], [-1]], [12])]):
        key = f"restore/{random.getrandbits(40):x}/{i}"
        threads = [threading.Thread(target=decide, args=(n, key, how, per_node[n])) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert [results[(n, key)] for n in range(3)] == [want] * 3
        for n in range(3):  # each contribution was absorbed by the root
            assert stores[0].get(f"{reductions.PREFIX}{key}/{n}") is None


def test_a_decision_a_node_never_joins_ends_in_a_timeout_naming_it(cluster):
    _, agreements, _, _ = cluster
    with pytest.raises(TimeoutError, match="restore/late/0"):
        agreements[0].decide("restore/late/0", "min", [1], wait_s=1.0)


def test_contributions_that_do_not_match_are_refused_by_the_root(cluster):
    stores, _, _, _ = cluster
    stores[1].set(f"{reductions.PREFIX}restore/x/0/7", reductions.encode("min", [1]))  # node 7 of 3
    stores[1].set(f"{reductions.PREFIX}restore/y/0/1", "not json at all")
    assert stores[0].get(f"{reductions.PREFIX}restore/x/0/7") is None
    assert stores[0].get(f"{reductions.PREFIX}restore/x/0") is None
    assert stores[0].get(f"{reductions.PREFIX}restore/y/0/1") is None
