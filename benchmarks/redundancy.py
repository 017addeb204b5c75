#!/usr/bin/env python3
"""Peer redundancy: replication beside a raw gloo exchange, recovery time per
tier, memory per node per scheme. Codec throughput (encode/decode beside ISA-L direct and numpy
XOR) is ``benchmarks/codecs.py``.

Real agents (``megatron_ft.testing.sim.LocalCluster``: one agent process per simulated node, TCP between
them), one trainer per node whose state is one ``--state-mib`` MiB tensor.

* replication: two nodes exchange one version (each sends its state to the other: pin, send from
  shared memory, the receiver ``recv_into`` its shared-memory block, ack, announce) - from the earlier
  of the two nodes' exchange starts until both nodes hold both copies, as the agents record it -
  beside the same exchange done by two gloo processes (``isend`` + ``irecv`` both ways, the time until
  both finished); measured in alternating blocks in one run, ratio of medians;
* recovery per tier: ``Restorer.restore`` of a fresh model on the node that needs it (local
  memory after a trainer crash; a replacement node rebuilding from a replica, from XOR parity,
  from RS k=2 m=2; from disk);
* memory per node: shared memory each agent holds (primary slots, peer blocks) over its share.

    python3 benchmarks/redundancy.py                    # 64 MiB per rank, updates docs/benchmarks.md
    python3 benchmarks/redundancy.py --state-mib 8 --reps 3 --no-docs
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron_ft.testing.helpers import free_port  # noqa: E402
from megatron_ft.testing.sim import LocalCluster  # noqa: E402

GLOO_PAIR = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
rank, port, nbytes, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
mine = torch.full((nbytes,), rank + 1, dtype=torch.uint8)   # this node's version
theirs = torch.empty(nbytes, dtype=torch.uint8)              # the peer's replica
times = []
for i in range(reps + 1):
    dist.barrier()
    t0 = time.perf_counter()
    reqs = [dist.isend(mine, 1 - rank), dist.irecv(theirs, 1 - rank)]  # both directions at once
    for r in reqs:
        r.wait()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)                 # until both nodes hold both copies
    times.append(float(t))
if rank == 0:
    print(json.dumps(times[1:]))
dist.destroy_process_group()
"""


