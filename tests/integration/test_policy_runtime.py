"""`interval: auto`, the `failure:` / `simulate:` config sections, and the decision logic the
checkpointer consults (no processes, except one end-to-end check with a real agent)."""
import json
import os
import uuid

import pytest
import torch
import yaml

from megatron_ft import config
from megatron_ft.policy import recoverability as rc
from megatron_ft.policy.runtime import AutoIntervals, Measurement, decide, placement_from_config
from megatron_ft.rank_files import find_rank_file
from megatron_ft.testing.helpers import inmem_ckpt_flags


def auto_cfg(**sections):
    base = {"snapshot": {"interval": "auto", "measure_iterations": 3}, "persist": {"interval": "auto"}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return config.from_dict(base)


# ------------------------------------------------------------------ configuration


def test_interval_auto_is_parsed_and_normalised():
    cfg = auto_cfg()
    assert cfg.snapshot.auto and cfg.snapshot.interval == 1  # measurement interval
    assert cfg.persist.auto and cfg.persist.interval == 0  # the agents persist only when asked
    # round trip through YAML (what the launcher and the agents read)
    again = config.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg
    plain = config.load()
    assert not plain.snapshot.auto and not plain.persist.auto


@pytest.mark.parametrize("data, match", [
    ({"snapshot": {"interval": "sometimes"}}, r"snapshot.interval='sometimes' is invalid: must be an integer >= 1 or 'auto'"),
    ({"persist": {"interval": -3}}, r"persist.interval=-3 is invalid: must be an integer >= 0 or 'auto'"),
    ({"snapshot": {"interval": 5, "auto": True}}, r"snapshot.interval=5 is invalid: conflicts with snapshot.auto=true"),
    ({"snapshot": {"auto": "yes"}}, r"snapshot.auto='yes' is invalid: must be true or false"),
    ({"snapshot": {"measure_iterations": 0}}, r"snapshot.measure_iterations=0 is invalid"),
    ({"persist": {"bandwidth_mib_s": 0}}, r"persist.bandwidth_mib_s=0 is invalid: must be a number > 0.0"),
    ({"failure": {"node_mttf_hours": 0}}, r"failure.node_mttf_hours=0 is invalid: must be a number > 0.0"),
    ({"failure": {"node_mttf_hours": "long"}}, r"failure.node_mttf_hours='long' is invalid"),
    ({"failure": {"weibull_shape": -1}}, r"failure.weibull_shape=-1 is invalid: must be a number > 0.0 and <= 20.0"),
    ({"failure": {"software_fraction": 1.5}}, r"failure.software_fraction=1.5 is invalid: must be a number >= 0.0 and <= 1.0"),
    ({"failure": {"replacement_minutes": -1}}, r"failure.replacement_minutes=-1 is invalid"),
    ({"failure": {"standby_nodes": 1.5}}, r"failure.standby_nodes=1.5 is invalid: must be an integer >= 0"),
    ({"failure": {"restart_minutes": True}}, r"failure.restart_minutes=True is invalid"),
    ({"failure": {"mttf": 3}}, r"unknown key\(s\) \['failure.mttf'\]"),
    ({"simulate": {"nodes": []}}, r"simulate.nodes=\[\] is invalid: must be a non-empty list"),
    ({"simulate": {"nodes": [16, 0]}}, r"simulate.nodes\[1\]=0 is invalid"),
    ({"simulate": {"days": 0}}, r"simulate.days=0 is invalid"),
    ({"simulate": {"persist_interval_hours": "often"}}, r"simulate.persist_interval_hours='often' is invalid"),
    ({"simulate": {"rs_m": 0}}, r"simulate.rs_m=0 is invalid"),
])
def test_bad_policy_values_are_named(data, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(data)


def test_flags_accept_auto(tmp_path, monkeypatch):
    f = tmp_path / "job.yaml"
    p = inmem_ckpt_flags(monkeypatch, f, "snapshot: {interval: auto}\npersist: {interval: auto}\n")
    cfg = config.from_args(p.parse_args(["--inmem-ckpt-config", str(f), "--inmem-ckpt-interval", "4"]))
    assert cfg.snapshot.interval == 4 and not cfg.snapshot.auto and cfg.persist.auto  # the flag wins
    cfg = config.from_args(p.parse_args(["--inmem-ckpt-config", str(f), "--inmem-ckpt-persist-interval", "auto"]))
    assert cfg.persist.auto and cfg.persist.interval == 0
    cfg = config.from_args(p.parse_args(["--inmem-ckpt-interval", "auto"]))
    assert cfg.snapshot.auto


def test_shipped_configs_load():
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = config.load(os.path.join(here, "configs", "local-cpu.yaml"))
    assert cfg.failure.node_mttf_hours == 1600
    fig = config.load(os.path.join(here, "configs", "gemini-fig15.yaml"))
    assert fig.simulate.nodes[0] == 16 and fig.simulate.nodes[-1] == 1000
    assert fig.simulate.persist_interval_hours == "auto"


# ------------------------------------------------------------------ decision logic


def test_free_snapshots_go_every_iteration():
    cfg = auto_cfg(cluster={"nodes": 64, "ranks_per_node": 8}, parallel={"tensor": 8, "pipeline": 8})
    m = Measurement(iteration_s=10.0, capture_s=0.0, copy_s=3.0, stall_s=0.0, snapshot_bytes=8 << 30, samples=5)
    d = decide(m, cfg)
    assert m.overhead_s == 0 and d.snapshot_every == 1
    # persist: none scheme, half of the failures hardware -> the disk is needed; no faster than a persist
    persist_s = 8 * (8 << 30) / (500 * 2 ** 20)
    assert d.persist_every * 10.0 >= persist_s
    assert "snapshot every 1 it" in d.line and "REFT eq. 8" in d.line and "REFT eq. 11" in d.line


def test_snapshot_interval_follows_young():
    cfg = auto_cfg(failure={"node_mttf_hours": 100.0})  # 2 nodes -> a failure every 50 h
    m = Measurement(1.0, 0.5, 0.2, 0.0, 1 << 20, 5)
    d = decide(m, cfg)
    rate = 2 / (100 * 3600.0)
    young = (2 * 0.5 / rate) ** 0.5  # 424 s
    assert abs(d.snapshot_every - young) <= 1
    assert d.snapshot.young_s == pytest.approx(young)
    # a copy that does not fit behind the computation counts too (REFT eq. 8)
    slow = decide(Measurement(1.0, 0.2, 1.3, 0.5, 1 << 20, 5), cfg)  # compute 0.3 s
    assert slow.snapshot.overhead_s == pytest.approx(0.2 + (1.3 - 0.3))
    assert slow.snapshot_every > d.snapshot_every and slow.snapshot.min_iterations == 2
    # more nodes fail more often: snapshot more often
    big = decide(m, auto_cfg(failure={"node_mttf_hours": 100.0}, cluster={"nodes": 32}))
    assert big.snapshot_every < d.snapshot_every


def test_persist_interval_depends_on_the_scheme_and_failure_mix():
    m = Measurement(2.0, 0.05, 0.5, 0.0, 256 << 20, 5)
    cfg = auto_cfg(cluster={"nodes": 16, "ranks_per_node": 1}, parallel={"tensor": 1, "pipeline": 1})
    none = decide(m, cfg, rc.none_placement(16))
    rep = decide(m, cfg, rc.replica_placement(16, 2))
    assert none.persist_every % none.snapshot_every == 0 and rep.persist_every % rep.snapshot_every == 0
    assert rep.persist_every > 10 * none.persist_every  # REFT: protected snapshots rarely need the disk
    assert rep.scheme == "replica(m=2)" and "replica(m=2) loses memory in" in rep.line
    soft = decide(m, auto_cfg(failure={"software_fraction": 1.0}))
    assert soft.persist_every == 0 and "only at breakpoints" in soft.line


def test_fixed_intervals_are_kept():
    cfg = config.from_dict({"snapshot": {"interval": 7}, "persist": {"interval": "auto"}})
    d = decide(Measurement(1.0, 0.01, 0.1, 0.0, 1 << 20, 5), cfg)
    assert d.snapshot_every == 7 and d.persist_every % 7 == 0 and "(configured)" in d.line
    cfg = config.from_dict({"snapshot": {"interval": "auto"}, "persist": {"interval": 30}})
    assert decide(Measurement(1.0, 0.01, 0.1, 0.0, 1 << 20, 5), cfg).persist_every == 30


def test_placement_from_config_defaults_to_none():
    assert placement_from_config(config.load()).scheme == "none"

    class Red:
        scheme, replicas = "replica", 2

    class Cfg:
        cluster = config.load().cluster
        redundancy = Red()

    assert placement_from_config(Cfg()).label == "replica(m=2)"
    if hasattr(config, "RedundancyConfig"):  # the redundancy section, when present
        for red, label in [({"scheme": "replica", "replicas": 2}, "replica(m=2)"),
                           ({"scheme": "xor", "group_size": 2}, "xor(n=2)"),
                           ({"scheme": "rs", "k": 2, "m": 1}, "rs(k=2+m=1)")]:
            cfg = config.from_dict({"cluster": {"nodes": 4, "ranks_per_node": 1},
                                    "parallel": {"tensor": 1, "pipeline": 1}, "redundancy": red})
            assert placement_from_config(cfg).label == label


class Stats:
    def __init__(self, capture, copy, nbytes=1 << 20, ok=True):
        self.capture_s, self.copy_s, self.nbytes, self.ok = capture, copy, nbytes, ok


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_auto_intervals_measures_then_decides_once():
    cfg = auto_cfg(failure={"node_mttf_hours": 10.0})
    clock = Clock()
    reduced = []

    def reduce_max(vals):  # what the other (slower) rank would contribute
        reduced.append(list(vals))
        return [max(a, b) for a, b in zip(vals, [2.0, 0.1, 0.3, 0.0, 4 << 20])]

    auto = AutoIntervals(cfg, reduce_max, clock=clock)
    assert auto.snapshot_every == 1 and auto.snapshot_due(5)
    decisions = []
    for it in range(1, 8):
        if it > 1:
            auto.waited(0.01, Stats(5.0 if it == 2 else 0.02, 0.2))  # the first snapshot also registered
        clock.t += 1.0
        d = auto.tick()
        if d is not None:
            decisions.append((it, d))
    assert len(decisions) == 1 and decisions[0][0] == 4  # 3 snapshots and 3 iteration times measured
    assert len(reduced) == 1
    d = decisions[0][1]
    # medians: capture 0.02 (the 5 s registration outlier ignored), maxed with the other rank: 0.1, 2.0 s
    assert "iteration 2.000 s" in d.line and "snapshot 0.100 s" in d.line
    rate = 2 / (10 * 3600.0)
    # overhead = capture + max(0, copy - compute) = 0.1 s; Young sqrt(2 * 0.1 / rate) = 60 s = 30 iterations
    assert d.snapshot_every == 30
    assert auto.snapshot_every == 30 and auto.snapshot_due(60) and not auto.snapshot_due(61)
    assert auto.tick() is None and auto.decision is d


def test_persist_requests_follow_the_decision():
    cfg = auto_cfg()
    auto = AutoIntervals(cfg)
    assert auto.persist_step(10) is None  # nothing decided yet
    auto.decision = decide(Measurement(1.0, 0.5, 0.1, 0.0, 1 << 20, 3), cfg)
    every = auto.decision.persist_every
    assert every > 1
    assert auto.persist_step(-1) is None
    assert auto.persist_step(5) is None  # arms: first persist one interval later
    assert auto.persist_step(5 + every - 1) is None
    assert auto.persist_step(5 + every) == 5 + every
    assert auto.persist_step(5 + every + 1) is None
    assert auto.persist_step(5 + 3 * every) == 5 + 3 * every
    fixed = AutoIntervals(config.from_dict({"snapshot": {"interval": "auto"}, "persist": {"interval": 4}}))
    fixed.decision = decide(Measurement(1.0, 0.0, 0.1, 0.0, 1 << 20, 3), fixed.cfg)
    assert fixed.persist_step(100) is None  # the agent persists by itself every 4


# ------------------------------------------------------------------ end to end with a real agent


def test_checkpointer_auto_intervals_with_a_real_agent(tmp_path, monkeypatch, shm_cleanup):
    """The checkpointer measures 3 snapshots, logs the decision (one line, also in the event log),
    snapshots at the chosen interval and asks the agent to persist at the chosen interval."""
    from conftest import AgentProc
    from megatron_ft.trainer.checkpointer import InMemoryCheckpointer
    from megatron_ft.capture.state import TorchStateAdapter

    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = config.from_dict({
        "run_id": run_id, "cluster": {"nodes": 1, "ranks_per_node": 1}, "parallel": {"tensor": 1, "pipeline": 1},
        "snapshot": {"interval": "auto", "measure_iterations": 3},
        "persist": {"interval": "auto", "dir": str(tmp_path / "persist"), "bandwidth_mib_s": 1e6},
        "failure": {"node_mttf_hours": 1e-5, "software_fraction": 0.0},  # absurdly fragile: short intervals
    })
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    monkeypatch.setenv("MFT_RUN_DIR", str(tmp_path / "run"))
    shm_cleanup(cfg)
    agent = AgentProc(cfg, str(path)).start()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ck = InMemoryCheckpointer(cfg, TorchStateAdapter(model, opt), 0, 1, {"tp": 1, "pp": 1, "dp": 1}, node=0,
                                  agent_socket=agent.sock)
        assert ck.auto is not None
        ck.restore()
        snapped = []
        for it in range(1, 41):
            model(torch.randn(8, 64)).sum().backward()
            ck.before_optimizer_step()
            opt.step()
            opt.zero_grad()
            pending = ck.engine._pending
            ck.after_iteration(it, it * 8)
            if ck.engine._pending is not pending and ck.engine._pending is not None:
                snapped.append(it)
        ck.before_optimizer_step()
        d = ck.auto.decision
        assert d is not None and d.snapshot_every >= 1
        after = [s for s in snapped if s > 4]
        assert after and all(s % d.snapshot_every == 0 for s in after)
        c = agent.client(rank=0)
        persisted = c.request("wait_persisted", wait_s=60)["persisted"]
        c.close(orderly=True)
        if d.persist_every:
            assert persisted, "the agent never persisted on the policy's request"
        ck.close()
        events = [json.loads(line) for line in open(find_rank_file(str(tmp_path / "run" / "events"), 0, ".jsonl"))]
        auto_ev = [e for e in events if e["event"] == "auto_intervals"]
        assert len(auto_ev) == 1 and auto_ev[0]["reason"].startswith("auto intervals: snapshot every")
    finally:
        agent.kill()
