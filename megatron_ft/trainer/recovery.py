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

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import faultpoints
from ..agent import shm, persist
from ..agent.protocol import AgentClient, AgentError
from ..capture import checksum, snapfile
from ..capture.layout import Layout
from ..capture.state import StateAdapter
from . import device_staging, guard, restore_read
from .guard import RollbacksExhausted

log = logging.getLogger("megatron_ft.trainer.recovery")
MAX_CANDIDATES = 4


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

    Its ``medium`` (a huge-page tmpfs, a 4 KiB-page tmpfs, a file) picks the reader: through the
    process's mapping of the slot, or ``pread`` (:func:`restore_read.cpu_reader` says why each)."""

    def __init__(self, path: str):
        self.path = path
        #: GPU path, set by :meth:`load_verified`: when every copy was queued / had landed (``perf_counter``)
        self.marks: dict[str, float] = {}
        #: set by :meth:`load_verified`: the tensors screened for NaN and infinities in the read's own pass,
        #: each with whether it holds only finite values (the value guard need not read them again)
        self.screened: dict[str, bool] = {}
        directory = os.path.dirname(path) or "."
        backing = shm.backing_of(directory)
        self.medium = (restore_read.HUGE_TMPFS if backing == shm.HUGE else
                       restore_read.TMPFS if shm.is_tmpfs(directory) else restore_read.FILE)
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

    @property
    def mapped(self) -> bool:
        """Whether the read goes through the process's mapping of the slot (a tmpfs, the native library there)."""
        return restore_read.maps(self.medium)

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
        """Read every tensor into its destination and verify each chunk's checksum in the same pass
        (:mod:`.restore_read`: the read plan, and the reader for this container's medium and the
        destinations' devices, chosen here once). Raises on a mismatch, after every chunk was read; the
        destinations may then hold part of this snapshot (the caller handles that). ``after_copies``, if
        given, is called on this thread once every byte is read or (GPU path) its copy queued, with each
        device's current stream ordered after the copies (:meth:`device_staging.RestoreStagings.after_copies`):
        what it queues there (the value guard's reads) runs as the bytes land and is complete when this
        returns. Not called when a chunk already failed on the host. By then :attr:`screened` names the
        tensors the read screened for NaN and infinities in its own pass (:meth:`restore_read.Reader.screened`)."""
        views = {e.spec.name: targets[e.spec.name].saved_view().reshape(-1) for e in self.layout.entries}
        plan = restore_read.plan_reads(self.path, self.layout, self.version["chunks"], self.version["checksum"],
                                       self.header.geometry.data_off, views)
        reader = restore_read.choose_reader(plan, self.fd, self.medium, self._page_locked, self.marks)
        self.screened = {}

        def settled() -> None:  # every chunk read and verified: what the pass screened, then the caller's
            self.screened = reader.screened()
            if after_copies is not None:
                after_copies()
        restore_read.read_verified(plan, reader, settled)

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
        locking = device_staging.page_lock_while_copying(self.path, restore_read.threads_here(
            restore_read.MAX_GPU_HOST_THREADS), device)
        if locking is None:
            return None
        if locking.array.nbytes < need:  # (read through blocks, which find it short)
            device_staging.forget_page_locked(self.path, locking)
            return None
        log.info("%s: restoring straight from the slot, page-locking it range by range as the copies go", self.path)
        return locking

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


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
    """After every rank verified its bytes: each data-parallel shard all-gathered, the JSON record applied."""
    for e in container.layout.entries:
        if e.spec.shard is not None:
            gather_shard(targets[e.spec.name])
    adapter.finish_restore(container.version.get("extra", {}))


