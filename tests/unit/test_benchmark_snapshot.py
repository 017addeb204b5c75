"""The snapshot benchmark's arithmetic (benchmarks/snapshot.py): paired targets, their fallback to
the separate phases, and the copy ceiling. Hand-worked figures; no processes are started."""
import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_snapshot", os.path.join(HERE, "..", "..", "benchmarks", "snapshot.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)
Stat = bench.Stat


def test_paired_ratio_is_the_median_of_the_per_repetition_ratios():
    # ratios 2, 4, 3 -> 3; the ratio of the medians would be 20 / 5 = 4
    assert bench.paired_ratio(Stat([10, 20, 30]), Stat([5, 5, 10])) == pytest.approx(3.0)
    assert bench.ratio(Stat([10, 20, 30]), Stat([5, 5, 10])) == pytest.approx(4.0)


def test_paired_ratio_needs_the_same_repetitions():
    assert bench.paired_ratio(Stat([1, 2, 3]), Stat([1, 2])) is None
    assert bench.paired_ratio(None, Stat([1, 2])) is None


def test_aggregate_takes_the_slowest_rank_per_repetition_and_leaves_unmeasured_figures_none():
    keys = [f.name for f in bench.fields(bench.MegatronFTResult) if f.name != "paired_load_copy"]
    r0 = {k: [1.0, 4.0, 2.0] for k in keys}
    r1 = {k: [3.0, 1.0, 2.5] for k in keys}
    m = bench.aggregate(bench.MegatronFTResult, [r0, r1])
    assert m.restore.values == [3.0, 4.0, 2.5]
    assert m.paired_load_copy is None  # no rank timed it (the torch file did not fit)


def _combo(paired_load_copy):
    s = lambda *v: Stat(list(v))  # noqa: E731
    mft = bench.MegatronFTResult(
        stall=s(0.01, 0.01, 0.01), snapshot_call=s(0, 0, 0), wait=s(0, 0, 0), copy=s(1, 1, 1),
        clean=s(1.2, 2.4, 1.2), restore=s(1.0, 2.0, 1.0), first_call=s(1), restore_map=s(0, 0, 0),
        restore_verify=s(0, 0, 0), restore_copy=s(1, 1, 1), restore_unmap=s(0, 0, 0),
        paired_raw=s(1.0, 2.0, 1.0), paired_load_copy=paired_load_copy)
    raw = bench.RawCopyResult(torch_copy=s(1.0, 1.0, 1.0), memcpy=s(1.0, 1.0, 1.0))
    torch_save = bench.TorchSaveResult(save=s(5, 5, 5), load=s(4, 4, 4), load_copy=s(8.0, 8.0, 8.0))
    dcp = bench.DcpResult(stall=s(0.5, 0.5, 0.5), wait=s(0, 0, 0), clean=s(2, 2, 2), load=s(3, 3, 3))
    return bench.ComboResult(256, 2, raw=raw, mft=mft, torch_save=torch_save, dcp=dcp)


def test_targets_use_the_paired_figures_when_measured():
    t = {x.name: x for x in bench.targets(_combo(bench.Stat([6.0, 12.0, 6.0])))}
    # clean 1.2 / 1.0, 2.4 / 2.0, 1.2 / 1.0 -> 1.2 paired; against the raw phase's median 1.0: 1.2 too
    assert t["clean / raw copy"].paired and t["clean / raw copy"].value == pytest.approx(1.2)
    # restore: 6 / 1, 12 / 2, 6 / 1 -> 6 paired (PASS); the separate phases: 8 / 1 = 8
    r = t["(torch.load + copy) / restore"]
    assert r.paired and r.value == pytest.approx(6.0) and r.across == pytest.approx(8.0) and r.ok
    assert t["ceiling: (torch.load + copy) / raw copy"].value == pytest.approx(6.0)
    assert not t["dcp stall / mft stall"].paired and t["dcp stall / mft stall"].ok


def test_restore_target_falls_back_to_the_separate_phases_and_can_fail():
    t = {x.name: x for x in bench.targets(_combo(None))}
    r = t["(torch.load + copy) / restore"]
    assert not r.paired and r.value == pytest.approx(8.0) and r.ok
    slow = _combo(bench.Stat([4.0, 8.0, 4.0]))  # 4x: below the 5x target
    r = {x.name: x for x in bench.targets(slow)}["(torch.load + copy) / restore"]
    assert r.paired and r.value == pytest.approx(4.0) and r.ok is False
