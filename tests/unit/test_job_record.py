"""The job record (``megatron_ft.health.job_record``): the fold against a brute-force recomputation over
random sequences of the keys it is made of, read back through a real store server by the reader; its
parts within the store's value limit at 2,048 and 16,384 nodes; the reader's long poll woken by a
change; and the store's requests counted (not timed) at 8 and 64 nodes: per node per heartbeat period,
per launcher generation and per standby claim, none growing with N."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from megatron_ft import config as ftconfig
from megatron_ft.health import job_record as jr
from megatron_ft.health.monitor import Monitor
from megatron_ft.health.store import EmbeddedStore
from megatron_ft.health.wire_store import VALUE_MAX, KVServer, WireKV
from megatron_ft.rendezvous import Rendezvous, claim_failed_node


def served(nodes):
    server = KVServer(("127.0.0.1", 0), None).start()
    jr.RecordKeeper(nodes, "e1").install(server, "mft/r/")
    return server, server.local("mft/r/"), WireKV(*server.address, "mft/r/", 5.0)


def expected(nodes, keys, ends):
    """The record recomputed from scratch: the source keys as they stand, and every ``ended`` ever set."""
    rec = jr.JobRecord(nodes=nodes)
    for k, v in keys.items():
        n = int(k.split("/")[1]) if "/" in k else -1
        if k.startswith("hb/"):
            h = json.loads(v)
            rec.owners[n] = jr.Owners(h["pid"], h["launcher"], h["trained"])
        elif k.startswith("failed/"):
            f = json.loads(v)
            rec.failed[n] = jr.Failed(f["pid"], f["time"])
    fatal = sorted((int(k.split("/")[1]), json.loads(v)) for k, v in keys.items() if k.startswith("fatal/"))
    if fatal:
        n, f = fatal[0]
        rec.fatal = {n: jr.Fatal(n, f["code"], f["message"])}
    if ends:
        e = max(ends, key=lambda e: e["time"])
        rec.ended = jr.Ended(e["node"], e["rc"], e["time"])
    rec.rdzv = keys.get("rdzv")
    return rec


def same(view_rec, want):
    assert view_rec.owners == want.owners
    assert view_rec.failed == want.failed
    assert view_rec.fatal == want.fatal
    assert view_rec.ended == want.ended and view_rec.rdzv == want.rdzv


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_record_a_reader_sees_equals_a_recomputation_from_the_keys(seed):
    nodes = 1100  # three parts
    rnd = random.Random(seed)
    server, local, wire = served(nodes)
    view = jr.JobView(wire, nodes)
    keys, ends = {}, []
    hot = [rnd.randrange(nodes) for _ in range(40)] + [0, 511, 512, 1023, 1024, nodes - 1]
    try:
        for step in range(1500):
            n, what = rnd.choice(hot), rnd.random()
            if what < 0.45:
                k, v = f"hb/{n}", json.dumps({"pid": rnd.choice([10, 11, 12]), "seq": step, "time": step * 0.1,
                                              "launcher": rnd.choice([0, 20]), "addr": "", "trained": rnd.random() < .5})
            elif what < 0.7:
                k, v = f"failed/{n}", json.dumps({"node": n, "pid": rnd.choice([10, 11]), "time": step + 0.123456789,
                                                  "why": "missed heartbeats", "kind": "hardware"})
            elif what < 0.85:
                k, v = f"failed/{n}", None
            elif what < 0.9:
                k, v = f"fatal/{n}", json.dumps({"format": jr.FATAL_FORMAT, "node": n, "code": rnd.choice([2, 3]),
                                                 "message": f"m{step}"})
            elif what < 0.95:
                ends.append({"node": n, "rc": rnd.choice([0, 1, None]), "time": rnd.uniform(0, 100)})
                k, v = "ended", json.dumps(ends[-1])
            else:
                k, v = "rdzv", json.dumps({"gen": step})
            if v is None:
                local.delete(k)
                keys.pop(k, None)
            else:
                local.set(k, v)
                keys[k] = v
            if step % 300 == 299:  # the reader catches up part by part
                same(view.refresh(owners=True), expected(nodes, keys, ends))
        same(view.refresh(owners=True), expected(nodes, keys, ends))
        for k in server._map.data:  # every stored part fits, and says what it is
            if k.startswith("mft/r/job/"):
                assert len(server._map.data[k]) <= VALUE_MAX
    finally:
        wire.close()
        server.close()


@pytest.mark.parametrize("nodes", [2048, 16384])
def test_parts_fit_the_store_value_limit_and_round_trip(nodes):
    parts = jr.parts_of(nodes)
    assert parts == nodes // jr.PART_NODES
    rec = jr.JobRecord(nodes=nodes, epoch="0/4194304/1712345678.123456")
    ends = [range(0, jr.PART_NODES), range(nodes - jr.PART_NODES, nodes)]  # the first part and the last
    for n in (n for r in ends for n in r):
        rec.owners[n] = jr.Owners(4194304 - n, 4194000 - n, n % 2 == 0)
        rec.failed[n] = jr.Failed(4194304 - n, 1712345678.1234567 + n)
    sizes = []
    for kind in ("owners", "failed"):
        back: dict = {}
        for p in (0, parts - 1):
            text = jr.encode_part(rec, kind, p, 7)
            sizes.append(len(text.encode()))
            epoch, version, entries = jr.decode_part(text, kind, p, nodes)
            assert (epoch, version) == (rec.epoch, 7)
            back.update(entries)
        assert back == (rec.owners if kind == "owners" else rec.failed)
    index = jr.encode_events(rec, [1 << 40] * parts)
    assert max(sizes) <= jr.largest_part_bytes(nodes) < VALUE_MAX and len(index) < 4096, (max(sizes), len(index))
    with pytest.raises(ValueError, match=r"names node 600, outside \[0, 512\)"):
        jr.decode_part(json.dumps({"format": jr.PART_FORMAT, "kind": "failed", "part": 0, "nodes": {"600": [1, 2.0]}}),
                       "failed", 0, nodes)


def test_a_readers_wait_wakes_on_a_verdict_and_returns_unchanged_after_its_wait():
    server, local, wire = served(4)
    watcher = WireKV(*server.address, "mft/r/", 5.0)

    class Both:  # a reader's store: gets on one connection, the long poll on another
        get, watch = wire.get, watcher.watch

    view = jr.JobView(Both(), 4)
    try:
        view.refresh()
        t0 = time.monotonic()
        rec = view.wait(view.version, 0.3)  # nothing changes: back after its wait, same version
        assert 0.25 < time.monotonic() - t0 < 2.0 and rec.failed == {}
        local.set("hb/2", json.dumps({"pid": 5, "launcher": 6}))  # owners only: no waiter is woken
        threading.Timer(0.3, lambda: local.set("failed/2", json.dumps({"pid": 5, "time": 9.5}))).start()
        t0 = time.monotonic()
        v = view.version
        rec = view.wait(v, 20.0)
        assert time.monotonic() - t0 < 5.0 and rec.failed == {2: jr.Failed(5, 9.5)} and view.version > v
    finally:
        watcher.close()
        wire.close()
        server.close()


# ---------------------------------------------------------------------------------------------- counts

def requests(server) -> int:
    """Requests a server answered on the wire (its own process's calls, ``local ...``, are not)."""
    return sum(v for k, v in server.op_counts().items() if " " not in k)


class Job:
    """``nodes`` real embedded stores (one per node, each its own server on 127.0.0.<n+1>) and their
    monitors, driven beat by beat from the test (no threads of their own)."""

    def __init__(self, nodes, port):
        run = f"count{nodes}"
        hosts = [f"127.0.0.{n + 1}" for n in range(nodes)]
        self.stores = [EmbeddedStore(run, n, nodes, hosts, port, timeout_s=5.0) for n in range(nodes)]
        for s in self.stores:
            s.connect(10)
        self.monitors = [Monitor(s, s.node, nodes, heartbeat_s=0.25, timeout_s=5.0, launcher_pid=lambda n=n: 9000 + n)
                         for n, s in enumerate(self.stores)]
        self.root = self.stores[0]._server

    def beat(self, rounds):
        for _ in range(rounds):
            for m in self.monitors:
                m.beat()

    def close(self):
        for s in self.stores:
            s.close()


class Client:
    """A launcher's or standby's store client on the root's server (StoreClient's interface)."""

    def __init__(self, server, run):
        self.kv = WireKV(*server.address, f"mft/{run}/", 5.0)
        self._w = WireKV(*server.address, f"mft/{run}/", 5.0)
        self.get, self.set, self.compare_set = self.kv.get, self.kv.set, self.kv.compare_set

    def connect(self, deadline_s=0.0):
        return self

    def watch(self, key, value, wait_s):
        return self._w.watch(key, value, wait_s)


def costs(nodes, port):
    job = Job(nodes, port)
    try:
        job.beat(2)
        before = requests(job.root)
        job.beat(10)
        per_node_period = (requests(job.root) - before) / (10 * nodes)
        cfg = ftconfig.from_dict({"run_id": f"count{nodes}", "cluster": {"nodes": nodes, "ranks_per_node": 1},
                                  "launch": {"start_timeout_s": 3}})
        r = Rendezvous(cfg, nodes - 1)
        r.store = Client(job.root, f"count{nodes}")
        before = requests(job.root)
        r.begin(r.initial())  # remembers every node's owners: the record's owners once
        first = requests(job.root) - before
        job.beat(1)
        before = requests(job.root)
        r.begin(r.initial())  # the next generation: nothing changed
        again = requests(job.root) - before
        standby = Client(job.root, f"count{nodes}")
        got = []
        t = threading.Thread(target=lambda: got.append(claim_failed_node(standby, nodes, "s", timeout_s=20,
                                                                          log=lambda m: None)))
        t.start()
        time.sleep(0.5)
        waiting = requests(job.root)
        job.monitors[0]._judge(3, 4242, "a test's verdict")  # the root's verdict (in process)
        t.join(20)
        claim = requests(job.root) - waiting
        assert got and got[0][0] == 3 and got[0][1]["why"] == "a test's verdict"
        return per_node_period, first, again, claim
    finally:
        job.close()


def test_requests_per_node_per_period_per_generation_and_per_claim_do_not_grow_with_nodes():
    from megatron_ft.testing.helpers import free_port

    small, large = costs(8, free_port()), costs(64, free_port())
    print(f"\n8 nodes: {small}\n64 nodes: {large}")
    # each agent sets its heartbeat and reads the root's: 2 (N - 1) / N per node; the root reads in process
    assert small[0] <= 2.0 and large[0] <= 2.0, (small, large)
    assert large[1:] == small[1:], (small, large)  # a launcher's generation, a standby's claim: the same at 64


def test_a_launchers_fatal_record_reaches_the_other_launchers_watch_through_the_store():
    """Node 1's launcher ends the job (``fatal/1``); node 0's launcher's watch sees it on the record held by
    a real root (an embedded store in this process), with no file of node 1 to read."""
    from megatron_ft.rendezvous import FatalWatch
    from megatron_ft.testing.helpers import free_port

    port = free_port()
    cfg = ftconfig.from_dict({"run_id": "fatalrec", "cluster": {"nodes": 2, "ranks_per_node": 1},
                              "health": {"store_port": port}, "redundancy": {"scheme": "none"}})
    root = EmbeddedStore("fatalrec", 0, 2, [], port, timeout_s=5.0)
    root.connect(10)
    watch = FatalWatch(cfg).start()
    try:
        time.sleep(0.3)  # the watch waits on the record (a long poll)
        Rendezvous(cfg, 1).record_fatal("no shared memory for rank 3", 3)
        deadline = time.monotonic() + 10
        while watch.seen is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.seen == (1, "no shared memory for rank 3", 3)
    finally:
        watch.stop()
        root.close()
