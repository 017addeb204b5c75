"""A job's generations when it goes on at fewer data-parallel replicas, and when it shrinks or grows (pure).

Generation 0 trains on the job's ``nodes`` node slots ``0 .. nodes-1``, each a host with its own agent and
memory. A slot lost with no standby claiming it and no replacement within ``recovery.elastic_after_s``
makes the next generation: the surviving slots renumbered ``0 .. N'-1`` in slot order, with as many of
them as the layout fits (:func:`megatron_ft.policy.elastic.shrink_sizes`: whole model-parallel groups, at
least ``cluster.elastic.min_data_parallel``, a multiple of the expert parallelism, the global batch
whole); a survivor the size leaves out waits, idle, and is the first taken when the job grows. A slot
that comes back (its replacement, a standby, the host relaunched) grows the job to the largest size the
slots present fit, never above generation 0's, at the next snapshot boundary. TP x PP never change;
ranks are numbered as Megatron-LM numbers them, node ``i`` of a generation holding ranks
``i*ranks_per_node ..``.

What each rank of a new generation restores from (:meth:`Generation.sources`): the old generation's
data-parallel replicas of its (tensor, pipeline) coordinate (which bytes of them it reads only their
extents records say: megatron-core pads buckets to a multiple of DP), each tagged with where its
container is - on this rank's own host (``local``), on another surviving host (``peer``: fetched from
that host's agent), or on a lost one (``lost``: from the redundancy's copy on a peer, or decoded).

:class:`ShrinkTrigger` is the decision as a state machine without I/O: losses, claims, returns and the
clock in; ``shrink`` or ``grow`` out.

Worked example: 3 slots x 2 ranks, TP1 PP2 (DP3), global batch 12, micro-batch 2; slot 1 is lost.

>>> g0 = Generation.first(3, 2, tensor=1, pipeline=2)
>>> g1 = g0.shrink({1}, global_batch=12, micro_batch=2)
>>> g1.slots, g1.idle, g1.data_parallel
((0, 2), (), 2)
>>> g1.slot_of_rank(2)          # new node 1 is slot 2 (old node 2)
2
>>> [(old, where) for old, where in g1.sources(g0, 3, lost={1})]    # new rank 3: stage 1's replica 1
[(3, 'lost'), (4, 'local'), (5, 'local')]
>>> g2 = g1.grow({1}, global_batch=12, micro_batch=2)
>>> g2.slots, g2.data_parallel
((0, 1, 2), 3)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from .elastic import _why_not, coordinates, rank_of, shrink_sizes

LOCAL, PEER, LOST = "local", "peer", "lost"


class ShrinkRefused(ValueError):
    """No smaller size fits the slots left (the message says which rule)."""


@dataclass(frozen=True)
class Generation:
    """One generation: ``slots[i]`` is the node slot (generation 0's node id) that trains as node ``i``;
    ``idle``: surviving slots that wait (the size left them out)."""

    number: int
    slots: tuple[int, ...]
    ranks_per_node: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    idle: tuple[int, ...] = ()
    full: int = 0  # generation 0's node count: a job never grows past it

    @classmethod
    def first(cls, nodes: int, ranks_per_node: int, tensor: int = 1, pipeline: int = 1,
              expert: int = 1) -> "Generation":
        g = cls(0, tuple(range(nodes)), ranks_per_node, tensor, pipeline, expert, (), nodes)
        why = _why_not(g.world_size, tensor, pipeline, expert, None, None, 1)
        if why:
            raise ValueError(f"generation 0 does not fit its layout: {why}")
        return g

    @property
    def world_size(self) -> int:
        return len(self.slots) * self.ranks_per_node

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor * self.pipeline)

    def slot_of_rank(self, rank: int) -> int:
        """The node slot whose host runs ``rank`` of this generation."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside generation {self.number}'s {self.world_size} ranks")
        return self.slots[rank // self.ranks_per_node]

    def _sized(self, present: Iterable[int], global_batch: Optional[int], micro_batch: Optional[int],
               min_data_parallel: int) -> "Generation":
        """The next generation on the slots ``present``: the most of them the rules fit (at most generation
        0's count), the slots that trained in this one first (their memory holds the newest state), then
        in slot order; the rest idle. :class:`ShrinkRefused` when none fits."""
        present = sorted(set(present))
        cap = min(len(present), self.full)
        sizes = shrink_sizes(cap + 1, self.ranks_per_node, self.tensor, self.pipeline, self.expert, global_batch,
                             micro_batch, min_data_parallel)  # every count up to ``cap`` that fits
        if not sizes:
            why = _why_not(cap * self.ranks_per_node, self.tensor, self.pipeline, self.expert, global_batch,
                           micro_batch, min_data_parallel) if cap else None
            raise ShrinkRefused(f"generation {self.number} ({len(self.slots)} nodes, DP {self.data_parallel}) cannot "
                                f"go on with the slots {present}: "
                                + (f"{cap} nodes: {why}" if why else "none is left"))
        n = max(sizes)
        keep = sorted(sorted(present, key=lambda s: (s not in self.slots, s))[:n])
        return replace(self, number=self.number + 1, slots=tuple(keep), idle=tuple(s for s in present if s not in keep))

    def shrink(self, lost: Iterable[int], global_batch: Optional[int] = None, micro_batch: Optional[int] = None,
               min_data_parallel: int = 1) -> "Generation":
        """The generation after losing the slots ``lost`` (training or idle ones); :class:`ShrinkRefused`
        when no size fits the rest."""
        lost = set(lost)
        return self._sized([s for s in (*self.slots, *self.idle) if s not in lost], global_batch, micro_batch,
                           min_data_parallel)

    def grow(self, returned: Iterable[int], global_batch: Optional[int] = None,
             micro_batch: Optional[int] = None, min_data_parallel: int = 1) -> "Generation":
        """The generation once the slots ``returned`` are back (with the idle ones): the largest size that
        fits, at most generation 0's. Where that is no larger, this generation with them idle (same number:
        no restart)."""
        present = {*self.slots, *self.idle, *returned}
        nxt = self._sized(present, global_batch, micro_batch, min_data_parallel)
        if len(nxt.slots) > len(self.slots):
            return nxt
        return replace(self, idle=tuple(sorted(present - set(self.slots))))

    def sources(self, old: "Generation", rank: int, lost: Iterable[int] = ()) -> list[tuple[int, str]]:
        """``(old rank, where its container is)`` for this generation's ``rank``: the old generation's
        data-parallel replicas of its (tensor, pipeline) coordinate, replica 0 first; ``where``: this rank's
        own host (:data:`LOCAL`), another surviving one (:data:`PEER`), a lost one (:data:`LOST`)."""
        lost = set(lost)
        tp, _, pp = coordinates(rank, self.tensor, self.pipeline, self.data_parallel)
        here = self.slot_of_rank(rank)
        out = []
        for d in range(old.data_parallel):
            o = rank_of(tp, d, pp, old.tensor, old.data_parallel)
            slot = old.slot_of_rank(o)
            out.append((o, LOST if slot in lost else LOCAL if slot == here else PEER))
        return out


@dataclass
class ShrinkTrigger:
    """When to shrink and when to grow, from what the job's root sees (no I/O; times on one monotonic clock).

    A lost slot (:meth:`lost`) that nothing claims (:meth:`claimed`: a standby took it; :meth:`returned`: it
    is back) within ``after_s`` makes :meth:`due` answer ``("shrink", slots)`` - every slot lost and
    unclaimed at that moment, so that losses close together cost one restart. While the job runs shrunk,
    a slot that returns makes it answer ``("grow", slots)``. ``after_s`` 0: never (the off setting).

    >>> t = ShrinkTrigger(after_s=30.0)
    >>> t.lost(1, now=100.0); t.due(now=120.0) is None
    True
    >>> t.lost(2, now=125.0); t.due(now=130.0)
    ('shrink', (1, 2))
    >>> t.shrunk({1, 2}); t.returned(2); t.due(now=400.0)
    ('grow', (2,))
    """

    after_s: float
    _since: dict[int, float] = field(default_factory=dict)  # lost, unclaimed slots: since when
    _out: set[int] = field(default_factory=set)  # slots the job shrank without
    _back: set[int] = field(default_factory=set)  # of those, the ones back

    def lost(self, slot: int, now: float) -> None:
        self._since.setdefault(slot, now)

    def claimed(self, slot: int) -> None:
        """A standby (or the replacement) took ``slot`` before the shrink: nothing to decide for it."""
        self._since.pop(slot, None)

    def returned(self, slot: int) -> None:
        if slot in self._out:
            self._back.add(slot)
        self._since.pop(slot, None)

    def shrunk(self, slots: Iterable[int]) -> None:
        """The shrink by ``slots`` was carried out."""
        for s in slots:
            self._since.pop(s, None)
            self._out.add(s)

    def grown(self, slots: Iterable[int]) -> None:
        for s in slots:
            self._out.discard(s)
            self._back.discard(s)

    def due(self, now: float) -> Optional[tuple[str, tuple[int, ...]]]:
        if self.after_s <= 0:
            return None
        if self._since and now - min(self._since.values()) >= self.after_s:
            return "shrink", tuple(sorted(self._since))
        if self._back:
            return "grow", tuple(sorted(self._back))
        return None


def run_id_of(base: str, number: int) -> str:
    """The run id generation ``number`` of run ``base`` runs under: its agents, store keys, shared-memory
    names and sockets are its own, so that nothing of the generation before is taken for its.

    >>> run_id_of("job", 0), run_id_of("job", 2)
    ('job', 'job.e2')
    """
    return base if number == 0 else f"{base}.e{number}"


def needed_by_node(new: Generation, old: Generation, node: int) -> list[int]:
    """The old generation's ranks whose containers node ``node`` of ``new`` must hold before its ranks
    restore: every old data-parallel replica of each of its ranks' (tensor, pipeline) coordinates, each
    once (their ``extents`` records say which bytes a rank reads)."""
    rpn = new.ranks_per_node
    out: set[int] = set()
    for r in range(node * rpn, (node + 1) * rpn):
        out.update(o for o, _ in new.sources(old, r))
    return sorted(out)


def restore_step(clean: dict[int, set[int]], rebuildable: Optional[set[int]]) -> Optional[int]:
    """The step a new generation restores from: the newest one every old rank that survived holds clean
    (``clean``: old rank -> its clean steps) and, when ranks were lost (``rebuildable`` not None), their
    redundancy can rebuild; None when there is none.

    >>> restore_step({0: {4, 5}, 1: {5, 6}}, None), restore_step({0: {4, 5}, 1: {4, 5}}, {4})
    (5, 4)
    >>> restore_step({0: {5}, 1: {6}}, None) is None
    True
    """
    common = set.intersection(*clean.values()) if clean else set()
    if rebuildable is not None:
        common &= rebuildable
    return max(common) if common else None


__all__ = ["Generation", "LOCAL", "LOST", "PEER", "ShrinkRefused", "ShrinkTrigger", "needed_by_node", "restore_step",
           "run_id_of"]
