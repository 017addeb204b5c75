#!/usr/bin/env python3
"""Snapshot benchmark: megatron-ft against the memory limit, torch.save and DCP, in one run.

For every per-rank state size and rank count, ``ranks`` separate processes (torch.multiprocessing
spawn, one gloo process group) hold the same synthetic training state and measure the methods one
after the other, each leaving the memory as it found it (the agent is shut down after (b)):

(a) ``raw copy``: one thread copies the state's bytes into an already touched /dev/shm buffer,
    with ``torch.Tensor.copy_`` and with libc ``memcpy``; the faster one (by median) is the
    memory limit every ratio is taken against;
(b) ``megatron-ft``: a real agent process (``python -m megatron_ft.agent``), per rank an
    AgentClient + SnapshotEngine + a StateAdapter over the state. One warm-up snapshot
    (registers; the agent creates and pre-faults the slots), then per measured snapshot
    ``stall`` = time in ``capture()`` + ``engine.snapshot()`` + time in ``engine.wait()`` after a
    simulated forward/backward (``time.sleep`` of ``--compute-factor`` x the raw copy time: on a
    GPU machine compute does not use the host CPU, and the copy must fit in the compute window),
    ``clean`` = ``SnapshotStats.clean_at`` - start of the snapshot. ``restore`` = wall time of
    ``Restorer(...).restore(adapter)`` from the agent's memory (includes checksum verification)
    into the (zeroed) state tensors. For the paired targets the same phase also times a raw copy
    just before each snapshot, a raw copy just before each restore and, memory permitting, a
    ``torch.load`` + copy (as in (c), from a file written once) just after each restore;
(c) ``torch.save`` of the same state dict to /dev/shm (stall = clean = save time), restore =
    ``torch.load(weights_only=True)`` alone (new tensors) and ``torch.load`` + copy into the
    existing state tensors (what ``model.load_state_dict`` / ``optimizer.load_state_dict`` do in a
    restarted trainer, whose model and optimizer exist before the checkpoint is loaded), alternating;
    the restore target compares the latter with (b), which also ends in the existing tensors;
(d) ``torch.distributed.checkpoint.async_save`` to a /dev/shm directory (stall = until it
    returns; clean = until its future completes, with the same simulated compute in between;
    restore = ``dcp.load`` in place).

Ranks start every repetition together (barrier); a repetition's figure is its slowest rank.
Reported: min and median over ``--reps`` repetitions, and the project's targets as PASS/FAIL.

(e) ``--demo-iterations``: the tiny GPT demo (``scripts/pretrain_gpt.py`` under
``megatron-ft launch``, TP1 PP2, 2 simulated nodes x 2 ranks) with snapshots every iteration
versus off; median iteration time excluding the first 5 iterations.

Usage::

    python benchmarks/snapshot.py [--sizes 256,1024] [--ranks 1,2,4] [--reps 3] [--out docs/benchmarks.md] [--quick]
                                  [--shm-dir DIR | --huge-shm]
    python benchmarks/snapshot.py --demo-iterations [--out docs/benchmarks.md]

Every method's buffers and files are in ``--shm-dir`` (default /dev/shm; ``--huge-shm`` mounts a
huge-page tmpfs for the run with ``megatron-ft shm-mount`` and reports to its own subsection).

Everything the benchmark creates (agent shared memory ``<shm dir>/mft.<run id>*``, torch/DCP files,
child processes, a tmpfs it mounted, the temporary directory) is removed on exit, also on errors and Ctrl-C.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import glob
import json
import mmap
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import yaml  # noqa: E402

from megatron_ft.capture import checksum
from megatron_ft.agent import shm  # noqa: E402
from megatron_ft import config as ftconfig  # noqa: E402
from megatron_ft.capture.layout import ALIGNMENT, Layout  # noqa: E402
from megatron_ft.agent.protocol import AgentClient, socket_path  # noqa: E402
from megatron_ft.trainer import mapped_slots, recovery  # noqa: E402
from megatron_ft.trainer.recovery import Restorer  # noqa: E402
from megatron_ft.trainer.snapshot import SnapshotEngine  # noqa: E402
from megatron_ft.capture.state import StateTensor  # noqa: E402
from megatron_ft.testing.helpers import free_port, with_free_ports  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SECTION = "## Snapshot benchmark"
DEMO_HEADING = "### Demo iteration time"
SHM_DIR = "/dev/shm"  # default for every method's memory; --shm-dir / --huge-shm change it
HUGE_HEADING = "### On a huge-page tmpfs"
PROCESS_OVERHEAD = 450 * MiB  # a rank process with torch imported (RSS), for the memory check
RANK_TIMEOUT_S = 1800.0

# targets (medians of the same run)
STALL_MAX = 0.1  # megatron-ft stall <= 0.1 x raw copy
CLEAN_MAX = 1.5  # snapshot clean within 1.5 x raw copy
RESTORE_MIN = 5.0  # (torch.load + copy into the existing state) / megatron-ft restore >= 5
RESTORE_RAW_MAX = 1.5  # megatron-ft restore from agent memory <= 1.5 x the raw copy of the same bytes
#: the phases of a timed restore (RestoreResult.phases: seconds from its start at which each ended)
RESTORE_PHASES = ("listed", "opened", "loaded", "guarded", "finished", "rewound")


# ====================================================================================== results


@dataclass
class Stat:
    """One figure over the repetitions (each repetition: the slowest rank), in seconds."""

    values: list[float]

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @staticmethod
    def over_ranks(per_rank: list[list[float]]) -> "Stat":
        reps = min(len(v) for v in per_rank)
        return Stat([max(v[i] for v in per_rank) for i in range(reps)])


@dataclass
class RawCopyResult:
    torch_copy: Stat  # torch.Tensor.copy_, one thread
    memcpy: Stat  # libc memcpy (ctypes.memmove)

    @property
    def reference(self) -> Stat:
        """The memory limit: the faster single-threaded copy (by median)."""
        return min(self.torch_copy, self.memcpy, key=lambda s: s.median)

    @property
    def reference_name(self) -> str:
        return "memcpy" if self.reference is self.memcpy else "torch copy_"


@dataclass
class MegatronFTResult:
    stall: Stat  # capture + snapshot() + wait() after the simulated compute
    snapshot_call: Stat  # capture + snapshot()
    wait: Stat  # wait() after the simulated compute
    copy: Stat  # SnapshotStats.copy_s: the worker's begin..commit
    clean: Stat  # clean_at - start
    restore: Stat  # Restorer.restore() from agent memory
    first_call: Stat  # the warm-up snapshot() call: registration, the agent creates + pre-faults 2 slots
    restore_map: Stat  # breakdown of a restore, measured separately: Container() (pread header + records)
    restore_verify: Stat  # identity, layout and destinations (check_identity + resolve_targets)
    restore_copy: Stat  # load_verified: pread straight into the tensors, every chunk checksummed
    restore_unmap: Stat  # finish_load (shard all-gathers, JSON record) + close
    paired_raw: Stat  # the faster raw copy, timed just before each measured snapshot (same phase)
    paired_load_copy: Optional[Stat] = None  # torch.load + copy just after each restore (memory permitting)
    paired_restore_raw: Optional[Stat] = None  # the faster raw copy, timed just before each restore (same phase)
    restore_fresh: Optional[Stat] = None  # the restore in a process that has not mapped the slot (a fresh trainer)
    paired_fresh_raw: Optional[Stat] = None  # the faster raw copy, timed just before each of those
    # the timed restores' phases (RestoreResult.phases): when each ended, seconds from the restore's start
    restore_listed: Optional[Stat] = None
    restore_opened: Optional[Stat] = None
    restore_loaded: Optional[Stat] = None
    restore_guarded: Optional[Stat] = None
    restore_finished: Optional[Stat] = None
    restore_rewound: Optional[Stat] = None


@dataclass
class TorchSaveResult:
    save: Stat  # stall = clean
    load: Stat  # torch.load(weights_only=True): new tensors
    load_copy: Stat  # torch.load + copy_ into the existing state tensors (load_state_dict)


@dataclass
class DcpResult:
    stall: Stat  # until async_save returns
    wait: Stat  # future.result() after the simulated compute (not part of the stall)
    clean: Stat  # until the future completed
    load: Stat  # dcp.load in place


@dataclass
class ComboResult:
    size_mib: int
    ranks: int
    compute_s: float = 0.0
    raw: Optional[RawCopyResult] = None
    mft: Optional[MegatronFTResult] = None
    torch_save: Optional[TorchSaveResult] = None
    dcp: Optional[DcpResult] = None
    skipped: str = ""
    unpaired_restore: str = ""  # why the restore target compares separate phases (memory), or ""
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class DemoResult:
    off_s: Optional[float] = None  # median iteration time, snapshots off
    on_s: Optional[float] = None  # median iteration time, a snapshot every iteration
    certified_s: Optional[float] = None  # the same with recovery.prefer: certified (a verdict per iteration)
    iterations: int = 0
    reps: int = 1
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average before / after
    notes: list[str] = field(default_factory=list)


def aggregate(cls, per_rank: list[dict]):
    """Build a result dataclass from the ranks' sample lists (field name = sample key); a figure
    no rank measured (an optional one) is None."""
    stats = {f.name: Stat.over_ranks([r.get(f.name, []) for r in per_rank]) for f in fields(cls)}
    return cls(**{k: v if v.values else None for k, v in stats.items()})


def paired_ratio(num: Optional[Stat], den: Optional[Stat]) -> Optional[float]:
    """Median over the repetitions of num[i] / den[i]: two figures measured one right after the
    other in every repetition, so the machine's drift between phases cancels."""
    if num is None or den is None or not num.values or len(num.values) != len(den.values):
        return None
    return statistics.median(n / d for n, d in zip(num.values, den.values))


