"""Shared memory within its budget: the blocks a node holds for its group (every version) are counted in
``agent.shm_limit_mib`` and against the free space of ``agent.shm_dir`` once the group's container sizes
are known, before any of them is exchanged. A node that holds its slots but not its peers' blocks is
refused then - naming the bytes and the fix, every later snapshot refused (a trainer with
``agent.required`` ends the job, exit 2) - never when a peer's block arrives; a job that fits runs."""
from __future__ import annotations

import re

import pytest
import torch

from megatron_ft.testing.helpers import wait_for
from megatron_ft.testing.sim import LocalCluster


def make_wide(rank, seed):
    """About 4 MiB of state per rank (a 512 x 512 layer and AdamW's two moments)."""
    torch.manual_seed(seed + 100 * rank)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_a_node_that_cannot_hold_its_peers_blocks_is_refused_before_any_exchange(tmp_path):
    """Replica on 2 nodes: 2 slots of ~4 MiB fit 12 MiB, the peer's block (3 versions of ~4 MiB) does not."""
    c = LocalCluster(str(tmp_path), 2, make_wide, scheme="replica", replicas=2, config={"agent": {"shm_limit_mib": 12}})
    try:
        c.train(1, wait_complete=False)  # each node's exchange refuses its part once the sizes are known
        wait_for("both nodes to judge their peers' blocks", lambda: all(c.status(n)["shared_memory"]["refused"]
                                                                        for n in range(2)), 30, c.logs)
        c.train(1, start=2, wait_complete=False)
        for n in range(2):
            st = c.status(n)
            mem = st["shared_memory"]
            assert 7 << 20 < mem["slots"] <= 12 << 20 and mem["peer_blocks_reserved"] == 0, mem
            assert re.search(rf"shared memory too small: node {n}'s blocks for its peers \(replica: 1 block\(s\), "
                             r"3 versions each\) need \d+\.\d MiB of shared memory beside its slots' \d+\.\d MiB, "
                             r"\d+\.\d MiB in all, but agent.shm_limit_mib=12: raise it to at least 2[0-4]",
                             mem["refused"]), mem
            assert st["redundancy"]["block_bytes"] == 0 and st["redundancy"]["complete_step"] < 1, st["redundancy"]
        # the second snapshot is not even begun: its node cannot protect it
        errors = [e.history[-1].error for e in c.engines]
        assert all("not started" in e and "shared memory too small" in e for e in errors), errors
    finally:
        c.close()


def test_a_job_whose_peers_blocks_fit_runs_with_them_counted(tmp_path):
    c = LocalCluster(str(tmp_path), 2, make_wide, scheme="replica", replicas=2, config={"agent": {"shm_limit_mib": 24}})
    try:
        c.train(3)
        for n in range(2):
            st = c.status(n)
            mem, red = st["shared_memory"], st["redundancy"]
            assert red["complete_step"] == 3 and not mem["refused"], (mem, red)
            # what exists is within what was reserved: two or three versions of the peer's block
            assert 0 < red["block_bytes"] <= mem["peer_blocks_reserved"] and mem["slots"] + mem["peer_blocks_reserved"] <= 24 << 20
    finally:
        c.close()


def make_large(rank, seed):
    """About 12 MiB of state per rank (a 1024 x 1024 layer and AdamW's two moments)."""
    torch.manual_seed(seed + 100 * rank)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_an_rs_rebuild_decodes_in_bounded_pieces(tmp_path):
    """rs k=2 m=2 on 4 nodes, node 2 lost: rank 2 is decoded from k = 2 surviving shards of ~12 MiB
    piece by piece - its decode buffers peak at k + 1 pieces of 4 MiB, not k whole shards - and the
    trainer restores it bit for bit."""
    from megatron_ft.agent.peer_rebuild import decode_piece_bytes
    from test_peer_redundancy import assert_same

    c = LocalCluster(str(tmp_path), 4, make_large, scheme="rs", k=2, m=2)
    try:
        c.train(2)
        shard = c.status(2)["ranks"]["2"]["slots"][0]["bytes"]
        c.lose_node(2)
        c.replace_node(2)
        rec = c.clients[2].request("recover", rank=2, step=2)
        piece = decode_piece_bytes(1)
        assert rec["source"] == "decoded" and shard > 2 * piece, (rec, shard)
        assert 0 < rec["decode_buffers_peak"] <= 3 * piece < 2 * shard, (rec, shard)
        res, model = c.restore(2)
        assert (res.source, res.step) == ("local_memory", 2), res.rejected  # the rebuilt copy, installed
        assert_same(c.models[2], model)
    finally:
        c.close()
