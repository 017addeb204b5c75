"""BAFT's bubble-aware checkpoint transfer plan (FCS 2025, sections 4.2.1-4.2.3).

Each pipeline stage's node sends its snapshot to "the prev node of the current node in the
pipeline group" (4.2.1), in the bubbles where both are idle, with the regular pipeline traffic's
time reserved at both ends of each bubble (4.2.2, :func:`.spans.pipeline_bubbles`).

The text we have describes both algorithms in prose only (their pseudo-code is a figure that is not
in it); what follows is our reading of that prose, sentence by sentence:

* **Algorithm 1** "will iterate over the bubbles of the node_i and its target node_i-1" - we take
  the *shared* bubbles, the intersections of the two nodes' reserved bubbles, since "the receiver
  and the sender should ... start the Transfer simultaneously" (3.1.2). "We set a variable m to
  denote the number of parameters that can be transferred by the bubbles up to now. Every time the
  bubble is appended to the plan, the number ... calculated according to the duration of bubble and
  the bandwidth, will be added to m, until m reaches the number ... that need to be transferred."
  "If the bubbles during one iteration are not enough ..., GetNextBubble will return the bubbles
  in the next iteration ... the checkpoint will be recorded every n iterations." The plan's slots
  are both the sender's ckptSendPlan and the receiver's ckptRecvPlan.
* **Algorithm 2**: "BAFT uses the layer as the granularity and uses the method of dynamic
  programming ... to select the weight that needs to be transmitted this time for each bubble. The
  number of parameters to be transferred M ... is determined by the bubble's duration and the
  bandwidth": per slot, a 0/1 knapsack (subset sum) over the layers not yet sent, maximising the
  bytes sent with at most M. Layers are indivisible, so Algorithm 1's byte count can fall short; we
  keep taking next bubbles until every layer is placed, and report both intervals.

Worked example (the test ``test_baft_hand_example``), link 100 B/s:

* sender (stage 1) bubbles [1, 3), [6, 7), [9, 10); receiver (stage 0) bubbles [0, 2), [5, 8),
  [9.5, 12). Shared: [1, 2), [6, 7), [9.5, 10) -> 100, 100, 50 B per iteration.
* Algorithm 1 for 600 B: m = 100, 200, 250 (iteration 0), 350, 450, 500 (iteration 1), 600
  (iteration 2, first bubble): 7 slots, a checkpoint every n = 3 iterations.
* Algorithm 2, layers (index: bytes) 0:70 1:50 2:40 3:40 4:30 5:30 6:30 7:60 8:80 9:70 10:50 11:50
  (600 B). Ties between subsets of the same total go to the one with the earliest layers.
  slot 1 (100 B): {0, 4} = 70 + 30.  slot 2 (100): {1, 10} = 50 + 50.  slot 3 (50): {11}.
  slot 4 (100): {2, 5, 6} = 40 + 30 + 30 (before {2, 7}: 5 < 7).  slot 5 (100): {3, 7}.
  slot 6 (50): nothing fits (80 and 70 are left).  slot 7 (100): {8} = 80 (80 + 70 > 100).
  Layer 9 is left after Algorithm 1's seven slots: the next bubble (iteration 2, [6, 7)) takes
  it. Still n = 3 iterations, 8 slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..config import _check_int, _fail
from .spans import IdleSpan, LinkModel


@dataclass(frozen=True)
class Slot:
    """Shared bubble ``bubble`` of iteration ``iteration`` of the plan, ``[start, end)`` seconds
    within that iteration, carrying at most ``capacity`` bytes."""

    iteration: int
    bubble: int
    start: float
    end: float
    capacity: int


def shared_bubbles(sender: Sequence[IdleSpan], receiver: Sequence[IdleSpan]) -> tuple[IdleSpan, ...]:
    """The non-empty intersections of the two nodes' bubbles, in time order (variance: the larger
    of the two).

    >>> shared_bubbles([IdleSpan(1, 3), IdleSpan(6, 7)], [IdleSpan(0, 2), IdleSpan(5, 8)])
    (IdleSpan(start=1, end=2, variance=0.0), IdleSpan(start=6, end=7, variance=0.0))
    """
    for name, spans in (("sender_bubbles", sender), ("receiver_bubbles", receiver)):
        for i, s in enumerate(spans):
            if not isinstance(s, IdleSpan):
                _fail(f"{name}[{i}]", s, "must be an IdleSpan")
    out = []
    for a in sender:
        for b in receiver:
            start, end = max(a.start, b.start), min(a.end, b.end)
            if end > start:
                out.append(IdleSpan(start, end, max(a.variance, b.variance)))
    return tuple(sorted(out, key=lambda s: (s.start, s.end)))


def _next_bubble(shared: Sequence[IdleSpan], link: LinkModel, what: str) -> Iterator[Slot]:
    """GetNextBubble: the shared bubbles of iteration 0, then of iteration 1, ... (those that carry
    at least one byte)."""
    caps = [link.bytes_within(b.length) for b in shared]
    if not any(caps):
        _fail(what, [(b.start, b.end) for b in shared],
              f"the sender and receiver share no bubble that carries a byte at {link.bandwidth} B/s")
    iteration = 0
    while True:
        for k, (b, cap) in enumerate(zip(shared, caps)):
            if cap:
                yield Slot(iteration, k, b.start, b.end, cap)
        iteration += 1


@dataclass(frozen=True)
class TransferPlan:
    """Algorithm 1: the slots in which ``sender`` sends ``bytes_to_send`` to ``receiver``."""

    sender: int
    receiver: int
    bytes_to_send: int
    slots: tuple[Slot, ...]

    @property
    def send_plan(self) -> tuple[Slot, ...]:
        """ckptSendPlan (on the sender): when to call send."""
        return self.slots

    @property
    def recv_plan(self) -> tuple[Slot, ...]:
        """ckptRecvPlan (on the receiver): the same bubbles, when to call receive."""
        return self.slots

    @property
    def interval_iterations(self) -> int:
        """n: a checkpoint completes every n iterations."""
        return self.slots[-1].iteration + 1 if self.slots else 1


def plan_transfer(sender_bubbles: Sequence[IdleSpan], receiver_bubbles: Sequence[IdleSpan], bytes_to_send: int,
                  link: LinkModel, sender: int = 1, receiver: int = 0, max_iterations: int = 10_000) -> TransferPlan:
    """Algorithm 1 (see the module docstring): append shared bubbles, iteration after iteration,
    until their capacity m reaches ``bytes_to_send``."""
    _check_int("bytes_to_send", bytes_to_send, 0)
    _check_int("max_iterations", max_iterations, 1)
    slots: list[Slot] = []
    m = 0
    if bytes_to_send:
        for slot in _next_bubble(shared_bubbles(sender_bubbles, receiver_bubbles), link, "bubbles"):
            if slot.iteration >= max_iterations:
                _fail("bytes_to_send", bytes_to_send, f"needs more than max_iterations={max_iterations} "
                      f"iterations of shared bubbles ({m} B fit in {max_iterations})")
            slots.append(slot)
            m += slot.capacity
            if m >= bytes_to_send:
                break
    return TransferPlan(sender, receiver, bytes_to_send, tuple(slots))


def best_layers(layer_bytes: Sequence[int], capacity: int, granularity: int = 1,
                max_states: int = 1_000_000) -> tuple[int, ...]:
    """Algorithm 2 for one bubble: the indices of the layers whose total is the largest not above
    ``capacity`` (0/1 knapsack with value = weight), the earliest layers among equal totals.

    Dynamic programming over the layers from the last: ``reach[j]`` is the set of totals the layers
    j.. can make without exceeding the capacity; the best total is max(reach[0]); walking j = 0, 1,
    ... a layer is taken whenever the rest of the total is still reachable from j + 1 on. With
    ``granularity`` g > 1, sizes are rounded up and the capacity down to multiples of g (feasible,
    no longer exactly optimal) to bound the number of totals.

    >>> best_layers([70, 50, 40, 40, 30], 100)       # 70 + 30 (also 50 + 40 ... is 90 only)
    (0, 4)
    """
    _check_int("capacity", capacity, 0)
    _check_int("granularity", granularity, 1)
    for i, b in enumerate(layer_bytes):
        _check_int(f"layer_bytes[{i}]", b, 1)
    weights = [-(-b // granularity) for b in layer_bytes]
    cap = capacity // granularity
    reach: list[set[int]] = [set() for _ in weights] + [{0}]
    for j in range(len(weights) - 1, -1, -1):
        w = weights[j]
        reach[j] = reach[j + 1] | {s + w for s in reach[j + 1] if s + w <= cap}
        if len(reach[j]) > max_states:
            _fail("granularity", granularity, f"too fine: more than {max_states} distinct totals; raise it")
    target, taken = max(reach[0]), []
    for j, w in enumerate(weights):
        if target and w <= target and target - w in reach[j + 1]:
            taken.append(j)
            target -= w
    return tuple(taken)


@dataclass(frozen=True)
class SlotLayers:
    """Algorithm 2's choice for one slot: the indices of the layers sent in it, and their bytes."""

    slot: Slot
    layers: tuple[int, ...]
    bytes: int


