"""Restore on (re)start: find the newest step every rank holds intact, load it, or say why not.

Tiers, tried in order (each restore checks checksums and run/step/topology identity; a
mismatch anywhere moves every rank to the next candidate or tier together):

1. ``local_memory``: the clean versions in this node's agent slots;
2. ``peer_memory`` / ``decoded``: what the node's redundancy group can rebuild (copied whole or
   decoded by the agent into a local slot);
3. ``disk``: the newest complete persisted step;
4. ``none``: nothing valid, start fresh (and say so).

A tier is left only when it is known to hold nothing usable. When the agent or a member of its
group could not say what it holds (a timeout, a store moving to a new root), the memory tiers are
*unknown*: every rank raises :class:`MemoryTierUnknown` together (the process restarts and asks
again) instead of going down to disk or a fresh start while a newer copy may be in memory.

The ranks decide together through their node agents (``decide``: each node's ranks combined by its
agent, the nodes' combinations by the root agent: two messages per node and decision, no world
collective; :mod:`megatron_ft.agent.reductions`): each rank contributes the steps it holds; the
candidates are the steps every rank holds, newest first. Without the agents' decisions
(``snapshot.agreement: collective``, an etcd store) the same decisions are collectives over every
rank (a fixed-size int64 all-gather, all-reduces; no pickle).
For each candidate every rank verifies its chunks and checks the values it restored (the guard,
:mod:`megatron_ft.trainer.guard`); an all-reduce of the verdicts decides. A version the guard refuses
on any rank is invalidated on every rank and all roll back to the next older one together, at most
``recovery.max_rollbacks`` times.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import faultpoints
from ..agent import shm, persist
from ..agent.protocol import AgentClient, AgentError
from ..capture import checksum, snapfile
from ..capture.layout import Layout
from ..capture.state import StateAdapter
from . import device_staging, guard
from .guard import RollbacksExhausted

log = logging.getLogger("megatron_ft.trainer.recovery")
MAX_CANDIDATES = 4
MAX_RESTORE_THREADS = 4
#: GPU path: host threads that read or sum blocks while the copy engine moves others (a GPU node's
#: host cores are otherwise idle then; on the H200 machine 8 reached 38-47 GB/s reading a slot)
MAX_GPU_HOST_THREADS = 8


def restore_threads(cores: int, local_ranks: int, cap: int = MAX_RESTORE_THREADS) -> int:
    """Threads one rank reads its snapshot back with (read + checksum release the GIL; restore runs
    before training): its share of the cores, since every rank on the node restores at once, at
    least 1 and at most ``cap``. One rank on 2 cores: 2; four ranks on 2 cores:
    1 (with 2 each, 8 threads contended for 2 cores: the 256 MiB x 4 restore took 100-102 ms
    against 74-91 ms with 1, in alternating runs of ``benchmarks/snapshot.py --huge-shm``)."""
    return max(1, min(cap, cores // max(1, local_ranks)))


def threads_here(cap: int = MAX_RESTORE_THREADS) -> int:
    """:func:`restore_threads` for this process: its CPU affinity and torchrun's ``LOCAL_WORLD_SIZE``.
    Also the GPU snapshot's checksum threads (``cap`` :data:`MAX_GPU_HOST_THREADS`)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return restore_threads(len(os.sched_getaffinity(0)), local, cap)


# restore reads pieces in blocks of this size into a per-thread buffer that stays in cache,
# then copies them into the tensors while summing (needs the native library)
READ_BLOCK = 4 << 20  # a multiple of 32 (the checksum groups)
#: GPU path: pinned blocks of this size go to the device (fewer, larger copies and fewer Python calls)
GPU_READ_BLOCK = 16 << 20
STREAMING_RESTORE = checksum.HAVE_NATIVE


@dataclass
class Candidate:
    step: int
    path: str
    source: str  # "local_memory" | "peer_memory" | "decoded" | "disk"


@dataclass
class RestoreResult:
    source: str  # "local_memory" | "disk" | "none"
    step: int = -1
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)
    rollbacks: int = 0  # versions the guard refused (every rank rolled back past them together)
    #: recovery.prefer: certified - whether the step is at or before the newest certified one (None: not asked)
    certified: Optional[bool] = None
    #: seconds from the start of the restore at which each phase of the restored candidate ended:
    #: ``listed`` (its tier's candidates), ``opened`` (header, identity, destinations), ``queued`` /
    #: ``landed`` (GPU path: every copy queued / done), ``loaded`` (bytes in place and verified),
    #: ``guarded`` (the value guard), ``finished`` (shards gathered, record applied), ``rewound``
    phases: dict = field(default_factory=dict)