# ====================================================================================== the state


def make_state(size_bytes: int, rank: int) -> dict[str, torch.Tensor]:
    """A synthetic rank state of exactly ``size_bytes``: one contiguous fp32 parameter buffer
    (about 1/3, like a megatron DDP buffer) plus Adam ``exp_avg``/``exp_avg_sq`` for 16 parameters
    of uneven sizes and their ``step`` scalars (like the distributed optimizer's shard)."""
    weights = [8, 1, 3, 4] * 4
    scalars = 4 * len(weights)
    per_moment = (size_bytes - scalars) // 3
    sizes = [per_moment * w // sum(weights) // 4 * 4 for w in weights]
    buffer_bytes = size_bytes - scalars - 2 * sum(sizes)
    assert buffer_bytes > 0 and buffer_bytes % 4 == 0, size_bytes
    state = {"model.param_data": torch.empty(buffer_bytes // 4, dtype=torch.float32)}
    for i, n in enumerate(sizes):
        state[f"optim.p{i}.exp_avg"] = torch.empty(n // 4, dtype=torch.float32)
        state[f"optim.p{i}.exp_avg_sq"] = torch.empty(n // 4, dtype=torch.float32)
        state[f"optim.p{i}.step"] = torch.empty((), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1234 + rank)
    block = torch.randn(MiB // 4, generator=gen).view(torch.uint8)
    for t in state.values():  # tile a random MiB: cheap, finite floats, different per rank
        raw = t.view(-1).view(torch.uint8)
        full = raw.numel() // block.numel() * block.numel()
        if full:
            raw[:full].view(-1, block.numel()).copy_(block)
        raw[full:].copy_(block[: raw.numel() - full])
    assert sum(t.numel() * t.element_size() for t in state.values()) == size_bytes
    return state


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bitwise identity of every tensor (fast native checksum), to verify restores."""
    return {k: checksum.checksum(byte_view(t)) for k, t in state.items()}


def zero_state(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        t.zero_()


class BenchStateAdapter:
    """The StateAdapter protocol (megatron_ft/capture/state.py) over a dict of named tensors."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.iteration = 0
        self.restored_extra: Optional[dict] = None

    def capture(self) -> tuple[list[StateTensor], dict]:
        return [StateTensor(n, t) for n, t in self.state.items()], {"iteration": self.iteration}

    def targets(self, layout: Layout, extra: dict) -> dict[str, StateTensor]:
        return {e.spec.name: StateTensor(e.spec.name, self.state[e.spec.name]) for e in layout.entries}

    def finish_restore(self, extra: dict) -> None:
        self.restored_extra = extra


def timed_snapshot(engine: SnapshotEngine, adapter: BenchStateAdapter, step: int, compute: Any,
                   who: str = "") -> tuple[Any, dict[str, float]]:
    """One measured snapshot as a training loop sees it: ``snapshot()`` right after the optimizer
    step, the next forward/backward (``compute()``, returning when it is done), then ``wait()`` as the
    next optimizer step calls it. Returns the snapshot's stats and ``snapshot_call``, ``wait``,
    ``stall`` (the two together: what the loop was blocked), ``compute`` and ``clean`` (seconds);
    raises if the snapshot failed. Also used by ``benchmarks/gpu_snapshot.py``."""
    adapter.iteration = step
    wall0, t0 = time.time(), time.perf_counter()
    engine.snapshot(step, *adapter.capture())
    t1 = time.perf_counter()
    compute()
    t2 = time.perf_counter()
    st = engine.wait()
    t3 = time.perf_counter()
    if st is None or not st.ok:
        raise RuntimeError(f"{who}snapshot of step {step} failed: {st}")
    return st, {"snapshot_call": t1 - t0, "wait": t3 - t2, "stall": (t1 - t0) + (t3 - t2), "compute": t2 - t1,
                "clean": st.clean_at - wall0}


# ====================================================================================== rank side


@dataclass
class RankContext:
    rank: int
    world: int
    size_bytes: int
    reps: int
    run_id: str  # per combination
    agent_config: str  # megatron-ft
    shm_dir: str = SHM_DIR  # the raw copy's buffer and the agent's slots
    torch_dir: str = SHM_DIR  # torch.save's file and DCP's directory
    compute_s: float = 0.0  # simulated forward/backward, set after the raw copy
    paired_restore: bool = False  # (b) also times torch.load + copy after each restore (memory permitting)
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    def path(self, what: str, directory: Optional[str] = None) -> str:
        return os.path.join(directory or self.shm_dir, f"mft.{self.run_id}.{what}")

    def barrier(self) -> None:
        dist.barrier()


class RawBuffer:
    """A pre-faulted shared-memory buffer holding the state's bytes packed as megatron-ft's layout
    packs them (64-byte aligned, in order): the target of the raw copy, the memory limit."""

    def __init__(self, rc: RankContext, what: str):
        self.path = rc.path(what)
        nbytes = rc.size_bytes + ALIGNMENT * len(rc.state)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        dst = torch.frombuffer(self.mm, dtype=torch.uint8)
        dst.fill_(0)  # pre-fault: every page touched before timing
        self.pieces, off = [], 0
        for t in rc.state.values():
            src = byte_view(t)
            off = -(-off // ALIGNMENT) * ALIGNMENT
            self.pieces.append((dst[off: off + src.numel()], src))
            off += src.numel()
        self.torch_copy()  # warm-up
        self.memcpy()

    def torch_copy(self) -> None:
        for d, s in self.pieces:
            d.copy_(s)

    def memcpy(self) -> None:
        for d, s in self.pieces:
            ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel())

    def timed(self, rc: RankContext) -> dict[str, float]:
        """One repetition of both copies, each started on all ranks together."""
        out = {}
        for name, fn in (("torch_copy", self.torch_copy), ("memcpy", self.memcpy)):
            rc.barrier()
            t0 = time.perf_counter()
            fn()
            out[name] = time.perf_counter() - t0
        return out

    def verify(self, rank: int) -> None:
        """The copies really happened (not timed)."""
        for d, s in self.pieces:
            if checksum.checksum(d) != checksum.checksum(s):
                raise RuntimeError(f"rank {rank}: raw copy differs from the source")

    def close(self) -> None:
        self.pieces.clear()
        try:
            self.mm.close()
        except BufferError:
            pass
        os.unlink(self.path)


def rank_raw_copy(rc: RankContext) -> dict:
    """(a) single-threaded copy of the state's bytes into a pre-faulted shared-memory buffer."""
    raw = RawBuffer(rc, f"raw.r{rc.rank}")
    out: dict[str, list[float]] = {"torch_copy": [], "memcpy": []}
    try:
        for _ in range(rc.reps):
            for name, dt in raw.timed(rc).items():
                out[name].append(dt)
        raw.verify(rc.rank)
    finally:
        raw.close()
    return out


def torch_load_copy(rc: RankContext, path: str, want: dict[str, int]) -> float:
    """A restarted trainer's restore from a torch.save file: torch.load, then copy_ into the existing
    (zeroed) state tensors (what load_state_dict does per tensor). Returns its time; the bytes are
    then checked against ``want``, the state's fingerprint (not timed)."""
    zero_state(rc.state)
    rc.barrier()
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    with torch.no_grad():
        for name, t in rc.state.items():
            t.copy_(loaded[name])
    dt = time.perf_counter() - t0
    del loaded
    gc.collect()
    if fingerprint(rc.state) != want:
        raise RuntimeError(f"rank {rc.rank}: torch.load + copy restored different bytes")
    return dt


def rank_megatron_ft(rc: RankContext) -> dict:
    """(b) SnapshotEngine into a real agent; stall with a simulated forward/backward; restore."""
    cfg = ftconfig.load(rc.agent_config)
    client = AgentClient(socket_path(cfg.agent.socket_dir, cfg.run_id, 0), timeout=600)
    client.connect({"rank": rc.rank, "local_rank": rc.rank, "pid": os.getpid(), "run_id": cfg.run_id})
    coord = dist.new_group(backend="gloo")  # as InMemoryCheckpointer: its own coordination group
    identity = {"run_id": cfg.run_id, "rank": rc.rank, "world_size": rc.world}
    adapter = BenchStateAdapter(rc.state)
    engine = SnapshotEngine(client, rc.rank, identity, cfg.snapshot.chunk_bytes, coord)
    out: dict[str, list[float]] = {k: [] for k in ("stall", "snapshot_call", "wait", "copy", "clean", "restore",
                                                   "paired_raw", "paired_load_copy", "paired_restore_raw",
                                                   "restore_fresh", "paired_fresh_raw",
                                                   *(f"restore_{p}" for p in RESTORE_PHASES))}
    raw: Optional[RawBuffer] = None
    torch_file = rc.path(f"torch.paired.r{rc.rank}.pt", rc.torch_dir)
    try:
        step = 0
        t0 = time.perf_counter()
        engine.snapshot(step, *adapter.capture())  # warm-up: register, the agent pre-faults both slots
        out["first_call"] = [time.perf_counter() - t0]
        warm = engine.wait()
        assert warm is not None and warm.ok, warm
        raw = RawBuffer(rc, f"raw.paired.r{rc.rank}")
        for _ in range(rc.reps):
            # paired with this snapshot: the raw copy of the same bytes just before it (the faster one)
            out["paired_raw"].append(min(raw.timed(rc).values()))
            step += 1
            rc.barrier()
            # forward/backward on the GPU: the host CPU stays free
            st, t = timed_snapshot(engine, adapter, step, lambda: time.sleep(rc.compute_s), f"rank {rc.rank}: ")
            for k in ("snapshot_call", "wait", "stall", "clean"):
                out[k].append(t[k])
            out["copy"].append(st.copy_s)
        raw.verify(rc.rank)
        want = fingerprint(rc.state)
        if rc.paired_restore:  # the same state as a torch.save file, for torch.load + copy after each restore
            torch.save(rc.state, torch_file)
        try:
            for _ in range(rc.reps):
                # paired with this restore: the raw copy of the same bytes just before it (the faster one)
                out["paired_restore_raw"].append(min(raw.timed(rc).values()))
                zero_state(rc.state)  # the state is lost; the tensors exist (a rebuilt model)
                rc.barrier()
                t0 = time.perf_counter()
                res = Restorer(rc.rank, rc.world, identity, cfg.run_id, cfg.persist.dir, client, coord).restore(adapter)
                out["restore"].append(time.perf_counter() - t0)
                if (res.source, res.step) != ("local_memory", step):
                    raise RuntimeError(f"rank {rc.rank}: restored {res.source} step {res.step}, not step {step}: "
                                       f"{res.rejected}")
                for p in RESTORE_PHASES:
                    out[f"restore_{p}"].append(res.phases.get(p, float("nan")))
                if fingerprint(rc.state) != want or adapter.restored_extra != {"iteration": step}:
                    raise RuntimeError(f"rank {rc.rank}: restored state differs from the snapshot")
                if rc.paired_restore:
                    out["paired_load_copy"].append(torch_load_copy(rc, torch_file, want))
                # the same restore in a process that has not mapped its slot yet (a fresh trainer's): paired
                # with its own raw copy; the engine writes no snapshot after this phase
                out["paired_fresh_raw"].append(min(raw.timed(rc).values()))
                zero_state(rc.state)
                mapped_slots.release_slot_mappings()
                rc.barrier()
                t0 = time.perf_counter()
                res = Restorer(rc.rank, rc.world, identity, cfg.run_id, cfg.persist.dir, client, coord).restore(adapter)
                out["restore_fresh"].append(time.perf_counter() - t0)
                if (res.source, res.step) != ("local_memory", step) or fingerprint(rc.state) != want:
                    raise RuntimeError(f"rank {rc.rank}: the fresh-process restore gave {res.source} step {res.step}"
                                       f" or other bytes: {res.rejected}")
            raw.verify(rc.rank)
        finally:  # also frees its memory before the breakdown's restores
            if os.path.exists(torch_file):
                os.unlink(torch_file)
            raw.close()
            raw = None
        restore_breakdown(rc, client, identity, adapter, step, out)
    finally:
        if raw is not None:
            raw.close()
        engine.close()
        client.close(orderly=True)
    mapped_slots.release_slot_mappings()  # (kept for the process across engines; as a process's end)
    out["_mapped_after_close"] = mapped_bytes(f"mft.{cfg.run_id}.")
    stop_agent(rc, cfg)
    return out


def restore_breakdown(rc: RankContext, client: AgentClient, identity: dict, adapter: BenchStateAdapter,
                      step: int, out: dict) -> None:
    """The steps of a local-memory restore (recovery.py), timed one by one (no agreement)."""
    path = next(v["path"] for v in client.request("list", rank=rc.rank)["versions"] if v["step"] == step)
    keys = ("restore_map", "restore_verify", "restore_copy", "restore_unmap")
    for key in keys:
        out[key] = []
    for _ in range(rc.reps):
        zero_state(rc.state)
        rc.barrier()
        t0 = time.perf_counter()
        cont = recovery.Container(path)
        t1 = time.perf_counter()
        cont.check_identity(identity, step)
        targets = recovery.resolve_targets(cont, adapter)
        t2 = time.perf_counter()
        cont.load_verified(targets)
        t3 = time.perf_counter()
        recovery.finish_load(cont, adapter, targets)
        cont.close()
        t4 = time.perf_counter()
        for key, dt in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            out[key].append(dt)


def mapped_bytes(name_prefix: str) -> int:
    """Bytes of this process's mappings of files whose name starts with ``name_prefix``."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and os.path.basename(parts[5].strip().removesuffix(" (deleted)")).startswith(name_prefix):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                total += hi - lo
    return total


def stop_agent(rc: RankContext, cfg: ftconfig.FTConfig) -> None:
    """After every rank is done: rank 0 asks the agent to shut down (it removes its segments, so
    the next methods start with the same free memory) and waits until they are gone."""
    rc.barrier()
    if rc.rank == 0:
        c = AgentClient(socket_path(cfg.agent.socket_dir, cfg.run_id, 0), timeout=60)
        c.connect({"rank": -1, "local_rank": -1, "pid": os.getpid(), "run_id": cfg.run_id})
        c.request("shutdown")
        c.close(orderly=False)
        deadline = time.time() + 300
        while glob.glob(os.path.join(cfg.agent.shm_dir, f"mft.{cfg.run_id}.n*")) and time.time() < deadline:
            time.sleep(0.05)
    rc.barrier()


def rank_torch_save(rc: RankContext) -> dict:
    """(c) torch.save of the state dict to /dev/shm; restore = torch.load(weights_only=True), alone
    and followed by the copy into the existing state tensors (load_state_dict), alternating."""
    path = rc.path(f"torch.r{rc.rank}.pt", rc.torch_dir)
    out: dict[str, list[float]] = {"save": [], "load": [], "load_copy": []}
    try:
        torch.save(rc.state, path)  # warm-up
        for _ in range(rc.reps):
            rc.barrier()
            t0 = time.perf_counter()
            torch.save(rc.state, path)
            out["save"].append(time.perf_counter() - t0)
        want = fingerprint(rc.state)
        for _ in range(rc.reps):
            rc.barrier()
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            out["load"].append(time.perf_counter() - t0)
            if fingerprint(loaded) != want:
                raise RuntimeError(f"rank {rc.rank}: torch.load returned different bytes")
            del loaded
            gc.collect()
            out["load_copy"].append(torch_load_copy(rc, path, want))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


def rank_dcp(rc: RankContext) -> dict:
    """(d) torch.distributed.checkpoint.async_save to /dev/shm; restore = dcp.load in place."""
    import torch.distributed.checkpoint as dcp

    pg = dist.new_group(backend="gloo")  # the save runs on a background thread: its own group
    base = rc.path("dcp", rc.torch_dir)
    sd = {f"r{rc.rank}.{k}": t for k, t in rc.state.items()}  # rank-unique keys: no dedup
    out: dict[str, list[float]] = {"stall": [], "wait": [], "clean": [], "load": []}

    def fresh_dir(step: int) -> str:
        rc.barrier()
        if rc.rank == 0:  # keep one checkpoint at a time (memory)
            for old in glob.glob(os.path.join(base, "step*")):
                shutil.rmtree(old, ignore_errors=True)
        rc.barrier()
        return os.path.join(base, f"step{step}")

    def save(step: int, compute_s: float) -> tuple[float, float, float]:
        ckpt = fresh_dir(step)
        done: list[float] = []
        t0 = time.perf_counter()
        ret = dcp.async_save(sd, checkpoint_id=ckpt, process_group=pg)
        t1 = time.perf_counter()
        fut = getattr(ret, "upload_completion", ret)  # Future, or AsyncSaveResponse with staged uploads
        fut.add_done_callback(lambda _f: done.append(time.perf_counter()))
        time.sleep(compute_s)
        t2 = time.perf_counter()
        fut.result()
        t3 = time.perf_counter()
        while not done:  # the callback runs right after result() is set
            time.sleep(0.001)
        return t1 - t0, t3 - t2, done[0] - t0

    try:
        save(0, 0.0)  # warm-up
        step = 0
        for step in range(1, rc.reps + 1):
            stall, wait, clean = save(step, rc.compute_s)
            out["stall"].append(stall)
            out["wait"].append(wait)
            out["clean"].append(clean)
            gc.collect()
        ckpt = os.path.join(base, f"step{step}")
        want = fingerprint(rc.state)
        for _ in range(rc.reps):
            zero_state(rc.state)
            rc.barrier()
            t0 = time.perf_counter()
            dcp.load(sd, checkpoint_id=ckpt, process_group=pg)
            out["load"].append(time.perf_counter() - t0)
            if fingerprint(rc.state) != want:
                raise RuntimeError(f"rank {rc.rank}: dcp.load restored different bytes")
    finally:
        rc.barrier()
        if rc.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    return out


# in this order; each method leaves the memory as it found it (the agent is shut down after "mft")
RANK_METHODS = {"raw": rank_raw_copy, "mft": rank_megatron_ft, "torch_save": rank_torch_save, "dcp": rank_dcp}


def _rank_entry(rank: int, world: int, port: int, params: dict, out_dir: str) -> None:
    """Body of one spawned rank process: every method in turn on the same state."""
    torch.set_num_threads(1)
    # as torchrun sets them for the ranks of one node (the restore sizes its threads by them)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        compute_factor = params.pop("compute_factor")
        rc = RankContext(rank, world, **params)
        rc.state = make_state(rc.size_bytes, rank)
        for method, fn in RANK_METHODS.items():
            t0 = time.time()
            samples = fn(rc)
            if rank == 0:
                print(f"[bench]   rank 0: {method} done in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            with open(os.path.join(out_dir, f"{method}.r{rank}.json"), "w") as f:
                json.dump(samples, f)
            if method == "raw":  # size the simulated compute exactly as the report does
                per_rank: list = [None] * world
                dist.all_gather_object(per_rank, samples)
                rc.compute_s = compute_factor * aggregate(RawCopyResult, per_rank).reference.median
            dist.barrier()
    finally:
        dist.destroy_process_group()


# ====================================================================================== main side



class Janitor:
    """Everything to undo on exit: child processes, shared memory of our run id, a tmpfs we
    mounted, the work dir."""

    def __init__(self, run_id: str, workdir: str, shm_dir: str = SHM_DIR, torch_dir: str = SHM_DIR):
        self.run_id, self.workdir, self.dirs = run_id, workdir, {shm_dir, torch_dir}
        self.popens: list[subprocess.Popen] = []
        self.spawned: list[Any] = []  # torch ProcessContext
        self.mounted: list[str] = []

    def cleanup(self) -> None:
        for ctx in self.spawned:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
        self.spawned.clear()
        for p in self.popens:
            kill_tree(p)
        self.popens.clear()
        for d in self.dirs:
            remove_shm(self.run_id, d)
        for d in self.mounted:
            subprocess.run(["umount", "-l", d], check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)


def remove_shm(run_id: str, shm_dir: str) -> None:
    for path in glob.glob(os.path.join(shm_dir, f"mft.{run_id}*")):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def kill_tree(p: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop ``p`` (SIGTERM, then SIGKILL) and all its descendants, even those in other sessions."""
    if p.poll() is not None:
        return
    try:
        import psutil

        children = psutil.Process(p.pid).children(recursive=True)
    except Exception:
        children = []
    p.terminate()
    try:
        p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    for c in children:
        try:
            c.kill()
        except Exception:
            pass


@dataclass
class Bench:
    """One benchmark run: settings, the temp dir, the janitor."""

    run_id: str
    workdir: str
    reps: int
    compute_factor: float
    mem_budget: int
    janitor: Janitor
    shm_dir: str = SHM_DIR
    torch_dir: str = SHM_DIR

    def combo_run_id(self, c: ComboResult) -> str:
        return f"{self.run_id}-{c.size_mib}m{c.ranks}r"

    def spawn_ranks(self, c: ComboResult, agent_config: str) -> str:
        """Run every method on ``c.ranks`` fresh processes; returns the result directory.
        Raises if a rank failed (the results of the methods done before are kept)."""
        out_dir = os.path.join(self.workdir, "results", f"{c.size_mib}m{c.ranks}r")
        os.makedirs(out_dir, exist_ok=True)
        params = dict(size_bytes=c.size_mib * MiB, reps=self.reps, run_id=self.combo_run_id(c),
                      agent_config=agent_config, compute_factor=self.compute_factor, shm_dir=self.shm_dir,
                      torch_dir=self.torch_dir, paired_restore=not c.unpaired_restore)
        ctx = mp.start_processes(_rank_entry, args=(c.ranks, free_port(), params, out_dir),
                                 nprocs=c.ranks, join=False, start_method="spawn")
        self.janitor.spawned.append(ctx)
        deadline = time.time() + RANK_TIMEOUT_S
        try:
            while not ctx.join(timeout=1.0):
                if time.time() > deadline:
                    raise TimeoutError(f"ranks did not finish within {RANK_TIMEOUT_S:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
            self.janitor.spawned.remove(ctx)
        return out_dir


def load_samples(out_dir: str, method: str, ranks: int) -> Optional[list[dict]]:
    paths = [os.path.join(out_dir, f"{method}.r{r}.json") for r in range(ranks)]
    if not all(os.path.exists(p) for p in paths):
        return None
    return [json.load(open(p)) for p in paths]


RESULT_TYPES = {"raw": RawCopyResult, "mft": MegatronFTResult, "torch_save": TorchSaveResult, "dcp": DcpResult}


def one_node_config(run_id: str, workdir: str, shm_dir: str, ranks: int = 1,
                    **sections: dict) -> tuple[ftconfig.FTConfig, str]:
    """An isolated single-node job of ``ranks`` ranks (TP = PP = 1): its own run id, socket dir and
    persist dir under ``workdir``, slots in ``shm_dir``, no persisting; ``sections`` override more (e.g.
    ``snapshot={"chunk_mib": 64}``). Written to ``workdir/<run_id>.yaml``; returns it and its path."""
    cfg = ftconfig.replace(ftconfig.FTConfig(), run_id=run_id,
                           cluster={"nodes": 1, "ranks_per_node": ranks}, parallel={"tensor": 1, "pipeline": 1},
                           agent={"shm_dir": shm_dir, "socket_dir": os.path.join(workdir, "sock")},
                           persist={"dir": os.path.join(workdir, "persist"), "interval": 0, "on_failure": False},
                           **sections)
    path = os.path.join(workdir, f"{run_id}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    return cfg, path


def agent_config(b: Bench, c: ComboResult) -> tuple[ftconfig.FTConfig, str]:
    """An isolated single-node job for combination ``c`` (:func:`one_node_config`)."""
    return one_node_config(b.combo_run_id(c), b.workdir, b.shm_dir, c.ranks)


def start_agent(b: Bench, cfg: ftconfig.FTConfig, cfg_path: str) -> subprocess.Popen:
    """``python -m megatron_ft.agent --config CFG --node 0`` (as tests/conftest.py AgentProc)."""
    sock = socket_path(cfg.agent.socket_dir, cfg.run_id, 0)
    os.makedirs(os.path.dirname(sock), mode=0o700, exist_ok=True)  # the agent refuses a socket dir others can enter
    p = subprocess.Popen([sys.executable, "-m", "megatron_ft.agent", "--config", cfg_path, "--node", "0"],
                         stdout=open(cfg_path + ".agent.log", "ab"), stderr=subprocess.STDOUT,
                         start_new_session=True, cwd=REPO)
    b.janitor.popens.append(p)
    deadline = time.time() + 60
    while not os.path.exists(sock):
        if p.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"agent did not start: {open(cfg_path + '.agent.log', errors='replace').read()}")
        time.sleep(0.02)
    return p


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fits(b: Bench, size_mib: int, ranks: int, copies: int = 4) -> str:
    """Why a combination would not fit, or "". Peak per rank: the state plus three more copies
    (megatron-ft: two agent slots and the paired raw copy's buffer; torch.save: file + loaded copy;
    DCP: staging copy + files); six for the restore paired with torch.load + copy (two slots, the raw
    copy's buffer, torch file, loaded copy)."""
    need = ranks * (copies * size_mib * MiB + PROCESS_OVERHEAD)
    shm_need = ranks * 2 * size_mib * MiB + 64 * MiB
    if need > b.mem_budget:
        return f"needs ~{need / GiB:.1f} GiB RAM > budget {b.mem_budget / GiB:.1f} GiB"
    avail = mem_available()
    if need > avail - 512 * MiB:
        return f"needs ~{need / GiB:.1f} GiB RAM, only {avail / GiB:.1f} GiB available now"
    st = os.statvfs(b.shm_dir)
    if shm_need > st.f_bavail * st.f_frsize:
        return f"needs {shm_need / GiB:.1f} GiB in {b.shm_dir}, {st.f_bavail * st.f_frsize / GiB:.1f} GiB free"
    return ""


def run_combo(b: Bench, size_mib: int, ranks: int) -> ComboResult:
    """All methods for one (size, ranks): an agent, one set of rank processes, then the results."""
    c = ComboResult(size_mib, ranks)
    c.skipped = fits(b, size_mib, ranks)
    if c.skipped:
        print(f"[bench] {size_mib} MiB x {ranks} ranks: SKIPPED ({c.skipped})", flush=True)
        return c
    c.unpaired_restore = fits(b, size_mib, ranks, copies=6)
    print(f"[bench] {size_mib} MiB x {ranks} ranks: raw copy, megatron-ft, torch.save, dcp ...", end="", flush=True)
    t0 = time.time()
    out_dir = os.path.join(b.workdir, "results", f"{c.size_mib}m{c.ranks}r")
    failure = ""
    agent = None
    try:
        cfg, cfg_path = agent_config(b, c)
        agent = start_agent(b, cfg, cfg_path)
        out_dir = b.spawn_ranks(c, cfg_path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        failure = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        traceback.print_exc()
        for log in glob.glob(os.path.join(b.workdir, f"{b.combo_run_id(c)}.yaml.agent.log")):
            print(f"--- agent log, last lines:\n{open(log, errors='replace').read()[-1500:]}", file=sys.stderr)
    finally:
        if agent is not None:
            kill_tree(agent, grace_s=120)  # normally already gone (rank 0 shut it down)
            b.janitor.popens.remove(agent)
        for d in {b.shm_dir, b.torch_dir}:
            remove_shm(b.combo_run_id(c), d)
    print(f" {time.time() - t0:.0f} s" + (" (FAILED)" if failure else ""), flush=True)
    for method, cls in RESULT_TYPES.items():
        per_rank = load_samples(out_dir, method, ranks)
        if per_rank is None:
            c.errors[method] = failure or "no results"
            failure = "not run (an earlier method failed)" if failure else failure
            continue
        setattr(c, method, aggregate(cls, per_rank))
        if method == "mft":
            leaked = max(r.get("_mapped_after_close", 0) for r in per_rank)
            if leaked:
                c.errors["mft mappings"] = (f"{leaked / MiB:.0f} MiB of agent segments still mapped in a rank "
                                            f"after SnapshotEngine.close() and release_slot_mappings()")
    if c.raw is not None:
        c.compute_s = b.compute_factor * c.raw.reference.median
    return c


# ====================================================================================== report


def fmt_s(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    if x < 1.0:
        return f"{x * 1000:.1f} ms" if x < 0.1 else f"{x * 1000:.0f} ms"
    return f"{x:.2f} s"


def cell(s: Optional[Stat]) -> str:
    return "n/a" if s is None else f"{fmt_s(s.min)} / {fmt_s(s.median)}"


@dataclass
class Target:
    name: str
    value: Optional[float]  # PASS/FAIL: the paired ratio if ``paired``, else the ratio of the medians
    across: Optional[float]  # the ratio of the medians of the separate phases
    paired: bool
    limit: str
    ok: Optional[bool]


def ratio(num: Optional[Stat], den: Optional[Stat]) -> Optional[float]:
    """Ratio of the medians of two figures (measured in separate phases of the run)."""
    if num is None or den is None:
        return None
    return num.median / den.median


def targets(c: ComboResult) -> list[Target]:
    """Each target's value: the paired ratio where both figures were measured in the same
    repetitions (the machine drifts by tens of percent between phases), else the ratio of the
    medians; ``across`` is always the ratio of the medians of the separate phases (a check)."""
    raw = c.raw.reference if c.raw else None
    m, t, d = c.mft, c.torch_save, c.dcp
    checks = [("stall / raw copy", paired_ratio(m and m.stall, m and m.paired_raw), ratio(m and m.stall, raw),
               f"<= {STALL_MAX}", lambda v: v <= STALL_MAX),
              ("clean / raw copy", paired_ratio(m and m.clean, m and m.paired_raw), ratio(m and m.clean, raw),
               f"<= {CLEAN_MAX}", lambda v: v <= CLEAN_MAX),
              ("restore / raw copy", paired_ratio(m and m.restore, m and m.paired_restore_raw),
               ratio(m and m.restore, raw), f"<= {RESTORE_RAW_MAX}", lambda v: v <= RESTORE_RAW_MAX),
              ("(torch.load + copy) / restore", paired_ratio(m and m.paired_load_copy, m and m.restore), ratio(t and t.load_copy, m and m.restore),
               f">= {RESTORE_MIN}", lambda v: v >= RESTORE_MIN),
              ("dcp stall / mft stall", None, ratio(d and d.stall, m and m.stall), "> 1", lambda v: v > 1.0),
              # a fresh trainer's restore maps (and populates) the slot it reads once, for its snapshots too
              ("fresh-process restore / raw copy", paired_ratio(m and m.restore_fresh, m and m.paired_fresh_raw),
               ratio(m and m.restore_fresh, raw), "info", None),
              ("bare torch.load / restore", None, ratio(t and t.load, m and m.restore), "info", None),
              # what a restore that copies the bytes once could reach at best: the raw copy's time
              ("ceiling: (torch.load + copy) / raw copy", paired_ratio(m and m.paired_load_copy, m and m.paired_raw),
               ratio(t and t.load_copy, raw), "info", None)]
    out = []
    for name, paired, across, limit, ok in checks:
        value = paired if paired is not None else across
        out.append(Target(name, value, across, paired is not None, limit,
                          None if value is None or ok is None else ok(value)))
    return out


def verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def results_table(combos: list[ComboResult]) -> str:
    head = ["state/rank", "ranks", "raw torch copy_", "raw memcpy", "sleep", "mft stall", "mft clean",
            "mft copy", "mft restore", "mft 1st snapshot()", "torch.save", "torch.load", "torch.load + copy",
            "dcp stall", "dcp clean", "dcp.load"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in combos:
        if c.skipped:
            rows.append(f"| {c.size_mib} MiB | {c.ranks} | skipped: {c.skipped} |" + " |" * (len(head) - 3))
            continue
        r, m, t, d = c.raw, c.mft, c.torch_save, c.dcp
        vals = [f"{c.size_mib} MiB", str(c.ranks), cell(r.torch_copy if r else None), cell(r.memcpy if r else None),
                fmt_s(c.compute_s) if c.raw else "n/a",
                cell(m.stall if m else None), cell(m.clean if m else None), cell(m.copy if m else None),
                cell(m.restore if m else None), fmt_s(m.first_call.median) if m else "n/a",
                cell(t.save if t else None), cell(t.load if t else None), cell(t.load_copy if t else None),
                cell(d.stall if d else None), cell(d.clean if d else None), cell(d.load if d else None)]
        rows.append("| " + " | ".join(vals) + " |")
    return "\n".join(rows)


def restore_table(combos: list[ComboResult]) -> str:
    """Where a megatron-ft restore spends its time, next to the raw copy of the same bytes."""
    rows = ["| state/rank | ranks | restore | = open (records) | + check identity/layout | + read into tensors, "
            "verify and screen | + finish | raw copy | torch.load | torch.load + copy |", "|" + "---|" * 10]
    for c in combos:
        m = c.mft
        if c.skipped or m is None:
            continue
        rows.append(f"| {c.size_mib} MiB | {c.ranks} | " + " | ".join(fmt_s(x.median) for x in (
            m.restore, m.restore_map, m.restore_verify, m.restore_copy, m.restore_unmap)) +
            f" | {fmt_s(c.raw.reference.median) if c.raw else 'n/a'} | "
            f"{fmt_s(c.torch_save.load.median) if c.torch_save else 'n/a'} | "
            f"{fmt_s(c.torch_save.load_copy.median) if c.torch_save else 'n/a'} |")
    return "\n".join(rows)


def phases_table(combos: list[ComboResult]) -> str:
    """The timed restores' own phases (``RestoreResult.phases``): when each ended, from the restore's start."""
    names = {"listed": "candidates listed", "opened": "opened + agreed", "loaded": "read + verified",
             "guarded": "values screened", "finished": "agreed + finished", "rewound": "agent told (end)"}
    rows = ["| state/rank | ranks | restore | " + " | ".join(names[p] for p in RESTORE_PHASES)
            + " | raw copy (paired) |", "|" + "---|" * (4 + len(RESTORE_PHASES))]
    for c in combos:
        m = c.mft
        if c.skipped or m is None:
            continue
        ends = [getattr(m, f"restore_{p}") for p in RESTORE_PHASES]
        rows.append(f"| {c.size_mib} MiB | {c.ranks} | {fmt_s(m.restore.median)} | "
                    + " | ".join(fmt_s(e.median) if e is not None else "n/a" for e in ends)
                    + f" | {fmt_s(m.paired_restore_raw.median) if m.paired_restore_raw else 'n/a'} |")
    return "\n".join(rows)


def targets_table(combos: list[ComboResult]) -> str:
    names = [t.name + f" ({t.limit})" for t in targets(ComboResult(0, 0))]
    rows = ["| state/rank | ranks | raw copy (ref) | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    for c in combos:
        if c.skipped:
            continue
        ref = f"{fmt_s(c.raw.reference.median)} ({c.raw.reference_name})" if c.raw else "n/a"
        cells = ["n/a" if t.value is None else " ".join(
                     [f"{t.value:.3g}"] + (["paired"] if t.paired else []) + ([verdict(t.ok)] if t.limit != "info" else [])
                     + ([f"({t.across:.3g})"] if t.paired and t.across is not None else [])) for t in targets(c)]
        rows.append(f"| {c.size_mib} MiB | {c.ranks} | {ref} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def pass_fail_lines(combos: list[ComboResult]) -> list[str]:
    measured = [c for c in combos if not c.skipped]
    labels = [
        ("megatron-ft stall per snapshot <= 0.1x the raw copy time of the same bytes", 0),
        ("snapshot clean within 1.5x the raw copy time", 1),
        (f"restore from agent memory <= {RESTORE_RAW_MAX}x the raw copy of the same bytes", 2),
        ("restore from the agent >= 5x faster than torch.load (from --torch-dir) + copy into the existing "
         "state (load_state_dict)", 3),
        ("megatron-ft stall below dcp.async_save's stall", 4),
    ]
    lines = []
    for text, i in labels:
        per = [(c, targets(c)[i]) for c in measured]
        oks = [t.ok for _, t in per]
        if not per or any(ok is None for ok in oks):
            v = "n/a" if not per or all(ok is None for ok in oks) else ("FAIL" if False in oks else "n/a (incomplete)")
        else:
            v = "PASS" if all(oks) else "FAIL"
        detail = ", ".join(f"{c.size_mib}MiBx{c.ranks}: " + ("n/a" if t.value is None else f"{t.value:.3g}")
                           for c, t in per)
        lines.append(f"{v}: {text} [{detail}]")
    return lines


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import importlib.metadata

        mcore = importlib.metadata.version("megatron-core")
    except Exception:
        mcore = "not installed"
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    return (f"{os.cpu_count()} cores ({cpu}), {mem / GiB:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, megatron-core {mcore}, "
            f"native fused copy+checksum: {'yes' if checksum.HAVE_NATIVE else 'NO (numpy fallback)'}")


def main_report(combos: list[ComboResult], command: str, args: argparse.Namespace, elapsed: float,
                load: tuple[float, float]) -> str:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    shm_dir, torch_dir = args.shm_dir, args.torch_dir

    def pages(d: str) -> str:
        return "2 MiB" if shm.page_backing(d) == shm.HUGE else "4 KiB"

    notes = []
    for c in combos:
        if c.skipped:
            notes.append(f"- {c.size_mib} MiB x {c.ranks} ranks skipped: {c.skipped}.")
        elif c.unpaired_restore:
            notes.append(f"- {c.size_mib} MiB x {c.ranks} ranks: restore not paired with torch.load + copy (the "
                         f"torch.save file beside the agent's slots {c.unpaired_restore.removeprefix('needs ')}); "
                         "its target is the ratio of the medians of the separate phases.")
        for method, err in c.errors.items():
            notes.append(f"- {c.size_mib} MiB x {c.ranks} ranks, {method}: {err}")
    return "\n".join([
        f"Measured {now} with `{command}` ({elapsed / 60:.1f} min) on {machine()}; 1-min load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end (other jobs share the machine).",
        "",
        "What is measured (ranks = separate processes, one gloo group; every repetition starts on all "
        "ranks together and counts its slowest rank; every rank process runs `torch.set_num_threads(1)`):",
        "",
        f"Memory: the raw copy's buffer and the agent's slots are in `{shm_dir}`, a tmpfs with "
        f"{pages(shm_dir)} pages" + (" (mounted by `--huge-shm`: `megatron-ft shm-mount`)" if args.huge_shm else "")
        + f"; the torch.save file and the DCP directory in `{torch_dir}` ({pages(torch_dir)} pages).",
        "",
        f"- **raw copy**: one thread copies the state's bytes into an already touched {shm_dir} buffer, "
        "with `torch.Tensor.copy_` and with libc `memcpy`; the faster (by median) is the memory limit "
        "every ratio uses.",
        "- **megatron-ft**: a real agent process, per rank AgentClient + SnapshotEngine + a StateAdapter. "
        "One warm-up snapshot (registration; the agent creates and pre-faults both slots). *stall* = "
        "`capture()` + `snapshot()` + `wait()` after a simulated forward/backward of "
        f"`--compute-factor` ({args.compute_factor:g}) x the raw copy time (`time.sleep`: on a GPU "
        "machine compute does not use the host CPU); *clean* = `SnapshotStats.clean_at` - start; "
        "*copy* = the worker's begin..commit; *restore* = `Restorer.restore()` from agent memory "
        "(checksums verified) into the zeroed state tensors; *1st snapshot()* = the warm-up call, "
        "which registers (the agent creates and pre-faults both slots; once per process start).",
        f"- **torch.save** of the same state dict to {torch_dir} (stall = clean = save time); restore = "
        "*torch.load*: `torch.load(weights_only=True)` alone (new tensors, nothing in the model yet), "
        "and *torch.load + copy*: the same followed by `copy_` into the existing (zeroed) state tensors, "
        "which is what `model.load_state_dict` / `optimizer.load_state_dict` do in a restarted trainer "
        "(it builds model and optimizer before loading). The two alternate. The restore target compares "
        "*torch.load + copy* with the megatron-ft restore, which also writes into the existing tensors; "
        "the bare `torch.load` ratio is shown next to it.",
        f"- **dcp**: `torch.distributed.checkpoint.async_save` to a {torch_dir} directory (default stager, "
        "thread executor, its own gloo group); stall = until it returns, clean = until its future "
        "completes (same simulated compute in between); restore = `dcp.load` in place.",
        "",
        "State per rank: one fp32 parameter buffer (~1/3) + Adam `exp_avg`/`exp_avg_sq` of 16 "
        "parameters of uneven sizes + 16 `step` scalars (49 tensors), the same bytes for every method. "
        "All restores are verified bit for bit.",
        "",
        f"Times: min / median over {args.reps} repetitions.",
        "",
        results_table(combos),
        "",
        "Restore from agent memory, step by step (medians; the steps are timed in separate restores "
        "without the cross-rank agreement, so they need not add up exactly):",
        "",
        restore_table(combos),
        "",
        "The timed restores themselves (`Restorer.restore()`, with the agreement among the ranks): when "
        "each phase ended, from the restore's start (medians; the slowest rank per repetition) - the "
        "agent's list of versions, the container opened and checked on every rank (an agreement), its "
        "bytes read and verified (and, where the read screened them in its pass, its values checked), the "
        "value guard's read of what the pass did not screen, the second agreement + shards + JSON record, "
        "the agent told which step the job resumed from - and the raw copy timed just before each:",
        "",
        phases_table(combos),
        "",
        "Targets, PASS/FAIL. *paired*: the median over the repetitions of the ratio of two figures "
        "measured one right after the other (megatron-ft's phase times a raw copy just before each "
        "snapshot and just before each restore, and a torch.load + copy of the same state from a torch.save file in "
        f"`{torch_dir}` just after each restore), so the machine's drift between phases cancels; in "
        "brackets the ratio of the medians of the separate phases (the tables above). Unmarked: the "
        "ratio of the medians of separate phases. The last column is the best any restore that copies "
        "the bytes once can reach: torch.load + copy over the raw copy of the same bytes (single-threaded).",
        "",
        targets_table(combos),
        "",
        "```",
        *pass_fail_lines(combos),
        "```",
        *(["", "Notes:", "", *notes] if notes else []),
    ])


def demo_report(d: DemoResult, command: str) -> str:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [f"{DEMO_HEADING} (snapshots every iteration vs off)", "",
             f"Measured {now} with `{command}`: `megatron-ft launch` (2 simulated nodes x 2 ranks) of "
             f"`scripts/pretrain_gpt.py --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
             f"--train-iters {d.iterations}`, without and with `--inmem-ckpt` (persist interval 0), and with "
             f"`recovery.prefer: certified` (every iteration's loss judged and agreed, versions certified); "
             f"median iteration time (slowest rank per iteration, from `progress/rank*.jsonl`) excluding the "
             f"first 5 iterations, the three jobs in turn, {d.reps} time(s), the median of each job's runs. "
             f"On this CPU-only machine the snapshot copy competes with training for the cores. 1-min load "
             f"average {d.load[0]:.1f} before, {d.load[1]:.1f} after.", ""]

    def over(a: Optional[float], b: Optional[float]) -> str:
        return f"{(a / b - 1) * 100:+.1f}%" if a and b else "n/a"

    if d.off_s is not None or d.on_s is not None:
        lines += ["| snapshots off | every iteration | overhead | every iteration, prefer: certified | "
                  "certified over every iteration |", "|---|---|---|---|---|",
                  f"| {fmt_s(d.off_s)} | {fmt_s(d.on_s)} | {over(d.on_s, d.off_s)} | {fmt_s(d.certified_s)} | "
                  f"{over(d.certified_s, d.on_s)} |", ""]
    lines += [f"- {n}" for n in d.notes]
    return "\n".join(lines)


def update_doc(path: str, main_body: Optional[str] = None, demo_body: Optional[str] = None,
               huge_body: Optional[str] = None) -> None:
    """Rewrite this benchmark's section of ``path``; other ``## `` sections stay as they are.

    Inside the section, the text before the first ``### `` heading is the main report (replaced
    by a main run), the ``### Demo iteration time`` subsection is replaced by a demo run, the
    ``### On a huge-page tmpfs`` subsection by a ``--huge-shm`` run, and any other ``### ``
    subsection (e.g. hand-written analysis) is kept."""
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmarks\n"
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == SECTION), None)
    if start is None:
        before, old, after = lines, [], []
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        before, old, after = lines[:start], lines[start + 1:end], lines[end:]
    heads = [i for i, ln in enumerate(old) if ln.startswith("### ")]
    main_part = "\n".join(old[: heads[0] if heads else len(old)]).strip()
    subs = ["\n".join(old[a:b]).strip() for a, b in zip(heads, heads[1:] + [len(old)])]
    if main_body is not None:
        main_part = main_body.strip()
    for heading, body in ((DEMO_HEADING, demo_body), (HUGE_HEADING, huge_body)):
        if body is None:
            continue
        at = [i for i, sub in enumerate(subs) if sub.startswith(heading)]
        if at:
            subs[at[0]] = body.strip()
        else:
            subs.insert(0, body.strip())
    section = [SECTION, ""]
    for part in [main_part] + subs:
        if part:
            section += [part, ""]
    while before and not before[-1].strip():
        before.pop()
    out = "\n".join(before + ([""] if before else []) + section + after).rstrip() + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(out)


# ====================================================================================== (e) demo


def iteration_times(run_dir: str, skip: int = 5) -> list[float]:
    """Per iteration the time the slowest rank finished it; deltas of iterations > ``skip``."""
    finished: dict[int, float] = {}
    for name in glob.glob(os.path.join(run_dir, "progress", "rank*.jsonl")):
        with open(name, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("restart_count", 0) == 0:
                    it = int(rec["iteration"])
                    finished[it] = max(finished.get(it, 0.0), float(rec["time"]))
    its = sorted(finished)
    return [finished[i] - finished[i - 1] for i in its if i > skip and i - 1 in finished]


def run_demo_job(b: Bench, name: str, iters: int, inmem: bool, prefer: str = "newest", rep: int = 0) -> float:
    run_id = f"{b.run_id}-demo-{name}-{rep}"
    run_dir = os.path.join(b.workdir, f"demo-{name}-{rep}")
    os.makedirs(run_dir, exist_ok=True)
    cfg = with_free_ports(ftconfig.FTConfig(), run_id=run_id,  # 2 nodes x 2 ranks, TP1 PP2
                          snapshot={"interval": 1}, agent={"socket_dir": os.path.join(b.workdir, "sock")},
                          persist={"dir": os.path.join(b.workdir, "persist"), "interval": 0, "on_failure": False},
                          recovery={"prefer": prefer})
    cfg_path = os.path.join(b.workdir, f"{run_id}.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    cmd = [sys.executable, "-m", "megatron_ft.cli", "launch", "--config", cfg_path, "--run-dir", run_dir, "--",
           os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--tensor-model-parallel-size", "1",
           "--pipeline-model-parallel-size", "2", "--train-iters", str(iters)]
    if inmem:
        cmd += ["--inmem-ckpt", "--inmem-ckpt-config", cfg_path]
    log_path = os.path.join(b.workdir, f"demo-{name}.log")
    print(f"[bench] demo, snapshots {name}: {shlex.join(cmd)}", flush=True)
    p = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    b.janitor.popens.append(p)
    try:
        rc = p.wait(timeout=RANK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"demo ({name}) did not finish within {RANK_TIMEOUT_S:.0f} s")
    finally:
        kill_tree(p)
        b.janitor.popens.remove(p)
        remove_shm(run_id, SHM_DIR)
    if rc != 0:
        tail = open(log_path, errors="replace").read()[-3000:]
        raise RuntimeError(f"demo ({name}) exited with {rc}:\n{tail}")
    times = iteration_times(run_dir)
    if not times:
        raise RuntimeError(f"demo ({name}): no progress records in {run_dir}/progress")
    return statistics.median(times)


def demo_accepts_inmem_ckpt() -> bool:
    """Whether scripts/pretrain_gpt.py has the megatron-ft integration (``--inmem-ckpt``)."""
    try:
        out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--help"], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "--inmem-ckpt" in out.stdout


def run_demo(b: Bench, iters: int, reps: int = 1) -> DemoResult:
    """The three jobs in turn, ``reps`` times (the machine's drift reaches each alike); per job the
    median of its repetitions' medians."""
    d = DemoResult(iterations=iters, reps=reps)
    load0 = os.getloadavg()[0]
    integrated = demo_accepts_inmem_ckpt()
    jobs = (("off", False, "newest"), ("on", True, "newest"), ("certified", True, "certified"))
    got: dict[str, list[float]] = {name: [] for name, _, _ in jobs}
    for rep in range(reps):
        for name, inmem, prefer in jobs:
            if inmem and not integrated:
                if rep == 0:
                    d.notes.append("NOT MEASURED: scripts/pretrain_gpt.py has no `--inmem-ckpt` flag yet (the "
                                   "megatron-ft integration is missing); the mode is implemented and runs as "
                                   "soon as the script accepts the flag.")
                continue
            try:
                got[name].append(run_demo_job(b, name, iters, inmem, prefer, rep))
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:
                d.notes.append(f"snapshots {name} (repetition {rep + 1}): FAILED: {str(e).strip().splitlines()[0]}")
                traceback.print_exc()
    for name, values in got.items():
        setattr(d, f"{name}_s", statistics.median(values) if values else None)
    d.load = (load0, os.getloadavg()[0])
    return d


# ====================================================================================== CLI


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,1024", help="per-rank state sizes in MiB (default 256,1024)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts (default 1,2,4)")
    p.add_argument("--reps", type=int, default=3, help="measured repetitions per method (>= 3, default 3)")
    p.add_argument("--compute-factor", type=float, default=2.0,
                   help="simulated forward/backward = this x the raw copy time (>= 1, default 2)")
    p.add_argument("--mem-budget-gib", type=float, default=20.0, help="skip combinations needing more RAM")
    p.add_argument("--out", default=None,
                   help="markdown file to update (default docs/benchmarks.md; --quick writes only if given)")
    p.add_argument("--quick", action="store_true", help="tiny state (8 MiB), 1-2 ranks: a smoke run < 1 min")
    p.add_argument("--shm-dir", default=SHM_DIR,
                   help=f"tmpfs of the agent's slots and the raw copy's buffer (default {SHM_DIR})")
    p.add_argument("--torch-dir", default=None,
                   help="tmpfs of the torch.save file and the DCP directory (default: --shm-dir)")
    p.add_argument("--huge-shm", action="store_true",
                   help="mount a huge-page tmpfs for the run (`megatron-ft shm-mount`, needs root) and use it "
                        "as --shm-dir; the report goes to its own subsection")
    p.add_argument("--demo-iterations", action="store_true",
                   help="instead: the demo's iteration time with snapshots every iteration vs off")
    p.add_argument("--demo-train-iters", type=int, default=40)
    p.add_argument("--demo-reps", type=int, default=1, help="--demo-iterations: runs of each job, in turn")
    args = p.parse_args(argv)
    if args.quick:
        explicit = argv if argv is not None else sys.argv[1:]
        if not any(a.startswith("--sizes") for a in explicit):
            args.sizes = "8"
        if not any(a.startswith("--ranks") for a in explicit):
            args.ranks = "1,2"
    elif args.out is None:
        args.out = os.path.join(REPO, "docs", "benchmarks.md")
    args.size_list = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.rank_list = [int(r) for r in args.ranks.split(",") if r.strip()]
    if args.reps < 3:
        p.error("--reps must be >= 3")
    if args.compute_factor < 1.0:
        p.error("--compute-factor must be >= 1 (the simulated compute must cover a raw copy)")
    if any(s < 1 for s in args.size_list) or any(r < 1 for r in args.rank_list):
        p.error("--sizes and --ranks take positive integers")
    if args.demo_iterations and args.demo_train_iters <= 6:
        p.error("--demo-train-iters must be > 6 (the first 5 iterations are excluded)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/snapshot.py" + ("" if not (argv if argv is not None else sys.argv[1:])
                                                 else " " + shlex.join(argv if argv is not None else sys.argv[1:]))
    run_id = f"bench{uuid.uuid4().hex[:8]}"
    workdir = tempfile.mkdtemp(prefix=f"mft-{run_id}-")
    if args.huge_shm:
        args.shm_dir = os.path.join(workdir, "huge-shm")
    args.torch_dir = args.torch_dir or args.shm_dir
    janitor = Janitor(run_id, workdir, args.shm_dir, args.torch_dir)
    bench = Bench(run_id, workdir, args.reps, args.compute_factor, int(args.mem_budget_gib * GiB), janitor,
                  args.shm_dir, args.torch_dir)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    t_start, load_start = time.time(), os.getloadavg()[0]
    try:
        if args.demo_iterations:
            d = run_demo(bench, args.demo_train_iters, args.demo_reps)
            body = demo_report(d, command)
            print("\n" + body)
            if args.out:
                update_doc(args.out, demo_body=body)
                print(f"\n[bench] updated {args.out}")
            return 0 if d.off_s is not None else 1
        if args.huge_shm:
            shm.mount_huge_tmpfs(args.shm_dir, "60%")
            janitor.mounted.append(args.shm_dir)
        print(f"[bench] run id {run_id}; {machine()}; memory in {args.shm_dir} "
              f"({shm.page_backing(args.shm_dir)} pages)", flush=True)
        combos = [run_combo(bench, s, r) for s in args.size_list for r in args.rank_list]
        body = main_report(combos, command, args, time.time() - t_start, (load_start, os.getloadavg()[0]))
        print("\n" + SECTION + "\n\n" + body)
        if args.out:
            if args.huge_shm:
                update_doc(args.out, huge_body=f"{HUGE_HEADING} (`--huge-shm`)\n\n{body}")
            else:
                update_doc(args.out, main_body=body)
            print(f"\n[bench] updated {args.out}")
        return 1 if any(c.errors for c in combos) else 0
    except KeyboardInterrupt:
        print("\n[bench] interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        janitor.cleanup()


if __name__ == "__main__":
    sys.exit(main())
