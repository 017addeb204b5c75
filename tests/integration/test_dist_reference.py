"""scripts/pretrain_gpt.py's reference checkpoint (``--ref-save-dir`` / ``--ref-save-at`` /
``--ref-stop-after-save`` / ``--ref-load-dir``, :mod:`megatron_ft.megatron.dist_reference`): a job at DP3
saves megatron-core's distributed checkpoint after iteration 2 and stops; a job at DP2 loads it and trains
to the end, starting at iteration 2 with the samples the DP3 job consumed. (That the state loaded at
another size equals the saved one, bit for bit: tests/integration/test_reslice_restore.py, through
tests/integration/dcp_reshard_job.py.)"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "pretrain_gpt.py")
# the tiny GPT of these tests: global batch 12, which DP 2 and 3 divide; --train-iters is the job's full length
GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "2", "--global-batch-size", "12", "--train-iters", "4", "--lr-warmup-iters", "1",
       "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]


def pretrain(nproc: int, run_dir, *args: str, port_offset: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               MFT_RUN_DIR=str(run_dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(29500 + os.getpid() % 1000 + 41 + port_offset), SCRIPT, *GPT, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"job failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def progress(run_dir, nproc: int) -> list:
    """Each rank's (iteration, consumed samples) per completed iteration."""
    return [[(r["iteration"], r["consumed_samples"]) for r in map(json.loads, open(run_dir / "progress" /
                                                                                  f"rank{rank}.jsonl"))]
            for rank in range(nproc)]


@pytest.mark.slow
def test_saved_at_dp3_and_resumed_at_dp2(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = pretrain(3, tmp_path / "dp3", "--ref-save-dir", str(ckpt), "--ref-save-at", "2",
                     "--ref-stop-after-save")
    assert "saved the reference checkpoint of iteration 2 (consumed samples 24)" in first.stdout, first.stdout
    assert progress(tmp_path / "dp3", 3) == [[(1, 12), (2, 24)]] * 3  # stopped right after the save
    assert (ckpt / "metadata.json").is_file() and (ckpt / "common.pt").is_file()

    second = pretrain(2, tmp_path / "dp2", "--ref-load-dir", str(ckpt), port_offset=1)
    assert "starting at iteration 2, consumed samples 24" in second.stdout, second.stdout
    assert progress(tmp_path / "dp2", 2) == [[(3, 36), (4, 48)]] * 2  # from iteration 2 to the end
    assert "iteration      4/4" in second.stdout