class Container:
    """A snapshot container (shared-memory slot or persisted file).

    Read with ``pread`` from 4 KiB-page memory and from disk: mapping such a file would build
    (and tear down) a page-table entry for every 4 KiB of a multi-GiB slot. Mapped when the slot
    is on a huge-page tmpfs (:func:`megatron_ft.agent.shm.page_backing`): one entry per 2 MiB, so the
    bytes go from the slot into the tensors in one pass, without the kernel's copy."""

    def __init__(self, path: str):
        self.path = path
        #: GPU path, set by :meth:`load_verified`: when every copy was queued / had landed (``perf_counter``)
        self.marks: dict[str, float] = {}
        self.mapped = STREAMING_RESTORE and shm.backing_of(os.path.dirname(path) or ".") == shm.HUGE
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.header = snapfile.read_header(os.pread(self.fd, snapfile.HEADER_SIZE, 0))
            g = self.header.geometry
            head = os.pread(self.fd, g.version_off + self.header.version_len, 0)  # header + both records
            self.layout: Layout = snapfile.read_layout(head, self.header)
            self.version = snapfile.read_version(head, self.header) if self.header.version_len else {}
        except BaseException:
            os.close(self.fd)
            raise

    def check_identity(self, identity: dict, step: Optional[int] = None) -> None:
        if self.header.state != snapfile.CLEAN:
            raise snapfile.SnapshotFormatError(f"{self.path}: state is {snapfile.STATE_NAMES[self.header.state]}")
        if step is not None and self.header.step != step:
            raise snapfile.SnapshotFormatError(f"{self.path}: step {self.header.step} != expected {step}")
        saved = self.version.get("identity", {})
        for key, want in identity.items():
            if saved.get(key) != want:
                raise snapfile.SnapshotFormatError(
                    f"{self.path}: identity {key}={saved.get(key)!r} does not match this job's {want!r}")
        if self.version.get("checksum") not in checksum.READS:
            raise snapfile.SnapshotFormatError(f"{self.path}: checksum algorithm {self.version.get('checksum')!r} "
                                               f"is not one of {checksum.READS}")
        if len(self.version.get("chunks", [])) != self.layout.num_chunks:
            raise snapfile.SnapshotFormatError(f"{self.path}: {len(self.version.get('chunks', []))} checksums for "
                                               f"{self.layout.num_chunks} chunks")

    def load_verified(self, targets: dict, after_copies: Optional[Callable[[], None]] = None) -> None:
        """Read every tensor into its destination and verify each chunk's checksum in the same pass.
        Raises on the first mismatch; the destinations may then hold part of this snapshot (the
        caller handles that). ``after_copies``, if given, is called on this thread once every byte is
        read or (GPU path) its copy queued, with each device's current stream ordered after the copies
        (:meth:`device_staging.RestoreStagings.after_copies`): what it queues there (the value guard's
        reads) runs as the bytes land and is complete when this returns. Not called when a chunk
        already failed on the host.

        CPU destinations, with the native library: each piece is read with ``pread`` in blocks of
        ``READ_BLOCK`` bytes into a per-thread buffer that stays in cache, then copied into the
        tensor and summed in one pass (``ChunkSum.copy_to``: streaming stores, so the tensor's lines
        are not read from memory first). Reading straight into the tensor and summing it afterwards
        cost ~10% more CPU here (the kernel's copy reads every destination line first, the sum reads
        the bytes again); smaller blocks (256 KiB) cost more than they save in per-call overhead.
        Without the native library (numpy checksum) the bytes are read straight into the tensor
        and summed there."""
        sums = self.version["chunks"]
        base = self.header.geometry.data_off
        names = [e.spec.name for e in self.layout.entries]
        views = {n: targets[n].saved_view().reshape(-1) for n in names}
        all_pieces = self.layout.all_pieces()
        buffers = threading.local()  # one read buffer per worker thread
        mapping = None
        if self.mapped:
            try:
                mapping = self._map()
            except OSError as e:  # not the snapshot's fault (e.g. address space): read it with pread
                log.warning("%s: mapping failed (%s); reading with pread", self.path, e)
        src = np.frombuffer(mapping, np.uint8) if mapping is not None else None
        # GPU path (nothing is allocated for CPU targets); on the caller's thread: see its ordering rule
        devices = device_staging.devices_of(views.values())  # GPU path: the destinations' devices (else none)
        on_gpu = bool(devices)
        stagings = device_staging.RestoreStagings(GPU_READ_BLOCK, devices)
        # GPU path: chunks with pieces on a device are verified on the device, after the copies
        on_device_sums = self.version["checksum"] == checksum.ALGORITHM
        verify_later: dict[int, list] = {}
        locked = None  # GPU path: the container page-locked in this process (perhaps still being, range by range)
        if on_device_sums and on_gpu:
            locked = self._page_locked(devices[0])
        page_locked = torch.from_numpy(locked.array) if locked is not None else None

        def upload(p, dst: torch.Tensor) -> torch.Tensor:
            """GPU path: a piece to the device - straight from a page-locked slot, else through the
            thread's pinned blocks; its lanes, summed there."""
            stage = stagings.here(dst.device)
            part = _byte_view(dst)[p.src_start:p.src_end]
            at = base + p.dst_offset
            if locked is not None and locked.wait_range(at, at + part.numel()):
                for lo, hi in locked.pieces(at, at + part.numel()):  # each copy inside one page-locked range
                    stage.upload_page_locked(page_locked[lo:hi], part[lo - at: hi - at])
                return _Landed(part)  # summed after every copy, all such pieces in one launch (below)
            for off in range(0, part.numel(), GPU_READ_BLOCK):
                k, block = stage.block()
                n = min(GPU_READ_BLOCK, part.numel() - off)
                if src is not None:
                    np.copyto(block[:n].numpy(), src[at + off: at + off + n])
                else:
                    _pread_into(self.fd, block[:n], at + off)
                stage.upload(k, part[off: off + n])
            return stage.lanes(part)

        def one_chunk(i: int) -> Optional[str]:
            lo, hi = self.layout.chunk_bounds(i)
            pieces = all_pieces[i]
            if on_device_sums and any(device_staging.on_device(views[names[p.entry_index]]) for p in pieces):
                parts = []  # GPU path: (offset in the chunk, lanes), combined after every copy is done
                for p in pieces:
                    dst = views[names[p.entry_index]]
                    if not device_staging.on_device(dst):
                        part = _byte_view(dst)[p.src_start:p.src_end]
                        _pread_into(self.fd, part, base + p.dst_offset)
                        parts.append((p.dst_offset - lo, checksum.host_lanes(part)))
                    else:
                        parts.append((p.dst_offset - lo, upload(p, dst)))
                verify_later[i] = parts
                return None
            chunk = checksum.ChunkSum(hi - lo, algorithm=self.version["checksum"])
            for p in pieces:
                dst = views[names[p.entry_index]]
                at = base + p.dst_offset
                if dst.device.type == "cpu" and src is not None:  # huge-page slot: straight from the mapping
                    part = _byte_view(dst)[p.src_start:p.src_end].numpy()
                    chunk.copy_to(p.dst_offset - lo, part, src[at: at + part.size])
                elif dst.device.type == "cpu" and STREAMING_RESTORE:
                    part = _byte_view(dst)[p.src_start:p.src_end].numpy()  # numpy: cheap slices
                    if not hasattr(buffers, "block"):
                        buffers.block = np.empty(READ_BLOCK, np.uint8)
                    for off in range(0, part.size, READ_BLOCK):
                        block = buffers.block[: min(READ_BLOCK, part.size - off)]
                        _pread_into(self.fd, block, at + off)
                        chunk.copy_to(p.dst_offset - lo + off, part[off: off + block.size], block)
                elif dst.device.type == "cpu":  # no native library: read in place, sum (numpy)
                    part = _byte_view(dst)[p.src_start:p.src_end]
                    _pread_into(self.fd, part, at)
                    chunk.add(p.dst_offset - lo, part)
                else:  # GPU path, a snapshot of an older checksum: read and summed on the host, then copied
                    part = torch.empty(p.src_end - p.src_start, dtype=torch.uint8)
                    _pread_into(self.fd, part, at)
                    chunk.add(p.dst_offset - lo, part)
                    _byte_view(dst)[p.src_start:p.src_end].copy_(part)
            return _mismatch(i, chunk.finish())

        def _mismatch(i: int, got: int) -> Optional[str]:
            if f"{got:016x}" != sums[i]:
                return f"{self.path}: chunk {i} checksum mismatch (stored {sums[i]}, computed {got:016x})"
            return None

        # chunks are independent and the read + checksum calls release the GIL: use the idle cores
        # (straight from a page-locked slot a thread only queues copies: one is enough, and no pool to start)
        workers = 1 if page_locked is not None else max(
            1, min(threads_here(MAX_GPU_HOST_THREADS if on_gpu else MAX_RESTORE_THREADS), self.layout.num_chunks))
        try:
            if workers == 1:
                errors = [one_chunk(i) for i in range(self.layout.num_chunks)]
            else:  # (each RestoreStaging makes its device current for its CUDA calls: a pool thread's is 0)
                with ThreadPoolExecutor(workers, thread_name_prefix="mft-restore") as pool:
                    errors = list(pool.map(one_chunk, range(self.layout.num_chunks)))
            if on_gpu:
                self.marks["queued"] = time.perf_counter()
            landed = [x for parts in verify_later.values() for _, x in parts if isinstance(x, _Landed)]
            with stagings.after_copies():  # launched while the copies are in flight
                _sum_landed(landed)
                if after_copies is not None and not any(errors):
                    after_copies()
        finally:
            stagings.finish()  # every device copy done before the blocks or the mapping go
            if on_gpu:
                self.marks["landed"] = time.perf_counter()
            if mapping is not None:
                del src
                mapping.close()
        if verify_later:  # GPU path: the device lanes to the host in one copy per device, then combined
            later = sorted(verify_later.items())
            device_parts = [lanes for _, parts in later for _, lanes in parts if not isinstance(lanes, list)]
            lanes = [x.lanes if isinstance(x, _Landed) else x for x in device_parts]
            on_host = iter(torch.stack(lanes).cpu().tolist() if lanes else [])
            for i, parts in later:
                lo, hi = self.layout.chunk_bounds(i)
                host = [(off, lanes if isinstance(lanes, list) else next(on_host)) for off, lanes in parts]
                errors.append(_mismatch(i, checksum.combine_lanes(hi - lo, host)))
        bad = [e for e in errors if e]
        if bad:
            raise snapfile.SnapshotFormatError(bad[0] + (f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""))

    def _page_locked(self, device: torch.device) -> Optional[device_staging.PageLockedFile]:
        """GPU path: this container page-locked in this process, for the copy engine to read without a
        bounce (perhaps still being page-locked: copy a range once ``wait_range`` allows): the file this
        process page-locked for its snapshots (an in-process restart); else, in a fresh process where
        :func:`device_staging.lock_while_copying` says so (a slot on a huge-page tmpfs), the slot
        page-locked range by range while the copies are queued, and kept for the process's snapshots;
        else None: through pinned blocks."""
        need = self.header.geometry.data_off + self.layout.data_nbytes
        locked = device_staging.page_locked_file(self.path)
        if locked is not None and locked.array.nbytes >= need:
            log.info("%s: restoring straight from the slot page-locked by this process for its snapshots", self.path)
            return locked
        if not device_staging.lock_while_copying(shm.backing_of(os.path.dirname(self.path) or ".")):
            return None
        locking = device_staging.page_lock_while_copying(self.path, threads_here(MAX_GPU_HOST_THREADS), device)
        if locking is None:
            return None
        if locking.array.nbytes < need:  # (read through blocks, which find it short)
            device_staging.forget_page_locked(self.path, locking)
            return None
        log.info("%s: restoring straight from the slot, page-locking it range by range as the copies go", self.path)
        return locking

    def _map(self) -> mmap.mmap:
        """The whole container, read-only. A file shorter than its header says is refused here:
        reading past its end through a mapping would be SIGBUS, not an error."""
        need, size = self.header.geometry.data_off + self.layout.data_nbytes, os.fstat(self.fd).st_size
        if size < need:
            raise snapfile.SnapshotFormatError(f"{self.path}: snapshot ends early ({size} bytes, needs {need})")
        return mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class _Landed:
    """GPU path: a piece copied straight from a page-locked slot into ``part`` (device bytes); its
    ``lanes`` are summed after every copy has landed, with the restore's other such pieces in one launch."""
    __slots__ = ("part", "lanes")

    def __init__(self, part: torch.Tensor):
        self.part, self.lanes = part, None


