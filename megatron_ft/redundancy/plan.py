"""The redundancy plan of a job: for every node, what it holds, how many bytes, and what it survives.

``make_plan(topology, scheme, ...)`` is a pure function (topology and parameters in, frozen plan
out) built from the papers' layouts:

=========  ====================================================  ==========================
scheme     groups                                                 a group survives
=========  ====================================================  ==========================
none       every node alone                                       0 node failures
replica    GEMINI Algorithm 1 (:mod:`.gemini`): groups of m, the  any m - 1 (a ring: any set
           remainder joined into a ring                           without m consecutive)
xor        REFT RAIM5 (:mod:`.reft`): one parity group per        any 1
           sharding group's node set (or ``group_size`` nodes)
rs         ECHECK (:mod:`.echeck`): k + m consecutive nodes,      any m
           sweep-line data/parity nodes
=========  ====================================================  ==========================

Every node always keeps its own ranks' snapshots ("primary": the local tier for software
failures, GEMINI's local replica). On top of that it holds:

* replica: whole copies of the other group members' ranks (ring: of the m - 1 ring predecessors);
* xor: per lane one parity block = XOR of n - 1 pieces (1/(n-1) of a rank's state each);
* rs: a data node holds data chunk D_j (copies of the packets of D_j it does not own), a parity
  node holds parity chunk P_i (one packet-sized block per reduction group).

Worked example, 16 nodes x 8 GPUs, TP 8, PP 2 (DP 8), 1 GiB state per rank:

* replica, m = 2: groups (0,1), (2,3), ..., (14,15). Node 0 holds ranks 0-7 (primary) and 8-15
  (node 1's replica): 16 GiB. P(recover | 2 nodes fail) = 1 - 8/C(16,2) = 0.9333 (Corollary 1).
* xor: parity groups nodes 0-7 (pp 0) and 8-15 (pp 1). Node 0 holds ranks 0-7 and, for each of its
  8 lanes (tp 0-7), the parity of stripe 0 = XOR of one 1/7 piece of ranks 8+t, 16+t, ..., 56+t:
  8 + 8/7 = 9.14 GiB. Any one failure per group is survived: P(recover | 2 fail) = 64/120.
* rs, k = 4, m = 2: groups nodes 0-5, 6-15 (k = 8 with the remainder). Node 0 (data node of D_0 =
  ranks 0-11) holds 8 + 4 = 12 GiB, node 1 (parity P_0, 12 packets) 8 + 12 = 20 GiB.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from fractions import Fraction
from typing import Iterable, Optional, Sequence, Union

from ..config import SCHEMES  # the one definition of the schemes
from .echeck import CodingGroup, rs_coding_groups
from .gemini import ReplicaGroup, mixed_placement
from .reft import ParityGroup, xor_parity_groups
from .topology import Topology

PRIMARY, REPLICA, PARITY, DATA = "primary", "replica", "parity", "data"


@dataclass(frozen=True)
class LocalGroup:
    """scheme ``none``: a node alone with its own snapshot."""

    members: tuple[int, ...]

    @property
    def tolerance(self) -> int:
        return 0


Group = Union[LocalGroup, ReplicaGroup, ParityGroup, CodingGroup]


@dataclass(frozen=True)
class Piece:
    """Piece ``index`` of ``count`` equal pieces of ``rank``'s state (the last may be short)."""

    rank: int
    index: int = 0
    count: int = 1

    def byte_range(self, size: int) -> tuple[int, int]:
        """``[start, stop)`` of this piece in a state of ``size`` bytes; piece length
        ``ceil(size / count)``. ``Piece(9, 2, 3).byte_range(100) == (68, 100)``."""
        step = -(-size // self.count)
        return min(size, self.index * step), min(size, (self.index + 1) * step)


@dataclass(frozen=True)
class ParityBlock:
    """Parity a node holds. xor: stripe ``index`` of ``lane`` = XOR of ``sources`` (pieces, each
    zero-padded to the longest). rs: parity chunk P_``index`` computed from all of the group's
    packets (``sources`` = every rank of the group, whole)."""

    scheme: str
    group: int
    index: int
    lane: int
    sources: tuple[Piece, ...]


@dataclass(frozen=True)
class NodeHoldings:
    """What one node holds for one snapshot version."""

    node: int
    group: int
    primary: tuple[int, ...]  # its own ranks, whole
    copies: tuple[int, ...]  # other nodes' ranks, whole (replica copies; rs data-chunk packets)
    parity: tuple[ParityBlock, ...] = ()
    data_chunk: int = -1  # rs: j of the data chunk D_j it holds (-1: none)

    def roles(self) -> tuple[str, ...]:
        out = [PRIMARY]
        if self.copies:
            out.append(DATA if self.data_chunk >= 0 else REPLICA)
        if self.parity:
            out.append(PARITY)
        return tuple(out)


@dataclass(frozen=True)
class NodeMemory:
    node: int
    primary: int  # bytes of its own ranks' state
    redundancy: int  # bytes it holds for others (copies, parity)

    @property
    def total(self) -> int:
        return self.primary + self.redundancy


@dataclass(frozen=True)
class RedundancyPlan:
    """A scheme laid out on a topology. ``groups[g].members`` are node ids; every node is in
    exactly one group (``node_group[node]``)."""

    topology: Topology
    scheme: str
    groups: tuple[Group, ...]
    replicas: int = 1
    group_size: int = 0
    k: int = 0
    m: int = 0

    @cached_property
    def node_group(self) -> tuple[int, ...]:
        out = [-1] * self.topology.nodes
        for gi, g in enumerate(self.groups):
            for n in g.members:
                out[n] = gi
        return tuple(out)

    @property
    def label(self) -> str:
        if self.scheme == "replica":
            return f"replica (GEMINI mixed placement, m={self.replicas})"
        if self.scheme == "xor":
            size = "whole sharding groups" if not self.group_size else f"groups of {self.group_size} nodes"
            return f"xor (REFT RAIM5 parity, {size})"
        if self.scheme == "rs":
            return f"rs (ECHECK Cauchy Reed-Solomon, k={self.k}, m={self.m})"
        return "none (local snapshots only)"

    def own_copy_is_redundant(self, node: int) -> bool:
        """Whether every packet ``node`` owns is also held whole by another member of its group: an
        rs parity node (ECHECK), whose own clean copy is then only a cache (one staging slot per rank)."""
        return self.scheme == "rs" and self.groups[self.node_group[node]].role(node)[0] == "parity"

    # ------------------------------------------------------------------ who holds what

    def holdings(self, node: int) -> NodeHoldings:
        """What ``node`` holds (computed on demand: O(its group), so planning stays O(ranks))."""
        topo = self.topology
        if not 0 <= node < topo.nodes:
            raise ValueError(f"node={node} is invalid: must be in [0, {topo.nodes - 1}]")
        gi = self.node_group[node]
        g = self.groups[gi]
        primary = tuple(topo.ranks_of(node))
        if isinstance(g, ReplicaGroup):
            copies = tuple(r for src in g.held(node)[1:] for r in topo.ranks_of(src))
            return NodeHoldings(node, gi, primary, copies)
        if isinstance(g, ParityGroup):
            s = g.members.index(node)
            blocks = tuple(ParityBlock("xor", gi, s, lane, tuple(Piece(r, p, g.pieces) for _, r, p in g.sources(lane, s)))
                           for lane in range(len(g.lanes)))
            return NodeHoldings(node, gi, primary, (), blocks)
        if isinstance(g, CodingGroup):
            kind, j = g.role(node)
            if kind == "data":
                own = set(primary)
                return NodeHoldings(node, gi, primary, tuple(r for r in g.chunk(j) if r not in own), (), j)
            block = ParityBlock("rs", gi, j, -1, tuple(Piece(r) for r in g.packets))
            return NodeHoldings(node, gi, primary, (), (block,))
        return NodeHoldings(node, gi, primary, ())

    # ------------------------------------------------------------------ bytes

    def memory(self, state_bytes: Union[int, Sequence[int]]) -> tuple[NodeMemory, ...]:
        """Bytes per node for one snapshot version, given every rank's state size (one number for
        all ranks, or one per rank). xor pieces and rs parity packets are as long as the longest
        contributor (shorter ones are zero-padded)."""
        topo = self.topology
        if isinstance(state_bytes, int) and not isinstance(state_bytes, bool):
            if state_bytes < 0:
                raise ValueError(f"state_bytes={state_bytes} is invalid: must be >= 0")
            size = [state_bytes] * topo.world_size
        else:
            size = list(state_bytes)
            if len(size) != topo.world_size or any(not isinstance(x, int) or x < 0 for x in size):
                raise ValueError(f"state_bytes must be one integer >= 0 or {topo.world_size} of them (one per rank)")
        rpn = topo.ranks_per_node
        primary = [sum(size[n * rpn:(n + 1) * rpn]) for n in range(topo.nodes)]
        extra = [0] * topo.nodes
        for g in self.groups:
            if isinstance(g, ReplicaGroup):
                for n in g.members:
                    extra[n] = sum(primary[src] for src in g.held(n)[1:])
            elif isinstance(g, ParityGroup):
                step = g.pieces
                for lane in g.lanes:
                    block = max(-(-size[r] // step) for r in lane)
                    for n in g.members:
                        extra[n] += block
            elif isinstance(g, CodingGroup):
                for j, n in enumerate(g.data_nodes):
                    extra[n] = sum(size[r] for r in g.chunk(j) if g.owner(r) != n)
                parity = sum(max(size[r] for r in rg.ranks) for rg in g.reduction_groups())
                for n in g.parity_nodes:
                    extra[n] = parity
        return tuple(NodeMemory(n, primary[n], extra[n]) for n in range(topo.nodes))

    # ------------------------------------------------------------------ failures

    def _check_nodes(self, failed: Iterable[int]) -> set[int]:
        out = set(failed)
        bad = sorted(n for n in out if not (isinstance(n, int) and 0 <= n < self.topology.nodes))
        if bad:
            raise ValueError(f"failed nodes {bad} are invalid: must be in [0, {self.topology.nodes - 1}]")
        return out

    def survives(self, failed: Iterable[int]) -> bool:
        """Does every group survive losing the nodes ``failed`` at once (by the group rules:
        more than ``tolerance`` members lost, or m ring-consecutive ones, loses a group)?"""
        by_group: dict[int, list[int]] = {}
        for n in self._check_nodes(failed):
            by_group.setdefault(self.node_group[n], []).append(n)
        for gi, down in by_group.items():
            g = self.groups[gi]
            if isinstance(g, ReplicaGroup) and g.ring:
                if any(all(h in down for h in g.holders(n)) for n in down):
                    return False
            elif len(down) > g.tolerance:
                return False
        return True

    def lost_ranks(self, failed: Iterable[int]) -> frozenset[int]:
        """Ranks whose state cannot be rebuilt from the surviving nodes' holdings after the nodes
        ``failed`` are lost at once - checked against what :meth:`holdings` says each survivor
        holds, not against the group rules (so the two can be compared):

        * a rank is safe if a survivor holds it whole (its own node, a replica, an rs data chunk);
        * xor: each of its pieces must be in a parity block on a survivor whose other pieces
          belong to ranks held whole by survivors;
        * rs: at least k of the group's k + m chunk holders must survive (any k decode).
        """
        down = self._check_nodes(failed)
        lost: set[int] = set()
        for gi in sorted({self.node_group[n] for n in down}):
            g = self.groups[gi]
            alive = [self.holdings(n) for n in g.members if n not in down]
            whole = {r for h in alive for r in h.primary + h.copies}
            pieces = {(p.rank, p.index): b for h in alive for b in h.parity if b.scheme == "xor" for p in b.sources}
            rs_alive = sum(1 for h in alive if h.data_chunk >= 0 or any(b.scheme == "rs" for b in h.parity))
            for n in g.members:
                if n not in down:
                    continue
                for r in self.topology.ranks_of(n):
                    if r in whole:
                        continue
                    if isinstance(g, ParityGroup):
                        ok = True
                        for p in range(g.pieces):
                            b = pieces.get((r, p))
                            if b is None or any(q.rank not in whole for q in b.sources if q.rank != r):
                                ok = False
                                break
                        if ok:
                            continue
                    elif isinstance(g, CodingGroup) and rs_alive >= g.k:
                        continue
                    lost.add(r)
        return frozenset(lost)

    def tolerance(self) -> int:
        """Simultaneous node failures every group survives, wherever they fall: the minimum
        group tolerance (0 for none, m - 1 replica, 1 xor, m rs)."""
        return min(g.tolerance for g in self.groups)

    def policy_placement(self):
        """This plan's groups as a :class:`megatron_ft.policy.recoverability.Placement` (the
        issue-6 failure model), so its exact counting applies to exactly this layout."""
        from ..policy.recoverability import Group as PGroup, Placement

        groups = []
        for g in self.groups:
            if isinstance(g, ReplicaGroup) and g.ring:
                groups.append(PGroup(g.members, window=g.copies))
            else:
                groups.append(PGroup(g.members, tolerance=g.tolerance))
        param = {"replica": (self.replicas,), "xor": (self.group_size,), "rs": (self.k, self.m)}.get(self.scheme, ())
        return Placement(self.scheme, self.topology.nodes, tuple(groups), param)

    def survivable_counts(self, kmax: int) -> list[int]:
        """``c[k]``: how many of the C(N, k) sets of k failed nodes the plan survives, k = 0..kmax
        (exact, by ``megatron_ft.policy.recoverability.recoverable_counts``)."""
        from ..policy.recoverability import recoverable_counts

        return recoverable_counts(self.policy_placement(), kmax)

    def recover_probability(self, k: int) -> Fraction:
        """P(every rank's state can be rebuilt from memory | k distinct nodes fail at once, all
        k-sets equally likely): GEMINI Corollary 1 made exact, for any scheme."""
        n = self.topology.nodes
        if not isinstance(k, int) or not 0 <= k <= n:
            raise ValueError(f"k={k!r} is invalid: must be in [0, {n}]")
        return Fraction(self.survivable_counts(k)[k], math.comb(n, k))


def make_plan(topology: Topology, scheme: str, replicas: int = 2, group_size: int = 0, k: int = 4,
              m: int = 2) -> RedundancyPlan:
    """Lay ``scheme`` out on ``topology``: ``replicas`` for replica (GEMINI m), ``group_size`` for
    xor (nodes per parity group, 0 = each sharding group's whole node set), ``k``/``m`` for rs.

    >>> p = make_plan(Topology(5, 1), "replica", replicas=2)
    >>> [g.members for g in p.groups], p.holdings(2).copies, p.survives({0, 2}), p.survives({2, 3})
    ([(0, 1), (2, 3, 4)], (4,), True, False)
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is invalid: must be one of {', '.join(SCHEMES)}")
    n = topology.nodes
    if scheme == "none":
        return RedundancyPlan(topology, scheme, tuple(LocalGroup((i,)) for i in range(n)))
    if scheme == "replica":
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 2:
            raise ValueError(f"replicas={replicas!r} is invalid: must be an integer >= 2")
        if replicas > n:
            raise ValueError(f"replicas={replicas} is invalid: a replica group needs nodes >= replicas, got {n} nodes")
        return RedundancyPlan(topology, scheme, mixed_placement(n, replicas), replicas=replicas)
    if scheme == "xor":
        return RedundancyPlan(topology, scheme, xor_parity_groups(topology, group_size), group_size=group_size)
    return RedundancyPlan(topology, scheme, rs_coding_groups(n, topology.ranks_per_node, k, m), k=k, m=m)


def plan_from_config(cfg, scheme: Optional[str] = None) -> RedundancyPlan:
    """The plan of a :class:`megatron_ft.config.FTConfig` (its ``redundancy`` section; ``scheme``
    overrides the scheme, keeping the section's parameters)."""
    r = cfg.redundancy
    return make_plan(Topology.from_config(cfg), scheme or r.scheme, replicas=r.replicas,
                     group_size=r.group_size, k=r.k, m=r.m)
