"""The job-wide agreement (megatron_ft.agent.agreement), in process: the incremental aggregator
against its definition over random report sequences, the rule for a snapshot due while one is
pending on a version table, and every step ending agreed or abandoned."""
import random

import pytest

from megatron_ft.agent.agreement import (Aggregator, NodeReport, PendingAgreement, Verdict, decide, node_report,
                                         resolved)
from megatron_ft.agent.versions import CLEAN, BusyError, VersionTable


def random_report(rng: random.Random, base: int) -> NodeReport:
    held = tuple(sorted(rng.sample(range(base, base + 6), rng.randint(0, 3))))
    return NodeReport(held, rng.randint(base - 1, base + 6))


@pytest.mark.parametrize("seed", range(20))
def test_the_incremental_aggregator_is_the_definition(seed):
    rng = random.Random(seed)
    nodes = rng.randint(1, 9)
    agg = Aggregator(nodes)
    reports: dict[int, NodeReport] = {}
    for i in range(300):
        n = rng.randrange(nodes + 1)
        if n == nodes and reports:  # a node leaves now and then
            gone = rng.choice(sorted(reports))
            del reports[gone]
            got = agg.forget(gone)
        else:
            n = min(n, nodes - 1)
            reports[n] = random_report(rng, i // 10)
            got = agg.update(n, reports[n])
        assert got == decide(reports, nodes), (i, reports)


def test_reports_and_verdicts_round_trip_and_malformed_ones_are_refused():
    r = NodeReport((3, 4), 4)
    assert NodeReport.decode(r.encode()) == r
    v = Verdict(4, (5, 7))
    assert Verdict.decode(v.encode()) == v and Verdict.decode(None) == Verdict()
    with pytest.raises(ValueError, match="format 9"):
        NodeReport.decode('{"v": 9, "held": [], "seen": 1}')
    with pytest.raises(ValueError, match="malformed"):
        NodeReport.decode('{"v": 1, "held": [-3], "seen": 1}')


def test_no_step_is_agreed_before_every_node_reported():
    agg = Aggregator(3)
    agg.update(0, NodeReport((5,), 5))
    assert agg.update(1, NodeReport((5,), 5)).agreed == -1
    assert agg.update(2, NodeReport((5,), 5)).agreed == 5


def test_a_node_without_all_its_ranks_registered_reports_nothing():
    assert node_report({0: [1]}, {0: 1}, ranks=2) == NodeReport()
    assert node_report({0: [1, 2], 1: [2]}, {0: 2, 1: 2}, ranks=2) == NodeReport((2,), 2)


class Job:
    """Ranks of a job with two slots each, one table per node, the agreement's rule applied at every
    begin (what the agent does), the verdict delivered to the nodes only when ``deliver`` is called
    (a deliberately slow agreement)."""

    def __init__(self, nodes: int, ranks_per_node: int):
        self.tables = [VersionTable() for _ in range(nodes)]
        self.rpn = ranks_per_node
        self.seen = [{} for _ in range(nodes)]
        for n, t in enumerate(self.tables):
            for r in range(ranks_per_node):
                t.add_rank(n * ranks_per_node + r, 2)
        self.agg = Aggregator(nodes)
        self.known = [Verdict() for _ in range(nodes)]  # what each node's agent knows
        self.skipped = 0

    def report(self, n: int) -> None:
        self.agg.update(n, node_report(self.tables[n].clean_steps(), self.seen[n], self.rpn))

    def deliver(self, n: int) -> None:
        v = self.known[n] = self.agg.verdict()
        t = self.tables[n]
        if v.agreed >= 0 and all(t.get(r).slot_with(v.agreed) is not None for r in t.ranks):
            for r in t.ranks:
                t.agree(r, v.agreed)

    def snapshot(self, n: int, rank: int, step: int, fails: bool = False) -> str:
        t = self.tables[n]
        try:
            slot = t.choose(rank, step)
            if slot.state == CLEAN and not resolved(slot.step, self.known[n], t.clean_steps(), self.seen[n]):
                self.skipped += 1
                raise PendingAgreement(f"step {slot.step} pending")
            slot = t.begin(rank, step)
        except BusyError:
            self.seen[n][rank] = max(step, self.seen[n].get(rank, -1))
            self.report(n)
            return "skipped"
        if fails:
            t.abort(rank, slot.index)
        else:
            t.commit(rank, slot.index, step)
        self.seen[n][rank] = step
        self.report(n)
        return "failed" if fails else "taken"


@pytest.mark.parametrize("seed", range(30))
def test_a_slow_agreement_skips_snapshots_never_overwrites_the_agreed_version_and_every_step_resolves(seed):
    rng = random.Random(seed)
    nodes, rpn = rng.randint(1, 4), rng.randint(1, 3)
    job = Job(nodes, rpn)
    agreed_seen = -1
    for step in range(1, 60):
        for n in range(nodes):
            for k in range(rpn):
                job.snapshot(n, n * rpn + k, step, fails=rng.random() < 0.05)
        for n in range(nodes):
            if rng.random() < 0.4:  # the verdict reaches this node late, or not this step
                job.deliver(n)
        v = job.agg.verdict()
        # the agreed step only moves forward, and every rank holds it (never overwritten)
        assert v.agreed >= agreed_seen
        agreed_seen = v.agreed
        if v.agreed >= 0:
            for t in job.tables:
                for r in t.ranks:
                    assert t.get(r).slot_with(v.agreed) is not None, (step, r, t.clean_steps())
        # a version some rank holds, of a step every rank finished with, is resolved where it is held:
        # held by every rank (then agreed), older than the agreed one, or abandoned - no rank waits forever
        finished = min(min(s.values()) for s in job.seen) if all(job.seen) else -1
        for n, t in enumerate(job.tables):
            for r, steps in t.clean_steps().items():
                for s in (x for x in steps if x <= finished):
                    held_by_all = all(u.get(q).slot_with(s) is not None for u in job.tables for q in u.ranks)
                    assert held_by_all or resolved(s, v, t.clean_steps(), job.seen[n]), (s, v, t.clean_steps())
                    if held_by_all:
                        assert v.agreed >= s, (s, v)
    assert v.agreed > 0 and job.skipped > 0  # agreements happened, and some snapshots waited


def test_the_pending_version_blocks_only_until_it_is_resolved():
    clean, seen = {0: [1, 2], 1: [1, 2]}, {0: 2, 1: 2}
    assert not resolved(2, Verdict(1), clean, seen)
    assert resolved(2, Verdict(1, (2,)), clean, seen)  # abandoned by another node
    assert resolved(2, Verdict(2), clean, seen)  # agreed
    assert resolved(2, Verdict(1), {0: [1, 2], 1: [1, 3]}, {0: 2, 1: 3})  # a local rank went past it


@pytest.mark.parametrize("seed", range(10))
def test_the_roots_running_combination_is_the_combination_of_every_nodes(seed):
    from megatron_ft.agent.reductions import Accumulator, combine

    rng = random.Random(seed)
    nodes = rng.randint(1, 12)
    acc = Accumulator(nodes)
    for d in range(20):
        how = rng.choice(["min", "max", "intersect"])
        width = rng.randint(1, 4)
        values = [[rng.randint(0, 9) for _ in range(width)] for _ in range(nodes)]
        order = list(range(nodes))
        rng.shuffle(order)
        results = [acc.add(f"d{d}", n, how, values[n]) for n in order + order[:2]]  # and sent twice
        assert results[nodes - 1] == combine(how, values) and results.count(None) == len(results) - 1


def test_decisions_are_refused_when_they_do_not_combine():
    from megatron_ft.agent.reductions import Accumulator, combine, decode, encode

    with pytest.raises(ValueError, match="allowed"):
        combine("sum", [[1]])
    with pytest.raises(ValueError, match="different lengths"):
        combine("min", [[1, 2], [1]])
    acc = Accumulator(2)
    acc.add("k", 0, "min", [1])
    with pytest.raises(ValueError, match="combines by 'max'"):
        acc.add("k", 1, "max", [1])
    assert decode(encode("min", [3])) == ("min", [3])
    with pytest.raises(ValueError, match="integers"):
        decode('{"v": 1, "how": "min", "values": [true]}')


def run_certified_job(lag: int):
    """Two nodes judge twelve iterations, the 7th anomalous on node 1 only; node 0 reports every
    iteration, node 1 every ``lag``-th (its reports then catch up). The certified steps in order."""
    agg = Aggregator(2, certify_after=2)
    certified: list[int] = []

    def note(v):
        if v.certified >= 0 and (not certified or certified[-1] != v.certified):
            certified.append(v.certified)

    def report(node, it):
        held = (it - 1,) if it > 1 else ()
        anomalies = (7,) if node == 1 and it >= 7 and agg.verdict().judged < 7 else ()
        note(agg.update(node, NodeReport(held, it - 1, judged=it, anomalies=anomalies)))

    for it in range(1, 13):
        report(0, it)
        if it % lag == 0 or it == 12:
            report(1, it)
    assert agg.verdict().judged == 12
    return certified


def test_the_roots_certifier_is_the_trainers_when_every_node_reports_at_once():
    from megatron_ft.agent.certification import Certifier

    ref, want = Certifier(2), []
    for it in range(1, 13):
        out = ref.iteration(it, it == 7, it - 1 if it > 1 else -1)
        if out.certify is not None:
            want.append(out.certify)
    assert run_certified_job(lag=1) == want


@pytest.mark.parametrize("lag", [2, 3, 5])
def test_a_late_node_delays_certification_never_certifies_a_version_an_anomaly_followed(lag):
    """Versions 5 and 6 are never certified (the anomaly came within two iterations after them)."""
    got = run_certified_job(lag)
    assert got and not {5, 6} & set(got) and got == sorted(got), got
    assert max(got) >= 7, got


def test_no_iteration_is_certified_past_a_node_that_has_not_judged_it():
    agg = Aggregator(2, certify_after=1)
    agg.update(0, NodeReport((5,), 5, judged=9))
    v = agg.update(1, NodeReport((5,), 5, judged=3))
    assert v.judged == 3 and v.certified <= 2


def test_a_restarted_agents_first_begin_of_a_rank_abandons_the_step_its_predecessor_never_committed():
    """An agent restarted over its slots (steps 3 and 4) knows them, not that its rank went on to begin
    step 9: the other node's step 5, which the killed agent never committed, waited until this node's
    first snapshot was *committed*. The rank's first begin now says it finished with every step before
    9, so the job abandons 5 at once."""
    from megatron_ft.agent.node_agreement import NodeAgreement

    t = VersionTable()
    t.add_rank(0, 2)
    t.adopt(0, 0, CLEAN, 3)
    t.adopt(0, 1, CLEAN, 4)
    reports = []

    class JobSide:  # what a node's agreement hands its report to (JobAgreement.report) and reads back
        verdict = Verdict(agreed=4)

        def report(self, report):
            reports.append(report)

    node = NodeAgreement(ranks_per_node=1)
    node.attach(JobSide(), t)
    assert reports[-1] == NodeReport((3, 4), 4)
    node.check_begin(0, t.choose(0, 9), 9, t)
    assert reports[-1] == NodeReport((3, 4), 8)
    agg = Aggregator(2)
    agg.update(0, reports[-1])
    assert 5 in agg.update(1, NodeReport((4, 5), 5)).abandoned
