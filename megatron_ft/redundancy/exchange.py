"""The byte-level exchange of one snapshot version: which *blocks* every node holds for its peers,
which *contributions* every node sends, and how a lost rank is rebuilt (pure functions).

:mod:`.plan` says who holds what in units of ranks and pieces; this module adds the byte lengths
(every rank's snapshot container size) and turns it into work the agents execute
(:mod:`megatron_ft.agent.redundancy`). A *block* is one buffer on a holder node, filled by one or
more contributions:

=========  ===========================  ========================================  =================
kind       key                          content                                   contributions
=========  ===========================  ========================================  =================
copy       ``copy.r{rank}``             the rank's whole container (replica; rs   1, stored
                                        data-node copy)
xor        ``xor.g{g}.l{lane}.s{s}``    XOR of the stripe's pieces, zero-padded   one per source
                                        to the longest (REFT RAIM5)               node, XOR-ed in
rs         ``rs.g{g}.p{i}.row{r}``      P_i's packet of reduction group r:        one per node
                                        ``sum_j e_ij d_{j,r}`` (ECHECK)           owning a packet
                                                                                  of the row, XOR-ed
=========  ===========================  ========================================  =================

RS parity is linear, so a node encodes *its own* packets of a row with the others set to zero
(``e_ij d_j`` for every i in one codec call: the encode step), the holder XORs the partial
parities of the row's owner nodes (the reduce step): ``P_i = XOR_o sum_{j owned by o} e_ij d_j``.
Packets of one node in one row are pre-reduced on that node before sending. (ECHECK reduces on a
target worker and forwards; the XOR tree is the same, with the last hop folded into the holder.)

Worked example, 4 nodes x 1 rank, rs k = 2, m = 2, container sizes 100, 120, 90, 110 bytes: one
group, packets d0..d3, D_0 = [r0, r1] on node 0, D_1 = [r2, r3] on node 2 (sweep line), parity
P_0 on node 1, P_1 on node 3. Blocks: ``copy.r1`` (120 B) on node 0 from node 1, ``copy.r3``
(110 B) on node 2 from node 3; rows {r0, r2} (length 100) and {r1, r3} (length 120):
``rs.g0.p0.row0`` on node 1 from nodes 0 and 2, ``rs.g0.p0.row1`` on node 1 from nodes 1 and 3,
and the same two for P_1 on node 3. Lose nodes 0 and 1: r0 = shard 0 of row 0, rebuilt from d2
(node 2) and P_1 row 0 (node 3), any k = 2 of the 4 shards.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional

from .echeck import CodingGroup
from .gemini import ReplicaGroup
from .plan import Piece, RedundancyPlan
from .reft import ParityGroup

COPY, XOR, RS = "copy", "xor", "rs"


@dataclass(frozen=True)
class Part:
    """Bytes ``[lo, hi)`` of ``rank``'s container; for rs, ``index`` is the rank's data shard j."""

    rank: int
    lo: int
    hi: int
    index: int = 0


@dataclass(frozen=True)
class BlockSpec:
    key: str
    kind: str
    holder: int
    length: int
    contributors: tuple[int, ...]  # distinct source nodes, each sends exactly one contribution
    parity: int = -1  # rs: i of P_i


@dataclass(frozen=True)
class Contribution:
    """What ``src`` sends for block ``key`` (held by ``dst``): its ``parts`` placed at offset 0
    (copy, xor) or encoded as data shards (rs), zero-padded to the block length."""

    key: str
    kind: str
    src: int
    dst: int
    parts: tuple[Part, ...]
    parity: int = -1


@dataclass(frozen=True)
class GroupExchange:
    group: int
    blocks: tuple[BlockSpec, ...]
    contributions: tuple[Contribution, ...]

    def held_by(self, node: int) -> tuple[BlockSpec, ...]:
        return tuple(b for b in self.blocks if b.holder == node)

    def sent_by(self, node: int) -> tuple[Contribution, ...]:
        return tuple(c for c in self.contributions if c.src == node)

    @cached_property
    def _by_key(self) -> dict[tuple[str, int], BlockSpec]:
        return {(b.key, b.holder): b for b in self.blocks}

    def block(self, key: str, holder: int) -> BlockSpec:
        """Keys name a block within its holder (``copy.r5`` may live on several replica holders)."""
        return self._by_key[(key, holder)]


def held_bytes(held: tuple[BlockSpec, ...], versions: int) -> int:
    """Shared memory the blocks ``held`` by one node take, ``versions`` of each (the agent's block store
    keeps up to three: the complete one, an announced one, the one receiving).

    >>> from .plan import make_plan
    >>> from .topology import Topology
    >>> ex = group_exchange(make_plan(Topology(2, 1), "replica", replicas=2), 0, {0: 64, 1: 96})
    >>> held_bytes(ex.held_by(0), 3)
    288
    """
    return versions * sum(max(b.length, 1) for b in held)


def _sizes_of(sizes: Mapping[int, int], ranks) -> dict[int, int]:
    missing = [r for r in ranks if r not in sizes]
    if missing:
        raise ValueError(f"container sizes of ranks {missing[:8]} are unknown")
    return {r: int(sizes[r]) for r in ranks}


def group_exchange(plan: RedundancyPlan, gi: int, sizes: Mapping[int, int]) -> GroupExchange:
    """Blocks and contributions of group ``gi`` given every member rank's container ``sizes``.

    >>> from .plan import make_plan
    >>> from .topology import Topology
    >>> p = make_plan(Topology(2, 1), "replica", replicas=2)
    >>> ex = group_exchange(p, 0, {0: 64, 1: 96})
    >>> [(b.key, b.holder, b.length, b.contributors) for b in ex.blocks]
    [('copy.r1', 0, 96, (1,)), ('copy.r0', 1, 64, (0,))]
    """
    topo = plan.topology
    g = plan.groups[gi]
    ranks = [r for n in g.members for r in topo.ranks_of(n)]
    size = _sizes_of(sizes, ranks)
    blocks: list[BlockSpec] = []
    contribs: list[Contribution] = []

    def copy(rank: int, src: int, dst: int) -> None:
        key = f"copy.r{rank}"
        blocks.append(BlockSpec(key, COPY, dst, size[rank], (src,)))
        contribs.append(Contribution(key, COPY, src, dst, (Part(rank, 0, size[rank]),)))

    if isinstance(g, ReplicaGroup):
        for n in g.members:
            for src in g.held(n)[1:]:
                for r in topo.ranks_of(src):
                    copy(r, src, n)
    elif isinstance(g, ParityGroup):
        for lane in range(len(g.lanes)):
            for s in range(g.size):
                key = f"xor.g{gi}.l{lane}.s{s}"
                holder = g.parity_node(s)
                parts = []
                for node, rank, piece in g.sources(lane, s):
                    lo, hi = Piece(rank, piece, g.pieces).byte_range(size[rank])
                    parts.append((node, Part(rank, lo, hi)))
                length = max(p.hi - p.lo for _, p in parts)
                blocks.append(BlockSpec(key, XOR, holder, length, tuple(n for n, _ in parts)))
                contribs.extend(Contribution(key, XOR, n, holder, (p,)) for n, p in parts)
    elif isinstance(g, CodingGroup):
        for j, dn in enumerate(g.data_nodes):
            for r in g.chunk(j):
                if g.owner(r) != dn:
                    copy(r, g.owner(r), dn)
        for rg in g.reduction_groups():
            length = max(size[r] for r in rg.ranks)
            by_node: dict[int, list[Part]] = {}
            for r in rg.ranks:
                by_node.setdefault(g.owner(r), []).append(Part(r, 0, size[r], g.chunk_of(r)))
            for i, pn in enumerate(g.parity_nodes):
                key = f"rs.g{gi}.p{i}.row{rg.index}"
                blocks.append(BlockSpec(key, RS, pn, length, tuple(by_node), parity=i))
                contribs.extend(Contribution(key, RS, n, pn, tuple(parts), parity=i) for n, parts in by_node.items())
    return GroupExchange(gi, tuple(blocks), tuple(contribs))


# ---------------------------------------------------------------------- rebuilding a lost rank

@dataclass(frozen=True)
class CopyRecipe:
    """Fetch the whole container from ``block`` (on ``block.holder``)."""

    rank: int
    block: BlockSpec


@dataclass(frozen=True)
class XorPiece:
    """Piece ``[lo, hi)`` of the lost rank = parity block XOR the stripe's other pieces."""

    lo: int
    hi: int
    parity: BlockSpec
    others: tuple[tuple[int, Part], ...]  # (owner node, part) of every other piece of the stripe


