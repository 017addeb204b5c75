#!/usr/bin/env python3
"""The GPU snapshot path against the link's limit (needs a CUDA device; see docs/benchmarks.md).

For each size of state per rank (``--sizes-gib``), one rank, its state as ``--tensors`` fp32 tensors on
the GPU, side by side in one run:

* **raw**: ``cudaMemcpyAsync`` of the same bytes between the GPU and one page-locked host buffer
  (``torch.empty(pin_memory=True)``), device-to-host and host-to-device, each timed to its
  synchronisation: the limit;
* **megatron-ft**: a real agent process, ``SnapshotEngine`` (device -> the agent's page-locked slot on a
  side stream: :mod:`megatron_ft.trainer.device_staging`) and ``Restorer`` (slot -> device, verified on
  the device). Per measured snapshot: an "optimizer step" kernel changes the state, ``snapshot()`` is
  called, then a "forward/backward" stand-in (bf16 matrix products, about ``--compute-factor`` x the raw
  copy) runs on the training stream, then ``wait()`` (what the next optimizer step calls), once with the
  checksums summed on the host and once on the device (``--sums``; alternating order):

  - *stall* = time in ``snapshot()`` + time blocked in ``wait()`` (the training loop's own cost),
  - *clean* = ``snapshot()`` called -> the agent holds the version CLEAN (copied, summed, committed),
  - *compute* with a snapshot in flight against the same products alone (the copy's interference),
  - *restore* = ``Restorer.restore`` from the agent's memory into zeroed GPU tensors (checksums
    verified), bit-exact against a copy of the state taken before (checked, not timed): first in the
    process whose snapshot engine page-locked the slots (an in-process restart, a guard's rollback: the
    copy engine reads the slot), then after the engine has closed, as a fresh process finds the slots,
    both ways a fresh process can take, alternating: page-locking the slot range by range while the
    copies go, and through pinned bounce blocks (``device_staging.FRESH_RESTORE``: ``auto`` ships the
    first on a huge-page tmpfs, the second on 4 KiB pages).

Targets (docs/benchmarks.md): stall <= 0.1x the raw device-to-host copy, clean <= 1.2x (judged with the
sums where they ship, :func:`~megatron_ft.trainer.device_staging.default_sums`), restore <= 1.25x the
raw host-to-device copy. No on-device shadow copy is made: the GPU memory allocated beyond the state and
the stand-in's matrices during the snapshots is reported (``extra_gpu_bytes``: the checksums'
temporaries). Beside them, the one-time costs: the first snapshot (the agent creating the slots, the
engine page-locking them) and page-locking one slot alone, whole on one thread and in ranges on the
restore's threads; and the device sums alone.

    python3 benchmarks/gpu_snapshot.py --sizes-gib 1,16 --json /tmp/gpu_snapshot.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_ft.agent import shm  # noqa: E402
from megatron_ft.capture import checksum  # noqa: E402
from megatron_ft.testing.helpers import remove_run_segments  # noqa: E402
from megatron_ft.testing.sim import AgentProc  # noqa: E402
from megatron_ft.trainer import device_staging  # noqa: E402
from megatron_ft.trainer.device_staging import (PageLockedFile, default_sums, lock_while_copying,  # noqa: E402
                                                page_locked_file, release_page_locked)
from megatron_ft.trainer.recovery import Restorer  # noqa: E402
from megatron_ft.trainer.restore_read import MAX_GPU_HOST_THREADS, threads_here  # noqa: E402
from megatron_ft.trainer.snapshot import SnapshotEngine  # noqa: E402
from snapshot import BenchStateAdapter, one_node_config, timed_snapshot  # noqa: E402  (benchmarks/snapshot.py)

GiB = 1 << 30
TARGETS = {"stall": 0.1, "clean": 1.2, "restore": 1.25}
#: the ways a fresh process restores (``device_staging.FRESH_RESTORE``): page-locking while copying, bounce blocks
FRESH_WAYS = ("page-lock", "bounce")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_phases(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per kind, the median of each phase over its runs."""
    return {kind: {k: med([ph[k] for ph in phs if k in ph]) for k in sorted({k for ph in phs for k in ph})}
            for kind, phs in runs.items()}


def rounded(phases: dict[str, dict[str, float]]) -> str:
    return json.dumps({kind: {k: round(v, 4) for k, v in ph.items()} for kind, ph in phases.items()})


