"""Restore on (re)start: find the newest step every rank holds intact, load it, or say why not.

Tiers, tried in order (each restore checks checksums and run/step/topology identity; a
mismatch anywhere moves every rank to the next candidate or tier together):

1. ``local_memory``: the clean versions in this node's agent slots;
2. ``disk``: the newest complete persisted step;
3. ``none``: nothing valid, start fresh (and say so).

Agreement uses a fixed-size int64 all-gather on the coordination group (no pickle): each rank
contributes the steps it holds; the candidates are the steps every rank holds, newest first.
For each candidate every rank verifies its chunks; an all-reduce(MIN) of the verdicts decides.
Only then are bytes copied into the training state, so a failed candidate never leaves the
model half overwritten.
"""
from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import checksum, shm, snapfile
from .agent import persist
from .layout import Layout
from .protocol import AgentClient
from .state import StateAdapter

log = logging.getLogger("megatron_ft.recovery")
MAX_CANDIDATES = 4


@dataclass
class Candidate:
    step: int
    path: str
    source: str  # "local_memory" | "disk"


@dataclass
class RestoreResult:
    source: str  # "local_memory" | "disk" | "none"
    step: int = -1
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)


class Container:
    """A snapshot container (shared-memory slot or persisted file) opened read-only."""

    def __init__(self, path: str):
        self.path = path
        self.seg = shm.open_segment(path, writable=False, populate=True)
        self.header = snapfile.read_header(self.seg.mm)
        self.layout: Layout = snapfile.read_layout(self.seg.mm, self.header)
        self.version = snapfile.read_version(self.seg.mm, self.header) if self.header.version_len else {}

    @property
    def data(self):
        g = self.header.geometry
        return self.seg.array[g.data_off: g.data_off + g.data_len]

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
        if self.version.get("checksum") != checksum.ALGORITHM:
            raise snapfile.SnapshotFormatError(f"{self.path}: checksum algorithm {self.version.get('checksum')!r} "
                                               f"is not {checksum.ALGORITHM!r}")

    def verify(self) -> None:
        """Recompute every chunk checksum; raise on the first mismatch."""
        sums = self.version.get("chunks", [])
        if len(sums) != self.layout.num_chunks:
            raise snapfile.SnapshotFormatError(f"{self.path}: {len(sums)} checksums for {self.layout.num_chunks} chunks")
        data = self.data
        for i in range(self.layout.num_chunks):
            lo, hi = self.layout.chunk_bounds(i)
            got = checksum.checksum(data[lo:hi])
            if f"{got:016x}" != sums[i]:
                raise snapfile.SnapshotFormatError(f"{self.path}: chunk {i} checksum mismatch "
                                                   f"(stored {sums[i]}, computed {got:016x})")

    def close(self) -> None:
        self.seg.close()


def resolve_targets(container: Container, adapter: StateAdapter) -> dict:
    """Destinations for every saved tensor, checked for name, shard and size before any byte moves."""
    targets = adapter.targets(container.layout)
    missing = [e.spec.name for e in container.layout.entries if e.spec.name not in targets]
    if missing:
        raise KeyError(f"no destination for saved tensors {missing[:5]}")
    for e in container.layout.entries:
        t = targets[e.spec.name]
        if t.spec() != e.spec:
            raise ValueError(f"{e.spec.name}: snapshot holds {e.spec}, this job expects {t.spec()}")
    return targets


def load_into(container: Container, adapter: StateAdapter, targets: dict) -> None:
    """Copy a verified container's tensors into their destinations, re-assemble data-parallel
    shards (all-gather over each shard's group) and apply the JSON record."""
    data = container.data
    for e in container.layout.entries:
        dst = targets[e.spec.name].saved_view()
        if not e.spec.nbytes:
            continue
        src = data[e.offset: e.offset + e.spec.nbytes]
        if dst.device.type == "cpu":
            ctypes.memmove(dst.data_ptr(), src.ctypes.data, e.spec.nbytes)  # releases the GIL
        else:  # GPU path: host bytes -> device tensor
            dst.copy_(torch.from_numpy(src.copy()).view(dst.dtype).view(dst.shape))
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


class Restorer:
    def __init__(self, rank: int, world_size: int, identity: dict, run_id: str, persist_dir: str,
                 client: Optional[AgentClient], coord_group: Any = None):
        self.rank = rank
        self.world_size = world_size
        self.identity = identity
        self.run_id = run_id
        self.persist_dir = persist_dir
        self.client = client
        self.coord_group = coord_group
        self.distributed = dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------ candidates
    def local_candidates(self) -> list[Candidate]:
        if self.client is None:
            return []
        try:
            versions = self.client.request("list", rank=self.rank)["versions"]
        except Exception as e:
            log.warning("rank %d: agent has no versions for us (%s)", self.rank, e)
            return []
        return [Candidate(v["step"], v["path"], "local_memory") for v in versions]

    def disk_candidates(self) -> list[Candidate]:
        steps = persist.complete_steps(self.persist_dir, self.run_id, self.world_size)
        return [Candidate(s, persist.rank_file(self.persist_dir, self.run_id, s, self.rank), "disk") for s in steps]

    def _common_steps(self, steps: list[int]) -> list[int]:
        mine = sorted(set(steps), reverse=True)[:MAX_CANDIDATES]
        if not self.distributed:
            return mine
        t = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
        t[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.coord_group))]
        dist.all_gather(parts, t, group=self.coord_group)
        common = None
        for p in parts:
            s = {int(x) for x in p.tolist() if x >= 0}
            common = s if common is None else common & s
        return sorted(common or (), reverse=True)

    def _all_ok(self, ok: bool) -> bool:
        if not self.distributed:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.coord_group)
        return bool(t.item())

    # ------------------------------------------------------------------ restore
    def restore(self, adapter: StateAdapter) -> RestoreResult:
        t0 = time.perf_counter()
        rejected: list[str] = []
        for tier, cands in (("local_memory", self.local_candidates), ("disk", self.disk_candidates)):
            by_step = {c.step: c for c in cands()}
            for step in self._common_steps(list(by_step)):
                cont: Optional[Container] = None
                targets: dict = {}
                ok = True
                try:
                    cont = Container(by_step[step].path)
                    cont.check_identity(self.identity, step)
                    cont.verify()
                    targets = resolve_targets(cont, adapter)
                except (snapfile.SnapshotFormatError, OSError, ValueError, KeyError) as e:
                    ok = False
                    rejected.append(f"{tier} step {step}: {e}")
                    log.warning("rank %d: rejecting %s step %d: %s", self.rank, tier, step, e)
                if self._all_ok(ok):
                    assert cont is not None
                    load_into(cont, adapter, targets)
                    extra = cont.version.get("extra", {})
                    cont.close()
                    return RestoreResult(tier, step, time.perf_counter() - t0, extra, rejected)
                if cont is not None:
                    cont.close()
                if ok:
                    rejected.append(f"{tier} step {step}: rejected by another rank")
        return RestoreResult("none", -1, time.perf_counter() - t0, {}, rejected)
