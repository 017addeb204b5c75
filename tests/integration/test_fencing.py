"""Fencing (megatron_ft/health/fencing.py), on both stores: a standby's claim of a verdict fences the judged
agent; every write that agent makes afterwards - whatever the key, whatever thread - is refused with the
claimer named, its stand-down is called once, and the store's state is unchanged by it. A withdrawn
verdict fences nothing; another agent of the node (the claimer's, a restarted one) writes as before.
Embedded: two real EmbeddedStore servers on loopback (the root derives the fence in process); etcd: a
real etcd server (test_health's fixture), the claim's transaction puts the fence, and a fenced agent
takes no new lease."""
import json
import time
import uuid

import pytest

import test_health

from megatron_ft.health import fencing
from megatron_ft.health.monitor import WITHDRAWN, claim_key
from megatron_ft.testing.helpers import free_port_range

etcd = test_health.etcd  # the real etcd server (module fixture)

JUDGED_PID = 4242  # the agent the root judged lost (a pid of this test's choosing: the fence names it)


def verdict(node: int, pid: int) -> dict:
    return {"node": node, "kind": "hardware", "pid": pid, "detected_by": 0, "time": time.time(), "why": "test"}


def check_fenced(root_get, claimer_cas, judged, told):
    """Shared by both stores: ``judged`` is node 1's store armed as agent JUDGED_PID; ``claimer_cas`` a
    standby's compare-and-set; ``root_get`` a read at the store."""
    v = verdict(1, JUDGED_PID)
    judged.set("agree/1", "before the claim")  # not fenced yet: applies
    assert root_get("agree/1") == "before the claim"
    assert claimer_cas(claim_key(1, v), "", "spare-host:77") == "spare-host:77"
    assert root_get(fencing.fence_key(1, JUDGED_PID)) == "spare-host:77"  # the claim set the fence with it
    for write in (lambda: judged.set("agree/1", "stale"), lambda: judged.publish("size/1", "{}"),
                  lambda: judged.compare_set("rdzv", "", "mine"), lambda: judged.delete("agree/1")):
        with pytest.raises(fencing.Fenced, match="spare-host:77"):
            write()
    assert root_get("agree/1") == "before the claim" and root_get("rdzv") is None and root_get("size/1") is None
    assert len(told) == 1 and "spare-host:77" in told[0], told  # the stand-down, once


def test_an_embedded_store_refuses_a_claimed_agents_writes_and_tells_it_once():
    run, base = f"f{uuid.uuid4().hex[:6]}", free_port_range(2)
    from megatron_ft.health.store import EmbeddedStore

    root = EmbeddedStore(run, 0, 2, [], base, timeout_s=5.0)
    root.connect(10)
    judged = EmbeddedStore(run, 1, 2, [], base, timeout_s=5.0)
    told = []
    judged.fence_as(JUDGED_PID, told.append)
    judged.connect(10)
    try:
        # a withdrawn verdict fences nothing
        w = verdict(1, JUDGED_PID)
        w["time"] -= 100
        root.compare_set(claim_key(1, w), "", f"{WITHDRAWN}root0")
        assert root.get(fencing.fence_key(1, JUDGED_PID)) is None
        check_fenced(root.get, root.compare_set, judged, told)
        assert root._server.op_counts().get("fenced", 0) >= 4  # counted at the store
        # the node's next agent (another pid: a replacement, the claimer's) writes as before
        from megatron_ft.health.wire_store import WireKV

        other = WireKV("127.0.0.1", base, f"mft/{run}/", 5.0)
        other.set("agree/1", "the new agent's", fence=fencing.fence_key(1, JUDGED_PID + 1))
        other.close()
        assert root.get("agree/1") == "the new agent's" and len(told) == 1
    finally:
        for s in (judged, root):
            s.close()


def test_etcd_refuses_a_claimed_agents_writes_and_its_new_lease(etcd):
    from megatron_ft.health.etcd import EtcdKV, EtcdStore, alive_key

    run = f"f{uuid.uuid4().hex[:6]}"
    root = EtcdStore(etcd, run, 0, 2, timeout_s=2.0)
    root.connect(10)
    judged = EtcdStore(etcd, run, 1, 2, timeout_s=2.0)
    told = []
    judged.fence_as(JUDGED_PID, told.append)
    judged.connect(10)
    standby = EtcdKV(etcd, f"mft/{run}/", 2.0)  # a standby's client (the launcher's StoreClient uses it)
    try:
        check_fenced(root.get, standby.compare_set, judged, told)
        # a fenced agent whose lease lapsed takes no new liveness: its alive key stays the old lease's
        before = json.loads(root.get(alive_key(1)))
        with pytest.raises(fencing.Fenced):
            judged._new_lease()
        assert json.loads(root.get(alive_key(1)))["lease"] == before["lease"] and len(told) == 1
        # another agent of node 1 (not fenced) still can
        other = EtcdStore(etcd, run, 1, 2, timeout_s=2.0)
        other.fence_as(JUDGED_PID + 1, told.append)
        other.set("agree/1", "the new agent's")
        assert root.get("agree/1") == "the new agent's"
        other.close()
    finally:
        for s in (judged, root):
            s.close()
        standby.close()
