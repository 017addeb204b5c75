"""The pure parts of going on at fewer data-parallel replicas and growing back: a generation's record and
configuration, what each new node must hold, the step the handover restores from, and its plan
(megatron_ft/launch/generation.py, megatron_ft/launch/elastic.py, megatron_ft/policy/generations.py).
The whole handover runs in the slow set: tests/integration/test_elastic_demo.py."""
import itertools
import json
import random

import pytest

from megatron_ft import config as ftconfig
from megatron_ft.agent import shm
from megatron_ft.launch.elastic import HandoverError, plan_handover
from megatron_ft.launch.generation import (GenerationRecord, generation_config, import_name, read_pointer,
                                           write_pointer)
from megatron_ft.policy.elastic import coordinates
from megatron_ft.policy.generations import Generation, needed_by_node, restore_step, run_id_of


def _cfg(nodes=3, rpn=2, pipeline=2, scheme="replica", **more):
    return ftconfig.from_dict({"run_id": "j", "cluster": {"nodes": nodes, "ranks_per_node": rpn},
                               "parallel": {"pipeline": pipeline}, "redundancy": {"scheme": scheme}, **more})


def _shrink(lost=(1,), nodes=3, rpn=2, pipeline=2):
    g0 = Generation.first(nodes, rpn, pipeline=pipeline)
    g1 = g0.shrink(set(lost))
    return GenerationRecord(1, "shrink", "j", g1.slots, g1.idle, nodes, rpn, 1, pipeline, 1,
                            previous_slots=g0.slots, lost=tuple(lost), decided_at=1.5, decider=g1.slots[0])


def test_record_round_trips_and_refuses_what_is_not_one():
    rec = _shrink()
    assert GenerationRecord.from_json(rec.to_json()) == rec
    planned = GenerationRecord(**{**rec.__dict__, "step": 9, "holder": {0: 0, 2: 2}, "rebuilt": {0: [2, 3]},
                                  "sources": {2: "decoded"}})
    assert GenerationRecord.from_json(planned.to_json()) == planned
    with pytest.raises(ValueError, match="format"):
        GenerationRecord.from_json(json.dumps({"format": "something-else/1"}))
    with pytest.raises(ValueError, match="not JSON"):
        GenerationRecord.from_json("{")
    broken = json.loads(rec.to_json())
    del broken["slots"]
    with pytest.raises(ValueError, match="slots"):
        GenerationRecord.from_json(json.dumps(broken))


def test_a_generation_runs_as_a_job_of_its_own_with_its_nodes_hosts_in_slot_order():
    rec = _shrink(lost=(1,))
    one = generation_config(_cfg(), rec)
    assert (one.run_id, one.cluster.nodes, one.data_parallel) == ("j.e1", 2, 2)
    assert generation_config(_cfg(), GenerationRecord.first(_cfg())).run_id == "j"
    hosts = generation_config(_cfg(health={"hosts": ["h0", "h1", "h2"]}), rec)
    assert list(hosts.health.hosts) == ["h0", "h2"] and hosts.launch.master_addr == "h0"
    lost0 = generation_config(_cfg(health={"host_pattern": "gpu-{node}"}), _shrink(lost=(0,)))
    assert list(lost0.health.hosts) == ["gpu-1", "gpu-2"] and lost0.launch.master_addr == "gpu-1"
    assert run_id_of("j", 3) == "j.e3"


def test_each_new_node_holds_every_old_replica_of_its_ranks_coordinates():
    for nodes, rpn, pipeline in [(3, 2, 2), (4, 1, 1), (4, 2, 2), (6, 2, 3)]:
        g0 = Generation.first(nodes, rpn, pipeline=pipeline)
        for lost in itertools.combinations(range(nodes), 1):
            try:
                g1 = g0.shrink(set(lost))
            except ValueError:
                continue
            for new, old in ((g1, g0), (g0, g1)):  # the shrink, and the grow-back
                for node in range(len(new.slots)):
                    need = needed_by_node(new, old, node)
                    want = set()
                    for r in range(node * rpn, (node + 1) * rpn):
                        tp, _, pp = coordinates(r, 1, pipeline, new.data_parallel)
                        want |= {o for o in range(old.world_size)
                                 if coordinates(o, 1, pipeline, old.data_parallel)[::2] == (tp, pp)}
                    assert need == sorted(want), (nodes, rpn, pipeline, lost, node)


def test_the_restore_step_is_the_newest_every_surviving_rank_holds_and_the_lost_can_be_rebuilt_at():
    rng = random.Random(5)
    for _ in range(300):
        clean = {r: set(rng.sample(range(10), rng.randint(1, 4))) for r in range(rng.randint(1, 5))}
        rebuildable = set(rng.sample(range(10), rng.randint(1, 3))) if rng.random() < 0.5 else None
        common = set.intersection(*clean.values()) & (rebuildable if rebuildable is not None else set(range(10)))
        assert restore_step(clean, rebuildable) == (max(common) if common else None)


