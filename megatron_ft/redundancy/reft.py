"""REFT's RAIM5 XOR parity inside each sharding group (REFT 2023, section 4.3), as pure functions.

A parity group is n nodes holding DP replicas of the same sharding groups. Each member keeps its
own snapshot whole (the local tier) and, RAID-5 style, one parity *stripe*:

* every member's data (per *lane*, see below) is cut into n - 1 equal pieces;
* piece ``p`` of member ``i`` belongs to stripe ``(i - 1 - p) mod n``;
* stripe ``s`` is the XOR of the n - 1 pieces that belong to it and lives on member ``s``, which
  contributes no piece to it. Each member therefore stores 1/(n-1) of its data extra, and the
  parity rotates over the members like RAID-5 parity over disks.

Losing one member ``f``: each of its pieces sits in a stripe ``s != f`` whose parity (on ``s``) and
other pieces (on the other survivors) are alive, so piece = parity XOR the other pieces. Losing two
members ``f`` and ``s`` loses ``f``'s piece of stripe ``s``: a group survives exactly 1 failure.

Worked example, REFT figure 7 (n = 4 nodes; stripes a, b, c, d = 0, 1, 2, 3; ``x_j`` = piece of
stripe x, as the paper labels them)::

    node 0: own data = [d_0, c_1, b_2]  (pieces 0, 1, 2 -> stripes 3, 2, 1)   parity p_a = a_0^a_1^a_2
    node 1: own data = [a_0, d_1, c_2]                                         parity p_b = b_0^b_1^b_2
    node 2: own data = [b_0, a_1, d_2]                                         parity p_c
    node 3: own data = [c_0, b_1, a_2]                                         parity p_d

Node 0 stores b_2, c_1, d_0 and p_a, as in the paper. Node 0 lost: b_2 = p_b ^ b_0 ^ b_1 (nodes 1,
2, 3), c_1 = p_c ^ c_0 ^ c_2, d_0 = p_d ^ d_1 ^ d_2. With n = 2 the single piece of each stripe is
the other member's whole data: XOR parity degenerates to a mirror.

*Lanes.* A node hosts ``ranks_per_node`` ranks. Lane ``l`` of a group takes the ``l``-th rank of
every member (each member's ranks sorted by sharding group, then dp), so a lane is a set of
same-shaped shards of one sharding group - REFT's SG - whenever the members hold the same sharding
groups. E.g. 16 nodes x 8 GPUs, TP 8, PP 2: nodes 0-7 hold pp stage 0 (one tp rank per GPU) and
form one parity group; its lane 5 is ranks 5, 13, 21, ..., 61 (tp 5, dp 0..7) = sharding group
(pp 0, tp 5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .topology import Topology


def stripe_of(member: int, piece: int, n: int) -> int:
    """The stripe that piece ``piece`` of member ``member`` belongs to: ``(member - 1 - piece) mod n``.

    >>> [stripe_of(0, p, 4) for p in range(3)]     # node 0 of REFT figure 7: d_0, c_1, b_2
    [3, 2, 1]
    """
    _check_raim5(member, n)
    if not 0 <= piece < n - 1:
        raise ValueError(f"piece={piece} is invalid: a member of a group of {n} has pieces 0..{n - 2}")
    return (member - 1 - piece) % n


def piece_in(member: int, stripe: int, n: int) -> int:
    """Which of member ``member``'s pieces belongs to ``stripe`` (never its own stripe).

    >>> piece_in(0, 1, 4)                           # b_2 lives on node 0
    2
    """
    _check_raim5(member, n)
    if stripe == member or not 0 <= stripe < n:
        raise ValueError(f"member {member} holds the parity of stripe {stripe}, no data piece of it")
    return (member - stripe - 1) % n


def raim5_layout(n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``layout[s]`` = the ``(member, piece)`` pairs XOR-ed into the parity of stripe ``s``, which
    member ``s`` holds.

    >>> raim5_layout(4)[0]                          # p_a = a_0 ^ a_1 ^ a_2 on node 0
    ((1, 0), (2, 1), (3, 2))
    >>> raim5_layout(2)                             # n = 2: a mirror
    (((1, 0),), ((0, 0),))
    """
    _check_raim5(0, n)
    return tuple(tuple((i, piece_in(i, s, n)) for i in range(n) if i != s) for s in range(n))


def _check_raim5(member: int, n: int) -> None:
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"RAIM5 needs a group of at least 2 nodes, got n={n!r}")
    if not 0 <= member < n:
        raise ValueError(f"member={member} is invalid: must be in [0, {n - 1}]")


