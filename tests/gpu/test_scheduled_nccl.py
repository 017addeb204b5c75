"""The scheduled transport on NCCL (megatron_ft/transport/scheduled/): what only GPUs can check.
Skipped without enough CUDA devices (CI has none); run on a machine with two or more GPUs with
``pytest tests/gpu/test_scheduled_nccl.py``.

* Two ranks that copy to each other exchange chunks far above NCCL's eager sizes both ways at the
  same planned times and complete (the ungrouped sends from two threads the transport used to issue
  can deadlock here), byte for byte through the side-stream staging: host -> device before the wire,
  device -> host before the agent is told the block is complete.
* The first batch on the data group follows the eager barrier ``groups.agree()`` runs, so it needs no rank
  that is not its peer; with three GPUs, a ring (each rank sends to the next only) checks that.
* The driver thread issues on its rank's device (a new thread starts on device 0).
* Through the link gate, each batch with a send waits for it (in key order) and no chunk starts
  inside one of training's simulated network calls.
The gloo runs of the same job are tests/integration/test_scheduled_transport.py."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))
from scheduled_job import check_transfers, run  # noqa: E402  (the job and its checks, shared with the gloo runs)


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_nccl(out, *args: str) -> dict[int, dict]:
    return run(out, "--backend", "nccl", *args, timeout=600)


@pytest.mark.skipif(gpus() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("modes", ["end", "pipelined", "blocking,pipelined"])
def test_two_ranks_exchange_large_chunks_both_ways_on_nccl(tmp_path, modes):
    # 64 MiB chunks (reserved 128 MiB in 2 sub-buffers), a 200 MiB container
    check_transfers(run_nccl(tmp_path, "--world", "2", "--modes", modes, "--nbytes", str(200 * 2**20 + 7),
                             "--reserved", str(128 * 2**20)))


@pytest.mark.skipif(gpus() < 3, reason="needs three CUDA devices")
def test_a_ring_on_nccl(tmp_path):
    ring = run_nccl(tmp_path, "--world", "3", "--replicas", "2", "--modes", "pipelined",
                    "--nbytes", str(64 * 2**20 + 3), "--reserved", str(32 * 2**20))
    check_transfers(ring)
    assert [out["srcs"] for _, out in sorted(ring.items())] == [[2], [0], [1]]


@pytest.mark.skipif(gpus() < 2, reason="needs two CUDA devices")
def test_through_the_link_gate_on_nccl(tmp_path):
    # the gated path on NCCL: each batch with a send waits for the gate, in key order (on gloo the
    # receives are posted at once instead); both ways, every block exact, no chunk inside a call
    out = run_nccl(tmp_path, "--world", "2", "--modes", "pipelined", "--calls", "--gate-ms", "1.5")
    check_transfers(out)
    assert all(r["chunks"] > 10 and r["chunks_inside_calls"] <= 1 for r in out.values()), out
