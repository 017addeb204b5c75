"""The guard after every restore: a version whose bytes verify but whose values are NaN is refused,
every rank rolls back to the next older version, at most ``recovery.max_rollbacks`` times."""
import pytest
import torch

from megatron_ft.capture.state import TorchStateAdapter
from megatron_ft.testing.faults import poison
from megatron_ft.trainer.guard import RollbacksExhausted
from megatron_ft.trainer.recovery import Restorer
from megatron_ft.rank_files import find_rank_file

from test_agent import identity, make_model, train_and_snapshot


def _restorer(agent, client, **guard):
    return Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, client, **guard)


def _poison_newest(client) -> int:
    newest = client.request("list", rank=0)["versions"][0]
    poison(newest["path"])
    return newest["step"]


def test_a_poisoned_version_that_verifies_is_refused_and_the_older_one_restored_bit_exact(agent):
    c = agent.client()
    m, opt, _ = train_and_snapshot(c, agent.cfg, 2)  # the state of step 2
    older = ({k: v.clone() for k, v in m.state_dict().items()},
             {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()})
    train_and_snapshot(c, agent.cfg, 1, start=3, model=(m, opt))
    assert [v["step"] for v in c.request("list", rank=0)["versions"]] == [3, 2]
    assert _poison_newest(c) == 3
    # a persisted copy of the refused step (the same values) is dropped too, not offered by the disk tier later
    import os
    from megatron_ft.agent import persist
    on_disk = persist.rank_file(agent.cfg.persist.dir, agent.cfg.run_id, 3, 0)
    os.makedirs(os.path.dirname(on_disk), exist_ok=True)
    open(on_disk, "wb").close()

    m2, opt2 = make_model(seed=1)
    res = _restorer(agent, c).restore(TorchStateAdapter(m2, opt2))
    assert not os.path.exists(on_disk) and os.path.exists(on_disk + ".corrupt")
    assert (res.source, res.step, res.rollbacks) == ("local_memory", 2, 1)
    assert any("step 3: non-finite values" in r for r in res.rejected), res.rejected
    for k, v in older[0].items():
        assert torch.equal(m2.state_dict()[k], v), k
    for k, s in opt2.state_dict()["state"].items():
        for n, t in s.items():
            assert torch.equal(t, older[1][k][n]), (k, n)
    # the refused version is gone from the agent: a second restore does not meet it again
    assert [v["step"] for v in c.request("list", rank=0)["versions"]] == [2]


def test_without_the_guard_the_poisoned_version_would_be_restored(agent):
    """What the guard is for: the poisoned snapshot passes every checksum."""
    c = agent.client()
    train_and_snapshot(c, agent.cfg, 2)
    _poison_newest(c)
    m2, opt2 = make_model(seed=1)
    res = _restorer(agent, c, check_values=False).restore(TorchStateAdapter(m2, opt2))
    assert (res.step, res.rejected) == (2, [])
    assert any(not torch.isfinite(p).all() for p in m2.parameters())


def test_rollbacks_past_the_limit_end_the_restore_naming_the_steps(agent):
    c = agent.client()
    train_and_snapshot(c, agent.cfg, 2)
    for v in c.request("list", rank=0)["versions"]:
        poison(v["path"])
    m2, opt2 = make_model(seed=1)
    with pytest.raises(RollbacksExhausted, match=r"2 restored versions \(steps \[2, 1\] in this restore\) failed the "
                                                  r"guard, more than recovery.max_rollbacks=1"):
        _restorer(agent, c, max_rollbacks=1).restore(TorchStateAdapter(m2, opt2))


