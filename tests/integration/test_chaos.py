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
    early = [t for t in a if t.kill_at == 1]
    assert all(chaos.KINDS[t.kind]["fail"] in chaos.EARLY_FAILS and 0 <= t.kill_delay <= chaos.EARLY_WINDOW_S
               for t in early)
    assert all(3 <= t.kill_at <= min(t.iters - 3, chaos.KINDS[t.kind].get("kill_at_max", 99))
               and 0 <= t.kill_delay <= 0.25 for t in a if t not in early)
    assert any(t.kill_delay < 0.03 for t in a) and any(t.kill_delay > 0.03 for t in a)
    # node and two-node losses: about half within the first second after the first iteration
    losses = [t for t in (chaos.draw(7, i, kinds) for i in range(20 * len(kinds)))
              if chaos.KINDS[t.kind]["fail"] in chaos.EARLY_FAILS]
    share = sum(t.kill_at == 1 for t in losses) / len(losses)
    assert 0.3 < share < 0.7, share
    # rs loses any two of its four nodes, drawn (a parity node and the data node holding its copy too)
    pairs = {t.lost_pair for t in (chaos.draw(7, i, ["two-nodes-rs"]) for i in range(40))}
    assert pairs == {(a, b) for a in range(4) for b in range(a + 1, 4)}
    assert all(t.lost_pair is None for t in a if t.kind != "two-nodes-rs")
    seconds = [t.second_delay for t in a if chaos.KINDS[t.kind].get("second_failure")]
    assert seconds and all(0 <= d <= 4 for d in seconds) and len(set(seconds)) > 1
    assert all(t.second_delay == 0 for t in a if not chaos.KINDS[t.kind].get("second_failure"))


def test_kinds_cover_the_promise_table():
    """Every failure of the promised-tier table has a kind, and each kind's demo arguments say it."""
    args = {k: " ".join(chaos.Trial(0, 1, k, 4, 0.01, 12, 1.5).demo_args()) for k in chaos.KINDS}
    assert "--fail=agent" in args["agent"] and "--kill-agent" not in args["agent"]
    assert "--second-failure --second-delay=1.5000" in args["second-failure"]
    assert "--fail=node" in args["node-replica-second-failure"] and "--second-failure" in args["node-replica-second-failure"]
    assert "--fail=two-nodes --kill-at=4 --iters=12 --redundancy=rs" in args["two-nodes-rs"]
    assert "--train-arg=--inmem-ckpt-persist-interval=3" in args["two-nodes-xor"]
    for kind, point in (("cut-empty+agent", "truncate-empty"), ("cut-header+agent", "truncate-header"),
                        ("cut-data+agent", "truncate")):
        assert "--fail=trainer" in args[kind] and f"--kill-point={point}-after-commit --with-agent" in args[kind]
    assert "--hosts" in chaos.draw(3, 0, ["node-replica"], hosts=True).demo_args()
    assert "--hosts" not in chaos.draw(3, 0, ["node-replica"]).demo_args()
    pair = chaos.Trial(0, 1, "two-nodes-rs", 1, 0.5, 12, lost_pair=(1, 2)).demo_args()
    assert "--victim-node=1" in pair and "--other-node=2" in pair
    # a kind with its own training arguments has its own reference run
    assert chaos.Trial(0, 1, "two-nodes-xor", 4, 0, 12).shape != chaos.Trial(0, 1, "node-xor", 4, 0, 12).shape


