"""Can the in-memory checkpoint survive k simultaneous node losses? Exact counts, bounds, checks.

A *placement* says where each node's snapshot (or the redundancy that rebuilds it) lives:

=========  ==============================================  =======================================
scheme     layout                                          a group is lost when
=========  ==============================================  =======================================
none       each node keeps only its own snapshot           its node fails (tolerates 0)
replica    GEMINI Algorithm 1: groups of m; if m does not   all m members of a group fail; in the
           divide N, the last group (m + N mod m nodes)     ring, m *consecutive* members fail
           is a ring where node i's copies are on i..i+m-1
ring       GEMINI's comparison: one ring of all N nodes     m consecutive nodes fail
xor        REFT RAIM5: parity groups of n nodes (a          2 or more members fail
           sharding group); remainder joins the last one
rs         ECHECK k+m coding per group of k+m nodes;        more than m members fail
           remainder joins the last group (larger k)
=========  ==============================================  =======================================

Two independent ways to count the failure sets of size k the job survives:

* :func:`recoverable_counts`: combinatorics. Groups fail independently of each other, so the
  number of survivable k-sets is the coefficient of x^k in the product of one polynomial per
  group, ``sum_j ok_j x^j``, where ``ok_j`` counts the survivable j-subsets of that group:
  ``C(n, j)`` for j <= tolerance in a plain group, and for a ring of L nodes with m copies the
  j-subsets of a cycle with no m consecutive members, ``L/(L-j) * #compositions of j into L-j
  parts of at most m-1`` (choose a failed-free node to cut the cycle; each cycle is counted L-j
  times).
* :func:`enumerate_recoverable_counts`: brute force over all 2^N failure sets against the
  physical layout (:meth:`Placement.stripes`: every piece of data, the nodes holding it or its
  parity, and how many of them may be lost).

Worked example (GEMINI figure 3b/3c): N = 5, m = 2 gives the group {0, 1} and the ring
{2, 3, 4} with node 2's copies on {2, 3}, node 3's on {3, 4}, node 4's on {4, 2}. Group
polynomial ``1 + 2x`` (both failing loses it), ring polynomial ``1 + 3x + 0x^2`` (any two of a
3-ring are adjacent) - product ``1 + 5x + 6x^2``: 6 of the C(5,2) = 10 two-node failures are
survivable, probability 0.6. GEMINI's Corollary 1 (N divisible by m) is exact for m <= k < 2m and
a strict lower bound for k >= 2m when N >= 2m (the union bound counts sets containing two
whole groups more than once). N = 8, m = 2, k = 4: bound 1 - 8*C(6,2)/(2*C(8,4)) = 1 - 120/140 =
0.1429; exact by inclusion-exclusion (C(8,4) - 4*C(6,2) + C(4,2)*C(4,0))/C(8,4) = (70-60+6)/70 =
0.2286.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from fractions import Fraction
from typing import Callable, Iterable, Optional

import numpy as np

from ..config import SCHEMES as CONFIGURED
from .gemini_groups import placement_strategy as algorithm1

#: the configured schemes, and GEMINI's ring placement as a model beside them
SCHEMES = (*CONFIGURED, "ring")


@dataclass(frozen=True)
class Group:
    """Nodes that protect each other's snapshots.

    ``window == 0``: a plain group, lost when more than ``tolerance`` members fail.
    ``window == m > 0``: a ring (GEMINI ring placement), lost when m cyclically consecutive
    members (in ``members`` order) all fail.
    """

    members: tuple[int, ...]
    tolerance: int = 0
    window: int = 0

    @property
    def size(self) -> int:
        return len(self.members)

    def ok_counts(self, kmax: Optional[int] = None) -> list[int]:
        """``ok[j]`` = number of j-subsets of this group whose failure it survives (j <= kmax).

        >>> Group((0, 1, 2, 3), tolerance=1).ok_counts()      # xor group of 4: C(4,0), C(4,1)
        [1, 4, 0, 0, 0]
        >>> Group((0, 1, 2, 3), window=2).ok_counts()         # 4-ring, 2 copies: {0,2},{1,3} only
        [1, 4, 2, 0, 0]
        """
        n = self.size
        top = n if kmax is None else min(n, kmax)
        if self.window == 0:
            return [math.comb(n, j) if j <= self.tolerance else 0 for j in range(top + 1)]
        return [cyclic_subsets_without_run(n, j, self.window) for j in range(top + 1)]

    def survives(self, failed_members: int) -> bool:
        """Plain groups only: does it survive ``failed_members`` simultaneous losses?"""
        assert self.window == 0
        return failed_members <= self.tolerance


@dataclass(frozen=True)
class Placement:
    """A redundancy scheme laid out on ``nodes`` nodes: its groups and its physical stripes."""

    scheme: str
    nodes: int
    groups: tuple[Group, ...]
    param: tuple[int, ...] = ()  # (m,) replica/ring, (n,) xor, (k, m) rs

    @property
    def label(self) -> str:
        p = {"replica": "m={}", "ring": "m={}", "xor": "n={}", "rs": "k={}+m={}"}.get(self.scheme, "")
        return f"{self.scheme}({p.format(*self.param)})" if p else self.scheme

    @property
    def memory_factor(self) -> float:
        """Host memory per node relative to the node's own snapshot (mean over groups)."""
        if self.scheme in ("replica", "ring"):
            return float(self.param[0])
        if self.scheme == "xor":
            return sum(g.size / (g.size - 1) * g.size for g in self.groups) / self.nodes
        if self.scheme == "rs":
            m = self.param[1]
            return sum(g.size / (g.size - m) * g.size for g in self.groups) / self.nodes
        return 1.0

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {node: (gi, pos) for gi, g in enumerate(self.groups) for pos, node in enumerate(g.members)}

    def survives(self, failed: Iterable[int]) -> bool:
        """Is every group still recoverable after losing the nodes in ``failed`` (group rules)?

        >>> replica_placement(5, 2).survives({0, 2}), replica_placement(5, 2).survives({2, 4})
        (True, False)
        """
        by_group: dict[int, list[int]] = {}
        for node in set(failed):
            gi, pos = self._where[node]
            by_group.setdefault(gi, []).append(pos)
        for gi, positions in by_group.items():
            g = self.groups[gi]
            if not g.window:
                if len(positions) > g.tolerance:
                    return False
                continue
            down = set(positions)
            if len(down) >= g.window and any(all((p + d) % g.size in down for d in range(g.window)) for p in down):
                return False
        return True

    def stripes(self) -> list[tuple[tuple[int, ...], int]]:
        """The physical layout, for brute-force checks: ``(holders, tolerance)`` per piece of
        data: the piece is lost when more than ``tolerance`` of ``holders`` fail.

        * none: node i's snapshot lives only on i.
        * replica / ring: node i's snapshot lives on its whole group (plain group) or on
          i, i+1, ..., i+m-1 around the ring; lost only when all m holders fail.
        * xor (RAIM5): in a group of n, stripe s has its parity on member s and one data shard on
          each other member; a stripe decodes with at most one member missing.
        * rs: the group's k data chunks and m parity chunks, one per member; any k decode.
        """
        out: list[tuple[tuple[int, ...], int]] = []
        for g in self.groups:
            if self.scheme == "none":
                out.append((g.members, 0))
            elif self.scheme in ("replica", "ring"):
                m = self.param[0]
                if g.window:
                    L = g.size
                    for i in range(L):
                        out.append((tuple(g.members[(i + d) % L] for d in range(m)), m - 1))
                else:
                    for _ in g.members:
                        out.append((g.members, m - 1))
            elif self.scheme == "xor":
                for _s in g.members:
                    out.append((g.members, 1))
            elif self.scheme == "rs":
                out.append((g.members, self.param[1]))
            else:  # pragma: no cover - constructors only build the schemes above
                raise ValueError(self.scheme)
        return out


