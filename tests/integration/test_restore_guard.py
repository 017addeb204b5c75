"""The guard after every restore: a version whose bytes verify but whose values are NaN is refused,
every rank rolls back to the next older version, at most ``recovery.max_rollbacks`` times."""
import pytest
import torch

from megatron_ft.capture.state import TorchStateAdapter
from megatron_ft.testing.faults import poison
from megatron_ft.trainer.guard import RollbacksExhausted
from megatron_ft.trainer.recovery import Restorer

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
