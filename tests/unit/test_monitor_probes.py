"""The root's probes of suspected nodes run at once: eight hosts that do not answer (a listening socket
whose accept queue is full: the kernel drops the connection attempts, as a host that is down sends
nothing back) cost a beat one probe's bound, not eight, and a ninth node whose agent's port refuses is
judged in that same beat. Real sockets, a real store server read in process as the root reads it."""
from __future__ import annotations

import json
import socket
import time

from megatron_ft.health.monitor import Monitor
from megatron_ft.health.wire_store import KVServer


class RootStore:
    def __init__(self):
        self.server = KVServer(("127.0.0.1", 0), None).start()
        self.kv = self.server.local("")
        self.root, self.is_root = 0, True
        self.get, self.set, self.delete, self.compare_set = (self.kv.get, self.kv.set, self.kv.delete,
                                                             self.kv.compare_set)


def silent_port():
    """A port whose connection attempts get no answer: listening, its one-slot accept queue filled."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.settimeout(0.05)
        try:
            c.connect(srv.getsockname())
        except OSError:
            pass
        fillers.append(c)
    return srv, fillers


def test_probes_of_many_silent_hosts_take_one_bound_and_a_refusing_one_is_judged_in_the_same_beat():
    store, now = RootStore(), [0.0]
    holders = [silent_port() for _ in range(8)]
    with socket.socket() as s:  # a port nothing listens on any more
        s.bind(("127.0.0.1", 0))
        gone = s.getsockname()[1]
    addrs = [f"127.0.0.1:{srv.getsockname()[1]}" for srv, _ in holders] + [f"127.0.0.1:{gone}"]
    root = Monitor(store, 0, 10, heartbeat_s=0.25, timeout_s=30.0, clock=lambda: now[0])
    try:
        for n, addr in enumerate(addrs, 1):
            store.set(f"hb/{n}", json.dumps({"pid": 100 + n, "seq": 1, "addr": addr}))
        root.beat()  # first look: every node seen now
        now[0] += 0.6  # two heartbeats missed by all nine
        t0 = time.monotonic()
        root.beat()
        took = time.monotonic() - t0
        assert list(root.failed) == [9] and "refuses connections" in root.failed[9]["why"], root.failed
        assert took < 1.0, f"one beat took {took:.2f} s with 8 silent hosts (one after another: >= 2 s)"
    finally:
        root.stop()
        for srv, fillers in holders:
            for c in fillers:
                c.close()
            srv.close()
        store.server.close()


def test_no_verdict_once_this_nodes_training_is_over():
    """At a job's end agents stop one after another; a root whose own trainers all wrote "done" judges
    nobody (a refused port looks the same as a lost node's), and judges again once they train."""
    store, now, over = RootStore(), [0.0], [True]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = s.getsockname()[1]
    root = Monitor(store, 0, 2, heartbeat_s=0.25, timeout_s=1.0, clock=lambda: now[0], finished=lambda: over[0])
    try:
        store.set("hb/1", json.dumps({"pid": 101, "seq": 1, "addr": f"127.0.0.1:{gone}"}))
        root.beat()
        now[0] += 2.0  # past timeout_s, and the port refuses
        root.beat()
        assert root.failed == {} and store.get("failed/1") is None
        over[0] = False
        now[0] += 0.1
        root.beat()
        assert list(root.failed) == [1]
    finally:
        root.stop()
