"""The device checksum kernel (megatron_ft.capture.lanes_kernel) against the host reference.

On CPU the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, numpy): that checks its
arithmetic - the lanes' definition, wrap-around mod 2^64, row numbering across programs, the last
partial tile - but not the compiled code or its speed, which only tests/gpu and
benchmarks/gpu_snapshot.py on a GPU can. The fallback (a kernel that fails) runs without Triton."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from megatron_ft.capture import checksum, lanes_kernel


INTERPRETED_CHECKS = r"""
import json, sys
import numpy as np, torch
from megatron_ft.capture import checksum, lanes_kernel
assert lanes_kernel.AVAILABLE
lanes_kernel.ROWS_PER_PROGRAM, lanes_kernel.TILE_ROWS = 512, 128  # small programs: a few KiB span many
calls = []  # per launch, the shapes of the rows it summed
real = lanes_kernel.segment_row_lanes
lanes_kernel.segment_row_lanes = lambda segs, o: calls.append([list(s.shape) for s in segs]) or real(segs, o)
u64 = lambda lanes: [v % 2**64 for v in lanes.tolist()]
out = {"cases": []}
for n in (32, 33, 4096 * 32 + 7, 512 * 32 * 3 + 96, 512 * 32 * 2):
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    calls.clear()
    out["cases"].append([n, u64(checksum.tensor_lanes(buf)) == checksum.host_lanes(buf), list(calls)])
ones = torch.full((131072 * 32,), 255, dtype=torch.uint8)  # c exceeds 2^64: it wraps
out["max_words"] = [u64(checksum.tensor_lanes(ones)), checksum.host_lanes(ones)]
chunk = np.random.default_rng(3).integers(0, 256, 3 * 4096 + 64, dtype=np.uint8)
cuts = [0, 1024, 1024 + 4096, chunk.size]
parts = [(lo, checksum.tensor_lanes(torch.from_numpy(chunk[lo:hi].copy()))) for lo, hi in zip(cuts, cuts[1:])]
out["combined"] = [checksum.combine_lanes(chunk.size, parts), checksum.checksum(chunk)]
# many pieces in one launch: views of one buffer before and after the first (negative offsets), another
# allocation, tails under 32 bytes, a piece at an odd address (copied to align it), an empty one
big = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
other = torch.randint(0, 256, (70_001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(10))
pieces = [big[64_000:190_000], big[:3_203], other, big[4_002:9_000], big[32:32], big[190_000:190_033]]
calls.clear()
got = checksum.pieces_lanes(pieces, torch.empty(len(pieces), 16, dtype=torch.int64))
out["pieces"] = [[u64(got[k]), checksum.host_lanes(p.contiguous().numpy())] for k, p in enumerate(pieces)]
out["segment_calls"] = [len(c) for c in calls]
out["still_available"] = lanes_kernel.AVAILABLE
json.dump(out, sys.stdout)
"""


def as_u64(lanes: torch.Tensor) -> list[int]:
    return [v % 2**64 for v in lanes.tolist()]


@pytest.fixture(scope="module")
def interpreted():
    """The checks, run once in a process started with ``TRITON_INTERPRET=1`` (Triton decides at import
    whether its kernels are interpreted)."""
    if lanes_kernel.triton is None:
        pytest.skip("Triton is not installed (it comes with CUDA builds of torch)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED_CHECKS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["still_available"], "the kernel failed and was turned off: " + done.stderr[-2000:]
    return out


def test_the_kernel_gives_the_host_lanes(interpreted):
    for n, same, calls in interpreted["cases"]:
        assert same, f"{n} bytes: the kernel's lanes differ from the host's"
        assert calls == [[[n // 32, 8]]], f"{n} bytes: the whole rows went through the kernel, once: {calls}"


def test_words_at_their_maximum_wrap_mod_2_64_as_on_the_host(interpreted):
    got, want = interpreted["max_words"]
    assert got == want
    rows = 131072
    assert sum(range(rows)) * (2**32 - 1) > 2**64 and got[8] == (sum(range(rows)) * (2**32 - 1)) % 2**64, "c wrapped"


def test_many_pieces_anywhere_in_memory_are_summed_in_one_launch(interpreted):
    assert interpreted["segment_calls"] == [6], "one launch for every piece"
    for k, (got, want) in enumerate(interpreted["pieces"]):
        assert got == want, f"piece {k}"


def test_pieces_summed_apart_combine_into_the_chunk_checksum(interpreted):
    got, want = interpreted["combined"]
    assert got == want


def test_a_kernel_that_fails_is_turned_off_once_and_the_sums_stay_right(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (without Triton too: the kernel is replaced below)
    monkeypatch.setattr(lanes_kernel, "AVAILABLE", True)

    def broken(segments, out):
        raise RuntimeError("no compiler for this device")
    monkeypatch.setattr(lanes_kernel, "segment_row_lanes", broken)
    buf = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING):
        assert as_u64(checksum.tensor_lanes(buf)) == checksum.host_lanes(buf)
        assert as_u64(checksum.tensor_lanes(buf)) == checksum.host_lanes(buf)
    assert lanes_kernel.AVAILABLE is False
    said = [r.getMessage() for r in caplog.records if "Triton checksum kernel failed" in r.getMessage()]
    assert len(said) == 1 and "no compiler for this device" in said[0], said


def test_bad_shapes_are_refused_by_name():
    if lanes_kernel.triton is None:
        pytest.skip("Triton is not installed")
    with pytest.raises(ValueError, match=r"int32 rows of 8 words on cpu, not torch.int64 \(4, 8\) on cpu"):
        lanes_kernel.segment_row_lanes([torch.zeros(4, 8, dtype=torch.int64)], torch.zeros(1, 16, dtype=torch.int64))