def test_moe_kinds_run_the_moe_shapes_and_are_drawn_only_when_named(tmp_path, monkeypatch):
    moe = [k for k in chaos.OPT_IN_KINDS if chaos.KINDS[k].get("moe")]
    assert set(chaos.OPT_IN_KINDS) - set(moe) == {"elastic", "elastic-xor", "elastic-rs"}  # opt-in too, longer
    args = {k: chaos.Trial(0, 1, k, 4, 0.01, 12).demo_args() for k in moe}
    assert set(args) == {"moe-trainer", "moe-node-replica", "moe-node-rs", "moe-poisoned-expert"}
    assert all("--moe" in a for a in args.values())
    assert "--kill-point=poison-expert-after-commit" in args["moe-poisoned-expert"]
    assert "--redundancy=rs" in args["moe-node-rs"] and "--fail=node" in args["moe-node-rs"]
    # a reference run of their own per shape, never a dense kind's
    shapes = {chaos.Trial(0, 1, k, 4, 0, 12).shape for k in moe}
    assert shapes == {"moe", "moe-replica", "moe-rs"}
    assert not shapes & {chaos.Trial(0, 1, k, 4, 0, 12).shape for k in chaos.KINDS if k not in chaos.OPT_IN_KINDS}
    # the default campaign draws the kinds it drew before; --kinds names the MoE ones
    import argparse

    drawn = []
    monkeypatch.setattr(chaos, "run_trial", lambda t, *a, **k: drawn.append(t.kind) or chaos.Outcome(
        t.__dict__, "right"))
    base = dict(config=None, seed=1, results=str(tmp_path / "r.jsonl"), start=0, trials=40, workdir=str(tmp_path),
                trial_timeout=1, docs=None)
    chaos.main(argparse.Namespace(kinds=None, **base))
    assert drawn and not set(drawn) & set(chaos.OPT_IN_KINDS)
    drawn.clear()
    chaos.main(argparse.Namespace(kinds="moe-trainer,moe-poisoned-expert", **{**base, "seed": 2, "trials": 4}))
    assert sorted(drawn) == ["moe-poisoned-expert", "moe-poisoned-expert", "moe-trainer", "moe-trainer"]


def test_a_campaign_on_a_cluster_file_keeps_its_scheme_and_reports_per_file(tmp_path):
    """--config: every trial runs the file's shape and scheme (no --redundancy of the kind's own),
    shares a reference per file, and is reported as 'kind @ file'; kinds that bring their own scheme,
    step count or restart limit are refused with the allowed list."""
    import argparse

    cfg = "/x/configs/cpu/rs-k3-m2-5x1.yaml"
    t = chaos.draw(3, 5, list(chaos.CONFIG_KINDS), config=cfg)
    assert t.config == cfg and f"--config={cfg}" in t.demo_args()
    assert not any(a.startswith("--redundancy") for a in chaos.Trial(0, 1, "launcher0", 4, 0, 12, config=cfg).demo_args())
    assert t.shape == "rs-k3-m2-5x1" and t.label == f"{t.kind} @ rs-k3-m2-5x1"
    outs = [{"trial": {**chaos.Trial(0, 1, "node", 4, 0, 12, config=cfg).__dict__}, "verdict": "right", "why": "",
             "load_before": 1.0, "when": "2026-11-25T17:00:00Z", "recovered_from": "decoded", "resumed_step": 3},
            {"trial": {**chaos.Trial(1, 1, "node", 4, 0, 12).__dict__}, "verdict": "right", "why": "",
             "load_before": 1.0, "when": "2026-11-25T17:00:00Z", "recovered_from": "disk", "resumed_step": 2}]
    text = chaos.report(outs, "megatron-ft chaos")
    assert "| node @ rs-k3-m2-5x1 | 1 | 1 | 0 | decoded | 3 | - | 0 |" in text and "| node | 1 | 1 | 0 | disk | 2 | - | 0 |" in text
    args = argparse.Namespace(config=cfg, kinds="node-rs", seed=1, results=str(tmp_path / "r.jsonl"))
    with pytest.raises(chaos.ftconfig.ConfigError, match=r"--kinds: \['node-rs'\] not among .* \(with --config\)"):
        chaos.main(args)


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
    ("trainer", 1, {**GOOD, "false_verdicts": ["node 1 (missed heartbeats for 5.2 s)"]}, [], "",
     ("wrong", "false verdict: ['node 1 (missed heartbeats for 5.2 s)']")),
    ("trainer", 1, None, [], "Traceback", ("wrong", "crash: no summary (exit 1)")),
    # two nodes of an xor group lost before the first persist completed: nothing else to promise
    ("two-nodes-xor", 0, {**GOOD, "promised_tier": "none", "recovered_from": "none", "newest_persisted_before_failure": None},
     [], "", ("right", "nothing persisted whole before the loss: a fresh start")),
    ("two-nodes-xor", 0, {**GOOD, "promised_tier": None, "recovered_from": "none", "newest_persisted_before_failure": None},
     [], "", ("wrong", "lower-tier: none < None")),  # no failure recorded at all: never right
    ("max-restarts-0", 1, None, [], "megatron-ft run failed with exit code 1", ("right", "the job ended non-zero, cleanly")),
    ("max-restarts-0", 0, GOOD, [], "", ("wrong", "max_restarts 0 should end the job non-zero (exit 0)")),
    # the guard: a poisoned version must be refused (one rollback); anywhere else a rollback is a false alarm
    ("poisoned", 0, {**GOOD, "recovered_from": "local_memory", "promised_tier": "local_memory", "rollbacks": 1}, [], "",
     ("right", "")),
    ("poisoned", 0, {**GOOD, "recovered_from": "local_memory", "promised_tier": "local_memory", "rollbacks": 0}, [], "",
     ("wrong", "rollbacks: 0, want 1")),
    ("node-rs", 0, {**GOOD, "rollbacks": 1}, [], "", ("wrong", "rollbacks: 1, want 0")),
    ("moe-poisoned-expert", 0, {**GOOD, "recovered_from": "local_memory", "promised_tier": "local_memory",
                                "rollbacks": 1}, [], "", ("right", "")),
    ("moe-poisoned-expert", 0, {**GOOD, "recovered_from": "local_memory", "promised_tier": "local_memory",
                                "rollbacks": 0}, [], "", ("wrong", "rollbacks: 0, want 1")),
])
def test_classification(kind, rc, summary, left, out, want):
    """Pure rules: a hang, a leak, a mismatch, a false failure verdict, a lower tier are wrong."""
    assert chaos.classify(trial(kind), rc, summary, left, out) == want