def gloo_exchange(nbytes: int, reps: int) -> list[float]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_PAIR, str(r), str(port), str(nbytes), str(reps)],
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def model_factory(nbytes: int):
    def make(rank: int, seed: int):
        torch.manual_seed(seed + rank)
        m = torch.nn.Linear(1024, max(1, nbytes // 4096), bias=False)
        return m, None
    return make


def agent_exchange(c: LocalCluster, step: int) -> float:
    """One version exchanged by ``c``'s two agents: from the earlier of the two nodes' exchange starts
    until both hold both copies, as the agents record it."""
    c.train(1, start=step)
    rec = [e for n in (0, 1) for e in c.status(n)["redundancy"]["exchanged"]
           if e["step"] == step and "complete_seconds" in e]
    return max(e["complete_seconds"] for e in rec)


def replication(workdir: str, nbytes: int, reps: int, blocks: int) -> dict:
    """Medians of the three exchanges, measured in ``blocks`` rounds of ``reps`` each, every round
    running gloo, the agents with the job's secret and the same agents without one, the two agent
    kinds in alternating order (the machine's drift reaches every kind alike)."""
    clusters: dict[bool, LocalCluster] = {}
    times: dict = {"ours": [], "unauthenticated": [], "gloo": []}
    try:
        for auth in (True, False):
            clusters[auth] = LocalCluster(os.path.join(workdir, "rep-" + ("auth" if auth else "open")), 2,
                                          model_factory(nbytes), chunk_bytes=4 << 20, scheme="replica", replicas=2,
                                          authenticate=auth)
            clusters[auth].train(1)  # first version: segments created and pre-faulted
        step = 2
        for block in range(blocks):
            times["gloo"] += gloo_exchange(nbytes, reps)
            for auth in ((True, False) if block % 2 == 0 else (False, True)):
                key = "ours" if auth else "unauthenticated"
                times[key] += [agent_exchange(clusters[auth], step + i) for i in range(reps)]
            step += reps
    finally:
        for c in clusters.values():
            c.close()
    return {k: statistics.median(v) for k, v in times.items()} | {"n": len(times["ours"])}


def lose_and_restore(c: LocalCluster, node: int) -> tuple[str, float]:
    c.lose_node(node)
    c.replace_node(node)
    res, _ = c.restore(node)
    return res.source, res.seconds


def tiers(workdir: str, nbytes: int) -> tuple[list[tuple], list[tuple]]:
    rows, mem = [], []
    cases = [("local_memory (trainer crash)", 1, {"scheme": "none"}, None),
             ("peer_memory (replica)", 2, {"scheme": "replica", "replicas": 2}, 1),
             ("decoded (xor, 3 nodes)", 3, {"scheme": "xor"}, 1),
             ("decoded (rs k=2 m=2, 4 nodes)", 4, {"scheme": "rs", "k": 2, "m": 2}, 2),
             ("disk (persisted)", 1, {"scheme": "none"}, 0)]
    for label, nodes, red, lost in cases:
        persist = 1 if label.startswith("disk") else 0
        c = LocalCluster(os.path.join(workdir, label.split()[0]), nodes, model_factory(nbytes), chunk_bytes=4 << 20,
                         persist_interval=persist, **red)
        try:
            c.train(2)
            if red["scheme"] != "none":
                ideal = {"replica": 2.0, "xor": 1 + 1 / (nodes - 1)}.get(red["scheme"])
                if red["scheme"] == "rs":
                    ideal = (red["k"] + red["m"]) / red["k"]
                for n in range(nodes):
                    st = c.status(n)
                    sizes = [s["bytes"] for r in st["ranks"].values() for s in r["slots"]]
                    mem.append((red["scheme"] + (f" k={red['k']} m={red['m']}" if "k" in red else ""), n,
                                sizes[0], sum(sizes), len(sizes), st["redundancy"]["block_bytes"], ideal))
            if persist:
                c.clients[0].request("wait_persisted", wait_s=600)
            if lost is None:
                res, _ = c.restore(0)
                rows.append((label, res.source, res.seconds))
            else:
                src, sec = lose_and_restore(c, lost)
                rows.append((label, src, sec))
        finally:
            c.close()
    return rows, mem


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="exchanges per block and kind")
    p.add_argument("--blocks", type=int, default=4, help="rounds of gloo, agents with and without the secret")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--replication-only", action="store_true", help="only the replication comparison (implies --no-docs)")
    args = p.parse_args()
    nbytes = args.state_mib << 20
    with tempfile.TemporaryDirectory(prefix="mft-bench-red-") as wd:
        rep = replication(wd, nbytes, args.reps, args.blocks)
        if args.replication_only:
            print(f"replication {args.state_mib} MiB: agent {rep['ours'] * 1e3:.1f} ms, without the secret "
                  f"{rep['unauthenticated'] * 1e3:.1f} ms (ratio {rep['ours'] / rep['unauthenticated']:.3f}), "
                  f"gloo {rep['gloo'] * 1e3:.1f} ms, ratio {rep['ours'] / rep['gloo']:.2f}")
            return 0
        rows, mem = tiers(wd, nbytes)
    ratio, auth = rep["ours"] / rep["gloo"], rep["ours"] / rep["unauthenticated"]
    lines = [f"Command: `python3 benchmarks/redundancy.py --state-mib {args.state_mib} --reps {args.reps} "
             f"--blocks {args.blocks}` ({datetime.date.today()}, 2 CPU cores, all nodes simulated on one machine over "
             f"loopback)", "",
             f"**Replication**: two nodes exchange one {args.state_mib} MiB version each (replica m=2): agents "
             f"{rep['ours'] * 1e3:.1f} ms vs raw gloo isend/irecv both ways {rep['gloo'] * 1e3:.1f} ms: ratio "
             f"**{ratio:.2f}x** (target <= 1.2x: {'PASS' if ratio <= 1.2 else 'FAIL'}); medians of {rep['n']} "
             f"exchanges each, alternating blocks.", "",
             f"**Authentication**: the same agents without the job's secret "
             f"(`megatron_ft/testing/unauthenticated_agent.py`, the benchmark's baseline only: the product's agent "
             f"has no such mode), in the same run, blocks alternating: {rep['unauthenticated'] * 1e3:.1f} ms; with "
             f"the secret {rep['ours'] * 1e3:.1f} ms: ratio **{auth:.3f}** (target <= 1.03: "
             f"{'PASS' if auth <= 1.03 else 'FAIL'}). The agents keep their peer connections, so the handshake "
             f"(HMAC-SHA256 challenge and response, both ways) is paid once per peer; frames after it carry no MAC.", "",
             "**Recovery per tier** (restore of one rank's state on the node that needs it, including the "
             "rebuild from peers):", "", "| tier | source reported | seconds |", "|---|---|---|"]
    lines += [f"| {lbl} | {src} | {sec:.3f} |" for lbl, src, sec in rows]
    lines += ["", "**Memory per node** (shared memory each agent holds after two versions). share = one copy of "
              "the node's own state; primary = its slots (two: clean + staging; one on an rs parity node, whose "
              "packets data nodes hold whole); blocks = two versions of what it holds for peers (the complete one "
              "+ the one being received). *One version* = the clean primary + one block version, i.e. resident "
              "minus staging; ideal = replica m, xor 1 + 1/(n-1), rs (k+m)/k shares:", "",
              "| scheme | node | share MiB | primary MiB (slots) | blocks MiB | resident / share | one version / share "
              "| ideal | one version / ideal |", "|---|---|---|---|---|---|---|---|---|"]
    for scheme, n, share, slots, nslots, blocks, ideal in mem:
        one = ((share if nslots == 2 else 0) + blocks / 2) / share
        lines.append(f"| {scheme} | {n} | {share / 2**20:.1f} | {slots / 2**20:.1f} ({nslots}) | {blocks / 2**20:.1f} "
                     f"| {(slots + blocks) / share:.2f} | {one:.2f} | {ideal:.2f} | {one / ideal:.2f} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _docs import write_section

        write_section(os.path.join(REPO, "docs", "benchmarks.md"), "## Peer redundancy", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