def test_the_agent_keeps_each_committed_steps_loss_and_counts_refused_versions(agent):
    """The loss check's memory: losses arrive with the commits (a non-finite one is not sent), survive a
    trainer's restart (a new connection), and ``refuse`` drops a restored version and everything newer
    (as a rewind to the step before) and counts the rollback."""
    from megatron_ft.trainer.snapshot import SnapshotEngine
    from megatron_ft.capture.state import TorchStateAdapter

    c = agent.client()
    m, opt = make_model()
    ad = TorchStateAdapter(m, opt)
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 14)
    for step, loss in ((1, 2.5), (2, float("nan")), (3, 2.25)):
        ad.extra = {"iteration": step}
        eng.snapshot(step, *ad.capture(), loss=loss)
        eng.wait()
    c2 = agent.client()  # a restarted trainer
    held = c2.request("losses", rank=0)
    assert (held["losses"], held["rollbacks"]) == ({"1": 2.5, "3": 2.25}, 0)
    assert [v["step"] for v in c2.request("list", rank=0)["versions"]] == [3, 2]
    assert c2.request("refuse", rank=0, step=3)["rollbacks"] == 1
    assert [v["step"] for v in c2.request("list", rank=0)["versions"]] == [2]
    assert c2.request("losses", rank=0)["rollbacks"] == 1
    # the restored step 2 then passed the guard: certified, the count forgiven (the limit is per incident)
    assert c2.request("certify", rank=0, step=2)["certified"] == [2]
    assert c2.request("losses", rank=0)["rollbacks"] == 0


@pytest.fixture
def certified_agent(job_config, tmp_path):
    """An agent of a job with ``recovery.prefer: certified`` (four slots per rank)."""
    import yaml

    from conftest import AgentProc
    from megatron_ft import config as ftconfig

    cfg = ftconfig.replace(job_config[0], recovery={"prefer": "certified"})
    path = str(tmp_path / "job-certified.yaml")
    yaml.safe_dump(cfg.to_dict(), open(path, "w"))
    a = AgentProc(cfg, path).start()
    yield a
    a.kill()
    a.forget_socket()


def _state(m, opt) -> tuple:
    return ({k: v.clone() for k, v in m.state_dict().items()},
            {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()})


def test_prefer_certified_restores_the_newest_certified_version_not_the_newest(certified_agent):
    """Step 2 certified and watched-then-certified while snapshots 3..6 go on: its slot stays, the
    restore with prefer: certified takes it (bit-exact), the one without takes the newest."""
    agent = certified_agent
    c = agent.client()
    m, opt, _ = train_and_snapshot(c, agent.cfg, 2)
    at_2 = _state(m, opt)
    assert c.request("watch", rank=0, step=2)["held"]
    train_and_snapshot(c, agent.cfg, 2, start=3, model=(m, opt))
    assert c.request("certify", rank=0, step=2)["held"]  # trained 2 iterations past it
    train_and_snapshot(c, agent.cfg, 2, start=5, model=(m, opt))
    listed = c.request("list", rank=0)["versions"]
    assert [v["step"] for v in listed if v["certified"]] == [2] and listed[0]["step"] == 6, listed

    m2, opt2 = make_model(seed=1)
    res = _restorer(agent, c, prefer_certified=True).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step, res.certified) == ("local_memory", 2, True)
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in at_2[0].items())
    assert all(torch.equal(t, at_2[1][k][n]) for k, s in opt2.state_dict()["state"].items() for n, t in s.items())
    # the restore rewound the agent to step 2: the newer, uncertified versions are gone
    assert [v["step"] for v in c.request("list", rank=0)["versions"]] == [2]


def test_prefer_certified_without_a_certified_version_restores_the_newest_and_says_so(certified_agent):
    agent = certified_agent
    c = agent.client()
    train_and_snapshot(c, agent.cfg, 3)
    m2, opt2 = make_model(seed=1)
    res = _restorer(agent, c, prefer_certified=True).restore(TorchStateAdapter(m2, opt2))
    assert (res.step, res.certified) == (3, False)


