"""P(recover from memory | k simultaneous node failures) for replica (GEMINI), XOR (REFT) and
k+m coding (ECHECK): exact combinatorics == exhaustive enumeration for every N <= 12, GEMINI's
Corollary 1 as a lower bound, Monte Carlo within its confidence interval for N = 1,000."""
import itertools
import math
from fractions import Fraction

import pytest

from megatron_ft.policy import recoverability as rc


def all_placements(n):
    out = [rc.none_placement(n)]
    for m in range(1, n + 1):
        out += [rc.replica_placement(n, m), rc.ring_placement(n, m)]
    for g in range(2, n + 1):
        out.append(rc.xor_placement(n, g))
    for k in range(1, n):
        for m in range(1, n - k + 1):
            out.append(rc.rs_placement(n, k, m))
    return out


@pytest.mark.parametrize("n", range(1, 13))
def test_exact_counts_match_exhaustive_enumeration(n):
    """Every placement and scheme, every k: combinatorial counts == brute force over all 2^N sets."""
    checked = 0
    for p in all_placements(n):
        exact = rc.recoverable_counts(p)
        brute = rc.enumerate_recoverable_counts(p)
        assert exact == brute, (p.label, n, exact, brute)
        assert exact[0] == 1 and all(0 <= c <= math.comb(n, k) for k, c in enumerate(exact))
        checked += 1
    assert checked == len(all_placements(n)) > 0


def test_enumeration_is_independent_of_the_formulas():
    """The brute force reads only the physical stripes; spot-check them against hand-made sets."""
    p = rc.replica_placement(5, 2)  # group {0,1}, ring {2,3,4}
    assert sorted(set(p.stripes())) == [((0, 1), 1), ((2, 3), 1), ((3, 4), 1), ((4, 2), 1)]
    assert rc.enumerate_recoverable_counts(p) == [1, 5, 6, 0, 0, 0]
    x = rc.xor_placement(6, 3)
    assert {h for h, _ in x.stripes()} == {(0, 1, 2), (3, 4, 5)} and all(t == 1 for _, t in x.stripes())
    r = rc.rs_placement(7, 2, 2)  # groups of 4, the remainder (3 nodes) joins the last: one group of 7
    assert [g.members for g in r.groups] == [(0, 1, 2, 3, 4, 5, 6)]


