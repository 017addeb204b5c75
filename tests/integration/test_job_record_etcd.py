"""The job record on etcd (``megatron_ft.health.job_view_etcd``), against a real etcd server (the
fixtures of test_health): the reader folds the keys' own events - a verdict, a fatal record, the end -
from one watch stream; a standby waiting on it claims a node whose agent's lease lapsed with a handful
of requests; and in a steady job nothing reaches the reader (an ``hb/`` is put only when its owners
change, so no event arrives per heartbeat)."""
import json
import threading
import time
import uuid

import test_etcd_liveness as tel
import test_health

etcd = test_health.etcd  # the real etcd server (a module fixture)


def test_a_standby_on_etcd_is_woken_by_the_record_and_claims_the_lost_node(etcd):
    from megatron_ft.health import job_record as jr
    from megatron_ft.health.etcd import EtcdKV
    from megatron_ft.health.store import job_view
    from megatron_ft.rendezvous import claim_failed_node

    run = f"t{uuid.uuid4().hex[:8]}"
    agents = [tel.agent(etcd, run, n, 3) for n in range(3)]
    kv = EtcdKV(etcd, f"mft/{run}/", 5.0)
    view = job_view(kv, 3)
    try:
        tel.wait_until("three heartbeats", lambda: len(view.refresh().owners) == 3, 10)
        v = view.version
        t0 = time.monotonic()
        view.wait(v, 1.0)  # a steady job: heartbeats every 0.1 s, no event reaches the reader
        assert view.version == v and time.monotonic() - t0 >= 0.9
        got, standby = [], EtcdKV(etcd, f"mft/{run}/", 5.0)
        t = threading.Thread(target=lambda: got.append(claim_failed_node(standby, 3, "spare", timeout_s=20,
                                                                          log=lambda m: None)))
        t.start()
        tel.stop(agents[2])  # its lease lapses TTL later: the root judges it
        t.join(20)
        assert got and got[0][0] == 2 and got[0][1]["kind"] == "hardware", got
        # one range read, the watch streams (one per 10 s), the compare-and-set and the verdict's read
        assert standby.requests <= 6, standby.requests
        kv.set("fatal/1", json.dumps({"format": jr.FATAL_FORMAT, "node": 1, "code": 3, "message": "no agent"}))
        rec = jr.wait_until(view, lambda r: r.first_fatal(), 10, "the fatal record")
        assert rec == jr.Fatal(1, 3, "no agent")
    finally:
        view.close()
        tel.stop(*agents[:2])
