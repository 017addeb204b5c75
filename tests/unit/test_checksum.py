"""The chunk checksum fl64x4: native and numpy agree for both folds, and the written fold (v2)
notices every single-bit flip, which the earlier fold (v1, still read) did not."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ft.capture import checksum


@pytest.mark.parametrize("algorithm", checksum.READS)
def test_native_and_numpy_agree(algorithm):
    if not checksum.HAVE_NATIVE:
        pytest.skip("native library not built")
    rng = np.random.default_rng(3)
    for n in (0, 1, 31, 32, 33, 4096, 100_003):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.empty_like(a)
        got = checksum.copy_checksum(dst, a, algorithm)
        assert got == checksum.checksum_numpy(a, algorithm), (algorithm, n)
        assert np.array_equal(dst, a)
        cs = checksum.ChunkSum(n, algorithm=algorithm)  # streamed in pieces
        half = (n // 64) * 32
        cs.add(0, a[:half])
        cs.add(half, a[half:])
        assert cs.finish() == got


def test_every_single_bit_flip_is_noticed_by_the_written_fold():
    base = np.random.default_rng(7).standard_normal(512).view(np.uint8)  # 4 KiB of float64
    ref = {alg: checksum.checksum(base, alg) for alg in checksum.READS}
    missed = {alg: 0 for alg in checksum.READS}
    bad = base.copy()
    for bit in range(base.size * 8):
        bad[bit // 8] ^= 1 << (bit % 8)
        for alg in checksum.READS:
            missed[alg] += checksum.checksum(bad, alg) == ref[alg]
        bad[bit // 8] ^= 1 << (bit % 8)
    assert missed["fl64x4-v2"] == 0
    assert missed["fl64x4-v1"] > 0  # why v2 exists: high-bit flips could cancel in the v1 fold


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="checksum algorithm 'crc64' is not one this build reads"):
        checksum.checksum(np.zeros(8, np.uint8), "crc64")
