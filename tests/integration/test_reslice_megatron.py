"""A real megatron-core job's data-parallel shards, described by the extents its snapshots record
(``megatron_ft/megatron/state.py::shard_extents``), re-sliced by the plan (``megatron_ft/redundancy/reslice.py``):
2 gloo ranks, TP1 PP1 DP2, DDP buckets and the distributed optimizer (tests/integration/reslice_job.py).

From the two ranks' saved bucket slices alone, the plan rebuilds every parameter whole (DP' = 1), equal to
the parameter each rank holds after the step's all-gather; every optimizer state's shards cover each
parameter exactly once; without one rank's shards the plan names what is missing."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ft.redundancy.reslice import Extent, plan_reslice

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "integration", "reslice_job.py")


@pytest.fixture(scope="module")
def dp2_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("reslice")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MFT_RUN_DIR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(29500 + os.getpid() % 1000 + 13), JOB, "--out", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"job failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    recs = {r: json.load(open(out / f"rank{r}.extents.json")) for r in (0, 1)}
    return out, recs


def sources(recs, ranks=(0, 1)):
    return {r: [Extent(entry, *x) for entry, xs in recs[r]["extents"].items() for x in xs] for r in ranks}


def whole_targets(srcs, suffix: str):
    """One target entry per parameter state: the whole of it (DP' = 1)."""
    numel = {}
    for xs in srcs.values():
        for x in xs:
            if (x.param.endswith(suffix) if suffix else ":" not in x.param):
                numel[x.param] = max(numel.get(x.param, 0), x.hi)
    return [Extent(name, 0, name, 0, n) for name, n in sorted(numel.items())]


def test_the_bucket_slices_rebuild_every_parameter_whole(dp2_job):
    out, recs = dp2_job
    srcs = sources(recs)
    values = [x for xs in srcs.values() for x in xs if ":" not in x.param]
    assert values and all(x.entry.endswith(".param_data") for x in values), values[:3]
    targets = whole_targets(srcs, "")
    held = {r: {e: np.load(out / f"rank{r}.{e}.npy") for e in recs[r]["extents"]} for r in (0, 1)}
    got = {t.entry: np.full(t.length, np.nan, np.float32) for t in targets}
    for c in plan_reslice(targets, srcs):
        got[c.dst_entry][c.dst_offset:c.dst_offset + c.length] = \
            held[c.src_rank][c.src_entry][c.src_offset:c.src_offset + c.length]
    assert len(got) == len(list(out.glob("rank0.full.*.npy")))  # every parameter of the model
    for name, v in got.items():
        for r in (0, 1):
            np.testing.assert_array_equal(v, np.load(out / f"rank{r}.full.{name}.npy"), err_msg=f"{name} rank {r}")
    # each rank's slices hold about half of every bucket: both ranks are sources
    assert {c.src_rank for c in plan_reslice(targets, srcs)} == {0, 1}


@pytest.mark.parametrize("state", [":exp_avg", ":exp_avg_sq"])
def test_the_optimizer_shards_cover_every_parameter_once(dp2_job, state):
    _, recs = dp2_job
    srcs = sources(recs)
    targets = whole_targets(srcs, state)
    assert len(targets) == len(whole_targets(srcs, ""))  # a state of every parameter
    copies = plan_reslice(targets, srcs)
    assert sum(c.length for c in copies) == sum(t.length for t in targets)
    assert all(c.src_entry.startswith("optim.") and c.src_entry.endswith(state[1:]) for c in copies)


def test_without_one_rank_the_plan_names_what_is_missing(dp2_job):
    _, recs = dp2_job
    with pytest.raises(ValueError, match=r"no source holds elements \[\d+, \d+\) of parameter 'c0\.module\."):
        plan_reslice(whole_targets(sources(recs), ""), sources(recs, ranks=(0,)))