# ---------------------------------------------------------------------------------- layouts


def placement_strategy(n: int, m: int) -> tuple[list[list[int]], str]:
    """GEMINI Algorithm 1 (0-based node ids, groups as lists): :mod:`megatron_ft.policy.gemini_groups`,
    which the planner :mod:`megatron_ft.redundancy.gemini` uses too.

    >>> placement_strategy(4, 2)
    ([[0, 1], [2, 3]], 'group')
    >>> placement_strategy(5, 2)          # the remainder joins the last group, which becomes a ring
    ([[0, 1], [2, 3, 4]], 'mixed')
    """
    groups, strategy = algorithm1(n, m)
    return [list(g) for g in groups], strategy


def _split(n: int, size: int) -> list[tuple[int, ...]]:
    """Consecutive groups of ``size``; the remainder joins the last group (as in Algorithm 1)."""
    groups = [list(range(i * size, (i + 1) * size)) for i in range(n // size)]
    groups[-1].extend(range((n // size) * size, n))
    return [tuple(g) for g in groups]


def none_placement(n: int) -> Placement:
    return Placement("none", n, tuple(Group((i,), 0) for i in range(n)))


def replica_placement(n: int, m: int) -> Placement:
    """GEMINI mixed placement: plain groups of m, the last group a ring when m does not divide N."""
    groups, strategy = placement_strategy(n, m)
    out = [Group(tuple(g), tolerance=m - 1) for g in groups]
    if strategy == "mixed":
        out[-1] = Group(tuple(groups[-1]), window=m)
    return Placement("replica", n, tuple(out), (m,))


def ring_placement(n: int, m: int) -> Placement:
    """GEMINI's ring strategy for comparison: node i's copies on i, i+1, ..., i+m-1 (mod N)."""
    if m < 1 or n < m:
        raise ValueError(f"need 1 <= m <= N for {m} replicas on {n} nodes")
    return Placement("ring", n, (Group(tuple(range(n)), window=m),), (m,))


def xor_placement(n: int, group: int) -> Placement:
    """REFT RAIM5: XOR parity within groups of ``group`` nodes (one loss per group)."""
    if group < 2 or n < 2:
        raise ValueError(f"xor needs groups of >= 2 nodes (N={n}, group={group})")
    size = min(group, n)
    return Placement("xor", n, tuple(Group(g, tolerance=1) for g in _split(n, size)), (group,))


def rs_placement(n: int, k: int, m: int) -> Placement:
    """ECHECK: k data + m parity chunks per group of k+m nodes (any m losses per group)."""
    if k < 1 or m < 1 or n < k + m:
        raise ValueError(f"rs needs k >= 1, m >= 1 and N >= k+m (N={n}, k={k}, m={m})")
    return Placement("rs", n, tuple(Group(g, tolerance=m) for g in _split(n, k + m)), (k, m))


def make_placement(scheme: str, n: int, *param: int) -> Placement:
    """``make_placement("rs", 12, 4, 2)`` etc.; ``none`` takes no parameter."""
    if scheme == "none":
        return none_placement(n)
    if scheme == "replica":
        return replica_placement(n, *param)
    if scheme == "ring":
        return ring_placement(n, *param)
    if scheme == "xor":
        return xor_placement(n, *param)
    if scheme == "rs":
        return rs_placement(n, *param)
    raise ValueError(f"scheme {scheme!r}: allowed {SCHEMES}")


# ---------------------------------------------------------------------------------- exact counts


def compositions_bounded(total: int, parts: int, cap: int) -> int:
    """Ways to write ``total`` as an ordered sum of ``parts`` integers in [0, cap] (inclusion-exclusion).

    >>> compositions_bounded(3, 2, 2)     # (1,2), (2,1)
    2
    """
    if parts == 0:
        return 1 if total == 0 else 0
    s = 0
    for i in range(parts + 1):
        rest = total - i * (cap + 1)
        if rest < 0:
            break
        s += (-1) ** i * math.comb(parts, i) * math.comb(rest + parts - 1, parts - 1)
    return s


def cyclic_subsets_without_run(length: int, chosen: int, run: int) -> int:
    """j-subsets of a cycle of ``length`` positions containing no ``run`` consecutive positions.

    With z = length - chosen > 0 unchosen positions, cut the cycle after a distinguished unchosen
    position: the chosen ones form z gaps of at most run-1, and every subset is obtained z times
    out of length * (#gap sequences). Example: length 16, chosen 3, run 2 (GEMINI's ring, k = 3):
    16/13 * C(13, 3) = 352 of C(16, 3) = 560 sets, probability 0.6286.
    """
    if chosen == 0:
        return 1
    if chosen >= length:
        return 0 if run <= length else 1
    z = length - chosen
    num = length * compositions_bounded(chosen, z, run - 1)
    assert num % z == 0
    return num // z


def _poly_mul(a: list[int], b: list[int], kmax: int) -> list[int]:
    out = [0] * min(len(a) + len(b) - 1, kmax + 1)
    for i, x in enumerate(a):
        if x == 0 or i > kmax:
            continue
        for j, y in enumerate(b[: kmax + 1 - i]):
            if y:
                out[i + j] += x * y
    return out


def recoverable_counts(p: Placement, kmax: Optional[int] = None) -> list[int]:
    """``c[k]`` = number of k-node failure sets (0 <= k <= kmax) the placement survives, exactly."""
    kmax = p.nodes if kmax is None else min(kmax, p.nodes)
    out = [1]
    for g in p.groups:
        out = _poly_mul(out, g.ok_counts(kmax), kmax)
    return out + [0] * (kmax + 1 - len(out))


def recoverable_probability(p: Placement, k: int, exact: bool = False):
    """P(the snapshot survives | k distinct nodes fail at once, all k-sets equally likely)."""
    if not 0 <= k <= p.nodes:
        raise ValueError(f"k={k} must be in [0, {p.nodes}]")
    f = Fraction(recoverable_counts(p, k)[k], math.comb(p.nodes, k))
    return f if exact else float(f)


def group_placement_exact(n: int, m: int, k: int) -> Fraction:
    """Exact survival probability of GEMINI's group placement (m divides N) by inclusion-exclusion
    over the g = N/m groups that could be entirely lost:
    ``sum_i (-1)^i C(g, i) C(N - i m, k - i m) / C(N, k)``. N = 16, m = 2, k = 2: 1 - 8/120 = 0.9333."""
    if n % m:
        raise ValueError(f"m={m} must divide N={n}")
    g = n // m
    s = sum((-1) ** i * math.comb(g, i) * math.comb(n - i * m, k - i * m) for i in range(g + 1) if k >= i * m)
    return Fraction(s, math.comb(n, k))


def gemini_corollary1(n: int, m: int, k: int) -> float:
    """GEMINI Corollary 1: 1 if k < m, else ``max(0, 1 - N C(N-m, k-m) / (m C(N, k)))``.

    Exact for m <= k < 2m; a lower bound for k >= 2m (the union bound). Paper's example:
    N = 16, m = 2, k = 2 -> 1 - 16*1/(2*120) = 0.9333; k = 3 -> 1 - 16*14/(2*560) = 0.8.
    """
    if n % m:
        raise ValueError(f"Corollary 1 assumes m divides N (N={n}, m={m})")
    if k < m:
        return 1.0
    return max(0.0, 1.0 - n * math.comb(n - m, k - m) / (m * math.comb(n, k)))


def mixed_gap_bound(n: int, m: int) -> float:
    """GEMINI Theorem 1: for k = m, mixed placement is within (2m-3)/C(N, m) of the best placement,
    whose loss probability is at least ceil(N/m)/C(N, m)."""
    return (2 * m - 3) / math.comb(n, m)


# ---------------------------------------------------------------------------------- brute force


@lru_cache(maxsize=1)
def _pop16() -> np.ndarray:
    t = np.zeros(1 << 16, dtype=np.int64)
    for b in range(16):
        t[(np.arange(1 << 16) >> b) & 1 == 1] += 1
    return t


def _popcount(x: np.ndarray) -> np.ndarray:
    """Bits set in each element (N <= 20, so two 16-bit table look-ups suffice)."""
    x = x.astype(np.int64)
    return _pop16()[x & 0xFFFF] + _pop16()[(x >> 16) & 0xFFFF]


def enumerate_recoverable_counts(p: Placement) -> list[int]:
    """Brute force: every subset of nodes (2^N of them) checked against :meth:`Placement.stripes`."""
    if p.nodes > 20:
        raise ValueError("exhaustive enumeration is for N <= 20")
    masks = np.arange(1 << p.nodes, dtype=np.uint64)
    size = _popcount(masks)
    ok = np.ones(masks.shape, dtype=bool)
    seen: set = set()
    for holders, tol in p.stripes():
        if (holders, tol) in seen:
            continue
        seen.add((holders, tol))
        hmask = np.uint64(sum(1 << h for h in holders))
        ok &= _popcount(masks & hmask) <= tol
    return np.bincount(size[ok], minlength=p.nodes + 1).tolist()


# ---------------------------------------------------------------------------------- Monte Carlo


@dataclass(frozen=True)
class MonteCarlo:
    estimate: float
    half_width: float  # of the normal-approximation interval at confidence ``z``
    samples: int
    z: float

    def contains(self, value: float) -> bool:
        return abs(self.estimate - value) <= self.half_width


def monte_carlo_recoverable(p: Placement, k: int, samples: int, seed: int = 0, z: float = 3.29,
                            batch: int = 2000) -> MonteCarlo:
    """Estimate P(survive k random simultaneous failures) by sampling k-sets uniformly.

    The interval is ``estimate +- z * sqrt(q(1-q)/samples)`` with q the estimate floored at
    1/samples away from 0 and 1 (z = 3.29: 99.9 %)."""
    rng = np.random.default_rng(seed)
    buckets: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for holders, tol in p.stripes():
        buckets.setdefault((len(holders), tol), []).append(holders)
    arrays = [(np.array(h, dtype=np.int64), tol) for (_, tol), h in buckets.items()]
    hits = 0
    done = 0
    while done < samples:
        s = min(batch, samples - done)
        pick = np.argpartition(rng.random((s, p.nodes)), k - 1, axis=1)[:, :k] if k else np.zeros((s, 0), int)
        failed = np.zeros((s, p.nodes), dtype=bool)
        np.put_along_axis(failed, pick, True, axis=1)
        ok = np.ones(s, dtype=bool)
        for idx, tol in arrays:
            ok &= ~np.any(failed[:, idx].sum(axis=2) > tol, axis=1)
        hits += int(ok.sum())
        done += s
    est = hits / samples
    q = min(max(est, 1.0 / samples), 1.0 - 1.0 / samples)
    return MonteCarlo(est, z * math.sqrt(q * (1 - q) / samples), samples, z)


# ---------------------------------------------------------------------------------- over time


def group_survival(g: Group, q: float) -> float:
    """P(group survives) when each member has independently failed with probability q.

    Plain group of n with tolerance 1 (REFT eq. 2's factor): (1-q)^n + n q (1-q)^(n-1)."""
    ok = g.ok_counts()
    n = g.size
    return sum(c * q ** j * (1 - q) ** (n - j) for j, c in enumerate(ok) if c)


def _per_group(p: Placement, of_group: Callable[[Group, float], float], q: float) -> list[tuple[Group, float]]:
    """Each group of ``p`` with ``of_group(group, q)``, computed once per group shape (size,
    tolerance, window): groups of one shape answer alike."""
    cache: dict[tuple, float] = {}
    out = []
    for g in p.groups:
        key = (g.size, g.tolerance, g.window)
        if key not in cache:
            cache[key] = of_group(g, q)
        out.append((g, cache[key]))
    return out


def survival_probability(p: Placement, q: float) -> float:
    """P(no group is lost) with independent per-node failure probability q (REFT eq. 2 without the
    SMP factor; ECHECK eq. 1 for replica groups of 4 = two pairs, eq. 2 for rs 2+2)."""
    return math.prod((survives for _, survives in _per_group(p, group_survival, q)), start=1.0)


def unrecoverable_given_failure(g: Group, q: float) -> float:
    """P(the group is lost | one given member fails now, each other member already down with
    probability q, independently). Groups are symmetric (plain groups, rings), so the survivable
    sets containing a given member are a fraction j/n of the survivable j-sets."""
    ok = g.ok_counts()
    n = g.size
    s = sum(ok[i + 1] * (i + 1) / n * q ** i * (1 - q) ** (n - 1 - i) for i in range(n) if ok[i + 1])
    return max(0.0, 1.0 - s)


def unrecoverable_fraction(p: Placement, q: float) -> float:
    """Mean over nodes of :func:`unrecoverable_given_failure`: the share of hardware failures that
    the in-memory tier cannot absorb when each node is independently "down" (failed and not yet
    rebuilt) with probability q. ``none`` -> 1 (every hardware failure needs the disk)."""
    return sum((lost * g.size for g, lost in _per_group(p, unrecoverable_given_failure, q)), 0.0) / p.nodes