@dataclass(frozen=True)
class ParityGroup:
    """One RAIM5 parity group: ``members`` (nodes, in stripe order) and ``lanes[l][i]``, the rank
    on ``members[i]`` that lane ``l`` protects. ``same_sharding_group`` tells whether every lane is
    one sharding group (REFT's layout) or had to mix groups (see :func:`xor_parity_groups`)."""

    members: tuple[int, ...]
    lanes: tuple[tuple[int, ...], ...]
    same_sharding_group: bool = True

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def pieces(self) -> int:
        """Pieces each protected rank state is cut into (n - 1)."""
        return self.size - 1

    @property
    def tolerance(self) -> int:
        return 1

    def parity_node(self, stripe: int) -> int:
        return self.members[stripe]

    def sources(self, lane: int, stripe: int) -> tuple[tuple[int, int, int], ...]:
        """``(node, rank, piece)`` of the pieces XOR-ed into the parity of ``stripe`` in ``lane``.

        >>> ParityGroup((8, 9, 10), ((64, 72, 80),)).sources(0, 0)
        ((9, 72, 0), (10, 80, 1))
        """
        n = self.size
        ranks = self.lanes[lane]
        return tuple((self.members[i], ranks[i], piece_in(i, stripe, n)) for i in range(n) if i != stripe)


def _split(nodes: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """Consecutive groups of ``size`` (0: one group); a remainder joins the last group, as in
    GEMINI's Algorithm 1. ``_split([0..6], 3) -> [(0,1,2), (3,4,5,6)]``."""
    nodes = tuple(nodes)
    if size <= 0 or size >= len(nodes):
        return [nodes]
    out = [nodes[i:i + size] for i in range(0, len(nodes) - len(nodes) % size, size)]
    if len(nodes) % size:
        out[-1] = out[-1] + nodes[len(nodes) - len(nodes) % size:]
    return out


def xor_parity_groups(topology: Topology, group_size: int = 0) -> tuple[ParityGroup, ...]:
    """Parity groups for a topology: REFT's RAIM5 within each sharding group.

    1. Nodes are classed by the multiset of sharding groups their ranks belong to. Nodes of one
       class are DP replicas of each other; with TP >= GPUs per node a class is exactly the node set
       of a sharding group (REFT's SG).
    2. Each class of >= 2 nodes is one parity group, or, with ``group_size`` > 0, consecutive
       groups of ``group_size`` nodes (a remainder joins the last group): smaller groups survive
       more failures in total at a higher memory cost (1/(n-1) extra per node).
    3. Nodes whose class has a single node (their sharding groups live on one node - e.g. the
       local CPU default, where node 0 holds all of pp stage 0) cannot be protected inside their
       sharding group. They are grouped with each other the same way (a lone leftover joins the
       last group), with lanes that mix sharding groups (``same_sharding_group=False``; unequal
       shard sizes are zero-padded). With fewer than 2 nodes there is nothing to pair: ValueError.

    Example: 16 nodes x 8, TP 8, PP 2 -> classes {0..7} (pp 0) and {8..15} (pp 1): two groups of 8,
    each surviving one node loss, 1/7 extra memory per node. ``group_size=4`` -> four groups of 4
    ({0..3}, {4..7}, {8..11}, {12..15}), 1/3 extra. Local CPU default (2 x 2, TP 1, PP 2) -> one
    mixed group (0, 1) whose lanes are (rank 0, rank 2) and (rank 1, rank 3).
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 0 or group_size == 1:
        raise ValueError(f"group_size={group_size!r} is invalid: must be 0 (a whole sharding group) or an integer >= 2")
    if topology.nodes < 2:
        raise ValueError(f"xor parity needs at least 2 nodes, got {topology.nodes}")
    rpn, tp, dp = topology.ranks_per_node, topology.tensor, topology.data

    sg = [(r // (tp * dp)) * tp + r % tp for r in range(topology.world_size)]  # Topology.sharding_group, inlined
    dpr = [(r // tp) % dp for r in range(topology.world_size)]

    ordered: list[list[int]] = []  # each node's ranks sorted by (sharding group, dp)
    classes: dict[tuple[int, ...], list[int]] = {}
    for node in range(topology.nodes):
        ranks = sorted(range(node * rpn, (node + 1) * rpn), key=lambda r: (sg[r], dpr[r]))
        ordered.append(ranks)
        classes.setdefault(tuple(sg[r] for r in ranks), []).append(node)

    member_sets: list[tuple[tuple[int, ...], bool]] = []  # (members, from one class)
    lone: list[int] = []
    for nodes in classes.values():
        if len(nodes) >= 2:
            member_sets.extend((g, True) for g in _split(nodes, group_size))
        else:
            lone.extend(nodes)
    if len(lone) >= 2:
        member_sets.extend((g, False) for g in _split(sorted(lone), group_size))
    elif lone:  # a single unprotectable node: join the last group (its lanes become mixed)
        members, _ = member_sets[-1]
        member_sets[-1] = (tuple(sorted(members + tuple(lone))), False)
    member_sets.sort(key=lambda ms: ms[0][0])
    out = []
    for members, _ in member_sets:
        lanes = tuple(tuple(ordered[n][lane] for n in members) for lane in range(rpn))
        same = all(all(sg[r] == sg[lane[0]] for r in lane) for lane in lanes)
        out.append(ParityGroup(members, lanes, same))
    return tuple(out)
