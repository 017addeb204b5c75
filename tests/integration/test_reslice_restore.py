"""A real megatron-core job restored at another data-parallel size from its snapshots
(``megatron_ft/megatron/reslice_restore.py``): scripts/pretrain_gpt.py's GPT trains 2 iterations at TP1 PP1
DP3 with the distributed optimizer and writes each rank's snapshot container (tests/integration/
reslice_restore_job.py); a new job at DP2 restores from the three containers.

Every parameter and every optimizer state (fp32 main copy, exp_avg, exp_avg_sq, gathered to the full
parameter), the Adam step, the scheduler and the iteration are bit-identical to the DP3 job's at its
snapshot, on both new ranks; each new rank read only the old ranks whose slices it needed. (A container
that fails its checksums, or a set without an old rank's slices, refuses the restore:
tests/unit/test_reslice_read.py.)"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(REPO, "tests", "integration")
JOB = os.path.join(HERE, "reslice_restore_job.py")
COMPARE = os.path.join(HERE, "dcp_reshard_job.py")


def torchrun(nproc: int, *args: str, port_offset: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MFT_RUN_DIR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(29500 + os.getpid() % 1000 + 17 + port_offset), JOB, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


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
    p = subprocess.run([sys.executable, COMPARE, "--mode", "compare", "--dir", str(dp3_snapshots / "state"),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    said = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and said["mismatches"] == [] and said["ranks"] == ["rank0", "rank1"], p.stdout + p.stderr
    assert said["arrays_per_rank"] > 100  # every parameter, and three optimizer states of each
    done = {r: json.load(open(out / f"rank{r}.resliced.json")) for r in (0, 1)}
    # new slice 0 of 2 spans old slices 0 and 1 of 3, new slice 1 old slices 1 and 2
    assert [done[r]["containers"] for r in (0, 1)] == [[0, 1], [0, 1, 2]]
    assert all(d["step"] == 2 and d["old_world"] == 3 and d["progress"] == {"iteration": 2, "consumed_samples": 24}
               for d in done.values())
