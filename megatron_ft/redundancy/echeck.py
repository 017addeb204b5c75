"""ECHECK's k + m erasure-coded layout (sections III-B and IV-B), as pure functions.

A coding group is n = k + m nodes with g ranks ("workers") each, W = n*g packets (a packet is one
rank's snapshot) in node order. The packets are cut into k consecutive *data groups* D_0..D_{k-1}
of about W/k packets; the m parity chunks are ``P_i = sum_j e_ij D_j`` (Cauchy Reed-Solomon over
GF(2^8), applied as a bit matrix so that "+" is XOR). Every node stores one chunk, any k chunks
rebuild the rest, so a group survives any m simultaneous node failures. (megatron-ft's nodes also
keep their own snapshot for the local tier.)

*Which nodes hold data* (IV-B.1): for each data group, the node (origin interval) overlapping it
most, found with a sweep line over both interval lists; the others hold parity. That minimises
the packets a data node has to fetch.

*Where the XOR reductions happen* (IV-B.2): reduction group r takes the r-th packet of every data
group (k workers, one per D_j); its m reductions give the r-th packet of every P_i. A reduction's
target is the worker on P_i's own node if the group has one (no transfer), else, among the
group's k workers (positions 0..k-1):

* k = m: parity i on worker i;
* k > m: every floor(k/m)-th worker: parity i on worker i * floor(k/m) (k - m workers never send);
* k < m: round robin: parity i on worker i mod k.

Worked example (figure 6): n = 4, g = 1, k = m = 2, packets d0..d3. D_0 = [d0, d1], D_1 = [d2, d3].
Sweep line (ties to the lower node): D_0 overlaps nodes 0 and 1 by one packet each -> node 0;
D_1 -> node 2; parity P_0 on node 1, P_1 on node 3. Reduction group 0 = {d0, d2} has no parity
worker -> k = m: p0 = e11 d0 + e12 d2 on worker 0 (then sent to node 1), p2 on worker 2 (sent to
node 3); reduction group 1 = {d1, d3}: p1 on worker 1 (node 1 = P_0's node), p3 on worker 3.

Figure 9: 3 nodes x 2 GPUs, k = 2, m = 1: origin [0,1] [2,3] [4,5], data [0,1,2] [3,4,5] -> data
nodes 0 and 2, parity node 1; node 0 fetches d2, node 2 fetches d3, the reduction of {d1, d4} is
made on d1's node 0 and sent: 3 transfers (figure 9a). Node 2 as parity costs 4 (figure 9b).

16 x 8 GPUs, k = 4, m = 2, first group nodes 0-5 (W = 48, data groups of 12): D_0 = ranks 0-11 ->
node 0 (8 of its packets), D_1 = 12-23 -> node 2 (16-23), D_2 = 24-35 -> node 3, D_3 = 36-47 ->
node 5; parity on nodes 1 and 4. Reduction groups 0-3 and 8-11 contain workers of both parity
nodes; groups 4-7 (ranks 4+r', 16+r', 28+r', 40+r') have none -> k > m: P_0's packet is reduced on
position 0 (node 0), P_1's on position 2 (node 3), and both are sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

Interval = tuple[int, int]  # [start, stop)


def data_groups(workers: int, k: int) -> tuple[Interval, ...]:
    """ECHECK's ``data_group``: W packets cut into k consecutive near-equal intervals
    ``[floor(j W / k), floor((j + 1) W / k))``.

    >>> data_groups(6, 2)
    ((0, 3), (3, 6))
    >>> data_groups(10, 4)                         # W not divisible by k: sizes 2, 3, 2, 3
    ((0, 2), (2, 5), (5, 7), (7, 10))
    """
    if not 1 <= k <= workers:
        raise ValueError(f"k={k} is invalid: need 1 <= k <= W={workers} packets")
    return tuple((j * workers // k, (j + 1) * workers // k) for j in range(k))


def _check_sorted(name: str, intervals: Sequence[Interval]) -> None:
    prev = None
    for a, b in intervals:
        if b <= a or (prev is not None and a < prev):
            raise ValueError(f"{name} must be non-empty, sorted, disjoint [start, stop) intervals: {list(intervals)}")
        prev = b


def sweep_line_data_nodes(origin: Sequence[Interval], data: Sequence[Interval]) -> tuple[int, ...]:
    """For each ``data`` interval, the index of the ``origin`` interval that overlaps it most.

    A sweep line over the endpoints of both sorted lists (two pointers: an origin interval is
    compared only with the data intervals it is active for), O(n + k) after sorting. Ties go to
    the lower index (figure 6: data nodes 0 and 2). The choices are distinct: if the best node is
    already a data node, the next best overlapping one is taken, else the lowest free one.

    >>> sweep_line_data_nodes([(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 6)])   # figure 9
    (0, 2)
    >>> sweep_line_data_nodes([(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 2), (2, 4)])  # figure 6
    (0, 2)
    """
    _check_sorted("origin", origin)
    _check_sorted("data", data)
    if len(data) > len(origin):
        raise ValueError(f"{len(data)} data intervals need as many distinct nodes, only {len(origin)} given")
    taken: set[int] = set()
    out: list[int] = []
    lo = 0
    for a, b in data:
        while lo < len(origin) and origin[lo][1] <= a:  # origin intervals that ended before a
            lo += 1
        cands = []
        i = lo
        while i < len(origin) and origin[i][0] < b:  # origin intervals active inside [a, b)
            overlap = min(b, origin[i][1]) - max(a, origin[i][0])
            if overlap > 0:
                cands.append((-overlap, i))
            i += 1
        cands.sort()
        pick = next((i for _, i in cands if i not in taken), None)
        if pick is None:
            pick = next(i for i in range(len(origin)) if i not in taken)
        taken.add(pick)
        out.append(pick)
    return tuple(out)


def reduction_target_positions(k: int, m: int) -> tuple[int, ...]:
    """Positions (0..k-1 within a reduction group without parity workers) where the m parity
    packets are reduced.

    >>> reduction_target_positions(2, 2), reduction_target_positions(4, 2), reduction_target_positions(2, 3)
    ((0, 1), (0, 2), (0, 1, 0))
    """
    if k < 1 or m < 1:
        raise ValueError(f"need k >= 1 and m >= 1, got k={k}, m={m}")
    if k == m:
        return tuple(range(m))
    if k > m:
        step = k // m
        return tuple(i * step for i in range(m))
    return tuple(i % k for i in range(m))


@dataclass(frozen=True)
class ReductionGroup:
    """The r-th packet of every data group and where each of the m parity packets is reduced."""

    index: int
    ranks: tuple[int, ...]  # one per data group that has an r-th packet, in data-group order
    targets: tuple[int, ...]  # targets[i]: the rank (worker) on which P_i's r-th packet is reduced


@dataclass(frozen=True)
class CodingGroup:
    """One k + m coding group: ``members`` (nodes), ``workers[p]`` (the ranks of ``members[p]``),
    ``data_nodes[j]`` (holds D_j), ``parity_nodes[i]`` (holds P_i)."""

    members: tuple[int, ...]
    workers: tuple[tuple[int, ...], ...]
    k: int
    m: int
    data_nodes: tuple[int, ...]
    parity_nodes: tuple[int, ...]

    @property
    def tolerance(self) -> int:
        return self.m

    @cached_property
    def packets(self) -> tuple[int, ...]:
        """All ranks of the group, in packet (node, then local rank) order."""
        return tuple(r for w in self.workers for r in w)

    @cached_property
    def bounds(self) -> tuple[Interval, ...]:
        return data_groups(len(self.packets), self.k)

    @cached_property
    def _owner(self) -> dict[int, int]:
        return {r: node for node, w in zip(self.members, self.workers) for r in w}

    def owner(self, rank: int) -> int:
        return self._owner[rank]

    def chunk(self, j: int) -> tuple[int, ...]:
        """The ranks (packets) of data chunk D_j."""
        a, b = self.bounds[j]
        return self.packets[a:b]

    def chunk_of(self, rank: int) -> int:
        idx = self.packets.index(rank)
        return next(j for j, (a, b) in enumerate(self.bounds) if a <= idx < b)

    def role(self, node: int) -> tuple[str, int]:
        """``("data", j)`` or ``("parity", i)``."""
        if node in self.data_nodes:
            return "data", self.data_nodes.index(node)
        return "parity", self.parity_nodes.index(node)

    @property
    def parity_packets(self) -> int:
        """Packets per parity chunk: the longest data group (shorter ones are zero-padded)."""
        return max(b - a for a, b in self.bounds)

    def reduction_groups(self) -> tuple[ReductionGroup, ...]:
        out = []
        positions = {}
        for r in range(self.parity_packets):
            ranks = tuple(self.packets[a + r] for a, b in self.bounds if a + r < b)
            on_node = {self._owner[x]: x for x in reversed(ranks)}  # node -> first such rank
            pos = positions.setdefault(len(ranks), reduction_target_positions(len(ranks), self.m))
            targets = tuple(on_node.get(p, ranks[pos[i]]) for i, p in enumerate(self.parity_nodes))
            out.append(ReductionGroup(r, ranks, targets))
        return tuple(out)

    def transfers(self) -> tuple[int, int]:
        """Packets sent between nodes per encode: (data packets fetched by data nodes, reduced
        parity packets sent to their parity node)."""
        data = sum(1 for j, node in enumerate(self.data_nodes) for x in self.chunk(j) if self._owner[x] != node)
        parity = sum(1 for g in self.reduction_groups() for i, t in enumerate(g.targets)
                     if self._owner[t] != self.parity_nodes[i])
        return data, parity


def coding_group(members: Sequence[int], workers: Sequence[Sequence[int]], k: int, m: int,
                 data_nodes: Optional[Sequence[int]] = None) -> CodingGroup:
    """A coding group over ``members`` whose ranks are ``workers``; data nodes by the sweep line
    unless given (to compare alternatives, as figure 9b does)."""
    members, workers = tuple(members), tuple(tuple(w) for w in workers)
    if len(members) != len(workers) or len(set(members)) != len(members):
        raise ValueError("members must be distinct and have one worker list each")
    if k < 1 or m < 1 or len(members) != k + m:
        raise ValueError(f"a coding group needs k >= 1, m >= 1 and k + m = {len(members)} nodes, got k={k}, m={m}")
    if any(not w for w in workers):
        raise ValueError("every member needs at least one rank")
    if data_nodes is None:
        origin, start = [], 0
        for w in workers:
            origin.append((start, start + len(w)))
            start += len(w)
        data_nodes = tuple(members[p] for p in sweep_line_data_nodes(origin, data_groups(start, k)))
    data_nodes = tuple(data_nodes)
    if len(data_nodes) != k or len(set(data_nodes)) != k or not set(data_nodes) <= set(members):
        raise ValueError(f"data_nodes={data_nodes} must be {k} distinct members of {members}")
    parity_nodes = tuple(n for n in members if n not in data_nodes)
    return CodingGroup(members, workers, k, m, data_nodes, parity_nodes)


def rs_coding_groups(nodes: int, ranks_per_node: int, k: int, m: int) -> tuple[CodingGroup, ...]:
    """Consecutive groups of k + m nodes (node n holds ranks n*g .. n*g+g-1); when k + m does not
    divide N the remaining nodes join the last group as extra data nodes (its k grows, m stays).

    >>> [(g.members, g.k, g.m) for g in rs_coding_groups(8, 1, 2, 1)]
    [((0, 1, 2), 2, 1), ((3, 4, 5, 6, 7), 4, 1)]
    """
    for name, v, lo in (("k", k, 1), ("m", m, 1), ("nodes", nodes, 1), ("ranks_per_node", ranks_per_node, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name}={v!r} is invalid: must be an integer >= {lo}")
    n = k + m
    if nodes < n:
        raise ValueError(f"rs with k={k}, m={m} needs at least k+m={n} nodes, got {nodes}")
    starts = list(range(0, nodes - nodes % n, n))
    out = []
    for gi, s in enumerate(starts):
        stop = nodes if gi == len(starts) - 1 else s + n
        members = tuple(range(s, stop))
        workers = [range(x * ranks_per_node, (x + 1) * ranks_per_node) for x in members]
        out.append(coding_group(members, workers, len(members) - m, m))
    return tuple(out)
