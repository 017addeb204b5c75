"""The chunk checksums: native and numpy agree for every algorithm a restore reads; the written one
(fl32x8-v1) notices every single-bit flip, every pair of top-bit flips and swapped words, which the
earlier ones (fl64x4-v1/v2, still read) did not all do."""
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


def test_every_single_bit_flip_is_noticed_by_the_written_checksum():
    base = np.random.default_rng(7).standard_normal(512).view(np.uint8)  # 4 KiB of float64
    ref = {alg: checksum.checksum(base, alg) for alg in checksum.READS}
    missed = {alg: 0 for alg in checksum.READS}
    bad = base.copy()
    for bit in range(base.size * 8):
        bad[bit // 8] ^= 1 << (bit % 8)
        for alg in checksum.READS:
            missed[alg] += checksum.checksum(bad, alg) == ref[alg]
        bad[bit // 8] ^= 1 << (bit % 8)
    assert missed[checksum.ALGORITHM] == 0 and missed["fl64x4-v2"] == 0
    assert missed["fl64x4-v1"] > 0  # why v1 was replaced: high-bit flips could cancel in its fold


def test_paired_sign_flips_and_swaps_are_noticed_by_the_written_checksum():
    """Two float64 sign bits of one fl64x4 lane an even number of rows apart cancel in sums mod 2^64;
    32-bit words in 64-bit lanes cannot lose them. Every pair of sign flips and every swap of two
    different 8-byte words of 2 KiB, exhaustively."""
    base = np.random.default_rng(8).standard_normal(256)
    raw = base.view(np.uint8)
    ref = checksum.checksum(raw)
    words = base.view("<u8")
    missed_sign, missed_swap, old_missed = 0, 0, 0
    for i in range(words.size):
        for j in range(i + 1, words.size):
            w = words.copy()
            w[i] ^= np.uint64(1 << 63)
            w[j] ^= np.uint64(1 << 63)
            missed_sign += checksum.checksum(w.view(np.uint8)) == ref
            old_missed += checksum.checksum(w.view(np.uint8), "fl64x4-v2") == checksum.checksum(raw, "fl64x4-v2")
            w = words.copy()
            w[i], w[j] = w[j], w[i]
            missed_swap += checksum.checksum(w.view(np.uint8)) == ref
    assert (missed_sign, missed_swap) == (0, 0)
    assert old_missed > 0  # what fl64x4 could not see


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="checksum algorithm 'crc64' is not one this build reads"):
        checksum.checksum(np.zeros(8, np.uint8), "crc64")