@pytest.mark.parametrize("n", range(1, 13))
def test_survives_matches_stripes_on_every_set(n):
    for p in all_placements(n)[:: max(1, len(all_placements(n)) // 12)]:
        stripes = p.stripes()
        for k in range(n + 1):
            for failed in itertools.combinations(range(n), k):
                f = set(failed)
                by_stripes = all(len(f & set(h)) <= t for h, t in stripes)
                assert p.survives(f) == by_stripes, (p.label, failed)


def test_gemini_algorithm1_literal():
    assert rc.placement_strategy(4, 2) == ([[0, 1], [2, 3]], "group")
    assert rc.placement_strategy(5, 2) == ([[0, 1], [2, 3, 4]], "mixed")
    assert rc.placement_strategy(11, 3) == ([[0, 1, 2], [3, 4, 5], [6, 7, 8, 9, 10]], "mixed")
    with pytest.raises(ValueError):
        rc.placement_strategy(1, 2)


def test_gemini_papers_numbers():
    """GEMINI 7.2: N = 16, m = 2: 93.3 % for k = 2, 80.0 % for k = 3; ring 'lower'."""
    g = rc.replica_placement(16, 2)
    assert rc.recoverable_probability(g, 2) == pytest.approx(14 / 15)
    assert round(rc.recoverable_probability(g, 2), 3) == 0.933
    assert rc.recoverable_probability(g, 3) == pytest.approx(0.8)
    ring = rc.recoverable_probability(rc.ring_placement(16, 2), 3)
    # exact ring: 16/13*C(13,3) = 352 of 560 = 0.6286, i.e. 21.4 % below the group placement;
    # the paper's "25.0 % lower" is the union bound 1 - 16*14/560 = 0.6 for the ring
    assert ring == pytest.approx(352 / 560)
    assert 1 - ring / 0.8 == pytest.approx(0.2143, abs=1e-4)
    assert 1 - 16 * 14 / 560 == pytest.approx(0.6)


@pytest.mark.parametrize("n", range(1, 13))
def test_corollary1_is_the_lower_bound_it_is(n):
    for m in range(1, n + 1):
        if n % m:
            continue
        p = rc.replica_placement(n, m)
        for k in range(n + 1):
            exact = rc.recoverable_probability(p, k, exact=True)
            assert exact == rc.group_placement_exact(n, m, k)
            bound = rc.gemini_corollary1(n, m, k)
            assert float(exact) >= bound - 1e-12, (n, m, k)
            if k < m:
                assert exact == 1
            elif k < 2 * m:  # no set holds two whole groups: the union bound is exact
                assert float(exact) == pytest.approx(bound, abs=1e-12)
            elif n >= 2 * m:  # some sets contain two whole groups: strictly above the unclipped bound
                unclipped = 1 - Fraction(n * math.comb(n - m, k - m), m * math.comb(n, k))
                assert exact > unclipped, (n, m, k)


def test_corollary1_strict_example():
    assert rc.gemini_corollary1(8, 2, 4) == pytest.approx(1 / 7)
    assert rc.recoverable_probability(rc.replica_placement(8, 2), 4, exact=True) == Fraction(16, 70)


@pytest.mark.parametrize("n", range(2, 13))
def test_mixed_placement_gap_theorem1(n):
    """GEMINI Theorem 1: with k = m the mixed placement is within (2m-3)/C(N,m) of the bound
    1 - ceil(N/m)/C(N,m) that no placement can beat."""
    for m in range(2, n + 1):
        p = rc.recoverable_probability(rc.replica_placement(n, m), m)
        best = 1 - math.ceil(n / m) / math.comb(n, m)
        assert p <= best + 1e-12
        assert best - p <= rc.mixed_gap_bound(n, m) + 1e-12
        assert p >= rc.recoverable_probability(rc.ring_placement(n, m), m) - 1e-12


def test_echeck_equations_1_and_2():
    """ECHECK eq. 1 (4-node group, two replica pairs) and eq. 2 (2+2 coding); R_era - R_rep = 2p^2(1-p)^2."""
    for p in (0.001, 0.01, 0.1, 0.3):
        rep = rc.survival_probability(rc.replica_placement(4, 2), p)
        era = rc.survival_probability(rc.rs_placement(4, 2, 2), p)
        eq1 = (1 - p) ** 4 + 4 * p * (1 - p) ** 3 + (math.comb(4, 2) - 2) * p ** 2 * (1 - p) ** 2
        eq2 = (1 - p) ** 4 + 4 * p * (1 - p) ** 3 + math.comb(4, 2) * p ** 2 * (1 - p) ** 2
        assert rep == pytest.approx(eq1, rel=1e-12) and era == pytest.approx(eq2, rel=1e-12)
        assert era - rep == pytest.approx(2 * p ** 2 * (1 - p) ** 2, rel=1e-9)
        # the 2000-node cluster of ECHECK figure 3: 500 groups
        big_rep = rc.survival_probability(rc.replica_placement(2000, 2), p)
        assert big_rep == pytest.approx(((1 - p) ** 2 + 2 * p * (1 - p)) ** 1000, rel=1e-9)
        assert rc.survival_probability(rc.rs_placement(2000, 2, 2), p) == pytest.approx(eq2 ** 500, rel=1e-9)


def test_survival_probability_matches_counts():
    """Time-based survival = sum_k counts[k] q^k (1-q)^(N-k), for every placement of 9 nodes."""
    q = 0.07
    for p in all_placements(9):
        c = rc.recoverable_counts(p)
        direct = sum(ck * q ** k * (1 - q) ** (9 - k) for k, ck in enumerate(c))
        assert rc.survival_probability(p, q) == pytest.approx(direct, rel=1e-12), p.label


def test_unrecoverable_given_failure_by_brute_force():
    for p in (rc.replica_placement(7, 2), rc.xor_placement(8, 4), rc.rs_placement(9, 3, 2), rc.ring_placement(6, 3)):
        q = 0.2
        for g in p.groups:
            n = g.size
            # member 0 fails; others down with prob q: sum over subsets
            tot = 0.0
            for k in range(n):
                for others in itertools.combinations(range(1, n), k):
                    failed = {g.members[0], *(g.members[i] for i in others)}
                    if not p.survives(failed):
                        tot += q ** k * (1 - q) ** (n - 1 - k)
            assert rc.unrecoverable_given_failure(g, q) == pytest.approx(tot, abs=1e-12)
    assert rc.unrecoverable_fraction(rc.none_placement(5), 0.3) == 1.0


MC_CASES = [
    ("replica", (2,), [10, 30, 60]),     # 1000 = 500 groups of 2 (Corollary 1 applies)
    ("replica", (3,), [60, 120]),        # 1000 = 332 groups of 3 + a ring of 4 (mixed)
    ("ring", (2,), [20]),
    ("xor", (4,), [10, 25]),
    ("xor", (6,), [20]),                 # remainder 4 joins the last group
    ("rs", (4, 2), [40, 80]),            # remainder 4 joins the last group (k = 8)
]


@pytest.mark.parametrize("scheme, param, ks", MC_CASES)
def test_monte_carlo_agrees_for_1000_nodes(scheme, param, ks):
    p = rc.make_placement(scheme, 1000, *param)
    counts = rc.recoverable_counts(p, kmax=max(ks))
    for k in ks:
        exact = counts[k] / math.comb(1000, k)
        assert 0.02 < exact < 0.98, (scheme, k, exact)  # a meaningful k
        mc = rc.monte_carlo_recoverable(p, k, samples=4000, seed=k)
        assert mc.contains(exact), (scheme, param, k, exact, mc)
        if scheme == "replica" and param == (2,):
            assert exact >= rc.gemini_corollary1(1000, 2, k)


def test_monte_carlo_interval_is_not_vacuous():
    """The interval is tight enough to reject a wrong answer (the ring's probability for the group)."""
    g = rc.replica_placement(1000, 2)
    ring_p = rc.recoverable_probability(rc.ring_placement(1000, 2), 40)
    mc = rc.monte_carlo_recoverable(g, 40, samples=4000, seed=3)
    assert mc.contains(rc.recoverable_probability(g, 40)) and not mc.contains(ring_p)
    assert mc.half_width < 0.03


def test_memory_factor():
    assert rc.replica_placement(8, 2).memory_factor == 2
    assert rc.xor_placement(8, 4).memory_factor == pytest.approx(4 / 3)
    assert rc.rs_placement(12, 4, 2).memory_factor == pytest.approx(1.5)
    assert rc.none_placement(3).memory_factor == 1


def test_bad_parameters():
    for bad in (lambda: rc.xor_placement(1, 2), lambda: rc.rs_placement(5, 4, 2), lambda: rc.replica_placement(2, 3),
                lambda: rc.make_placement("raid6", 4), lambda: rc.recoverable_probability(rc.none_placement(3), 4)):
        with pytest.raises(ValueError):
            bad()
