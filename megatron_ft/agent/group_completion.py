"""Which version a redundancy group holds whole: a state machine with no I/O, no lock and no clock.

The agent's redundancy (:mod:`.redundancy`) feeds it events under its own lock and passes the time
in; everything it decides is a return value, so the rules are unit-tested in process against any
order of events.

Events, for one group member (``node``) and the versions ``S`` its ranks agreed on:

* ``begin(S, now)``: this node starts exchanging ``S`` (newer than anything complete or in flight;
  an older one is refused, False). ``S`` is *in flight*: its primary slots stay protected.
* ``sent(S)``: its contributions have been read from the primary slots (those may move on).
* ``failed(S)``: the exchange of ``S`` failed here; it is no longer in flight.
* ``announce(member, S, now)``: ``member`` holds every block the plan gives it for ``S``. Once every
  member announced ``S`` or a newer step, ``S`` is *complete*: returned as a :class:`Completion`.
  Members may hold different steps (a sender skips versions when it falls behind; with the
  scheduled transport each sender picks its own): the complete step is the group's lower bound,
  every member keeping the blocks of the newest step it announced (:meth:`kept_blocks`), and the
  rebuild plans from what the survivors actually hold.
* ``claim(S)``: this node is about to announce ``S``; from now on its blocks of ``S`` are kept
  (:meth:`kept_blocks`) until ``S`` or a newer version is complete, or a rewind drops ``S``.
* ``scheduled(S, now)``: the trainers started sending ``S`` themselves (scheduled transport).
* ``rewind(S)``: the job resumed from ``S``: newer versions are an abandoned future.
* ``marked(steps)``: the steps this node's ranks certified or watch (``recovery.prefer: certified``):
  their blocks are kept too, so that a lost member's ranks can be rebuilt at the certified version.

What it answers:

* :meth:`protected` - the steps whose *primary slots* the agent must keep: the complete one (the
  group's recovery point), the one in flight (given up after ``exchange_timeout_s``), and those the
  trainers are still sending (``scheduled_timeout_s``).
* :meth:`kept_blocks` - the steps whose *block versions* must not be reused: the complete one, the
  marked ones, and every newer one this node announced (the others count on them: an announcement
  is a promise to hold that version until the group's complete step passes it; a block dropped after
  it would leave the group's recovery point without this node's part). A block store that finds
  every version of a block kept takes no newer contribution for it
  (:data:`.block_store.MAX_VERSIONS`, two more with marks); the newer step then never completes,
  which is safe - the group recovers from the complete one.

    >>> g = GroupCompletion(node=0, members=(0, 1))
    >>> g.begin(5, now=0.0), g.protected(now=1.0)
    (True, ({5}, None))
    >>> g.claim(5), g.announce(0, 5, now=1.0) is None, g.kept_blocks()
    (True, True, {5})
    >>> g.announce(1, 5, now=2.0).step, g.complete_step, g.protected(now=2.0)
    (5, 5, ({5}, None))
    >>> g.rewind(3); g.complete_step, g.kept_blocks()
    (3, {3})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

EXCHANGE_TIMEOUT_S = 60.0
SCHEDULED_TIMEOUT_S = 3600.0  # a scheduled transfer spreads over iterations: protect its step longer


@dataclass(frozen=True)
class Completion:
    """``step`` became complete in the group; ``seconds`` from this node's exchange start (None
    when this node did not time it)."""
    step: int
    seconds: Optional[float]


@dataclass
class GroupCompletion:
    node: int
    members: tuple[int, ...]
    exchange_timeout_s: float = EXCHANGE_TIMEOUT_S
    scheduled_timeout_s: float = SCHEDULED_TIMEOUT_S
    complete_step: int = -1
    inflight_step: int = -1  # being exchanged here (its primary slots stay protected)
    inflight_since: float = 0.0
    sending_step: int = -1  # its contributions are still being read from the primary slots
    claimed: set[int] = field(default_factory=set)  # steps newer than complete this node announced
    announced: dict[int, int] = field(default_factory=dict)  # member -> the newest step it announced
    scheduled_since: dict[int, float] = field(default_factory=dict)  # step -> trainers began sending it
    started: dict[int, float] = field(default_factory=dict)  # step -> this node began exchanging it
    marked_steps: set[int] = field(default_factory=set)  # certified or watched by this node's ranks (kept)
    rebuilt_step: int = -1  # the newest step this node rebuilt from the group (never exchanged from here)

    def begin(self, step: int, now: float) -> bool:
        if step <= max(self.complete_step, self.inflight_step, self.rebuilt_step):
            return False
        self.inflight_step, self.inflight_since, self.sending_step = step, now, step
        return True

    def exchange_started(self, step: int, now: float) -> None:
        """The bytes of ``step`` start moving (the clock of its completion time)."""
        self.started.setdefault(step, now)

    def sent(self, step: int) -> None:
        if self.sending_step == step:
            self.sending_step = -1

    def failed(self, step: int) -> None:
        if self.inflight_step == step:
            self.inflight_step = -1

    def scheduled(self, step: int, now: float) -> None:
        """The trainers began sending ``step`` at ``now`` (the protection clock, as ``begin``'s)."""
        self.scheduled_since.setdefault(step, now)

    def rebuilt(self, step: int) -> None:
        """This node rebuilt ``step`` from the group (a replacement): the group holds it, and it is never
        exchanged again from here (sent once more it would pin the rebuilt slot - an rs parity node's only
        one - while the trainers' next snapshot needs it)."""
        self.rebuilt_step = max(self.rebuilt_step, step)

    def claim(self, step: int) -> bool:
        """This node announces ``step`` (False: it already announced it or newer)."""
        if step <= max(self.claimed, default=self.complete_step):
            return False
        self.claimed.add(step)
        return True

    def announce(self, member: int, step: int, now: float) -> Optional[Completion]:
        self.announced[member] = max(self.announced.get(member, -1), step)
        low = min(self.announced.get(n, -1) for n in self.members)
        if low <= self.complete_step:
            return None
        self.complete_step = low
        self.claimed = {s for s in self.claimed if s > low}
        t0 = self.started.pop(low, None)
        for old in [s for s in self.started if s < low]:
            del self.started[old]
        if self.inflight_step <= low:
            self.inflight_step = -1
        return Completion(low, None if t0 is None else now - t0)

    def protected(self, now: float) -> tuple[set[int], Optional[int]]:
        """(steps whose primary slots stay, the in-flight step given up now for its timeout or None)."""
        gave_up = None
        if self.inflight_step >= 0 and now - self.inflight_since > self.exchange_timeout_s:
            gave_up, self.inflight_step = self.inflight_step, -1
        for st, since in list(self.scheduled_since.items()):
            if st <= self.complete_step or now - since > self.scheduled_timeout_s:
                del self.scheduled_since[st]
        steps = {s for s in (self.complete_step, self.inflight_step) if s >= 0} | set(self.scheduled_since)
        return steps, gave_up

    def newest_announced(self) -> dict[int, int]:
        """member -> the newest step it announced (the complete step when nothing newer)."""
        return {n: self.announced.get(n, -1) for n in self.members}

    def sending(self) -> set[int]:
        return {self.sending_step} if self.sending_step >= 0 else set()

    def kept_blocks(self) -> set[int]:
        return ({self.complete_step} if self.complete_step >= 0 else set()) | self.claimed | self.marked_steps

    def marked(self, steps: set[int]) -> None:
        self.marked_steps = {s for s in steps if s >= 0}

    def rewind(self, step: int) -> None:
        self.complete_step = min(self.complete_step, step)
        self.rebuilt_step = min(self.rebuilt_step, step)
        self.marked_steps = {s for s in self.marked_steps if s <= step}
        self.claimed = {s for s in self.claimed if s <= step and s > self.complete_step}
        self.announced = {n: min(s, step) for n, s in self.announced.items()}
        if self.inflight_step > step:
            self.inflight_step = -1
        for st in [st for st in self.scheduled_since if st > step]:
            del self.scheduled_since[st]