def gather_shard(t) -> None:
    """Collective over ``t.group``: every slice of the sharded ``t`` (a :class:`StateTensor`) all-gathered."""
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
        # local memory first (every rank agrees from its own agent's versions, no peer traffic); when
        # no step is common, local and peer holdings together; then disk
        tiers = (("local", self.local_candidates), ("memory", self.memory_candidates), ("disk", self.disk_candidates))
        for tier, cands in tiers:
            if tier == "disk":
                self._check_memory_known()
            by_step = {c.step: c for c in cands()
                       if c.step not in attempt.refused and (upto is None or c.step <= upto)}
            listed = time.perf_counter()
            if tier == "disk" and by_step:
                log.warning("rank %d: no version every rank can restore from memory (local, or rebuilt from the "
                            "redundancy group: more nodes lost than it tolerates?); falling back to the newest "
                            "persisted checkpoint on disk", self.rank)
            for step in self._common_steps(list(by_step)):
                res = self._try_candidate(adapter, t0, attempt, tier, by_step[step], listed)
                if res is not None:
                    return res
        return None

    def _try_candidate(self, adapter: StateAdapter, t0: float, attempt: "_Attempt", tier: str, cand: Candidate,
                       listed: float) -> Optional[RestoreResult]:
        """Collective: restore ``cand``, a step every rank listed in ``tier`` (``listed``: when). Every rank
        opens and checks it, and all agree (nothing touched yet); then each loads, verifies and screens
        it, and all agree again. Returns the result when every rank restored it. Else ``None``, with why
        in ``attempt.rejected``; a version a guard refused is added to ``attempt.refused`` and every rank
        rolls back past it (:meth:`_check_rollbacks` raises when too many were)."""
        rejected, refused, step = attempt.rejected, attempt.refused, cand.step
        faultpoints.reached("restore", step, self.rank)
        cand, cont, targets, ok = self._open_candidate(tier, cand, adapter, rejected)
        if not self._all_ok(ok):
            if ok:
                rejected.append(f"{tier} step {step}: rejected by another rank")
            if cont is not None:
                cont.close()
            return None
        assert cont is not None
        attempt.touched = True
        marks = {"listed": listed, "opened": time.perf_counter()}
        ok, bad_values = self._load_checked(tier, cand, cont, targets, rejected, marks)
        marks["guarded"] = time.perf_counter()
        all_ok, any_refused = self._agree(ok, bool(bad_values))
        if all_ok:
            finish_load(cont, adapter, targets)
            marks["finished"] = time.perf_counter()
            extra = cont.version.get("extra", {})
            cont.close()
            self._rewind(step)
            marks["rewound"] = end = time.perf_counter()
            return RestoreResult(cand.source, step, end - t0, extra, rejected, len(refused),
                                 phases={k: v - t0 for k, v in marks.items()})
        cont.close()
        if any_refused:  # a bad version, not a bad copy: every rank drops its copy and rolls back
            refused.add(step)
            if not bad_values:
                rejected.append(f"{tier} step {step}: refused by the guard on another rank")
            self._check_rollbacks(step, self._refuse(cand), refused, rejected)
        elif ok:
            rejected.append(f"{tier} step {step}: corrupt on another rank")
        return None

    def _open_candidate(self, tier: str, cand: Candidate, adapter: StateAdapter,
                        rejected: list[str]) -> tuple[Candidate, Optional[Container], dict, bool]:
        """This rank's checks of ``cand`` before any byte of the training state moves: a peer candidate is
        rebuilt into a local slot first, then its container is opened, its header and identity checked
        and every saved tensor's destination resolved. Returns (the candidate, with its local path once
        rebuilt; the container, if it opened; the destinations; whether every check passed); a failure
        is logged and added to ``rejected``. The caller closes the container."""
        step = cand.step
        cont: Optional[Container] = None
        targets: dict = {}
        try:
            cand = self._materialize(cand)
            cont = Container(cand.path)
            cont.check_identity(self.identity, step)
            targets = resolve_targets(cont, adapter)
        except (snapfile.SnapshotFormatError, OSError, ValueError, KeyError, AgentError) as e:
            rejected.append(f"{tier} step {step}: {e}")
            log.warning("rank %d: rejecting %s step %d: %s", self.rank, tier, step, e)
            return cand, cont, targets, False
        return cand, cont, targets, True

    def _load_checked(self, tier: str, cand: Candidate, cont: Container, targets: dict, rejected: list[str],
                      marks: dict) -> tuple[bool, list[str]]:
        """This rank's load of ``cand``: read ``cont`` into ``targets`` verifying every chunk (a corrupt copy
        is invalidated), then, with ``check_values``, the guard's screen of the restored values (on the
        GPU path queued as the copies land). Adds the container's marks and ``loaded`` to ``marks``; a
        failure is logged and added to ``rejected``. Returns (whether this rank's copy passed both, the
        tensors holding NaN or Inf: non-empty only when the guard refused the values)."""
        step = cand.step
        bad_values: list[str] = []
        screens: list[guard.ValueScreen] = []  # the guard's reads, queued as the copies land

        def screen_values() -> None:  # what the read did not screen in its own pass (cont.screened)
            screens.append(guard.ValueScreen({n: t.saved_view() for n, t in targets.items()
                                              if t.values_checked and n not in cont.screened}))
        try:
            cont.load_verified(targets, after_copies=screen_values if self.check_values else None)
            ok = True
        except (snapfile.SnapshotFormatError, OSError) as e:
            ok = False
            rejected.append(f"{tier} step {step}: {e}")
            log.warning("rank %d: %s step %d is corrupt: %s", self.rank, tier, step, e)
            self._invalidate(cand)
        marks.update(cont.marks, loaded=time.perf_counter())
        if ok and self.check_values:
            if not screens:
                screen_values()
            later = set(screens[0].result())
            bad_values = [n for n, t in targets.items()
                          if t.values_checked and (n in later or cont.screened.get(n) is False)]
            if bad_values:
                ok = False
                rejected.append(f"{tier} step {step}: non-finite values in {len(bad_values)} tensor(s) "
                                f"({', '.join(bad_values[:3])})")
                log.error("rank %d: %s step %d passed its checksums but holds NaN or Inf in %s: refused",
                          self.rank, tier, step, ", ".join(bad_values[:5]))
        return ok, bad_values

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
