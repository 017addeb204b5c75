"""The agent's version table: which slot of each local rank holds which step, in which state, and
which slot the next snapshot may overwrite (REFT's clean/dirty double buffer, extended to the
redundancy group's complete version).

A pure state machine: no I/O, no locks, no clocks. The slot store (:mod:`megatron_ft.agent.slot_store`)
holds its lock around every call and mirrors a slot's new state into the container header of
its shared-memory segment afterwards; the rules below are proven in process by
``tests/unit/test_version_table.py`` against every order of events.

States of one slot::

    EMPTY --begin--> WRITING --commit--> CLEAN --invalidate / rewind / begin (reuse)--> ...
                        |                  ^
                        +--abort--> EMPTY  |  (adopt: a CLEAN slot found after an agent restart)

Rules (the invariants the tests check after every event):

* ``begin`` never hands out the slot holding the rank's *protected* version: the newest step the
  job agreed on (``agree``) if the rank holds it clean, else its newest clean step; nor a slot of
  one of the caller's ``keep`` steps (the group's complete version and the one being exchanged),
  nor a pinned slot (being persisted or sent). With no such slot free it raises :class:`BusyError`
  (the snapshot is skipped; training goes on).
* A slot is CLEAN only after ``commit`` of the step ``begin`` gave it.
* ``rewind(step)``: the job resumed from ``step`` (any tier). Every version newer than ``step``
  belongs to an abandoned future: it is emptied, and the agreed step is lowered to ``step``, so
  the version the job resumed from is the protected one and later snapshots find free slots.
* ``newest_consistent``: the newest step every local rank holds clean (the agreed one when every
  rank agreed on it).
* Certified versions (``recovery.prefer: certified``): ``watch(step)`` marks the version whose next
  iterations are being judged (the *candidate*), ``certify(step)`` the newest one the job trained past
  with no anomaly. ``begin`` keeps both slots as it keeps the protected one (not a staging slot);
  ``install`` takes them last. A mark names a step held clean or is cleared: ``rewind`` clears marks newer than the step
  resumed from, ``invalidate`` the mark of the version it drops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from ..capture.snapfile import CLEAN, EMPTY, STATE_NAMES, WRITING

__all__ = ["BusyError", "TransitionError", "SlotState", "RankVersions", "VersionTable", "CLEAN", "EMPTY", "WRITING"]


class BusyError(RuntimeError):
    """No slot of the rank may be overwritten now (every one protected, kept or pinned)."""

    busy = True  # a temporary refusal (the wire tells the client so)


class TransitionError(RuntimeError):
    """An event that the slot's state does not allow (e.g. commit of a slot not being written)."""


@dataclass
class SlotState:
    index: int
    state: int = EMPTY
    step: int = -1
    pins: int = 0  # >0 while the agent or a transport reads it

    def describe(self) -> str:
        return f"step {self.step} {STATE_NAMES[self.state]}"


@dataclass
class RankVersions:
    rank: int
    slots: list[SlotState] = field(default_factory=list)
    agreed: int = -1  # newest step the whole job agreed on (lowered by rewind)
    certified: int = -1  # newest step the job trained past with no anomaly (prefer: certified)
    candidate: int = -1  # the step whose next iterations are being judged

    def marked(self) -> list[SlotState]:
        """The slots of the certified and the candidate version."""
        return [s for st in (self.certified, self.candidate) if st >= 0 and (s := self.slot_with(st)) is not None]

    def forget(self, slot: SlotState) -> None:
        """``slot`` is about to be emptied or overwritten: a mark naming its step goes with it."""
        if slot.step == self.certified:
            self.certified = -1
        if slot.step == self.candidate:
            self.candidate = -1

    def clean(self) -> list[SlotState]:
        """Clean slots, newest step first."""
        return sorted((s for s in self.slots if s.state == CLEAN), key=lambda s: -s.step)

    def slot_with(self, step: int) -> Optional[SlotState]:
        return next((s for s in self.slots if s.state == CLEAN and s.step == step), None)

    def protected(self) -> Optional[SlotState]:
        """The version ``begin`` never overwrites: the agreed one if held clean, else the newest clean."""
        if self.agreed >= 0 and (s := self.slot_with(self.agreed)) is not None:
            return s
        clean = self.clean()
        return clean[0] if clean else None


