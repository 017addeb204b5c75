"""Which rendezvous generation a launcher joins (``megatron_ft.launch.Rendezvous``), against a real
store server keeping the job record (what a root agent's does): a node replaced between the host's loss
and the survivors' next generation must wait for that generation, never join the dead one; a live
host's generation is joined at once."""
from __future__ import annotations

import json
import threading
import time

from megatron_ft import config as ftconfig
from megatron_ft.launch import RdzvGeneration, Rendezvous
from megatron_ft.testing.helpers import RecordStore


class Store(RecordStore):
    """What the launcher asks of the agents' store: a real store server deriving the job record, and a
    client of it on the wire (a StoreClient's interface: connect, get, set, compare_set, watch, kv)."""

    def __init__(self, nodes=4):
        super().__init__(nodes, "mft/rdzv/", wire=True)

    def connect(self, deadline_s=0.0):
        return self

    def requests(self):
        return sum(v for k, v in self.server.op_counts().items() if " " not in k)


def job(node, store, timeout=3.0):
    cfg = ftconfig.from_dict({"run_id": "rdzv", "cluster": {"nodes": 4, "ranks_per_node": 1},
                              "parallel": {"tensor": 1, "pipeline": 2},
                              "launch": {"start_timeout_s": timeout}})
    r = Rendezvous(cfg, node)
    r.store = store
    return r


def beat(store, node, agent, launcher, trained=True):
    store.set(f"hb/{node}", json.dumps({"pid": agent, "launcher": launcher, "trained": trained}))


def running_job():
    """Generation 0 hosted by node 0 (agent 100, launcher 200), published by its launcher."""
    store = Store()
    for n in range(4):
        beat(store, n, 100 + n, 200 + n)
    host = job(0, store)
    host.begin(host.initial())
    return store


def test_the_host_publishes_who_it_is_and_a_replacement_of_a_live_job_joins_at_once():
    store = running_job()
    assert json.loads(store.get("rdzv"))["host_agent"] == 100
    t0 = time.monotonic()
    got = job(3, store).current(print)
    assert (got.gen, got.node) == (0, 0) and time.monotonic() - t0 < 1.0


def test_a_node_replaced_before_the_survivors_move_waits_for_their_generation_not_the_dead_one():
    store = running_job()
    store.set("failed/0", json.dumps({"node": 0, "pid": 100, "time": 5.0}))  # the root's verdict on node 0's agent
    nxt = RdzvGeneration(1, 1, "127.0.0.1", 11015, 101, 201)
    threading.Timer(0.7, lambda: store.set("rdzv", nxt.to_json())).start()  # the survivors, moments later
    got = job(3, store).current(print)
    assert (got.gen, got.node) == (1, 1)


def test_a_host_replaced_already_is_gone_even_once_its_verdict_is_withdrawn():
    store = running_job()
    beat(store, 0, 900, 901)  # node 0's replacement runs: its verdict was deleted
    nxt = RdzvGeneration(1, 1, "127.0.0.1", 11015, 101, 201)
    threading.Timer(0.7, lambda: store.set("rdzv", nxt.to_json())).start()
    assert job(3, store).current(print).gen == 1


def test_a_launcher_whose_torchrun_failed_joins_a_newer_published_generation_at_once():
    store = running_job()
    old = job(3, store).current(print)
    store.set("rdzv", RdzvGeneration(1, 1, "127.0.0.1", 11015, 101, 201).to_json())
    t0 = time.monotonic()
    got = job(3, store).after_failure(old, print)
    assert got.gen == 1 and time.monotonic() - t0 < 1.0


def test_a_record_of_the_earlier_format_is_still_joined():
    store = running_job()
    store.set("rdzv", json.dumps({"format": "megatron-ft-rdzv/1", "gen": 0, "node": 0, "addr": "127.0.0.1",
                                  "port": 11014}))
    assert job(3, store).current(print).port == 11014


def test_the_host_node_starting_last_hosts_the_record_another_launcher_put_back():
    """At the job's start (no trainer anywhere yet) the launchers that started first put generation 0's
    record into the store (keep_published); node 0's launcher, slower to start, hosts it at once - it is
    not a replacement of a lost host waiting for a next generation that nobody will make."""
    store = Store()
    for n in (1, 2, 3):
        beat(store, n, 100 + n, 200 + n, trained=False)
    store.set("rdzv", RdzvGeneration(0, 0, "127.0.0.1", 29400).to_json())
    said = []
    got = job(0, store, timeout=30.0).current(said.append)
    # hosted at once: not taken for a restart of this node's launcher, waiting for a next generation
    assert (got.gen, got.node) == (0, 0) and not [m for m in said if "starts again" in m], (got, said)
