"""Wasted time (GEMINI eq. 1-2), Weibull survival (REFT eq. 1-3), optimal intervals (REFT
eq. 4-11, Young, Daly) and the exact goodput of periodic checkpointing."""
import math

import numpy as np
import pytest

from megatron_ft.policy import intervals as iv
from megatron_ft.policy import recoverability, survival, wasted
from megatron_ft.policy.recoverability import xor_placement
from megatron_ft.policy.survival import Weibull


# ------------------------------------------------------------------ GEMINI 2.1


def test_gemini_eq1_mt_nlg_example():
    """42-minute checkpoints at the highest allowed frequency, 42-minute retrieval: 105 minutes."""
    assert wasted.average_wasted_time(42, 42, 42) == 105
    assert wasted.min_interval(42, 1) == 42
    assert not wasted.satisfies_constraint(30, 42, 1) and wasted.satisfies_constraint(42, 42, 1)
    assert wasted.highfreq_iterations(558, 62) == 9 and wasted.highfreq_iterations(10, 62) == 1
    with pytest.raises(ValueError):
        wasted.average_wasted_time(-1, 1, 1)


def test_first_order_goodput_is_gemini_eq1_less_the_unrepeated_stall():
    """rate * T_wasted (eq. 1 with 1/f = tau + C, plus downtime) is the first-order loss, minus the
    stall C that the restart does not repeat."""
    tau, c, t, d, rate = 3000.0, 60.0, 500.0, 400.0, 1e-7
    first = iv.goodput_first_order(tau, c, t, d, rate)
    gemini = tau / (tau + c) * (1 - rate * (wasted.average_wasted_time(t, tau + c, 0) + d - c))
    assert first == pytest.approx(gemini, rel=1e-12)
    assert iv.goodput_single_tier(tau, c, t, d, rate) == pytest.approx(first, rel=1e-6)


# ------------------------------------------------------------------ REFT section 5


def test_weibull_parametrisation():
    w = Weibull(mttf=1000.0, shape=1.7)
    assert w.lam == pytest.approx(w.scale ** -1.7)
    assert Weibull.from_rate(w.lam, 1.7).mttf == pytest.approx(1000.0)
    assert w.survival(w.scale) == pytest.approx(math.exp(-1))
    assert w.failure_probability(123.0) == pytest.approx(1 - w.survival(123.0))
    # the mean of samples is the MTTF
    rng = np.random.default_rng(0)
    x = rng.weibull(1.7, 200_000) * w.scale
    assert x.mean() == pytest.approx(1000.0, rel=0.01)
    with pytest.raises(ValueError):
        Weibull(0, 1)


def test_reft_eq2_is_the_xor_placement():
    hw = Weibull.from_rate(1e-4, 1.3)
    p = xor_placement(3072, 6)
    for t in (0.5, 5.0, 30.0):
        assert survival.job_survival_inmemory(t, p, hw) == pytest.approx(survival.reft_eq2(hw.survival(t), 6, 3072),
                                                                          rel=1e-9)
    smp = Weibull.from_rate(1e-7, 1.3)
    assert survival.job_survival_inmemory(5.0, p, hw, smp) == pytest.approx(
        survival.reft_eq2(hw.survival(5.0), 6, 3072, smp.survival(5.0)), rel=1e-9)


def test_reft_figure8_numbers():
    """3072 nodes, 6 DP paths, lambda_hw = 1e-4, lambda_sw = 1e-5 (per day^c), c = 1.3, threshold 0.9:
    REFT needs a checkpoint every 16.22 days, checkpointing alone every ~0.5 days."""
    hw, sw = Weibull.from_rate(1e-4, 1.3), Weibull.from_rate(1e-5, 1.3)
    p = xor_placement(3072, 6)
    t_reft = survival.time_to_survival(lambda t: survival.job_survival_inmemory(t, p, hw), 0.9)
    t_ckpt = survival.time_to_survival(lambda t: survival.job_survival_checkpoint(t, 3072, hw, sw), 0.9)
    assert t_reft == pytest.approx(16.22, rel=0.01)
    assert t_ckpt == pytest.approx((math.log(1 / 0.9) / (3072 * 1.1e-4)) ** (1 / 1.3), rel=1e-6)  # 0.41 days
    assert 0.3 < t_ckpt < 0.6 and t_reft / t_ckpt > 30
    # the closer to wear-out (larger c), the longer REFT's protection lasts relative to early failures
    assert survival.job_survival_checkpoint(1.0, 3072, hw, sw) < survival.job_survival_inmemory(1.0, p, hw)


def test_time_to_survival_edge_cases():
    assert survival.time_to_survival(lambda t: 1.0, 0.5) == math.inf
    with pytest.raises(ValueError):
        survival.time_to_survival(lambda t: 0.5, 1.5)


def test_reft_eq4_minimised_by_eq5():
    o, lam, T = 30.0, 1 / 7200.0, 1e6
    def total(ts):
        return iv.reft_eq4_total_overhead(o, T, ts, iv.reft_restart_overhead(ts, 60, 30), lam)
    best = iv.young_interval(o, lam)
    assert best == pytest.approx(math.sqrt(2 * o / lam))
    for f in (0.5, 0.8, 1.25, 2.0):
        assert total(best) < total(best * f)


