"""Lose a node with nobody to take its place, keep training at fewer data-parallel replicas from memory, grow
back when it returns - ``megatron-ft demo --fail node --elastic`` end to end (real launchers, agents, torchrun,
megatron-core; megatron_ft/testing/demo_elastic.py), against Megatron's own reshard: its distributed checkpoint
saved at DP at the shrink's step and loaded at DP', saved there at the grow-back's step and loaded at DP.

Each shape asserts the tier the lost node's ranks came from (a peer's copy, or decoded from parity), the step
the shrink resumed from (the loss's, not a restart), both sizes, and every loss and final state bit for bit.
About 2.5 minutes each: the slow set."""
import json
import os
import subprocess
import sys

import pytest

from megatron_ft.testing.hosts import unavailable_reason

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"replica": ("peer_memory", 3, 2), "xor": ("decoded", 3, 2), "rs": ("decoded", 4, 3)}


@pytest.mark.slow
@pytest.mark.parametrize("scheme, hosts", [(s, False) for s in sorted(SHAPES)] + [("replica", True)],
                         ids=[*sorted(SHAPES), "replica-hosts"])
def test_the_job_shrinks_from_memory_and_grows_back_bit_identical_to_megatron_s_reshard(tmp_path, scheme, hosts):
    """``hosts``: every node on a host of its own (its own /dev/shm and address; megatron_ft/testing/hosts.py)."""
    if hosts and (why := unavailable_reason()):
        pytest.skip(why)
    tier, dp, dp_after = SHAPES[scheme]
    kill_at = 6
    p = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "demo", "--fail", "node", "--elastic",
                        "--redundancy", scheme, "--workdir", str(tmp_path / "demo"), "--iters", "40",
                        "--kill-at", str(kill_at), "--quiet", *(["--hosts"] if hosts else [])],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["scenario"] == "node-elastic" and s["bitwise_identical"] and s["hosts"] == hosts, s["details"]
    assert s["recovered_from"] == tier
    assert kill_at - 1 <= s["resumed_step"] <= kill_at + 1  # the step of the loss, not a restart at 0
    assert (s["data_parallel_before"], s["data_parallel_after"]) == (dp, dp_after)
    assert (s["grow"]["data_parallel_before"], s["grow"]["data_parallel_after"]) == (dp_after, dp)
    assert s["grow"]["step"] > s["resumed_step"]
    lost_tiers = {t for ranks in s["shrink"]["sources"].values() for t in ranks.values()}
    assert tier in lost_tiers and "local_memory" in lost_tiers
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("mft.demo-elastic")]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "distributed"])
def test_upstream_megatron_lm_shrinks_from_memory_and_grows_back_bit_identical_to_its_own_reshard(tmp_path, optimizer):
    """The same with upstream Megatron-LM's own ``pretrain_gpt.py`` (the newest release with a patch series), its
    reference its own ``--ckpt-format torch_dist`` checkpoint saved at DP and loaded at DP' (and back); with the
    distributed optimizer, its ``dp_reshardable`` bucket shards re-cut at the other size. About 6 minutes each."""
    from megatron_ft.testing import megatron_lm

    source = megatron_lm.source()
    if not source:
        pytest.skip(f"no upstream Megatron-LM {megatron_lm.TAG}: set MEGATRON_LM_DIR or provide the shared archive")
    kill_at = 8
    extra = ["--train-arg=--use-distributed-optimizer"] if optimizer == "distributed" else []
    p = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "demo", "--fail", "node", "--elastic",
                        "--megatron-lm", source, "--workdir", str(tmp_path / "demo"), "--iters", "32",
                        "--kill-at", str(kill_at), "--quiet", *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["scenario"] == "node-elastic" and s["program"] == "megatron-lm" and s["bitwise_identical"], s["details"]
    assert s["recovered_from"] == "peer_memory"
    assert kill_at - 1 <= s["resumed_step"] <= kill_at + 1
    assert (s["data_parallel_before"], s["data_parallel_after"]) == (3, 2)
    assert (s["grow"]["data_parallel_before"], s["grow"]["data_parallel_after"]) == (2, 3)
    assert s["grow"]["step"] > s["resumed_step"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("mft.demo-elastic")]