@dataclass(frozen=True)
class XorRecipe:
    rank: int
    pieces: tuple[XorPiece, ...]


@dataclass(frozen=True)
class RsRecipe:
    """Decode data shard ``index`` of row ``row`` from any k of: the other data shards (packets
    held whole by their owner or a data node) and the parity blocks."""

    rank: int
    size: int
    row: int
    index: int
    length: int
    k: int
    m: int
    data: tuple[Optional[tuple[int, int]], ...]  # per data shard j: (rank, its size) or None (zero)
    parity: tuple[BlockSpec, ...]  # P_0..P_{m-1} of the row


Recipe = "CopyRecipe | XorRecipe | RsRecipe"


def recipes(plan: RedundancyPlan, rank: int, sizes: Mapping[int, int]) -> list:
    """Ways to rebuild ``rank`` from its group's peers, cheapest first (copies, then decoding).

    >>> from .plan import make_plan
    >>> from .topology import Topology
    >>> p = make_plan(Topology(3, 1), "xor")                  # one group of 3, pieces of 1/2
    >>> [(x.lo, x.hi, x.parity.key, [(n, q.rank) for n, q in x.others]) for x in recipes(p, 0, {0: 10, 1: 10, 2: 10})[0].pieces]
    [(0, 5, 'xor.g0.l0.s2', [(1, 1)]), (5, 10, 'xor.g0.l0.s1', [(2, 2)])]
    """
    topo = plan.topology
    node = topo.node_of(rank)
    gi = plan.node_group[node]
    g = plan.groups[gi]
    ex = group_exchange(plan, gi, sizes)
    out: list = [CopyRecipe(rank, b) for b in ex.blocks if b.key == f"copy.r{rank}"]
    if isinstance(g, ParityGroup):
        member = g.members.index(node)
        lane = next(li for li, lane in enumerate(g.lanes) if rank in lane)
        pieces = []
        for p in range(g.pieces):
            lo, hi = Piece(rank, p, g.pieces).byte_range(sizes[rank])
            s = (member - 1 - p) % g.size  # reft.stripe_of
            others = []
            for n2, r2, p2 in g.sources(lane, s):
                if r2 != rank:
                    a, b = Piece(r2, p2, g.pieces).byte_range(sizes[r2])
                    others.append((n2, Part(r2, a, b)))
            pieces.append(XorPiece(lo, hi, ex.block(f"xor.g{gi}.l{lane}.s{s}", g.parity_node(s)), tuple(others)))
        out.append(XorRecipe(rank, tuple(pieces)))
    elif isinstance(g, CodingGroup):
        j = g.chunk_of(rank)
        row = g.chunk(j).index(rank)
        rg = g.reduction_groups()[row]
        data: list[Optional[tuple[int, int]]] = [None] * g.k
        for r in rg.ranks:
            data[g.chunk_of(r)] = (r, int(sizes[r]))
        parity = tuple(ex.block(f"rs.g{gi}.p{i}.row{row}", g.parity_nodes[i]) for i in range(g.m))
        out.append(RsRecipe(rank, int(sizes[rank]), row, j, parity[0].length, g.k, g.m, tuple(data), parity))
    return out


def holders_of_whole(plan: RedundancyPlan, rank: int) -> tuple[int, ...]:
    """Nodes holding ``rank``'s container whole: its own node first, then copy holders."""
    own = plan.topology.node_of(rank)
    out = [own]
    for n in plan.groups[plan.node_group[own]].members:
        if n != own and rank in plan.holdings(n).copies:
            out.append(n)
    return tuple(out)
