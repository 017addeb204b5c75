"""The scheduled transport on gloo, end to end but without agents (tests/integration/scheduled_job.py):
every block a receiver's agent is told is complete holds exactly the bytes of its sender's slot,
across pairs that copy to each other, a ring, two copies per rank, mixed modes and a rank that has
nothing to send at one transfer start. The full demo (tests/integration/test_recovery.py) runs it
with real agents and a node loss; the NCCL path needs GPUs (tests/gpu/test_scheduled_nccl.py)."""
from __future__ import annotations

import pytest
from scheduled_job import check_transfers, run


def check(ranks: dict[int, dict]) -> None:
    check_transfers(ranks)
    for out in ranks.values():
        assert all(rec["bytes"] > 0 for rec in out["records"])
        assert out["groups"] == [60], out["groups"]  # a fast link's chunks: the data group's one-minute floor


def test_two_ranks_copy_to_each_other_in_planned_chunks(tmp_path):
    ranks = run(tmp_path, "--world", "2", "--modes", "pipelined")
    check(ranks)
    assert all(len(out["records"]) >= 3 for out in ranks.values())


def test_mixed_modes_and_a_rank_with_nothing_to_send_at_one_start(tmp_path):
    ranks = run(tmp_path, "--world", "2", "--modes", "end,pipelined", "--skip-pin", "1:2")
    check(ranks)
    assert len(ranks[1]["records"]) == ranks[1]["pins"] - 1 >= 2  # its second start announced nothing
    assert len(ranks[0]["done"]) == len(ranks[1]["records"])


def test_through_the_link_gate_no_chunk_starts_while_training_uses_the_network(tmp_path):
    # training "sends" 8 ms in every 10 ms of the first 36 ms of each iteration, over the plan's
    # idle spans; at their planned offsets the chunks start inside those calls, through the gate
    # (window 1.5 ms after each call) only between them, and every block still arrives exact
    gated = run(tmp_path / "gated", "--world", "2", "--modes", "pipelined", "--calls", "--gate-ms", "1.5")
    check(gated)
    for r, out in gated.items():
        assert out["chunks"] > 10 and out["chunks_inside_calls"] <= 1, (r, out)  # one: a descheduled sender
        # the transport counts its own threads' CPU (the driver moved every chunk; each receiver ended)
        assert out["cpu_s"]["driver"] > 0 and out["cpu_s"]["receivers"] > 0, out["cpu_s"]
    offsets = run(tmp_path / "offsets", "--world", "2", "--modes", "pipelined", "--calls")
    check(offsets)
    assert sum(out["chunks_inside_calls"] for out in offsets.values()) > 4, offsets


@pytest.mark.slow  # 12 s; the two ranks' and the mixed modes' runs keep the driver's ordering in the default suite
def test_a_ring_and_two_copies_per_rank(tmp_path):
    ring = run(tmp_path / "ring", "--world", "3", "--replicas", "2", "--modes", "blocking,pipelined,end")
    check(ring)
    assert [out["srcs"] for _, out in sorted(ring.items())] == [[2], [0], [1]]
    two = run(tmp_path / "two", "--world", "3", "--replicas", "3", "--modes", "pipelined")
    check(two)
    assert all(len(out["srcs"]) == 2 and len(out["done"]) >= 4 for out in two.values())


def test_four_ranks_in_two_pairs_make_groups_of_their_pair_only(tmp_path):
    # replica m = 2 on four nodes: nodes {0, 1} and {2, 3} copy to each other. Every group the
    # transport makes (the bubble exchange's, the headers', the data group) spans the rank's pair,
    # and only the pair's ranks call new_group for it: no group of the world, no call for a group
    # a rank is not in (a world-sized group per plan is a full mesh at 16,384 ranks)
    ranks = run(tmp_path, "--world", "4", "--replicas", "2", "--modes", "pipelined")
    check(ranks)
    for r, out in ranks.items():
        pair = [0, 1] if r < 2 else [2, 3]
        assert out["srcs"] == out["dsts"] == [p for p in pair if p != r], (r, out["srcs"], out["dsts"])
        assert len(out["new_groups"]) == 3, (r, out["new_groups"])  # ctl, ctrl, one data group
        assert all(g["ranks"] == pair for g in out["new_groups"]), (r, out["new_groups"])
        if out["local_synchronization"]:
            assert all(g["local"] for g in out["new_groups"]), (r, out["new_groups"])


def test_ranks_in_unequally_many_groups_even_their_counts_and_make_their_pair_alone(tmp_path):
    # rank 0 belongs to one group more than the others: torch would name a group its pair makes
    # alone differently on rank 0 and rank 1 (a wait for ever). Each other rank first makes a group
    # of itself alone (no other rank takes part), then every pair makes its own groups alone, as with
    # equal counts - not every pair's group on every rank (O(R) calls per rank)
    ranks = run(tmp_path, "--world", "4", "--replicas", "2", "--modes", "pipelined", "--extra-group-on", "0")
    check(ranks)
    for r, out in ranks.items():
        if not out["local_synchronization"]:
            continue
        pair = [0, 1] if r < 2 else [2, 3]
        made = [g["ranks"] for g in out["new_groups"]]
        assert made == ([] if r == 0 else [[r]]) + [pair] * 3, (r, made)  # padding; ctl, ctrl, the data group
        assert all(g["local"] for g in out["new_groups"]), (r, out["new_groups"])
