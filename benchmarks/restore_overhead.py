#!/usr/bin/env python3
"""The fixed cost of a restore from the agent's memory: what it spends besides copying bytes.

One rank, its state as ``--tensors`` tensors of ``--numel`` fp32 elements each (small by default, so
that the copies and checksums vanish and what is left is the restore's own work), a real agent
process, three snapshots, then ``--reps`` restores (``Restorer.restore``, as an in-process restart
calls it) into the existing tensors. Prints the median of the whole restore and of each phase's end
(``RestoreResult.phases``, ms from the start: ``listed`` the agent's versions, ``opened`` the container
read and checked, ``queued``/``landed`` on a GPU, ``loaded``, ``guarded``, ``finished``, ``rewound``).

On a GPU (``--device cuda``) the same phases as ``benchmarks/gpu_snapshot.py`` reports for large
states, here without the copies: the part of the 1 GiB figure that does not scale with the bytes.

    python3 benchmarks/restore_overhead.py                     # 32 tensors of 4 KiB, CPU
    python3 benchmarks/restore_overhead.py --tensors 256 --reps 50
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from megatron_ft.testing.helpers import remove_run_segments  # noqa: E402
from megatron_ft.testing.sim import AgentProc  # noqa: E402
from megatron_ft.trainer.recovery import Restorer  # noqa: E402
from megatron_ft.trainer.snapshot import SnapshotEngine  # noqa: E402
from snapshot import BenchStateAdapter, one_node_config  # noqa: E402  (benchmarks/snapshot.py)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=32, help="tensors in the state (default 32)")
    p.add_argument("--numel", type=int, default=1024, help="fp32 elements per tensor (default 1024)")
    p.add_argument("--reps", type=int, default=30, help="measured restores (default 30)")
    p.add_argument("--device", default="cpu", help="where the state lives: cpu (default) or cuda")
    p.add_argument("--shm-dir", default="/dev/shm")
    args = p.parse_args(argv)
    if args.tensors < 1 or args.numel < 1 or args.reps < 3:
        p.error(f"--tensors {args.tensors}, --numel {args.numel} and --reps {args.reps}: need >= 1, >= 1 and >= 3")

    work = tempfile.mkdtemp(prefix="mft-restore-overhead-")
    run_id = f"brs{os.getpid()}"
    cfg, cfg_path = one_node_config(run_id, work, args.shm_dir)
    agent = AgentProc(cfg, cfg_path).start()
    client = agent.client()
    identity = {"run_id": run_id, "rank": 0, "world_size": 1}
    state = {f"t{i:04d}": torch.randn(args.numel, device=args.device) for i in range(args.tensors)}
    adapter = BenchStateAdapter(state)
    engine = SnapshotEngine(client, 0, identity, cfg.snapshot.chunk_bytes)
    try:
        for step in range(3):
            engine.snapshot(step, *adapter.capture())
            engine.wait()
        took, phases = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            r = Restorer(0, 1, identity, run_id, cfg.persist.dir, client).restore(adapter)
            took.append(time.perf_counter() - t0)
            if (r.source, r.step) != ("local_memory", 2):
                raise RuntimeError(f"restored {r.source} step {r.step}, not local_memory step 2: {r.rejected}")
            phases.append(r.phases)
    finally:
        engine.close()
        client.close(orderly=True)
        agent.stop()
        remove_run_segments(args.shm_dir, run_id)
    marks = {k: round(1e3 * statistics.median(ph[k] for ph in phases), 3) for k in phases[-1]}
    print(f"{args.tensors} tensors x {args.numel} fp32 on {args.device}, {args.reps} restores: "
          f"median {1e3 * statistics.median(took):.3f} ms; phases (ms from the start, medians): {marks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
