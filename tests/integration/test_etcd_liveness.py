"""etcd used natively for liveness, against a real etcd server (the fixtures of test_health: Debian's
etcd 3.4 on free loopback ports, one over TLS with client certificates): an agent's lease expiring
(SIGKILL of a child process holding it) is a ``failed/<node>`` verdict within TTL + 1 s and a new
agent of that node withdraws it; a root whose lease expires is replaced by the lowest live node,
which judges the old root at once; a paused agent (SIGSTOP past its lease) is judged, and when it
runs again its verdict is withdrawn, or, its node claimed by a standby, it stands down; etcd requests per node per heartbeat period do not grow with the
number of nodes (4 and 32 simulated agents in one process, counted by the client); ``watch`` waits
on an etcd watch; all of it over TLS too."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import test_health

etcd, etcd_tls = test_health.etcd, test_health.etcd_tls  # the real etcd servers (module fixtures)

TIMEOUT_S = 1.0  # health.timeout_s: leases of 2 s (at least 2), refreshed every 0.67 s
HEARTBEAT_S = 0.1
TTL = 2


def agent(url, run, node, nodes, tls=None):
    """One agent's etcd side in this process: its store (lease, root) and its liveness monitor."""
    from megatron_ft.health.etcd import EtcdStore
    from megatron_ft.health.etcd_liveness import EtcdLiveness

    store = EtcdStore(url, run, node, nodes, timeout_s=TIMEOUT_S, tls=tls)
    store.connect(10)
    return store, EtcdLiveness(store, node, nodes, HEARTBEAT_S, TIMEOUT_S).start()


def stop(*agents):
    """An agent stops refreshing its lease (as a killed one): etcd deletes its keys TTL s later."""
    for store, monitor in agents:
        monitor.stop()
        store.close()


CHILD = """
import os, sys, time
from megatron_ft.health.etcd import EtcdStore
from megatron_ft.health.etcd_liveness import EtcdLiveness
url, run, node, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = EtcdStore(url, run, node, nodes, timeout_s=%r)
s.fence_as(os.getpid(), lambda why: os._exit(3))  # as the agent does: its writes fenced once its node is claimed
s.connect(10)
EtcdLiveness(s, node, nodes, %r, %r, fenced=lambda why: os._exit(3)).start()  # stands down: exit 3
print("ready", flush=True)
time.sleep(120)
""" % (TIMEOUT_S, HEARTBEAT_S, TIMEOUT_S)