def _sum_landed(landed: list[_Landed]) -> None:
    """Fill in the lanes of ``landed`` pieces (their copies complete), one batched call per device."""
    by_device: dict[torch.device, list[_Landed]] = {}
    for x in landed:
        by_device.setdefault(x.part.device, []).append(x)
    for device, xs in by_device.items():
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            out = torch.empty(len(xs), 16, dtype=torch.int64, device=device)
            checksum.pieces_lanes([x.part for x in xs], out)
        for x, row in zip(xs, out):
            x.lanes = row


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


_PREAD_BLOCK = 1 << 30


def _pread_into(fd: int, dst: torch.Tensor | np.ndarray, offset: int) -> None:
    """Fill the contiguous CPU uint8 tensor or array ``dst`` from ``fd`` at ``offset`` (releases the GIL)."""
    arr = dst.numpy() if isinstance(dst, torch.Tensor) else dst
    n = arr.size
    if not n:
        return
    mv = memoryview(arr).cast("B")
    done = 0
    while done < n:
        got = os.preadv(fd, [mv[done: min(n, done + _PREAD_BLOCK)]], offset + done)
        if got <= 0:
            raise snapfile.SnapshotFormatError(f"snapshot ends early: {n - done} bytes missing at offset {offset + done}")
        done += got


