"""An agent that did not run for longer than ``health.timeout_s`` (SIGSTOP, a starved host) and runs
again: the root's verdict on it is withdrawn when nobody claimed its node (the node trains on), and
kept when a standby claimed it first - then the returning agent stands down. Never both."""
from __future__ import annotations

import json
import os

from megatron_ft.health.monitor import WITHDRAWN, Monitor


class Store:
    def __init__(self, root=0):
        self.data, self.root = {}, root

    @property
    def is_root(self):
        return True

    def get(self, key):
        return self.data.get(key)

    def set(self, key, value):
        self.data[key] = value

    def delete(self, key):
        self.data.pop(key, None)

    def compare_set(self, key, expected, desired):
        cur = self.data.get(key)
        if (cur is None and expected == "") or cur == expected:
            self.data[key] = desired
            cur = desired
        return cur or ""


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
    assert store.get("claim/1/4242").startswith(WITHDRAWN)  # no standby may claim it now
    assert store.compare_set("claim/1/4242", "", "standby-a").startswith(WITHDRAWN)


def test_a_paused_agent_whose_node_a_standby_claimed_stays_failed_and_stands_down():
    store = Store()
    root, now = judged(store)
    store.compare_set("claim/1/4242", "", "standby-a")
    store.set("hb/1", json.dumps({"pid": 4242, "seq": 2}))
    now[0] += 0.1
    root.beat()
    assert json.loads(store.get("failed/1"))["pid"] == 4242  # the verdict stands: the standby is node 1 now
    # the returning agent (node 1; here the test's own pid) sees it after its pause and stands down
    store.set("failed/1", json.dumps({"pid": os.getpid(), "why": "missed heartbeats"}))
    store.set(f"claim/1/{os.getpid()}", "standby-a")
    said, clock = [], [100.0]
    me = Monitor(store, 1, 2, heartbeat_s=0.1, timeout_s=1.0, clock=lambda: clock[0], fenced=said.append)
    me.beat()
    assert said == []  # no pause seen: nothing read
    clock[0] += 30.0  # this agent did not run for 30 s
    me.beat()
    assert len(said) == 1 and "standby-a claimed it" in said[0]


def test_a_returning_agent_whose_verdict_was_withdrawn_trains_on():
    store = Store()
    store.set("failed/1", json.dumps({"pid": os.getpid()}))
    store.set(f"claim/1/{os.getpid()}", f"{WITHDRAWN}0")
    said, clock = [], [0.0]
    me = Monitor(store, 1, 2, heartbeat_s=0.1, timeout_s=1.0, clock=lambda: clock[0], fenced=said.append)
    me.beat()
    clock[0] += 30.0
    me.beat()
    assert said == []