def test_report_tallies_kinds_and_load():
    outs = [{"trial": {"kind": "trainer", "index": i, "kill_at": 4, "kill_delay": 0.1}, "verdict": v, "why": w,
             "load_before": 1.0 + i, "when": "2026-11-24T19:00:00Z", "recovered_from": r, "resumed_step": s}
            for i, (v, w, r, s) in enumerate([("right", "", "local_memory", 3), ("wrong", "hang", None, None)])]
    outs[0]["restarted_by"] = "fast round 2"  # how it came back: a fast round or torchrun (older records: none)
    outs.append({**outs[0], "restarted_by": "torchrun restart 1"})
    text = chaos.report(outs, "megatron-ft chaos --seed 1")
    assert "| trainer | 3 | 2 | 1 | local_memory, none (clean exit) | 3 | fast round, torchrun restart | 0 |" in text and "trial 1 (trainer, kill at 4 +0.1 s): hang" in text
    assert "max 2.00" in text


# node0-replica with the slow set (default-suite time, CI < 15 min); node 0's launcher stays in the default
@pytest.mark.parametrize("kind", [pytest.param("node0-replica", marks=pytest.mark.slow), "launcher0"])
def test_one_real_trial(tmp_path, kind, reference_dir):
    """A real trial (demo run, SIGKILL at a wall-clock moment inside an iteration): right, at the
    promised tier. node0-replica loses the node hosting torchrun's rendezvous: the survivors move it
    to the next generation; launcher0 kills only that node's launcher (its torchrun, the rendezvous
    host, dies with it; its agent lives and reports no launcher): the survivors move the rendezvous
    too, and the restarted launcher adopts the agent and joins them."""
    t = chaos.Trial(0, 1, kind, 5, 0.05, 10)
    o = chaos.run_trial(t, str(tmp_path), timeout=300, references=reference_dir)  # the suite's reference runs
    assert (o.verdict, o.why) == ("right", ""), (o, open(tmp_path / "trial0000" / "demo.out").read()[-3000:])
    assert o.recovered_from == o.promised and o.resumed_step >= 1
    json.dumps(o.__dict__)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hang", "hang-in-restore", "agent-pause"])
def test_one_real_trial_of_a_hang(tmp_path, kind):
    """A trainer stopped and never resumed, a trainer stuck in its restore: found hung (one verdict, on
    the victim), ended, recovered from local memory bit-exact; an agent paused past health.timeout_s:
    its verdict withdrawn when it runs again, the job trains through (no restart, no false verdict)."""
    t = chaos.Trial(0, 1, kind, 5, 0.05, 12)
    o = chaos.run_trial(t, str(tmp_path), timeout=300)
    assert o.verdict == "right", (o, open(tmp_path / "trial0000" / "demo.out").read()[-3000:])
    if kind == "agent-pause":
        assert o.why == "trained through" and o.recovered_from == "none"
    else:
        assert o.recovered_from == o.promised == "local_memory" and o.resumed_step >= 1
    if kind == "hang-in-restore":  # past its restore's deadline: SIGUSR1 first, its stacks in the job's log
        log = open(tmp_path / "trial0000" / "demo" / "run.log").read()
        stack = log[log.index("Current thread 0x"):][:3000]
        assert "trainer/recovery.py" in stack and "in restore" in stack, stack


