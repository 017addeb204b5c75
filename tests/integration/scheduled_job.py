"""A scheduled-transport job on gloo without agents (tests/integration/test_scheduled_transport.py):
``--world`` processes, one per simulated node, each a :class:`ScheduledTransport` whose agent is a
stand-in writing slots and blocks as files; a short training loop of sleeps. Each rank writes
``rank{R}.json``: the blocks its agent was told are complete, whether each held exactly the
bytes its sender's slot held (checked then, and removed), the transfers it recorded, whether the
transport failed, and the ranks of every process group the process created (``new_groups``: each
``torch.distributed.new_group`` call, recorded on its way to torch).

Run: python scheduled_job.py --out DIR --world 2 --replicas 2 --modes pipelined,end [--skip-pin R:N]
[--calls [--gate-ms W]] [--extra-group-on R,...] [--backend nccl --nbytes N --reserved R] (NCCL: one GPU per rank,
tests/gpu/test_scheduled_nccl.py)
(``--skip-pin R:N``: rank R's agent refuses its N-th pin, so R announces no transfer that time;
``--calls``: training's own network calls at fixed times of each iteration; ``--gate-ms``: they
report to the link gate, whose window is W ms, and the chunks wait for it)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

NBYTES = 3 * 2**20 + 12345  # not a multiple of a chunk (--nbytes)
RESERVED, SUB_BUFFERS = 2**20, 2  # (--reserved)
ITERS = 10
ITERATION_S = 0.04
#: --calls: training's network calls, seconds into each iteration: over the planned spans' times
#: (see schedule()), so that chunks sent at their planned offsets start inside them
CALLS = [(0.001, 0.009), (0.011, 0.019), (0.021, 0.029), (0.031, 0.036)]
LINK_BYTES_S = 400e6


def slot_bytes(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(1000 * rank + step).integers(0, 256, NBYTES, dtype=np.uint8)


class FakeAgent:
    """The agent operations the transport uses, on files under ``dir``."""
    dir = ""
    rank = -1
    refuse_pin: set = set()  # which pin requests (1-based) this rank's agent refuses
    pins = 0
    done: list = []
    exact: dict = {}

    def __init__(self, socket_path: str, timeout: float):
        pass

    def connect(self, hello: dict) -> dict:
        return {}

    def close(self, orderly: bool = True) -> None:
        pass

    def request(self, op: str, **kw):
        if op == "sched_pin":
            FakeAgent.pins += 1
            if FakeAgent.pins in self.refuse_pin:
                raise RuntimeError(f"step {kw['step']} is not clean here")
            path = os.path.join(self.dir, f"slot.r{kw['rank']}")  # unpinned before the next pin
            slot_bytes(kw["rank"], kw["step"]).tofile(path)
            return {"path": path}
        if op == "sched_unpin":
            return {}
        if op == "sched_recv_begin":
            assert kw["length"] == NBYTES, kw
            path = os.path.join(self.dir, f"block.r{self.rank}.from{kw['src_rank']}.s{kw['step']}")
            with open(path, "wb") as f:
                f.truncate(kw["length"])
            return {"path": path}
        if op == "sched_recv_done":  # the block is closed by now: check it, then drop it
            path = os.path.join(self.dir, f"block.r{self.rank}.from{kw['src_rank']}.s{kw['step']}")
            self.exact[f"{kw['src_rank']}:{kw['step']}"] = bool(
                np.array_equal(np.fromfile(path, dtype=np.uint8), slot_bytes(kw["src_rank"], kw["step"])))
            os.unlink(path)
            self.done.append([kw["src_rank"], kw["step"]])
            return {}
        raise AssertionError(op)


def schedule(mode: str, copies: int):
    from megatron_ft.schedule.modes import plan_sends
    from megatron_ft.schedule.spans import IdleSpan, LinkModel

    link = LinkModel(LINK_BYTES_S)  # a chunk of 512 KiB: 1.3 ms planned
    spans = [IdleSpan(0.0, 0.004), IdleSpan(0.01, 0.012), IdleSpan(0.02, 0.03)]
    return plan_sends(mode, NBYTES, copies, link, RESERVED, SUB_BUFFERS, 0.9, spans, spans, spans)


def main(rank: int, args) -> None:
    from megatron_ft import config as ftconfig
    from megatron_ft.agent import shm
    from megatron_ft.transport import scheduled

    global NBYTES, RESERVED
    NBYTES, RESERVED = args.nbytes, args.reserved
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if args.backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, rank=rank, world_size=args.world)
    cfg = ftconfig.replace(ftconfig.load(), cluster={"nodes": args.world, "ranks_per_node": 1},
                           parallel={"tensor": 1, "pipeline": 1},
                           redundancy={"scheme": "replica", "replicas": args.replicas, "transport": "scheduled"})
    FakeAgent.dir, FakeAgent.rank = args.out, rank
    FakeAgent.refuse_pin = {int(s) for r, s in (x.split(":") for x in args.skip_pin if x) if int(r) == rank}
    if rank in args.extra_group_on:  # this rank belongs to one group more than the others (Megatron's
        dist.new_group([rank], use_local_synchronization=True)  # embedding groups: some stages only)
    step = {"agreed": -1}
    chunks: list = []  # (issued, finished) of each chunk this rank sent
    made: list = []  # the ranks of every process group this process creates from here on
    new_group = dist.new_group

    def recording_new_group(ranks=None, *a, **kw):
        made.append({"ranks": sorted(ranks) if ranks is not None else list(range(args.world)),
                     "local": bool(kw.get("use_local_synchronization"))})
        return new_group(ranks, *a, **kw)

    dist.new_group = recording_new_group
    t = scheduled.ScheduledTransport(cfg, rank, lambda: FakeAgent("unused", 30), shm.open_segment,
                                     lambda: step["agreed"],
                                     emit=lambda name, kind, start, end, *a: chunks.append((start, end)))
    modes = args.modes.split(",")
    sched = schedule(modes[rank % len(modes)], args.replicas - 1)
    gate = None
    if args.gate_ms:  # training's network calls report to the link gate; the chunks wait for it
        from megatron_ft.schedule.modes import gated
        from megatron_ft.schedule.spans import LinkModel

        gate = t.use_link(LINK_BYTES_S, quiet_s=1.0)
        sched = gated(sched, args.gate_ms / 1e3, LinkModel(LINK_BYTES_S))
    sched = t.groups.agree(sched)
    # a second schedule with the same data timeout (compare_modes agrees one per mode) reuses its group
    assert t.groups.agree(sched) == sched
    t.use(sched, 0, sched.mode)
    calls: list = []  # (start, end) of each simulated network call of training
    for it in range(ITERS):
        t.begin_iteration()
        t0 = time.perf_counter()
        if args.calls:  # training's own network use at fixed times of the iteration (sleeps)
            for a, b in CALLS:
                time.sleep(max(0.0, t0 + a - time.perf_counter()))
                start = time.perf_counter()
                if gate is not None:
                    gate.begin()
                time.sleep(b - a)
                if gate is not None:
                    gate.end(start, 0, args.gate_ms / 1e3)
                calls.append((start, time.perf_counter()))
        time.sleep(max(0.0, t0 + ITERATION_S - time.perf_counter()))
        step["agreed"] = it
        t.end_iteration(it)
    t.close()
    # a chunk that started while one of training's calls ran (the collision the gate prevents)
    inside = sum(1 for issued, _ in chunks if any(a <= issued < b for a, b in calls))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"done": FakeAgent.done, "exact": FakeAgent.exact, "records": t.records, "failed": t.failed,
                   "srcs": t.srcs, "dsts": t.dsts, "mode": sched.mode, "groups": sorted(t.groups.data),
                   "new_groups": made, "local_synchronization": scheduled.LOCAL_SYNCHRONIZATION,
                   "pins": FakeAgent.pins, "interval": sched.interval_iterations, "chunks": len(chunks),
                   "chunks_inside_calls": inside, "gate_forced": gate.forced if gate else 0,
                   "cpu_s": t.cpu_s}, f)
    dist.destroy_process_group()


def run(out, *args: str, timeout: float = 300) -> dict[int, dict]:
    """Run this job (``args``: its command line) with its output in ``out``; each rank's record by rank.
    A job that fails fails the calling test with the tails of its output."""
    import pytest

    os.makedirs(out, exist_ok=True)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", str(out), *args], capture_output=True,
                       text=True, timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
    if p.returncode != 0:
        pytest.fail(f"scheduled job failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return {int(f[4:-5]): json.load(open(os.path.join(out, f)))
            for f in os.listdir(out) if f.startswith("rank") and f.endswith(".json")}


def check_transfers(ranks: dict[int, dict]) -> None:
    """Every rank's transport ended without failing, every block it was told complete held exactly its
    sender's bytes, and every transfer its sources started arrived whole."""
    for r, out in ranks.items():
        assert out["failed"] is None, (r, out["failed"])
        assert out["exact"] and all(out["exact"].values()), (r, out["exact"])
        for src in out["srcs"]:
            assert sorted(s for x, s in out["done"] if x == src) == [rec["step"] for rec in ranks[src]["records"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--modes", default="pipelined")
    p.add_argument("--skip-pin", default="", type=lambda s: s.split(","))
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--nbytes", type=int, default=NBYTES)
    p.add_argument("--calls", action="store_true", help="training uses the network (CALLS) in every iteration")
    p.add_argument("--gate-ms", type=float, default=0.0, help="send through the link gate with this window")
    p.add_argument("--reserved", type=int, default=RESERVED)
    p.add_argument("--extra-group-on", default=[], type=lambda s: [int(x) for x in s.split(",") if x],
                   help="these ranks make a group of their own first (unequal group counts)")
    a = p.parse_args()
    a.port = free_port()
    mp.spawn(main, args=(a,), nprocs=a.world)