def resolve_targets(container: Container, adapter: StateAdapter) -> dict:
    """Destinations for every saved tensor, checked for name, shard and size before any byte moves."""
    targets = adapter.targets(container.layout, container.version.get("extra", {}))
    missing = [e.spec.name for e in container.layout.entries if e.spec.name not in targets]
    if missing:
        raise KeyError(f"no destination for saved tensors {missing[:5]}")
    for e in container.layout.entries:
        t = targets[e.spec.name]
        if t.spec() != e.spec:
            raise ValueError(f"{e.spec.name}: snapshot holds {e.spec}, this job expects {t.spec()}")
    return targets


def finish_load(container: Container, adapter: StateAdapter, targets: dict) -> None:
    """After every rank verified its bytes: re-assemble data-parallel shards (all-gather over each
    shard's group) and apply the JSON record."""
    for e in container.layout.entries:
        if e.spec.shard is not None:
            _gather_shard(targets[e.spec.name])
    adapter.finish_restore(container.version.get("extra", {}))


def _gather_shard(t) -> None:
    shard = t.shard
    flat = t.tensor.view(-1)
    per = -(-shard.full_numel // shard.count)
    lo, hi = shard.bounds()
    mine = torch.zeros(per, dtype=flat.dtype, device=flat.device)
    mine[: hi - lo] = flat[lo:hi]
    parts = [torch.empty(per, dtype=flat.dtype, device=flat.device) for _ in range(shard.count)]
    dist.all_gather(parts, mine, group=t.group)
    full = torch.cat(parts)[: shard.full_numel]
    flat.copy_(full)


def collective_device(group: Any = None) -> torch.device:
    """Where a small tensor for a collective on ``group`` (None: the default group) must live: the
    current CUDA device on NCCL (GPU path), else the host."""
    if dist.get_backend(group) == "nccl":  # GPU path
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Restorer:
    """``group_wait_s``: how long the agent may wait for its group's members to say what they hold
    (``health.group_answer_s``); each such request is bounded by that plus the client's timeout.
    ``check_values``: the guard (``recovery.guard``); ``max_rollbacks``: ``recovery.max_rollbacks``;
    ``prefer_certified``: ``recovery.prefer: certified``."""

    def __init__(self, rank: int, world_size: int, identity: dict, run_id: str, persist_dir: str,
                 client: Optional[AgentClient], coord_group: Any = None, group_wait_s: float = 15.0,
                 check_values: bool = True, max_rollbacks: int = 2, prefer_certified: bool = False,
                 decide: Optional[Callable[[str, list[int]], list[int]]] = None):
        self.rank = rank
        #: the job-wide decisions through the agents, ``decide(how, values) -> the job's result`` (None:
        #: collectives over ``coord_group``); every rank makes the same decisions in the same order
        self.decide = decide if dist.is_available() and dist.is_initialized() else None
        self.decisions = 0
        self.prefer_certified = prefer_certified
        self.check_values = check_values
        self.max_rollbacks = max_rollbacks
        self.group_wait_s = group_wait_s
        #: why this rank cannot tell what the memory tiers hold (None: it can)
        self.memory_unknown: Optional[str] = None
        self.world_size = world_size
        self.identity = identity
        self.run_id = run_id
        self.persist_dir = persist_dir
        self.client = client
        self.coord_group = coord_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_collectives = 0  # collectives over the coordination group (every rank), counted

    # ------------------------------------------------------------------ candidates
    def local_candidates(self) -> list[Candidate]:
        if self.client is None:
            return []
        try:
            versions = self.client.request("list", rank=self.rank)["versions"]
        except Exception as e:
            self.memory_unknown = f"its agent did not list its versions: {e}"
            log.error("rank %d: %s", self.rank, self.memory_unknown)
            return []
        return [Candidate(v["step"], v["path"], "local_memory") for v in versions]

    def peer_candidates(self) -> list[Candidate]:
        """The versions this rank's agent can rebuild from its redundancy group (copied whole or
        decoded), for the steps it does not hold itself."""
        if self.client is None:
            return []
        try:
            reply = self.client.request("peer_list", rank=self.rank, wait_s=self.group_wait_s)
        except Exception as e:
            self.memory_unknown = f"its agent did not list what the group can rebuild: {e}"
            log.error("rank %d: %s", self.rank, self.memory_unknown)
            return []
        if reply.get("unanswered"):
            self.memory_unknown = (f"{'; '.join(f'{who}: {why}' for who, why in reply['unanswered'].items())}: "
                                   f"did not say what the group holds within {self.group_wait_s:g} s")
            log.error("rank %d: %s", self.rank, self.memory_unknown)
        return [Candidate(v["step"], "", v["source"]) for v in reply["versions"]]

    def memory_candidates(self) -> list[Candidate]:
        """Local versions and, for the steps not held locally, what the group can rebuild: all ranks
        then agree on one step from the union (a parity node's unfinished newer step, or a rank whose
        slot of the group's complete step was reused, never hides that step)."""
        local = self.local_candidates()
        held = {c.step for c in local}
        return local + [c for c in self.peer_candidates() if c.step not in held]

    def _materialize(self, cand: Candidate) -> Candidate:
        """A peer candidate is rebuilt into a local slot by the agent first."""
        if cand.path or self.client is None:
            return cand
        self.client.request("recover", rank=self.rank, step=cand.step, wait_s=self.group_wait_s)
        for c in self.local_candidates():
            if c.step == cand.step:
                return Candidate(c.step, c.path, cand.source)
        raise OSError(f"the agent rebuilt step {cand.step} but does not list it")

    def disk_candidates(self) -> list[Candidate]:
        steps = persist.complete_steps(self.persist_dir, self.run_id, self.world_size)
        return [Candidate(s, persist.rank_file(self.persist_dir, self.run_id, s, self.rank), "disk") for s in steps]

    def _common_steps(self, steps: list[int]) -> list[int]:
        mine = sorted(set(steps), reverse=True)[:MAX_CANDIDATES]
        if not self.distributed:
            return mine
        if self.decide is not None:
            self.decisions += 1
            return sorted(self.decide("intersect", mine), reverse=True)
        t = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
        t[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        t = t.to(collective_device(self.coord_group))
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.coord_group))]
        dist.all_gather(parts, t, group=self.coord_group)
        self.world_collectives += 1
        common = None
        for p in parts:
            s = {int(x) for x in p.tolist() if x >= 0}
            common = s if common is None else common & s
        return sorted(common or (), reverse=True)

    def _all_ok(self, ok: bool) -> bool:
        return self._agree(ok, False)[0]

    def _agree(self, ok: bool, refused: bool) -> tuple[bool, bool]:
        """Collective: (every rank ok, some rank's guard refused its values)."""
        if not self.distributed:
            return ok, refused
        if self.decide is not None:
            self.decisions += 1
            every_ok, none_refused = self.decide("min", [int(ok), int(not refused)])
            return bool(every_ok), not bool(none_refused)
        t = torch.tensor([1 if ok else 0, 0 if refused else 1], dtype=torch.int64,
                         device=collective_device(self.coord_group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.coord_group)
        self.world_collectives += 1
        return bool(t[0].item()), not bool(t[1].item())

    # ------------------------------------------------------------------ restore
    def restore(self, adapter: StateAdapter) -> RestoreResult:
        """Try every common candidate, newest first, tier by tier. Each candidate: all ranks check
        header, identity and layout (nothing touched yet) and agree; then each reads its bytes
        straight into the training state verifying every chunk, and all agree again. A candidate
        that fails the second agreement is invalidated where it was corrupt and the next one
        overwrites the state completely; if none is left, :class:`RestoreFailed` is raised so the
        process restarts clean instead of training on half-restored state.

        With ``prefer_certified`` the tiers are first searched for versions at or before the newest
        certified one (the ranks agree on it); only where no rank holds any of those in a tier every
        rank reaches (more nodes lost than the redundancy tolerates, an exchange that had not carried
        it) does the search go on over every version, saying so."""
        t0 = time.perf_counter()
        attempt = _Attempt()
        certified = self._newest_certified() if self.prefer_certified else None
        if certified is not None and certified >= 0:
            res = self._through_tiers(adapter, t0, attempt, upto=certified)
            if res is not None:
                res.certified = True
                return res
        res = self._through_tiers(adapter, t0, attempt)
        if res is not None:
            if certified is not None:
                res.certified = False
                log.warning("rank %d: restored step %d, not certified: %s", self.rank, res.step,
                            f"no version at or before the newest certified one (step {certified}) is held where "
                            f"every rank reaches it" if certified >= 0 else "no version is certified yet")
            return res
        if attempt.touched:
            raise RestoreFailed(f"rank {self.rank}: every snapshot candidate failed after loading began "
                                f"({attempt.rejected}); the corrupt copies were invalidated, restart to begin fresh")
        self._rewind(-1)
        return RestoreResult("none", -1, time.perf_counter() - t0, {}, attempt.rejected)

    def _newest_certified(self) -> int:
        """Collective: the newest certified step any rank's agent marks (-1: none). The marks come from
        verdicts every rank shared, so an agent that has none (a replaced node's) only does not know."""
        mine = -1
        if self.client is not None:
            try:
                mine = max((v["step"] for v in self.client.request("list", rank=self.rank)["versions"]
                            if v.get("certified")), default=-1)
            except Exception as e:
                log.warning("rank %d: the agent did not say which version is certified: %s", self.rank, e)
        if not self.distributed:
            return mine
        if self.decide is not None:
            self.decisions += 1
            return int(self.decide("max", [mine])[0])
        t = torch.tensor([mine], dtype=torch.int64, device=collective_device(self.coord_group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.coord_group)
        self.world_collectives += 1
        return int(t.item())

    def _through_tiers(self, adapter: StateAdapter, t0: float, attempt: "_Attempt",
                       upto: Optional[int] = None) -> Optional[RestoreResult]:
        """Collective: the first candidate (at most step ``upto``) every rank restores, tier by tier, or
        ``None``. ``attempt`` carries what was rejected, refused and touched across calls."""
        rejected, refused = attempt.rejected, attempt.refused
        # local memory first (every rank agrees from its own agent's versions, no peer traffic); when
        # no step is common, local and peer holdings together; then disk
        tiers = (("local", self.local_candidates), ("memory", self.memory_candidates), ("disk", self.disk_candidates))
        for tier, cands in tiers:
            if tier == "disk":
                self._check_memory_known()
            by_step = {c.step: c for c in cands() if c.step not in refused and (upto is None or c.step <= upto)}
            listed = time.perf_counter()
            if tier == "disk" and by_step:
                log.warning("rank %d: no version every rank can restore from memory (local, or rebuilt from the "
                            "redundancy group: more nodes lost than it tolerates?); falling back to the newest "
                            "persisted checkpoint on disk", self.rank)
            for step in self._common_steps(list(by_step)):
                faultpoints.reached("restore", step, self.rank)
                cont: Optional[Container] = None
                targets: dict = {}
                ok = True
                try:
                    by_step[step] = self._materialize(by_step[step])
                    cont = Container(by_step[step].path)
                    cont.check_identity(self.identity, step)
                    targets = resolve_targets(cont, adapter)
                except (snapfile.SnapshotFormatError, OSError, ValueError, KeyError, AgentError) as e:
                    ok = False
                    rejected.append(f"{tier} step {step}: {e}")
                    log.warning("rank %d: rejecting %s step %d: %s", self.rank, tier, step, e)
                if not self._all_ok(ok):
                    if ok:
                        rejected.append(f"{tier} step {step}: rejected by another rank")
                    if cont is not None:
                        cont.close()
                    continue
                assert cont is not None
                attempt.touched = True
                bad_values: list[str] = []
                marks = {"listed": listed, "opened": time.perf_counter()}
                screens: list[guard.ValueScreen] = []  # the guard's reads, queued as the copies land

                def screen_values() -> None:
                    screens.append(guard.ValueScreen({n: t.saved_view() for n, t in targets.items()
                                                      if t.values_checked}))
                try:
                    cont.load_verified(targets, after_copies=screen_values if self.check_values else None)
                    ok = True
                except (snapfile.SnapshotFormatError, OSError) as e:
                    ok = False
                    rejected.append(f"{tier} step {step}: {e}")
                    log.warning("rank %d: %s step %d is corrupt: %s", self.rank, tier, step, e)
                    self._invalidate(by_step[step])
                marks.update(cont.marks, loaded=time.perf_counter())
                if ok and self.check_values:
                    if not screens:
                        screen_values()
                    bad_values = screens[0].result()
                    if bad_values:
                        ok = False
                        rejected.append(f"{tier} step {step}: non-finite values in {len(bad_values)} tensor(s) "
                                        f"({', '.join(bad_values[:3])})")
                        log.error("rank %d: %s step %d passed its checksums but holds NaN or Inf in %s: refused",
                                  self.rank, tier, step, ", ".join(bad_values[:5]))
                marks["guarded"] = time.perf_counter()
                all_ok, any_refused = self._agree(ok, bool(bad_values))
                if all_ok:
                    finish_load(cont, adapter, targets)
                    marks["finished"] = time.perf_counter()
                    extra = cont.version.get("extra", {})
                    cont.close()
                    self._rewind(step)
                    marks["rewound"] = end = time.perf_counter()
                    return RestoreResult(by_step[step].source, step, end - t0, extra, rejected, len(refused),
                                         phases={k: v - t0 for k, v in marks.items()})
                cont.close()
                if any_refused:  # a bad version, not a bad copy: every rank drops its copy and rolls back
                    refused.add(step)
                    if not bad_values:
                        rejected.append(f"{tier} step {step}: refused by the guard on another rank")
                    self._check_rollbacks(step, self._refuse(by_step[step]), refused, rejected)
                elif ok:
                    rejected.append(f"{tier} step {step}: corrupt on another rank")
        return None

    def _refuse(self, cand: Candidate) -> int:
        """Every rank, for the version the guard refused on some rank: :func:`refuse_version`."""
        return refuse_version(self.client, self.rank, cand.step,
                              persist.rank_file(self.persist_dir, self.run_id, cand.step, self.rank))

    def _check_rollbacks(self, step: int, counted: int, refused: set[int], rejected: list[str]) -> None:
        """Every rank, after the same collective verdicts: past ``max_rollbacks`` refused versions (in
        this restore, or as the agent counted them across restarts) the job has nothing trustworthy to
        resume from."""
        n = max(counted, len(refused))
        if n <= self.max_rollbacks:
            log.warning("rank %d: rolling back past step %d (rollback %d of at most %d)", self.rank, step, n,
                        self.max_rollbacks)
            return
        raise RollbacksExhausted(f"rank {self.rank}: {n} restored versions (steps {sorted(refused, reverse=True)} in "
                                 f"this restore) failed the guard, more than recovery.max_rollbacks="
                                 f"{self.max_rollbacks}: nothing trustworthy is left to resume from "
                                 f"({'; '.join(rejected[-3:])})")

    def _check_memory_known(self) -> None:
        """Collective: before any rank goes below the memory tiers, every rank must know they hold
        nothing it can use; else all raise :class:`MemoryTierUnknown` together."""
        if self._all_ok(self.memory_unknown is None):
            return
        why = self.memory_unknown or "another rank could not tell what its memory tiers hold"
        raise MemoryTierUnknown(f"rank {self.rank}: {why}. Not falling back to disk or a fresh start while a "
                                f"newer version may be in memory; the process ends and its restart asks again")

    def _rewind(self, step: int) -> None:
        """Tell the agent the job resumed from ``step``: newer versions are dropped and ``step`` is
        the protected one (without this, a stale newer agreed step would keep every later snapshot
        out of the slots)."""
        if self.client is None:
            return
        try:
            self.client.request("rewind", rank=self.rank, step=step)
        except Exception as e:  # the agent may be restarting; its re-adopted table is rewound next time
            log.warning("rank %d: could not tell the agent it resumed from step %d: %s", self.rank, step, e)

    def _invalidate(self, cand: Candidate) -> None:
        """Make sure a corrupt copy is never offered again."""
        try:
            if cand.source in ("local_memory", "peer_memory", "decoded") and self.client is not None:
                self.client.request("invalidate", rank=self.rank, step=cand.step)
            elif cand.source == "disk":
                os.replace(cand.path, cand.path + ".corrupt")
        except Exception as e:  # best effort: the checksum still rejects it next time
            log.warning("rank %d: could not invalidate %s step %d: %s", self.rank, cand.source, cand.step, e)


@dataclass
class _Attempt:
    """One restore's record across its searches: why candidates were rejected, the steps the guard
    refused (skipped in every tier), whether any state was overwritten yet."""

    rejected: list[str] = field(default_factory=list)
    refused: set[int] = field(default_factory=set)
    touched: bool = False


def refuse_version(client: Optional[AgentClient], rank: int, step: int, persisted: str) -> int:
    """Drop ``rank``'s copies of a version the guard refused, wherever it would be offered again: the
    agent's ``refuse`` (the slot of ``step`` and of every newer version, as a rewind to the step
    before; the rollback counted) and the persisted file ``persisted``, renamed ``*.corrupt``. Returns
    the rollbacks the agent has counted since the job last passed the guard (0 if it cannot say).
    Not collective; every rank calls it for its own copies."""
    if os.path.exists(persisted):
        os.replace(persisted, persisted + ".corrupt")
    if client is None:
        return 0
    try:
        return int(client.request("refuse", rank=rank, step=step)["rollbacks"])
    except Exception as e:  # a restart that meets the version again refuses it again
        log.warning("rank %d: the agent did not drop step %d: %s", rank, step, e)
        return 0


class MemoryTierUnknown(RuntimeError):
    """The agent or a member of its redundancy group could not say what it holds in time: going on
    to disk or a fresh start could lose work that is still in memory. Nothing was loaded; end the
    process (its restart asks again). Callers must not treat it as "no snapshot"."""


class RestoreFailed(RuntimeError):
    """State was partly overwritten by snapshots that then failed verification; restart the process."""
