"""The chaos harness (megatron_ft.testing.chaos): seeded draws and the classification rules, in
process; one real trial of each of two kinds runs end to end in the default suite."""
import json

import pytest

from megatron_ft.testing import chaos


def test_draws_are_seeded_and_every_kind_gets_its_share():
    kinds = list(chaos.KINDS)
    a = [chaos.draw(7, i, kinds) for i in range(3 * len(kinds))]
    assert a == [chaos.draw(7, i, kinds) for i in range(3 * len(kinds))]  # same seed, same trials
    assert a != [chaos.draw(8, i, kinds) for i in range(3 * len(kinds))]
    for k in kinds:
        assert sum(t.kind == k for t in a) == 3
    assert all(3 <= t.kill_at <= t.iters - 3 and 0 <= t.kill_delay <= 0.25 for t in a)
    assert any(t.kill_delay < 0.03 for t in a) and any(t.kill_delay > 0.03 for t in a)


def trial(kind):
    return chaos.Trial(0, 1, kind, 5, 0.01, 12)


GOOD = {"bitwise_identical": True, "recovered_from": "decoded", "promised_tier": "decoded", "problems": []}


@pytest.mark.parametrize("kind,rc,summary,left,out,want", [
    ("node-rs", 0, GOOD, [], "", ("right", "")),
    ("node-rs", None, None, [], "", ("wrong", "hang")),
    ("node-rs", 0, {**GOOD, "recovered_from": "disk"}, [], "", ("wrong", "lower-tier: disk < decoded")),
    ("node-rs", 0, {**GOOD, "recovered_from": "none"}, [], "", ("wrong", "lower-tier: none < decoded")),
    ("node-rs", 1, {**GOOD, "bitwise_identical": False, "problems": ["loss differs"]}, [], "",
     ("wrong", "mismatch: ['loss differs']")),
    ("node-rs", 0, GOOD, ["mft.demo-node-1.n1.r1.s0"], "", ("wrong", "leak: ['mft.demo-node-1.n1.r1.s0']")),
    ("trainer", 1, None, [], "Traceback", ("wrong", "crash: no summary (exit 1)")),
    ("max-restarts-0", 1, None, [], "megatron-ft run failed with exit code 1", ("right", "the job ended non-zero, cleanly")),
    ("max-restarts-0", 0, GOOD, [], "", ("wrong", "max_restarts 0 should end the job non-zero (exit 0)")),
])
def test_classification(kind, rc, summary, left, out, want):
    assert chaos.classify(trial(kind), rc, summary, left, out) == want


def test_report_tallies_kinds_and_load():
    outs = [{"trial": {"kind": "trainer", "index": i, "kill_at": 4, "kill_delay": 0.1}, "verdict": v, "why": w,
             "load_before": 1.0 + i, "when": "2026-11-24T19:00:00Z", "recovered_from": r, "resumed_step": s}
            for i, (v, w, r, s) in enumerate([("right", "", "local_memory", 3), ("wrong", "hang", None, None)])]
    text = chaos.report(outs, "megatron-ft chaos --seed 1")
    assert "| trainer | 2 | 1 | 1 | local_memory, none (clean exit) | 3 |" in text and "trial 1 (trainer, kill at 4 +0.1 s): hang" in text
    assert "max 2.00" in text


@pytest.mark.parametrize("kind", ["node0-replica", "launcher"])
def test_one_real_trial(tmp_path, kind):
    """A real trial (demo run, SIGKILL at a wall-clock moment inside an iteration): right, at the
    promised tier. node0-replica loses the node hosting torchrun's rendezvous: the survivors move it
    to the next generation; launcher kills one launcher, whose agent a new launcher adopts."""
    t = chaos.Trial(0, 1, kind, 5, 0.05, 10)
    o = chaos.run_trial(t, str(tmp_path), timeout=300)
    assert (o.verdict, o.why) == ("right", ""), (o, open(tmp_path / "trial0000" / "demo.out").read()[-3000:])
    assert o.recovered_from == o.promised and o.resumed_step >= 1
    json.dumps(o.__dict__)