def child(url, run, node, nodes):
    p = subprocess.Popen([sys.executable, "-c", CHILD, url, run, str(node), str(nodes)], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "ready", "the child agent did not start"
    return p


def wait_until(what, fn, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.02)
    pytest.fail(f"no {what} within {timeout_s} s")


def test_a_lost_agents_lease_expiry_is_a_verdict_within_ttl_plus_1s_and_a_new_agent_withdraws_it(etcd):
    run = f"t{uuid.uuid4().hex[:8]}"
    root = agent(etcd, run, 0, 2)
    store = root[0]
    procs = []
    try:
        assert store.is_root and store.root == 0
        procs.append(child(etcd, run, 1, 2))
        pid = procs[0].pid
        wait_until("alive/000001", lambda: store.get("alive/000001"), 5)
        wait_until("hb/1", lambda: store.get("hb/1"), 5)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        v = json.loads(wait_until("failed/1", lambda: store.get("failed/1"), TTL + 5))
        took = time.monotonic() - t0
        assert took <= TTL + 1, f"the verdict came {took:.2f} s after the SIGKILL (lease TTL {TTL} s)"
        assert (v["node"], v["kind"], v["pid"], v["detected_by"]) == (1, "hardware", pid, 0), v
        assert "liveness lease expired" in v["why"], v
        assert store.get("last_verdict") == f"1/{pid}/{v['time']}"
        assert json.loads(store.get("hb/1"))["pid"] == pid  # the last heartbeat record stays readable
        procs.append(child(etcd, run, 1, 2))  # a replacement agent (a new pid): the verdict goes
        wait_until("failed/1 withdrawn", lambda: store.get("failed/1") is None, 5)
        assert store.is_root  # nothing moved the root
    finally:
        for p in procs:
            p.kill()
            p.wait()
        stop(root)


def test_a_root_whose_lease_expires_is_replaced_by_the_lowest_live_node_which_judges_it(etcd):
    run = f"t{uuid.uuid4().hex[:8]}"
    agents = {n: agent(etcd, run, n, 4) for n in (2, 3, 0, 1)}  # the first to arrive is root, whatever its number
    try:
        assert [agents[n][0].root for n in range(4)] == [2] * 4
        assert [agents[n][0].is_root for n in range(4)] == [False, False, True, False]
        stop(agents[2])
        t0 = time.monotonic()
        wait_until("node 0 root", lambda: agents[0][0].is_root, TTL + 2)
        v = json.loads(wait_until("failed/2", lambda: agents[0][0].get("failed/2"), 3))
        took = time.monotonic() - t0
        assert took <= TTL + 1, f"the new root judged the old one {took:.2f} s after it stopped (lease TTL {TTL} s)"
        assert (v["node"], v["pid"], v["detected_by"]) == (2, os.getpid(), 0) and "lease expired" in v["why"], v
        assert agents[0][0].get("root") == "0"
        wait_until("every survivor follows node 0", lambda: all(agents[n][0].root == 0 for n in (0, 1, 3)), 3)
        assert [agents[n][0].is_root for n in (1, 3)] == [False, False]
    finally:
        stop(*agents.values())


def _requests_per_node_per_beat(url, nodes, window_s=3.0):
    run = f"t{uuid.uuid4().hex[:8]}"
    agents = [agent(url, run, n, nodes) for n in range(nodes)]
    try:
        time.sleep(1.0)  # every join seen by the root
        before = sum(s.kv.requests for s, _ in agents)
        time.sleep(window_s)
        sent = sum(s.kv.requests for s, _ in agents) - before
        assert [s.is_root for s, _ in agents].count(True) == 1
        return sent / nodes / (window_s / HEARTBEAT_S)
    finally:
        stop(*agents)


@pytest.mark.slow  # the default suite keeps one of each kind; `pytest -m slow` runs this
def test_etcd_requests_per_node_per_heartbeat_do_not_grow_with_the_number_of_nodes(etcd, capsys):
    """Counted by the client (``EtcdKV.requests``: unary calls and watch streams opened) over 3 s of a
    steady job, heartbeat_s 0.1 s, timeout_s 1 s. Reading every heartbeat every beat would be N + 2
    per node per beat (34 at 32 nodes)."""
    small = _requests_per_node_per_beat(etcd, 4)
    large = _requests_per_node_per_beat(etcd, 32)
    with capsys.disabled():
        print(f"\netcd requests per node per heartbeat period: {small:.3f} at 4 nodes, {large:.3f} at 32 nodes")
    assert large <= 1.0, large
    assert large <= small * 1.5 + 0.05, (small, large)


def test_store_watch_waits_on_an_etcd_watch_bounded_by_its_wait(etcd):
    from megatron_ft.health.etcd import EtcdKV, EtcdStore

    run = f"t{uuid.uuid4().hex[:8]}"
    s = EtcdStore(etcd, run, 0, 1, timeout_s=TIMEOUT_S)
    s.connect(10)
    writer = EtcdKV(etcd, f"mft/{run}/")
    try:
        threading.Timer(0.3, writer.set, ("k", "v")).start()
        t0, before = time.monotonic(), s.kv.requests
        assert s.watch("k", None, 5.0) == "v"
        # one read and one stream (and the lease's keepalive, when it falls in): no 50 ms poll
        assert 0.2 < time.monotonic() - t0 < 2.0 and s.kv.requests - before <= 3, s.kv.requests - before
        t0 = time.monotonic()
        assert s.watch("k", "v", 0.5) == "v"  # unchanged: returns after its wait
        assert 0.4 < time.monotonic() - t0 < 2.0
        assert s.watch("k", "w", 5.0) == "v"  # already different: at once
        threading.Timer(0.3, writer.delete, ("k",)).start()
        assert s.watch("k", "v", 5.0) is None
    finally:
        s.close()


@pytest.mark.slow  # the default suite keeps one of each kind; `pytest -m slow` runs this
def test_leases_root_watch_and_verdicts_work_over_tls(etcd_tls):
    from megatron_ft.health.etcd import EtcdTLS

    url, certs, _ = etcd_tls
    tls = EtcdTLS(certs["ca"], *certs["client"])
    run = f"t{uuid.uuid4().hex[:8]}"
    a, b = agent(url, run, 0, 2, tls), agent(url, run, 1, 2, tls)
    try:
        assert a[0].is_root and b[0].root == 0
        threading.Timer(0.3, a[0].set, ("k", "v")).start()
        assert b[0].watch("k", None, 5.0) == "v"
        stop(b)
        v = json.loads(wait_until("failed/1", lambda: a[0].get("failed/1"), TTL + 2))
        assert (v["node"], v["detected_by"]) == (1, 0), v
    finally:
        stop(a, b)


@contextlib.contextmanager
def judged_while_stopped(etcd):
    """A root agent and a child agent of node 1, the child SIGSTOPped until the root judged it lost:
    yields (the root's store, the child process, the verdict); the child is ended afterwards."""
    run = f"t{uuid.uuid4().hex[:8]}"
    root = agent(etcd, run, 0, 2)
    store = root[0]
    p = child(etcd, run, 1, 2)
    try:
        wait_until("alive/000001", lambda: store.get("alive/000001"), 5)
        os.kill(p.pid, signal.SIGSTOP)
        yield store, p, json.loads(wait_until("failed/1", lambda: store.get("failed/1"), TTL + 5))
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()
        stop(root)


def test_a_paused_agent_is_judged_and_its_verdict_withdrawn_when_it_runs_again_unclaimed(etcd):
    """SIGSTOP of an agent for longer than its lease: the root judges it; on SIGCONT its keepalive finds
    the lease gone, it takes a new one and puts ``alive/`` again with the same pid, and - no standby
    having claimed the node - the verdict is withdrawn (a tombstone in the verdict's claim key)."""
    from megatron_ft.health.monitor import WITHDRAWN, claim_key

    with judged_while_stopped(etcd) as (store, p, v):
        assert v["pid"] == p.pid
        os.kill(p.pid, signal.SIGCONT)
        wait_until("failed/1 withdrawn", lambda: store.get("failed/1") is None, TTL + 5)
        assert store.get(claim_key(1, v)).startswith(WITHDRAWN)
        assert json.loads(wait_until("alive/000001", lambda: store.get("alive/000001"), 5))["pid"] == p.pid
        assert p.poll() is None  # it trains on: not fenced


@pytest.mark.slow  # the default suite keeps one of each kind; `pytest -m slow` runs this
def test_a_paused_agent_whose_node_a_standby_claimed_stands_down_when_it_runs_again(etcd):
    from megatron_ft.health.monitor import claim_key

    with judged_while_stopped(etcd) as (store, p, v):
        assert store.compare_set(claim_key(1, v), "", "spare-host:4242") == "spare-host:4242"  # a standby's claim
        os.kill(p.pid, signal.SIGCONT)
        assert p.wait(timeout=TTL + 5) == 3  # fenced: it stood down
        assert store.get("failed/1") is not None  # the node stays failed: the standby has it


def test_the_etcd_root_follows_the_reports_on_a_watch_and_reads_no_key_per_period(etcd):
    """The job-wide agreement on etcd: the root reads the reports once, then follows ``agree/`` on one
    watch stream, each report folded as it arrives; idle, it reads no report (before: every report, every
    ``poll_s``) and only re-opens its stream now and then."""
    from megatron_ft.agent.agreement import REPORT_KEY, NodeReport
    from megatron_ft.agent.job_agreement import JobAgreement
    from megatron_ft.health.etcd import EtcdStore
    from megatron_ft.testing.helpers import wait_for

    run, n = f"t{uuid.uuid4().hex[:8]}", 3
    stores = [EtcdStore(etcd, run, i, n, timeout_s=TIMEOUT_S) for i in range(n)]
    jobs = []
    reads, streams = [], []
    root = stores[0]
    get, read_prefix, events = root.get, root.kv.read_prefix, root.kv.events
    root.get = lambda key: (reads.append(key) if key.startswith(REPORT_KEY) else None) or get(key)
    root.kv.read_prefix = lambda prefix: reads.append(prefix) or read_prefix(prefix)
    root.kv.events = lambda key, *a, **k: (streams.append(key) if key == REPORT_KEY else None) or events(key, *a, **k)
    try:
        for s in stores:
            s.connect(10)
        assert root.is_root
        learned = [[] for _ in range(n)]
        for i, s in enumerate(stores):
            jobs.append(JobAgreement(i, n, s, lambda v, i=i: learned[i].append(v), lambda: None, poll_s=0.5).start())
        for step in (3, 4):
            for j in jobs:
                j.report(NodeReport(held=(step,), seen=step))
            wait_for(f"every agent learns step {step}", lambda: all(seen and seen[-1].agreed == step for seen in learned),
                     10.0, lambda: repr(learned))
        reads.clear(), streams.clear()
        time.sleep(3.0)  # six periods of poll_s, nothing reported
        assert reads == [] and len(streams) <= 2, (reads, streams)
    finally:
        for j in jobs:
            j.close()
        for s in stores:
            s.close()


def test_the_etcd_roots_hang_verdict_reads_every_stall_report_in_one_request(etcd):
    """etcd derives no key: while its own node stalls, the root agent reads the N stall reports in one
    range read per tick (not one read per node) and writes the verdict."""
    from megatron_ft import config as ftconfig
    from megatron_ft.agent.hang_watch import HangWatch
    from megatron_ft.health import hang as rule
    from megatron_ft.health.etcd import EtcdStore

    run, n = f"t{uuid.uuid4().hex[:8]}", 6
    cfg = ftconfig.from_dict({"run_id": run, "cluster": {"nodes": n, "ranks_per_node": 1},
                              "parallel": {"tensor": 1, "pipeline": 1}})
    stores = [EtcdStore(etcd, run, i, n, timeout_s=TIMEOUT_S) for i in range(n)]
    try:
        for s in stores:
            s.connect(10)
        assert stores[0].is_root
        hung = rule.NodeStall(1, 1, (rule.Culprit(1, 4242, 4, "work", 6.0),), ())
        stores[1].publish(f"{rule.STALL_KEY}1", hung.encode())
        for k in range(2, n):  # every other node's rank waits
            stores[k].publish(f"{rule.STALL_KEY}{k}", rule.NodeStall(k, 1, (), (k,)).encode())
        own = rule.NodeStall(0, 1, (), (0,))  # the root's own node waits too
        stores[0].publish(f"{rule.STALL_KEY}0", own.encode())  # as its tick sends it before asking
        watch = HangWatch(cfg, 0, None, stores[0])
        before = stores[0].kv.requests
        verdict = watch._verdict(own)
        assert verdict is not None and [c.rank for c in verdict.culprits] == [1]
        assert stores[0].kv.requests - before <= 3  # one range read, the verdict written (+ a lease refresh); n + 1 before
        assert rule.HangVerdict.decode(stores[2].get(rule.HANG_KEY)).culprits[0].rank == 1
    finally:
        for s in stores:
            s.close()