def test_the_plan_rebuilds_the_lost_ranks_on_a_surviving_group_member_at_the_group_s_complete_step():
    rec = _shrink(lost=(2,))
    reports = {0: {"clean": {"0": [5, 6], "1": [5, 6]}, "complete": 5},
               1: {"clean": {"2": [5, 6], "3": [6, 5]}, "complete": 5}}
    for scheme, tier in (("replica", "peer_memory"), ("xor", "decoded")):
        p = plan_handover(rec, reports, _cfg(scheme=scheme))
        assert p.step == 5 and p.rebuilt == {0: [4, 5]} and p.sources == {4: tier, 5: tier}
        assert p.holder == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 0}
    nothing_lost = GenerationRecord(**{**rec.__dict__, "lost": (), "slots": (0, 1, 2), "previous_slots": (0, 1)})
    assert plan_handover(nothing_lost, reports, _cfg()).step == 6  # a grow: the newest step every rank holds


def test_the_plan_is_refused_by_name_where_memory_cannot_give_the_step():
    rec = _shrink(lost=(2,))
    with pytest.raises(HandoverError, match="complete steps: \\[4\\]"):
        plan_handover(rec, {0: {"clean": {"0": [5, 6], "1": [5, 6]}, "complete": 4},
                            1: {"clean": {"2": [5, 6], "3": [5, 6]}, "complete": 4}}, _cfg())
    with pytest.raises(HandoverError, match="did not say"):
        plan_handover(rec, {0: {"clean": {"0": [5], "1": [5]}, "complete": 5}}, _cfg())
    with pytest.raises(HandoverError, match="nothing in memory"):
        plan_handover(rec, {0: {"clean": {"0": [5], "1": [5]}, "complete": 5},
                            1: {"clean": {"2": [5], "3": [5]}, "complete": 5}}, _cfg(scheme="none"))
    two = GenerationRecord(**{**rec.__dict__, "lost": (1, 2), "slots": (0,)})  # a ring of 3 keeps one loss
    with pytest.raises(HandoverError, match="lost together"):
        plan_handover(two, {0: {"clean": {"0": [5], "1": [5]}, "complete": 5}}, _cfg())


def test_imports_are_the_new_node_s_own_files_and_the_pointer_keeps_the_newest(tmp_path):
    name = import_name("j.e1", 1, 4)
    assert shm.held_by(name, "j.e1", 1) and not shm.held_by(name, "j", 1) and not shm.held_by(name, "j.e1", 0)
    assert read_pointer(str(tmp_path)) is None
    rec = _shrink()
    write_pointer(str(tmp_path), rec)
    newer = GenerationRecord(**{**rec.__dict__, "number": 2, "kind": "grow"})
    write_pointer(str(tmp_path), newer)
    write_pointer(str(tmp_path), rec)  # a late writer of the older generation does not win
    assert read_pointer(str(tmp_path)) == newer


def test_the_chaos_elastic_kinds_draw_the_lost_node_and_judge_the_tier_and_the_grow_back():
    from megatron_ft.testing import chaos

    drawn = {chaos.draw(3, i, ["elastic", "elastic-rs"]).victim for i in range(40)}
    assert drawn == {0, 1, 2, 3}
    t = chaos.draw(3, 0, ["elastic"])
    assert "--elastic" in t.demo_args() and f"--victim-node={t.victim}" in t.demo_args()
    assert "elastic" in chaos.OPT_IN_KINDS and t.shape == "elastic-replica"
    good = {"bitwise_identical": True, "recovered_from": "peer_memory", "promised_tier": "peer_memory", "resumed_step": 5, "data_parallel_before": 3,
            "data_parallel_after": 2, "grow": {"step": 9, "data_parallel_after": 3}}
    assert chaos.classify(t, 0, good, [], "") == ("right", "DP 3 -> 2 -> 3")
    assert chaos.classify(t, 0, {**good, "recovered_from": "disk"}, [], "")[0] == "wrong"
    assert chaos.classify(t, 0, {**good, "grow": {}}, [], "")[1].startswith("no grow-back")
    assert chaos.classify(t, 0, {**good, "bitwise_identical": False, "details": ["x"]}, [], "")[1] == "mismatch: ['x']"
    assert chaos.classify(t, None, None, [], "") == ("wrong", "hang")


def test_the_wait_for_a_replacement_ends_before_the_survivors_stop_waiting_in_their_rendezvous():
    with pytest.raises(ftconfig.ConfigError, match=r"recovery.elastic_after_s=200.*below launch.start_timeout_s=120"):
        _cfg(recovery={"elastic_after_s": 200}, launch={"start_timeout_s": 120})
    assert _cfg(recovery={"elastic_after_s": 60}, launch={"start_timeout_s": 120}).recovery.elastic
    assert not _cfg(recovery={"elastic_after_s": 0}, launch={"start_timeout_s": 10}).recovery.elastic


def test_a_generation_s_redundancy_fits_its_node_count():
    from megatron_ft.launch.generation import fitted_redundancy

    for scheme, extra in (("rs", {"k": 2, "m": 2}), ("rs", {"k": 3, "m": 1}), ("replica", {"replicas": 3}),
                          ("xor", {"group_size": 3}), ("none", {})):
        base = _cfg(nodes=4, rpn=1, pipeline=1, scheme=scheme, **({"redundancy": {"scheme": scheme, **extra}}
                                                                   if extra else {}))
        for nodes in (1, 2, 3, 4):
            fitted = ftconfig.replace(base, cluster={"nodes": nodes},
                                      redundancy=fitted_redundancy(base.redundancy, nodes))  # valid: no ConfigError
            r = fitted.redundancy
            if scheme == "rs" and nodes >= 2:
                assert r.m == min(base.redundancy.m, nodes - 1) and r.k + r.m <= nodes
            if nodes == 1:
                assert r.scheme == "none"