def test_reft_eq7_to_11_literal():
    assert iv.save_overhead(3.0, 5.0) == 0 and iv.save_overhead(5.0, 3.0) == 2.0
    lam, n = 0.01, 6
    assert iv.reft_eq7(lam, n) == pytest.approx(1 - 0.99 ** 6 - 6 * 0.01 * 0.99 ** 5)
    assert iv.reft_eq7(lam, n) == pytest.approx(1 - recoverability.group_survival(xor_placement(6, 6).groups[0], lam))
    assert iv.reft_eq9(5.0, 3.0, lam) == pytest.approx(iv.young_interval(2.0, lam))
    assert iv.reft_eq10(50.0, 3.0, lam) == pytest.approx(iv.young_interval(47.0, lam))
    assert iv.reft_eq11(5.0, 3.0, lam, n) == pytest.approx(iv.young_interval(2.0, iv.reft_eq7(lam, n)))
    assert iv.reft_eq11(5.0, 3.0, lam, n) > iv.reft_eq9(5.0, 3.0, lam)  # persist far less often than snapshot


def test_daly_reduces_to_young_for_cheap_checkpoints():
    m = 86400.0
    assert iv.daly_interval(1.0, m) == pytest.approx(iv.young_interval(1.0, 1 / m), rel=0.01)
    assert iv.daly_interval(3 * m, m) == m
    assert iv.daly_interval(600.0, m) < iv.young_interval(600.0, 1 / m) * 1.1


# ------------------------------------------------------------------ exact goodput and choices


def test_goodput_closed_form_limits():
    # no stall, instantaneous saves, no downtime: L tau / (e^{L tau} - 1)
    tau, rate = 1000.0, 1e-4
    assert iv.goodput_single_tier(tau, 0, 0, 0, rate) == pytest.approx(rate * tau / math.expm1(rate * tau))
    assert iv.goodput_single_tier(tau, 10, 10, 100, 0.0) == pytest.approx(tau / 1010)
    assert iv.goodput_single_tier(3600, 60, 600, 600, 1 / 86400) == pytest.approx(0.9503, abs=1e-4)
    with pytest.raises(ValueError, match="constraint 2"):
        iv.goodput_single_tier(100, 0, 500, 0, 1e-5)


def test_best_interval_beats_neighbours_and_tracks_young():
    T, c, t, d = 62.0, 81.0, 558.0, 828.0
    for nodes in (16, 128, 1000):
        rate = nodes / (1600 * 3600.0)
        n, g = iv.best_checkpoint_iterations(T, c, t, d, rate)
        for m in (n - 1, n + 1):
            if m * T + c >= t:
                assert iv.goodput_single_tier(m * T, c, t, d, rate) <= g + 1e-12
        young_n = iv.young_interval(c, rate) / T
        assert n >= wasted.highfreq_iterations(t - c, T)
        assert 0.5 * young_n < n < 1.5 * max(young_n, t / T)


def test_snapshot_interval_choice():
    ch = iv.choose_snapshot_interval(0.5, 0.0, 0.2, 1e-3)
    assert ch.iterations == 1  # free snapshots: every iteration (GEMINI)
    ch = iv.choose_snapshot_interval(0.5, 0.05, 1.7, 1e-3)
    assert ch.min_iterations == 4 and ch.iterations >= 4  # constraint 2: ceil(1.7 / 0.5)
    ch = iv.choose_snapshot_interval(1.0, 2.0, 0.3, 1e-4)  # Young: 200 s
    assert ch.iterations == 200 and ch.young_s == pytest.approx(200.0)
    slower = iv.choose_snapshot_interval(1.0, 2.0, 0.3, 1e-6)
    assert slower.iterations == 2000  # 10x fewer failures per unit time -> sqrt(100) = 10x longer
    assert iv.choose_snapshot_interval(1.0, 2.0, 0.3, 0.0).iterations == 1_000_000


def test_persist_interval_choice():
    assert iv.choose_persist_interval(1.0, 5, 1.0, 10.0, 0.0).iterations == 0  # nothing needs the disk
    ch = iv.choose_persist_interval(1.0, 5, 1.0, 12.0, 1e-4)
    assert ch.iterations % 5 == 0 and ch.iterations >= 15
    assert ch.iterations == pytest.approx(iv.young_interval(1.0, 1e-4), abs=5)
    # the rarer disk-needing failures are (redundancy), the rarer persists
    assert iv.choose_persist_interval(1.0, 5, 1.0, 12.0, 1e-8).iterations > 50 * ch.iterations


def test_disk_failure_rate_by_scheme():
    mttf = 1600 * 3600.0
    none = iv.disk_failure_rate(recoverability.none_placement(64), mttf, 0.5, 600)
    assert none == pytest.approx(64 * 0.5 / mttf)
    rep = iv.disk_failure_rate(recoverability.replica_placement(64, 2), mttf, 0.5, 600)
    xor = iv.disk_failure_rate(recoverability.xor_placement(64, 4), mttf, 0.5, 600)
    rs = iv.disk_failure_rate(recoverability.rs_placement(64, 4, 2), mttf, 0.5, 600)
    assert rs < rep < xor < none * 1e-3
    q = 1 - math.exp(-0.5 / mttf * 600)
    assert rep == pytest.approx(none * q, rel=1e-6)  # the partner must already be down
    assert iv.disk_failure_rate(recoverability.none_placement(8), mttf, 1.0, 600) == 0