def timed_cuda(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class Compute:
    """A forward/backward stand-in on the training stream: bf16 8192^2 matrix products."""

    def __init__(self, seconds: float):
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        one = med([timed_cuda(lambda: torch.matmul(self.a, self.b, out=self.c)) for _ in range(5)])
        self.n = max(1, round(seconds / one))

    def launch(self) -> None:
        for _ in range(self.n):
            torch.matmul(self.a, self.b, out=self.c)


def raw_copies(state: dict[str, torch.Tensor], nbytes: int, reps: int) -> dict[str, list[float]]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pieces, off = [], 0
    for t in state.values():
        b = t.view(-1).view(torch.uint8)
        pieces.append((host[off: off + b.numel()], b))
        off += b.numel()

    def d2h():
        for h, d in pieces:
            h.copy_(d, non_blocking=True)

    def h2d():
        for h, d in pieces:
            d.copy_(h, non_blocking=True)

    d2h(), h2d()  # warm-up
    out = {"raw_d2h": [timed_cuda(d2h) for _ in range(reps)], "raw_h2d": [timed_cuda(h2d) for _ in range(reps)]}
    del pieces, host
    return out


def copy_pieces(host: torch.Tensor, state: dict[str, torch.Tensor], to_host: bool) -> None:
    """The state's tensors to (``to_host``) or from consecutive bytes of ``host``, asynchronously."""
    off = 0
    for t in state.values():
        b = t.view(-1).view(torch.uint8)
        if to_host:
            host[off: off + b.numel()].copy_(b, non_blocking=True)
        else:
            b.copy_(host[off: off + b.numel()], non_blocking=True)
        off += b.numel()


def page_lock_alone(path: str, threads: int = 0) -> float:
    """Seconds to map and page-lock one whole slot file in this process, alone: on this thread (as a
    snapshot engine does) or in ranges on ``threads`` threads (as a fresh process's restore does)."""
    t0 = time.perf_counter()
    entry = PageLockedFile(path, threads=threads)
    try:
        if not (entry.wait_range(0, entry.array.nbytes) and entry.ok):
            raise RuntimeError(f"page-locking {path} failed: {entry.error}")
        return time.perf_counter() - t0
    finally:
        entry.close()


def one_size(size_gib: float, args, workdir: str) -> dict:
    nbytes = int(size_gib * GiB)
    per = nbytes // args.tensors // 4
    free_gpu, _ = torch.cuda.mem_get_info()
    need_gpu = 2 * nbytes + 3 * 8192 * 8192 * 2 + GiB  # state, the restore check's copy, the stand-in
    if need_gpu > free_gpu:
        return {"size_gib": size_gib, "skipped": f"needs {need_gpu / GiB:.1f} GiB of GPU memory, {free_gpu / GiB:.1f} free"}
    shm_free = shm.shm_free_bytes(args.shm_dir)
    if 2 * nbytes + GiB > shm_free:
        return {"size_gib": size_gib, "skipped": f"needs {(2 * nbytes + GiB) / GiB:.1f} GiB in {args.shm_dir}, "
                                                 f"{shm_free / GiB:.1f} free"}
    torch.manual_seed(0)
    state = {f"t{i:03d}": torch.randn(per, device="cuda") for i in range(args.tensors)}
    res: dict = {"size_gib": size_gib, "tensors": args.tensors, "chunk_mib": args.chunk_mib,
                 "state_bytes": per * 4 * args.tensors, "shm_pages": shm.page_backing(args.shm_dir),
                 "sums_shipped": default_sums()}
    res.update(raw_copies(state, per * 4 * args.tensors, args.reps))
    raw_d2h, raw_h2d = med(res["raw_d2h"]), med(res["raw_h2d"])
    compute = Compute(args.compute_factor * raw_d2h)

    run_id = f"bgpu{os.getpid()}x{int(size_gib * 1024)}"
    cfg, cfg_path = one_node_config(run_id, workdir, args.shm_dir, snapshot={"chunk_mib": args.chunk_mib})
    agent = AgentProc(cfg, cfg_path).start()
    identity = {"run_id": run_id, "rank": 0, "world_size": 1}
    adapter = BenchStateAdapter(state)
    client = agent.client()
    engine = SnapshotEngine(client, 0, identity, cfg.snapshot.chunk_bytes)
    modes = [m for m in args.sums.split(",") if m]
    keys = [f"{k}_{m}" for m in modes for k in ("snapshot_call", "wait", "stall", "clean", "compute_with_snapshot",
                                                  "clean_idle")]
    fresh = [f"restore_fresh_{way}" for way in FRESH_WAYS]
    out: dict[str, list] = {k: [] for k in keys + ["compute_alone", "restore"] + fresh}
    phases: dict[str, list[dict]] = {m: [] for m in modes}
    restore_phases: dict[str, list[dict]] = {k: [] for k in ["restore"] + fresh}
    step = 0

    def restore_checked(key: str) -> None:
        for t in state.values():
            t.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = Restorer(0, 1, identity, run_id, cfg.persist.dir, client).restore(adapter)
        torch.cuda.synchronize()
        out[key].append(time.perf_counter() - t0)
        restore_phases[key].append(r.phases)
        if (r.source, r.step) != ("local_memory", step):
            raise RuntimeError(f"restored {r.source} step {r.step}, not step {step}: {r.rejected}")
        bad = [n for n in state if not torch.equal(state[n].view(torch.uint8), reference[n].view(torch.uint8))]
        if bad or adapter.restored_extra != {"iteration": step}:
            raise RuntimeError(f"restored state differs from the snapshot: {bad[:3]} {adapter.restored_extra}")

    try:
        t0 = time.perf_counter()
        engine.snapshot(0, *adapter.capture())
        res["first_call_s"] = time.perf_counter() - t0  # registration: the agent's slots, page-locking them
        first = engine.wait()
        assert first is not None and first.ok, first
        res["first_clean_s"] = time.perf_counter() - t0
        res["register_s"] = engine._staging.register_s if engine._staging is not None else None
        base_alloc = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for rep in range(args.reps):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):  # alternating order
                engine._staging.sums = mode
                step += 1
                out["compute_alone"].append(timed_cuda(compute.launch))
                for t in state.values():  # the optimizer step: the snapshot must hold these bytes
                    t.add_(1.0)
                torch.cuda.synchronize()
                st, times = timed_snapshot(engine, adapter, step, lambda: (compute.launch(), torch.cuda.synchronize()))
                for k in ("snapshot_call", "wait", "stall", "clean"):
                    out[f"{k}_{mode}"].append(times[k])
                out[f"compute_with_snapshot_{mode}"].append(times["compute"])
                phases[mode].append(st.phases)
                step += 1  # the same snapshot with no training kernels beside it
                for t in state.values():
                    t.add_(1.0)
                torch.cuda.synchronize()
                _, times = timed_snapshot(engine, adapter, step, lambda: None)
                out[f"clean_idle_{mode}"].append(times["clean"])
        res["extra_gpu_bytes"] = torch.cuda.max_memory_allocated() - base_alloc
        reference = {n: t.clone() for n, t in state.items()}
        # a restore in the process whose engine page-locked the slots (an in-process restart, a rollback)
        for _ in range(args.reps):
            restore_checked("restore")
        res["device_sums"] = [timed_cuda(lambda: [checksum.tensor_lanes(t.view(-1).view(torch.uint8))
                                                  for t in state.values()]) for _ in range(args.reps)]
        newest = max(client.request("list", rank=0)["versions"], key=lambda v: v["step"])
        # the copies alone between the state and a page-locked slot (the older one is written)
        slots = {seg.path: torch.from_numpy(page_locked_file(seg.path).array) for seg in engine._slots}
        newer = slots.pop(newest["path"])
        older = next(iter(slots.values()))
        res["d2h_into_slot"] = [timed_cuda(lambda: copy_pieces(older, state, to_host=True)) for _ in range(args.reps)]
        res["h2d_from_slot"] = [timed_cuda(lambda: copy_pieces(newer, state, to_host=False)) for _ in range(args.reps)]
        del slots, newer, older
        engine.close()
        release_page_locked()  # the process's page-locked slots go: now as a fresh process finds them
        res["page_lock_slot_s"] = [page_lock_alone(newest["path"]) for _ in range(args.reps)]
        res["page_lock_ranges_s"] = [page_lock_alone(newest["path"], threads_here(MAX_GPU_HOST_THREADS))
                                     for _ in range(args.reps)]
        res["fresh_shipped"] = FRESH_WAYS[0] if lock_while_copying(res["shm_pages"]) else FRESH_WAYS[1]
        for rep in range(args.reps):
            for way in (FRESH_WAYS if rep % 2 == 0 else FRESH_WAYS[::-1]):
                release_page_locked()  # as a fresh process finds the slots
                device_staging.FRESH_RESTORE = way
                try:
                    restore_checked(f"restore_fresh_{way}")
                finally:
                    device_staging.FRESH_RESTORE = "auto"
        release_page_locked()
        del reference
    finally:
        engine.close()
        client.close(orderly=True)
        agent.stop()  # SIGTERM: the agent removes its segments
        remove_run_segments(args.shm_dir, run_id)
    res.update(out)
    res["phases"] = median_phases(phases)
    res["restore_phases"] = median_phases(restore_phases)
    res["ratios"] = {"stall": med(out[f"stall_{res['sums_shipped']}"]) / raw_d2h,
                     "clean": med(out[f"clean_{res['sums_shipped']}"]) / raw_d2h,
                     "restore": med(out["restore"]) / raw_h2d}
    res["ratios_other"] = {f"{k}_{m}": med(out[f"{k}_{m}"]) / raw_d2h for m in modes for k in ("stall", "clean")}
    for way in FRESH_WAYS:
        res["ratios_other"][f"restore_fresh_{way}"] = med(out[f"restore_fresh_{way}"]) / raw_h2d
    res["pass"] = {k: res["ratios"][k] <= v for k, v in TARGETS.items()}
    del state, compute
    torch.cuda.empty_cache()
    return res


