"""GEMINI's mixed replica placement (SOSP '23, section 4, Algorithm 1), as pure functions.

Every node keeps its own snapshot (the local replica) and m - 1 more copies live on other nodes.

* N divisible by m - *group placement*: nodes 0..m-1, m..2m-1, ... form groups; every member
  holds every member's snapshot. A group is lost only when all m of its members fail (optimal,
  Theorem 1.1).
* otherwise - *mixed*: the first floor(N/m) - 1 groups as above; the last m + (N mod m) nodes form a
  *ring* in which each node's snapshot lives on itself and the next m - 1 nodes of the ring. The
  ring is lost when m ring-consecutive members fail (near-optimal, Theorem 1.2).

Worked examples (0-based node ids; the paper counts from 1):

* N = 4, m = 2 (figure 3a): groups (0, 1) and (2, 3). Node 0 holds snapshots 0 and 1, node 1 holds
  1 and 0, node 2 holds 2 and 3, node 3 holds 3 and 2. Of the C(4,2) = 6 two-node failures only
  {0, 1} and {2, 3} lose a snapshot: P(recover | k=2) = 4/6.
* N = 5, m = 2 (figure 3c): group (0, 1) and ring (2, 3, 4). Node 2's snapshot lives on 2 and 3,
  node 3's on 3 and 4, node 4's on 4 and 2; so node 2 holds snapshots 2 and 4, node 3 holds 3 and 2,
  node 4 holds 4 and 3. Losing {2, 3} loses snapshot 2; losing {0, 2} loses nothing.
* N = 7, m = 3: group (0, 1, 2) and ring (3, 4, 5, 6): node 5's snapshot on 5, 6, 3; node 6's on
  6, 3, 4.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from ..policy.gemini_groups import placement_strategy  # Algorithm 1 itself (the policy layer's, below this one)


@dataclass(frozen=True)
class ReplicaGroup:
    """Nodes that hold each other's snapshots. ``ring`` is False for a plain group of ``copies``
    nodes (everyone holds everyone's), True for GEMINI's ring (a member's copies are on it and the
    next ``copies - 1`` members, wrapping around)."""

    members: tuple[int, ...]
    copies: int
    ring: bool = False

    @property
    def tolerance(self) -> int:
        """Simultaneous member failures always survived: m - 1 (a ring can survive more, if no m
        ring-consecutive members are among them)."""
        return self.copies - 1

    def _pos(self, node: int) -> int:
        try:
            return self.members.index(node)
        except ValueError:
            raise ValueError(f"node {node} is not in replica group {self.members}") from None

    def holders(self, node: int) -> tuple[int, ...]:
        """Nodes holding ``node``'s snapshot, the node itself first.

        >>> ReplicaGroup((2, 3, 4), 2, ring=True).holders(4)
        (4, 2)
        """
        if not self.ring:
            i = self._pos(node)
            return (node,) + self.members[:i] + self.members[i + 1:]
        i, n = self._pos(node), len(self.members)
        return tuple(self.members[(i + d) % n] for d in range(self.copies))

    def held(self, node: int) -> tuple[int, ...]:
        """Nodes whose snapshots ``node`` holds, itself first.

        >>> ReplicaGroup((2, 3, 4), 2, ring=True).held(2)
        (2, 4)
        """
        if not self.ring:
            return self.holders(node)
        i, n = self._pos(node), len(self.members)
        return tuple(self.members[(i - d) % n] for d in range(self.copies))


def mixed_placement(nodes: Union[int, Sequence[int]], m: int) -> tuple[ReplicaGroup, ...]:
    """GEMINI's mixed placement of ``m`` copies over ``nodes`` (a count, or node ids in order).

    >>> [(g.members, g.ring) for g in mixed_placement(5, 2)]
    [((0, 1), False), ((2, 3, 4), True)]
    """
    ids = tuple(range(nodes)) if isinstance(nodes, int) else tuple(nodes)
    groups, strategy = placement_strategy(len(ids), m)
    out = [ReplicaGroup(tuple(ids[i] for i in g), m, ring=False) for g in groups]
    if strategy == "mixed":
        out[-1] = ReplicaGroup(out[-1].members, m, ring=True)
    return tuple(out)
