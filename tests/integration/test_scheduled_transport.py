"""The scheduled transport on gloo, end to end but without agents (tests/integration/scheduled_job.py):
every block a receiver's agent is told is complete holds exactly the bytes of its sender's slot,
across pairs that copy to each other, a ring, two copies per rank, mixed modes and a rank that has
nothing to send at one transfer start. The full demo (tests/integration/test_recovery.py) runs it
with real agents and a node loss; the NCCL path needs GPUs (tests/gpu/test_scheduled_nccl.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

JOB = os.path.join(REPO, "tests", "integration", "scheduled_job.py")


def run_job(out, *args: str) -> dict[int, dict]:
    os.makedirs(out, exist_ok=True)
    p = subprocess.run([sys.executable, JOB, "--out", str(out), *args], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    if p.returncode != 0:
        pytest.fail(f"scheduled job failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return {int(f[4:-5]): json.load(open(os.path.join(out, f)))
            for f in os.listdir(out) if f.startswith("rank") and f.endswith(".json")}


def check(ranks: dict[int, dict]) -> None:
    for r, out in ranks.items():
        assert out["failed"] is None, (r, out["failed"])
        assert out["exact"] and all(out["exact"].values()), (r, out["exact"])
        for src in out["srcs"]:  # every transfer its sources started arrived whole
            assert sorted(s for x, s in out["done"] if x == src) == [rec["step"] for rec in ranks[src]["records"]]
        assert all(rec["bytes"] > 0 for rec in out["records"])
        assert out["groups"] == [60], out["groups"]  # a fast link's chunks: the data group's one-minute floor


def test_two_ranks_copy_to_each_other_in_planned_chunks(tmp_path):
    ranks = run_job(tmp_path, "--world", "2", "--modes", "pipelined")
    check(ranks)
    assert all(len(out["records"]) >= 3 for out in ranks.values())


def test_mixed_modes_and_a_rank_with_nothing_to_send_at_one_start(tmp_path):
    ranks = run_job(tmp_path, "--world", "2", "--modes", "end,pipelined", "--skip-pin", "1:2")
    check(ranks)
    assert len(ranks[1]["records"]) == ranks[1]["pins"] - 1 >= 2  # its second start announced nothing
    assert len(ranks[0]["done"]) == len(ranks[1]["records"])


def test_a_ring_and_two_copies_per_rank(tmp_path):
    ring = run_job(tmp_path / "ring", "--world", "3", "--replicas", "2", "--modes", "blocking,pipelined,end")
    check(ring)
    assert [out["srcs"] for _, out in sorted(ring.items())] == [[2], [0], [1]]
    two = run_job(tmp_path / "two", "--world", "3", "--replicas", "3", "--modes", "pipelined")
    check(two)
    assert all(len(out["srcs"]) == 2 and len(out["done"]) >= 4 for out in two.values())
