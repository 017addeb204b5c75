"""An agent that did not run for longer than ``health.timeout_s`` (SIGSTOP, a starved host) and runs
again: the root's verdict on it is withdrawn when nobody claimed its node (the node trains on), and
kept when a standby claimed it first - then the returning agent stands down. Never both."""
from __future__ import annotations

import json
import os

from megatron_ft.health.monitor import WITHDRAWN, Monitor, claim_key
from megatron_ft.testing.helpers import RecordStore


class Store(RecordStore):
    """The root's store: a real store server (keeping the job record, as a root agent's does) read and
    written in process, as the root agent does its own."""

    def __init__(self, root=0):
        super().__init__(2)
        self.root = root

    @property
    def is_root(self):
        return True

    @property
    def data(self):
        return {k: v for k, v in self.server._map.data.items() if not k.startswith("job/")}


def judged(store):
    """A root (node 0) that judged node 1's agent (pid 4242) lost after its heartbeats stopped."""
    now = [0.0]
    root = Monitor(store, 0, 2, heartbeat_s=0.1, timeout_s=1.0, clock=lambda: now[0])
    store.set("hb/1", json.dumps({"pid": 4242, "seq": 1}))
    root.beat()
    for _ in range(15):
        now[0] += 0.1
        root.beat()
    assert json.loads(store.get("failed/1"))["pid"] == 4242
    return root, now


def test_a_paused_agent_that_nobody_replaced_gets_its_verdict_withdrawn():
    store = Store()
    root, now = judged(store)
    store.set("hb/1", json.dumps({"pid": 4242, "seq": 2}))  # the same agent, running again
    now[0] += 0.1
    root.beat()
    assert store.get("failed/1") is None and 1 not in root.failed
    key = [k for k in store.data if k.startswith("claim/1/4242/")][0]
    assert store.get(key).startswith(WITHDRAWN)  # no standby may claim that verdict now
    assert store.compare_set(key, "", "standby-a").startswith(WITHDRAWN)


def test_a_paused_agent_whose_node_a_standby_claimed_stays_failed_and_stands_down():
    store = Store()
    root, now = judged(store)
    store.compare_set(claim_key(1, json.loads(store.get("failed/1"))), "", "standby-a")
    store.set("hb/1", json.dumps({"pid": 4242, "seq": 2}))
    now[0] += 0.1
    root.beat()
    assert json.loads(store.get("failed/1"))["pid"] == 4242  # the verdict stands: the standby is node 1 now
    # the returning agent (node 1; here the test's own pid) sees it after its pause and stands down
    mine = {"pid": os.getpid(), "why": "missed heartbeats", "time": 7.0}
    store.set("failed/1", json.dumps(mine))
    store.set(claim_key(1, mine), "standby-a")
    said, clock = [], [100.0]
    me = Monitor(store, 1, 2, heartbeat_s=0.1, timeout_s=1.0, clock=lambda: clock[0], fenced=said.append)
    me.beat()
    assert said == []  # no pause seen: nothing read
    clock[0] += 30.0  # this agent did not run for 30 s
    me.beat()
    assert len(said) == 1 and "standby-a claimed it" in said[0]


def test_a_returning_agent_withdraws_its_verdict_itself_before_any_standby_can_claim_it():
    store = Store()
    mine = {"pid": os.getpid(), "time": 9.0}
    store.set("failed/1", json.dumps(mine))
    said, clock = [], [0.0]
    me = Monitor(store, 1, 2, heartbeat_s=0.1, timeout_s=1.0, clock=lambda: clock[0], fenced=said.append)
    me.beat()
    clock[0] += 30.0
    me.beat()
    assert said == [] and store.get(claim_key(1, mine)).startswith(WITHDRAWN)
    from megatron_ft.launch import claim_failed_node

    try:  # a standby polling now finds the verdict withdrawn: it claims nothing
        claim_failed_node(store, 2, "standby-b", timeout_s=0.3, log=lambda *a: None)
    except TimeoutError:
        pass
    else:
        raise AssertionError("a standby claimed a withdrawn verdict")


def test_a_later_verdict_on_the_same_agent_can_be_claimed_again():
    first, later = {"pid": 4242, "time": 1.0}, {"pid": 4242, "time": 50.0}
    store = Store()
    store.set(claim_key(1, first), f"{WITHDRAWN}root0")
    store.set("failed/1", json.dumps(later))
    from megatron_ft.launch import claim_failed_node

    assert claim_failed_node(store, 2, "standby-c", timeout_s=1.0, log=lambda *a: None)[0] == 1