def _demo_args(*argv):
    import argparse

    from megatron_ft.testing import demo

    p = argparse.ArgumentParser()
    demo.add_parser(p.add_subparsers())
    return p.parse_args(["demo", *argv])


@pytest.mark.parametrize("argv,shape,want", [
    (["--fail=agent"], None, ([2, 3], [])),  # the last node's trainers, no node lost
    (["--fail=all-trainers"], None, ([0, 1], [])),
    (["--fail=node", "--victim-node=0"], None, ([0, 1], [0])),
    (["--fail=launcher", "--victim-node=0"], "replica", ([0, 1], [])),  # the rendezvous host's launcher
    (["--fail=launcher"], None, ([2, 3], [])),
    (["--fail=two-nodes", "--redundancy=rs"], "rs", ([2, 3], [2, 3])),  # 4 nodes x 1: the default victim and the highest other
    (["--fail=two-nodes", "--redundancy=xor"], "xor", ([4, 5, 2, 3], [1, 2])),
    (["--fail=two-nodes", "--redundancy=rs", "--victim-node=2", "--other-node=1"], "rs", ([2, 1], [1, 2])),
])
def test_demo_victims(argv, shape, want):
    from megatron_ft import config as ftconfig
    from megatron_ft.testing import demo

    cfg = ftconfig.load()
    if shape:
        cfg = ftconfig.replace(cfg, **demo.DEMO_SHAPES[shape])
    assert demo.choose_victims(_demo_args(*argv), cfg) == want


def test_demo_refuses_bad_failure_arguments():
    from megatron_ft import config as ftconfig
    from megatron_ft.testing import demo

    with pytest.raises(ftconfig.ConfigError, match="at least 3 nodes, not 2"):
        demo.choose_victims(_demo_args("--fail=two-nodes"), ftconfig.load())
    with pytest.raises(ftconfig.ConfigError, match="--victim-node=5 is invalid for --fail agent"):
        demo.choose_victims(_demo_args("--fail=agent", "--victim-node=5"), ftconfig.load())
    with pytest.raises(ftconfig.ConfigError, match="--victim-node=2 is invalid for --fail launcher: must be in "
                                                   "\\[0, 1\\]"):
        demo.choose_victims(_demo_args("--fail=launcher", "--victim-node=2"), ftconfig.load())
    # node 0's launcher under redundancy none: the survivors move the rendezvous too
    assert demo.choose_victims(_demo_args("--fail=launcher", "--victim-node=0"), ftconfig.load()) == ([0, 1], [])
    with pytest.raises(ftconfig.ConfigError, match="--second-failure is invalid with --fail=none"):
        demo.main(_demo_args("--fail=none", "--second-failure"))
    rs = ftconfig.replace(ftconfig.load(), **demo.DEMO_SHAPES["rs"])
    with pytest.raises(ftconfig.ConfigError, match=r"--other-node=4 is invalid for --fail two-nodes: must be in \[0, 3\]"):
        demo.choose_victims(_demo_args("--fail=two-nodes", "--victim-node=2", "--other-node=4"), rs)
    with pytest.raises(ftconfig.ConfigError, match="--other-node=2 is invalid: it must differ from --victim-node"):
        demo.choose_victims(_demo_args("--fail=two-nodes", "--victim-node=2", "--other-node=2"), rs)
    with pytest.raises(ftconfig.ConfigError, match="--with-agent is invalid with --fail=trainer "
                                                   "--kill-point=after-iteration"):
        demo.main(_demo_args("--fail=trainer", "--with-agent"))
    with pytest.raises(ftconfig.ConfigError, match="--with-agent is invalid with --fail=node"):
        demo.main(_demo_args("--fail=node", "--kill-point=truncate-empty-after-commit", "--with-agent"))


def test_a_verdict_on_a_node_the_run_did_not_take_down_is_found(tmp_path):
    from megatron_ft.testing import demo

    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "agent.log").write_text(
        "[agent n0 2026-11-26 02:16:03,449] ERROR root: node 1 missed heartbeats for 0.5 s and its agent's port "
        "127.0.0.1:46841 refuses connections: hardware failure (agent and memory lost)\n"
        "[agent n0 2026-11-26 02:17:03,449] ERROR root: node 2 missed heartbeats for 5.1 s: hardware failure "
        "(agent and memory lost)\n")
    assert demo.unexpected_verdicts(str(tmp_path), {1, 2}) == []
    assert demo.unexpected_verdicts(str(tmp_path), {1}) == ["node 2 (missed heartbeats for 5.1 s; node0's log)"]