class VersionTable:
    """Version state of every local rank of one node. Not thread-safe: the owner locks."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankVersions] = {}

    # ------------------------------------------------------------------ ranks
    def add_rank(self, rank: int, nslots: int) -> RankVersions:
        rv = self.ranks[rank] = RankVersions(rank, [SlotState(i) for i in range(nslots)])
        return rv

    def adopt(self, rank: int, index: int, state: int, step: int) -> None:
        """A slot found in shared memory after an agent restart (a torn WRITING one counts as EMPTY)."""
        rv = self.ranks.setdefault(rank, RankVersions(rank))
        clean = state == CLEAN
        rv.slots.append(SlotState(index, CLEAN if clean else EMPTY, step if clean else -1))
        rv.slots.sort(key=lambda s: s.index)

    def drop_rank(self, rank: int) -> None:
        self.ranks.pop(rank, None)

    def get(self, rank: int) -> RankVersions:
        rv = self.ranks.get(rank)
        if rv is None:
            raise KeyError(f"rank {rank} is not registered")
        return rv

    def slot(self, rank: int, index: int) -> SlotState:
        rv = self.get(rank)
        if not 0 <= index < len(rv.slots) or rv.slots[index].index != index:
            raise KeyError(f"rank {rank} has no slot {index}")
        return rv.slots[index]

    # ------------------------------------------------------------------ snapshot events
    def begin(self, rank: int, step: int, keep: Iterable[int] = (), staging_only: bool = False) -> SlotState:
        """The slot to write ``step`` into, now WRITING. ``keep``: steps whose slots must stay
        (the group's complete version, one being exchanged). ``staging_only`` (an rs parity node's
        single slot, whose packets data nodes hold whole): only ``keep`` and pins protect."""
        slot = self.choose(rank, step, keep, staging_only)
        self.get(rank).forget(slot)
        slot.state, slot.step = WRITING, step
        return slot

    def choose(self, rank: int, step: int, keep: Iterable[int] = (), staging_only: bool = False) -> SlotState:
        """The slot :meth:`begin` would hand out for ``step`` (nothing changes); :class:`BusyError` if none."""
        rv = self.get(rank)
        kept = {id(s) for st in keep if (s := rv.slot_with(st)) is not None}
        if not staging_only:  # a staging slot is never kept for a mark: the group holds its versions
            kept |= {id(s) for s in rv.marked()}
            if (p := rv.protected()) is not None:
                kept.add(id(p))
        free = [s for s in rv.slots if id(s) not in kept and s.pins == 0]
        if not free:
            held = ", ".join(s.describe() + (" (pinned: persisting or sending)" if s.pins else " (protected)")
                             for s in rv.slots)
            raise BusyError(f"rank {rank}: no free slot for step {step}: {held}")
        return min(free, key=lambda s: (s.state != EMPTY, s.step))

    def commit(self, rank: int, index: int, step: int) -> SlotState:
        s = self.slot(rank, index)
        if s.state != WRITING or s.step != step:
            raise TransitionError(f"rank {rank} slot {index}: commit of step {step} but the slot is {s.describe()}")
        self._supersede(rank, s)
        s.state = CLEAN
        return s

    def _supersede(self, rank: int, new: SlotState) -> None:
        """A newer write of the same step replaces an older clean copy (one clean slot per step)."""
        for s in self.get(rank).slots:
            if s is not new and s.state == CLEAN and s.step == new.step and s.pins == 0:
                s.state, s.step = EMPTY, -1

    def abort(self, rank: int, index: int) -> Optional[SlotState]:
        s = self.slot(rank, index)
        if s.state != WRITING:
            return None
        s.state, s.step = EMPTY, -1
        return s

    def invalidate(self, rank: int, step: int) -> Optional[SlotState]:
        """A reader found this version corrupt: never offer it again."""
        rv = self.get(rank)
        s = rv.slot_with(step)
        if s is not None:
            rv.forget(s)
            s.state, s.step = EMPTY, -1
        return s

    def install(self, rank: int, step: int) -> SlotState:
        """The slot a version rebuilt from peers is written into, now WRITING (the caller copies the
        bytes in, then commits it): the slot already holding ``step``, else not the protected
        one unless nothing else is free of pins; never a pinned one."""
        rv = self.get(rank)
        unpinned = [s for s in rv.slots if s.pins == 0]
        if not unpinned:
            raise BusyError(f"rank {rank}: every slot is pinned; cannot install step {step}")
        p = rv.protected()
        marked = rv.marked()
        slot = rv.slot_with(step)
        if slot is None or slot.pins:
            slot = min(unpinned, key=lambda s: (s is p, s in marked, s.state == CLEAN, s.step))
            rv.forget(slot)
        slot.state, slot.step = WRITING, step  # (the caller writes the bytes, then commits)
        return slot

    # ------------------------------------------------------------------ job-wide events
    def agree(self, rank: int, step: int) -> None:
        """Every rank of the job holds ``step`` clean (the trainers agreed on it)."""
        rv = self.get(rank)
        rv.agreed = max(rv.agreed, step)

    def rewind(self, rank: int, step: int) -> list[SlotState]:
        """The job resumed from ``step`` (-1: fresh). Returns the slots emptied: every version newer
        than ``step`` and every unfinished write. The agreed step becomes ``step``."""
        rv = self.get(rank)
        emptied = []
        for s in rv.slots:
            if s.state == WRITING or (s.state == CLEAN and s.step > step):
                s.state, s.step = EMPTY, -1
                emptied.append(s)
        rv.agreed = step
        rv.certified = rv.certified if rv.certified <= step else -1
        rv.candidate = rv.candidate if rv.candidate <= step else -1
        return emptied

    def watch(self, rank: int, step: int) -> bool:
        """``step``'s next iterations are being judged: keep its slot (the previous candidate's is
        released). False (nothing marked) if the rank does not hold ``step`` clean."""
        rv = self.get(rank)
        rv.candidate = step if rv.slot_with(step) is not None else -1
        return rv.candidate >= 0

    def certify(self, rank: int, step: int) -> bool:
        """The job trained past ``step`` with no anomaly: it is the certified version (kept until a
        newer one is certified). False if the rank does not hold it clean (nothing changes)."""
        rv = self.get(rank)
        if step <= rv.certified or rv.slot_with(step) is None:
            return step == rv.certified
        rv.certified = step
        if rv.candidate == step:
            rv.candidate = -1
        return True

    # ------------------------------------------------------------------ queries
    def agreed_low(self, expected_ranks: int) -> int:
        """The step every local rank agreed on, once all ``expected_ranks`` registered; else -1."""
        if len(self.ranks) < expected_ranks or not self.ranks:
            return -1
        return min(rv.agreed for rv in self.ranks.values())

    def newest_consistent(self) -> int:
        """Newest step every local rank holds clean (the agreed one if every rank holds it)."""
        if not self.ranks:
            return -1
        common: Optional[set[int]] = None
        for rv in self.ranks.values():
            steps = {s.step for s in rv.clean()}
            common = steps if common is None else common & steps
        if not common:
            return -1
        agreed = min(rv.agreed for rv in self.ranks.values())
        return agreed if agreed in common else max(common)

    def clean_steps(self) -> dict[int, list[int]]:
        return {r: [s.step for s in rv.clean()] for r, rv in self.ranks.items()}

    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (used by the tests after every event)."""
        for rv in self.ranks.values():
            steps = [s.step for s in rv.slots if s.state == CLEAN]
            assert len(steps) == len(set(steps)), f"rank {rv.rank}: step held clean twice: {steps}"
            for s in rv.slots:
                assert s.pins >= 0, f"rank {rv.rank} slot {s.index}: negative pins"
                assert (s.state == EMPTY) == (s.step < 0), f"rank {rv.rank} slot {s.index}: {s.describe()}"
            for name, st in (("certified", rv.certified), ("candidate", rv.candidate)):
                assert st < 0 or rv.slot_with(st) is not None, f"rank {rv.rank}: {name} step {st} is not held clean"