def table(results: list[dict]) -> str:
    rows = ["| state/rank | raw D2H (s) | raw H2D (s) | sums | stall (s) | stall/raw | clean (s) | clean/raw | "
            "compute alone / with snapshot (s) |",
            "|---|---|---|---|---|---|---|---|---|"]
    restores = ["| state/rank | restore, slots page-locked by this process (s) | /raw H2D | restore, fresh process, "
                "page-locking while copying (s) | /raw H2D | restore, fresh process, bounce blocks (s) | /raw H2D | "
                "page-locking one slot alone: whole / in ranges (s) | first snapshot (s) | device sums alone (s) | "
                "extra GPU memory |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            rows.append(f"| {r['size_gib']:g} GiB | skipped: {r['skipped']} |" + " |" * 7)
            continue
        q, p = r["ratios"], r["pass"]
        what = f"{r['size_gib']:g} GiB ({r['tensors']} tensors, {r['chunk_mib']} MiB chunks, {r['shm_pages']} pages)"
        for mode in ("host", "device"):
            if f"stall_{mode}" not in r:
                continue
            shipped = mode == r["sums_shipped"]

            def mark(k: str) -> str:
                x = r["ratios_other"][f"{k}_{mode}"]
                return f"{x:.3f}" + (f" ({'PASS' if p[k] else 'FAIL'}, <= {TARGETS[k]})" if shipped else "")
            rows.append(
                f"| {what} | {med(r['raw_d2h']):.4f} ({r['state_bytes'] / med(r['raw_d2h']) / 1e9:.1f} GB/s) | "
                f"{med(r['raw_h2d']):.4f} ({r['state_bytes'] / med(r['raw_h2d']) / 1e9:.1f} GB/s) | "
                f"{mode}{' (shipped)' if shipped else ''} | {med(r[f'stall_{mode}']):.5f} | {mark('stall')} | "
                f"{med(r[f'clean_{mode}']):.4f} | {mark('clean')} | {med(r['compute_alone']):.4f} / "
                f"{med(r[f'compute_with_snapshot_{mode}']):.4f} |")
        restores.append(
            f"| {what} | {med(r['restore']):.4f} | {q['restore']:.3f} ({'PASS' if p['restore'] else 'FAIL'}, <= "
            f"{TARGETS['restore']}) | "
            + "".join(f"{med(r[f'restore_fresh_{w}']):.4f}{' (shipped)' if w == r['fresh_shipped'] else ''} | "
                      f"{r['ratios_other'][f'restore_fresh_{w}']:.3f} | " for w in FRESH_WAYS)
            + f"{med(r['page_lock_slot_s']):.3f} / {med(r['page_lock_ranges_s']):.3f} | "
            f"{r['first_call_s']:.2f} (page-locking {r['register_s']:.2f}) | "
            f"{med(r['device_sums']):.4f} | {r['extra_gpu_bytes'] / 2**20:.1f} MiB |")
    alone = []
    for r in results:
        if "skipped" in r:
            continue
        alone.append(f"{r['size_gib']:g} GiB: D2H into a page-locked slot alone {med(r['d2h_into_slot']):.4f} s, "
                     f"H2D from it alone {med(r['h2d_from_slot']):.4f} s; clean with no training kernels beside it: "
                     + ", ".join(f"{m} {med(r[f'clean_idle_{m}']):.4f} s" for m in ("host", "device")
                                 if f"clean_idle_{m}" in r)
                     + f"; restores from page-locked slots in order (s): "
                       f"{', '.join(f'{x:.4f}' for x in r['restore'])} (the first pays what a process's first restore does)"
                     + "; worker phases (median s): " + rounded(r["phases"])
                     + "; restore phases (median s): " + rounded(r["restore_phases"]))
    return "\n".join(rows) + "\n\n" + "\n".join(restores) + "\n\n" + "\n".join(alone)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gib", default="1,16")
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--chunk-mib", type=int, default=64, help="snapshot.chunk_mib (configs/gpu-1.yaml)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compute-factor", type=float, default=2.0)
    p.add_argument("--sums", default="host,device", help="where the snapshot's checksums are summed, each measured")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu_snapshot.py needs a CUDA device", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="mft-gpu-bench-")
    results = []
    try:
        for s in args.sizes_gib.split(","):
            r = one_size(float(s), args, workdir)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    props = torch.cuda.get_device_properties(0)
    machine = {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / GiB, 1), "cpus": os.cpu_count(),
               "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(machine))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "command": " ".join(sys.argv), "results": results}, f, indent=1)
    return 0 if all("skipped" not in r and all(r["pass"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
