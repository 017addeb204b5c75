"""The scale bed (megatron_ft/testing/scale_bed.py) at a small size: 8 simulated nodes' real agents, store
and wire over 2 worker processes, light trainers on the real protocol, 3 measured agreed steps; then 2
restores' job-wide decisions (intersect of the held steps, min of the verdicts twice) by every client
through its agent."""
import os

import pytest

from megatron_ft.testing.scale_bed import ScaleBed


def test_every_agent_learns_each_agreed_step_and_each_restore_decision_in_two_messages_per_node():
    bed = ScaleBed(8, procs=2, heartbeat_s=1.0, timeout_s=30.0, step_timeout_s=20.0)
    shm_dir, tmp = bed.shm_dir, bed.tmp
    try:
        bed.start(timeout_s=60)
        pids = [w.popen.pid for w in bed.workers]
        assert len(pids) == 2
        steps = [bed.step(s) for s in (1, 2, 3)]
        fig = bed.run(3, warmup=0, settle_s=0.3)  # steps 4-6
        restores = bed.restores(2, decisions=3, fresh=False, wait_s=30.0, settle_s=0.3)
    finally:
        closed = bed.close()
    for r in steps:  # every agent applied each step as agreed
        assert r["missing"] == [] and r["nodes_learnt"] == 8, r
        assert r["skipped"] == 0
    # the design: one report in and one verdict out per node per agreed step (2 rounds); slack for a
    # verdict watch re-issued across the window's edges
    assert 1.5 <= fig["agreement_msgs_per_node_step"] <= 2.5, fig
    assert fig["reports_sent_per_node_step"] == 1.0 and fig["verdicts_seen_per_node_step"] == 1.0, fig
    assert fig["rounds"] == 2
    assert fig["skipped_pending"] == 0
    # the restore's decisions: every client answered, all got the same combined answers - the steps every
    # node holds (5 and 6: each agent keeps its 2 newest, steps 1-6 agreed), then (every rank ok, none refused)
    assert restores["failed"] == 0 and restores["errors"] == [], restores
    assert restores["clients_answered"] == 8
    assert restores["same_answers"], restores
    assert restores["answers"] == [["[5, 6]"], ["[1, 1]"], ["[1, 1]"]], restores
    # the design: one contribution in and one result out per node per decision (2 rounds); slack for a
    # result watch re-polled on a slow machine
    assert restores["contributions_per_node_decision"] == 1.0, restores
    assert 1.5 <= restores["msgs_per_node_decision"] <= 2.5, restores
    assert restores["decisions_sent_per_node_decision"] == 1.0 and restores["rounds"] == 2, restores
    # nothing left behind at the root: every contribution absorbed, no decision open
    assert restores["left_contributions"] == [] and restores["left_open"] == [], restores
    assert restores["results_kept"] == 6
    # the agents' store watch connections: opened in the warm-up restore, reused by the measured ones
    assert restores["watch_conns_added"] == 0, restores
    # torn down: no segment, socket or worker left
    assert closed == {"left": [], "stuck_workers": [], "alive_workers": []}, closed
    assert not os.path.exists(shm_dir) and not os.path.exists(tmp)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_restore_on_its_own_connection_leaves_no_store_connection_behind():
    bed = ScaleBed(4, procs=2, heartbeat_s=1.0, timeout_s=30.0, step_timeout_s=20.0)
    try:
        bed.start(timeout_s=60)
        for s in (1, 2):
            bed.step(s)
        first = bed.restores(1, decisions=3, fresh=True, wait_s=30.0, settle_s=0.3)
        again = bed.restores(2, decisions=3, fresh=True, wait_s=30.0, settle_s=0.3)
    finally:
        bed.close()
    assert first["same_answers"] and again["same_answers"] and again["failed"] == 0, again
    # each agent opened the connections its watches need when it joined (reserve_watchers): not even the
    # first restore after a node loss opens one - every node at once would be a burst of handshakes at the root
    assert first["watch_conns_added"] == 0, first
    assert again["watch_conns_added"] == 0, again


def test_health_mode_counts_the_stores_requests_per_node_and_a_lost_node_is_judged_once_and_claimed_once():
    """The health scenario (megatron_ft/testing/scale_health.py) at 6 nodes: heartbeats only, counted at
    the root's store; then one node's agent lost, judged by the root, and claimed by exactly one of two
    waiting standbys (real ``claim_failed_node``, each its own store client)."""
    from megatron_ft.testing import scale_health as sh

    bed = ScaleBed(6, procs=2, heartbeat_s=0.5, timeout_s=2.0, mode="health")
    sides = None
    try:
        bed.start(timeout_s=60)
        sides = sh.start_sides(bed)
        h = sh.health_run(bed, 2.0)
        d = sh.detect(bed, [5], sides, standbys=2)
    finally:
        if sides is not None:
            sh.stop_sides(sides)
        closed = bed.close()
    # every node's heartbeat reached the root's store, no node judged while all were healthy
    assert h["root_ops"].get("set hb", 0) + h["root_ops"].get("local set hb", 0) >= 5 * 3, h["root_ops"]
    assert h["false_verdicts"] == 0 and h["last_verdict"] is None, h
    # a few requests per node per heartbeat, not one per node per node
    assert 0.5 <= h["store_requests_per_node_period"] <= 4.0, h
    assert h["root_rounds"] >= 2 and h["beats"] >= 5, h
    # the lost node: judged by the root (its pid, missed heartbeats), claimed by one standby only
    assert [(v["node"], v["detected_by"]) for v in d["verdicts"]] == [(5, 0)], d
    assert d["detected_s"] is not None and d["claims"] == 1, d
    assert d["standby_errors"] == [], d
    assert closed == {"left": [], "stuck_workers": [], "alive_workers": []}, closed