def test_a_certified_version_that_holds_nan_is_refused_and_an_older_one_taken(certified_agent):
    """Certified is a verdict on the losses, not on the copy: the value check still runs, and the
    rollback goes to the newest version at or before it."""
    agent = certified_agent
    c = agent.client()
    m, opt, _ = train_and_snapshot(c, agent.cfg, 1)
    at_1 = _state(m, opt)
    train_and_snapshot(c, agent.cfg, 2, start=2, model=(m, opt))
    assert c.request("certify", rank=0, step=1)["held"] and c.request("certify", rank=0, step=2)["held"]
    listed = {v["step"]: v for v in c.request("list", rank=0)["versions"]}
    assert listed[2]["certified"] and not listed[1]["certified"] and not listed[3]["certified"]
    from megatron_ft.testing.faults import poison
    poison(listed[2]["path"])
    m2, opt2 = make_model(seed=1)
    res = _restorer(agent, c, prefer_certified=True).restore(TorchStateAdapter(m2, opt2))
    assert (res.step, res.rollbacks, res.certified) == (1, 1, True), res
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in at_1[0].items())


def test_the_trainer_certifies_the_versions_its_losses_vouch_for_and_a_restore_takes_the_newest(
        job_config, tmp_path, monkeypatch):
    """The checkpointer with prefer: certified (certify_after 2) over ten iterations whose 7th loss spikes:
    versions 1-4 are certified as training goes on, 5 and 6 never are (the spike came within two
    iterations after them), 7 and 8 are again. A new trainer life restores step 8 - the newest certified,
    not the newest (10) - bit-exact, and says so."""
    import json

    import yaml

    from conftest import AgentProc
    from megatron_ft import config as ftconfig
    from megatron_ft.trainer.checkpointer import InMemoryCheckpointer

    cfg = ftconfig.replace(job_config[0], recovery={"prefer": "certified", "certify_after": 2})
    path = tmp_path / "job-certified.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    monkeypatch.setenv("MFT_RUN_DIR", str(tmp_path / "run"))
    agent = AgentProc(cfg, str(path)).start()
    topo = {"tp": 1, "pp": 1, "dp": 1}
    try:
        m, opt = make_model()
        ck = InMemoryCheckpointer(cfg, TorchStateAdapter(m, opt), 0, 1, topo, node=0, agent_socket=agent.sock)
        assert ck.restore().source == "none"
        states = {}
        for it in range(1, 11):
            loss = m(torch.randn(16, 32)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            ck.before_optimizer_step()
            opt.step()
            states[it] = _state(m, opt)
            ck.after_iteration(it, it * 16, loss=1e6 if it == 7 else 1.0)
        ck.before_optimizer_step()
        ck.close()
        events = [json.loads(line) for line in open(find_rank_file(str(tmp_path / "run" / "events"), 0, ".jsonl"))]
        assert [e["step"] for e in events if e["event"] == "certified"] == [1, 2, 3, 4, 7, 8]

        m2, opt2 = make_model(seed=1)
        ck2 = InMemoryCheckpointer(cfg, TorchStateAdapter(m2, opt2), 0, 1, topo, node=0, agent_socket=agent.sock)
        res = ck2.restore()
        assert (res.source, res.step, res.certified) == ("local_memory", 8, True)
        assert all(torch.equal(m2.state_dict()[k], v) for k, v in states[8][0].items())
        assert all(torch.equal(t, states[8][1][k][n]) for k, s in opt2.state_dict()["state"].items()
                   for n, t in s.items())
        ck2.close()
    finally:
        agent.kill()
        agent.forget_socket()


def test_without_prefer_certified_a_certification_keeps_no_slot(agent):
    """The guard certifies every restored version that passes; with recovery.prefer: newest (two slots per
    rank) that must not keep its slot, or the next snapshots find none free."""
    c = agent.client()
    m, opt, _ = train_and_snapshot(c, agent.cfg, 1)
    assert c.request("certify", rank=0, step=1)["held"] is False
    _, _, eng = train_and_snapshot(c, agent.cfg, 3, start=2, model=(m, opt))
    assert [v["step"] for v in c.request("list", rank=0)["versions"]] == [4, 3]
    assert all(st.ok for st in eng.history), [st.error for st in eng.history if not st.ok]