@dataclass(frozen=True)
class StagePlan:
    """Algorithm 1 and 2 for one pipeline stage: ``transfer`` (byte-count slots) and ``assignments``
    (the layers per slot, continuing past Algorithm 1's slots when whole layers did not fit)."""

    transfer: TransferPlan
    layer_bytes: tuple[int, ...]
    assignments: tuple[SlotLayers, ...]

    @property
    def fluid_interval_iterations(self) -> int:
        """Algorithm 1's n (bytes as a fluid)."""
        return self.transfer.interval_iterations

    @property
    def interval_iterations(self) -> int:
        """n with whole layers: a checkpoint of this stage completes every n iterations."""
        used = [a.slot.iteration for a in self.assignments if a.layers]
        return max(used) + 1 if used else 1


def plan_stage(sender_bubbles: Sequence[IdleSpan], receiver_bubbles: Sequence[IdleSpan],
               layer_bytes: Sequence[int], link: LinkModel, sender: int = 1, receiver: int = 0,
               granularity: int = 1, max_iterations: int = 10_000) -> StagePlan:
    """Algorithm 1 for the total of ``layer_bytes`` (the bytes this rank checkpoints, layer by layer;
    within a data-parallel group each rank sends 1/DP of them, BAFT 4.2.3), then Algorithm 2 per
    slot over the layers not yet placed."""
    layer_bytes = tuple(layer_bytes)
    for i, b in enumerate(layer_bytes):
        _check_int(f"layer_bytes[{i}]", b, 1)
    transfer = plan_transfer(sender_bubbles, receiver_bubbles, sum(layer_bytes), link, sender, receiver,
                             max_iterations)
    left = list(range(len(layer_bytes)))
    assignments: list[SlotLayers] = []
    if left:
        shared = shared_bubbles(sender_bubbles, receiver_bubbles)
        biggest = max(link.bytes_within(b.length) for b in shared)
        for i in left:
            if -(-layer_bytes[i] // granularity) * granularity > biggest - biggest % granularity:
                _fail(f"layer_bytes[{i}]", layer_bytes[i], f"must fit the largest shared bubble ({biggest} B at "
                      f"granularity {granularity}); split the layer into smaller pieces")
        for slot in _next_bubble(shared, link, "bubbles"):
            if slot.iteration >= max_iterations:
                _fail("layer_bytes", f"{len(left)} layers left", f"do not fit in max_iterations={max_iterations}")
            chosen = tuple(left[j] for j in best_layers([layer_bytes[i] for i in left], slot.capacity, granularity))
            assignments.append(SlotLayers(slot, chosen, sum(layer_bytes[i] for i in chosen)))
            left = [i for i in left if i not in chosen]
            if not left:
                break
    return StagePlan(transfer, layer_bytes, tuple(assignments))


@dataclass(frozen=True)
class PipelinePlan:
    """One :class:`StagePlan` per stage; stage i sends to stage (i - 1) mod P."""

    stages: tuple[StagePlan, ...]

    @property
    def interval_iterations(self) -> int:
        """Every stage holds a complete checkpoint of its sender every this many iterations."""
        return max(s.interval_iterations for s in self.stages)


def plan_pipeline(stage_bubbles: Sequence[Sequence[IdleSpan]], stage_layer_bytes: Sequence[Sequence[int]],
                  link: LinkModel, granularity: int = 1, max_iterations: int = 10_000,
                  targets: Optional[Sequence[int]] = None) -> PipelinePlan:
    """BAFT over a whole pipeline: stage i's node sends to its previous stage's node; stage 0, which
    has none, sends to the last stage (chain replication closed into a ring) unless ``targets``
    says otherwise."""
    stages = len(stage_bubbles)
    _check_int("stages", stages, 2)
    if len(stage_layer_bytes) != stages:
        _fail("stage_layer_bytes", f"{len(stage_layer_bytes)} stages", f"must have one entry per stage ({stages})")
    targets = tuple((i - 1) % stages for i in range(stages)) if targets is None else tuple(targets)
    if len(targets) != stages:
        _fail("targets", targets, f"must name one target per stage ({stages})")
    for i, t in enumerate(targets):
        _check_int(f"targets[{i}]", t, 0, stages - 1)
        if t == i:
            _fail(f"targets[{i}]", t, "must be another stage than the sender")
    return PipelinePlan(tuple(
        plan_stage(stage_bubbles[i], stage_bubbles[targets[i]], stage_layer_bytes[i], link, i, targets[i],
                   granularity, max_iterations) for i in range(stages)))
