"""A real megatron-core job restored at another data-parallel size from its snapshots
(``megatron_ft/megatron/reslice_restore.py``): scripts/pretrain_gpt.py's GPT trains 2 iterations at TP1 PP1
DP3 with the distributed optimizer and writes each rank's snapshot container (tests/integration/
reslice_restore_job.py); a new job at DP2 restores from the three containers.

Every parameter and every optimizer state (fp32 main copy, exp_avg, exp_avg_sq, gathered to the full
parameter), the Adam step, the scheduler and the iteration are bit-identical to the DP3 job's at its
snapshot, on both new ranks; each new rank read only the old ranks whose slices it needed. (A container
that fails its checksums, or a set without an old rank's slices, refuses the restore:
tests/unit/test_reslice_read.py.)

Slow set: the same against Megatron's own reshard - megatron-core's torch_dist checkpoint saved at one size
and loaded at the other - shrinking (DP3 -> DP2) and growing back (DP2 -> DP3), the restored states and
two more iterations from each bit-identical."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(REPO, "tests", "integration")
JOB = os.path.join(HERE, "reslice_restore_job.py")
COMPARE = os.path.join(HERE, "dcp_reshard_job.py")


def torchrun(nproc: int, *args: str, port_offset: int = 0, job: str = JOB) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MFT_RUN_DIR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(29500 + os.getpid() % 1000 + 17 + port_offset), job, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def dcp_torchrun(nproc: int, *args: str, port_offset: int = 0) -> subprocess.CompletedProcess:
    return torchrun(nproc, *args, port_offset=port_offset, job=COMPARE)


def compare(ref, new) -> dict:
    """dcp_reshard_job's comparison: every rank's dumps under ``new`` against rank 0's under ``ref``, bit for bit."""
    p = subprocess.run([sys.executable, COMPARE, "--mode", "compare", "--dir", str(ref), "--out", str(new)],
                       capture_output=True, text=True, timeout=120)
    return json.loads(p.stdout.strip().splitlines()[-1])


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"job failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


@pytest.fixture(scope="module")
def dp3_snapshots(tmp_path_factory):
    d = tmp_path_factory.mktemp("reslice-dp3")
    ok(torchrun(3, "--mode", "save", "--dir", str(d / "snap"), "--out", str(d / "state"), "--iters", "2"))
    return d


def test_dp3_snapshots_restore_bit_identical_at_dp2(dp3_snapshots, tmp_path):
    out = tmp_path / "dp2"
    ok(torchrun(2, "--mode", "load", "--dir", str(dp3_snapshots / "snap"), "--out", str(out), "--iters", "2",
                port_offset=1))
    said = compare(dp3_snapshots / "state", out)
    assert said["mismatches"] == [] and said["ranks"] == ["rank0", "rank1"], said
    assert said["arrays_per_rank"] > 100  # every parameter, and three optimizer states of each
    done = {r: json.load(open(out / f"rank{r}.resliced.json")) for r in (0, 1)}
    # new slice 0 of 2 spans old slices 0 and 1 of 3, new slice 1 old slices 1 and 2
    assert [done[r]["containers"] for r in (0, 1)] == [[0, 1], [0, 1, 2]]
    assert all(d["step"] == 2 and d["old_world"] == 3 and d["progress"] == {"iteration": 2, "consumed_samples": 24}
               for d in done.values())


@pytest.mark.slow
@pytest.mark.parametrize("old, new", [(3, 2), (2, 3)], ids=["shrink", "grow-back"])
def test_the_resume_from_memory_equals_megatron_s_own_reshard(tmp_path, old, new):
    """The reference is megatron-core's distributed checkpoint (torch_dist; the distributed optimizer in its
    dp_reshardable format; the RNG state as Megatron-LM saves it) saved at DP ``old`` and loaded at DP ``new``
    (tests/integration/dcp_reshard_job.py): the restore from the DP ``old`` snapshots and that load give the
    same state, and two more iterations from each end bit-identical - shrinking (DP3 -> DP2) and growing
    back (DP2 -> DP3). (The project's script always runs the distributed optimizer; its snapshots' bucket
    slices need megatron-core's parameter buffers.)"""
    flags, port = ["--iters", "2", "--more", "2"], 4 + 4 * (old < new)
    ok(dcp_torchrun(old, "--mode", "save", "--dist-opt", "--dir", str(tmp_path / "ckpt"), "--out",
                    str(tmp_path / "dcp-old"), *flags, port_offset=port))
    ok(torchrun(old, "--mode", "save", "--dir", str(tmp_path / "snap"), "--out", str(tmp_path / "mem-old"), *flags,
                port_offset=port + 1))
    ok(dcp_torchrun(new, "--mode", "load", "--dist-opt", "--dir", str(tmp_path / "ckpt"), "--out",
                    str(tmp_path / "dcp-new"), "--restored-out", str(tmp_path / "dcp-restored"), *flags,
                    port_offset=port + 2))
    ok(torchrun(new, "--mode", "load", "--dir", str(tmp_path / "snap"), "--out", str(tmp_path / "mem-new"),
                "--restored-out", str(tmp_path / "mem-restored"), *flags, port_offset=port + 3))
    for ref, got in (("dcp-old", "mem-old"), ("dcp-old", "dcp-restored"), ("dcp-restored", "mem-restored"),
                     ("dcp-new", "mem-new")):
        said = compare(tmp_path / ref, tmp_path / got)
        assert said["mismatches"] == [] and said["arrays_per_rank"] > 100, (ref, got, said)
        assert len(said["ranks"]) == (old if got.endswith("old") else new)
    assert json.load(open(tmp_path / "mem-new" / "rank0.json"))["iteration"] == 4
