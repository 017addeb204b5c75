"""XOR parity (``m = 1``): REFT's RAIM5 across a sharding group.

Parity is ``d_0 ^ d_1 ^ ... ^ d_{k-1}``; any one lost shard (data or parity) is the XOR of the
other ``k``. Implemented with ``numpy.bitwise_xor(..., out=)`` over chunks small enough that the
accumulator stays in cache while the sources stream from memory: ``k`` reads and one write per
parity byte, instead of the ``k - 1`` read-modify-write passes over the whole parity buffer a
naive loop makes.

Example (k=3): ``d0=0x0f, d1=0x33, d2=0x55`` gives ``p=0x69``; losing ``d1`` it is rebuilt as
``d0 ^ d2 ^ p = 0x0f ^ 0x55 ^ 0x69 = 0x33``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from .base import XOR_MAX_K, Codec, CodecDecodeError, CodecDescriptor, CodecParameterError, validate_km

#: bytes per chunk: the accumulator (one chunk) stays in cache while k sources stream by (1 MiB
#: measured best here, 64 MiB shards: ~5% faster than 256 KiB, ~25% faster than 32 KiB)
DEFAULT_CHUNK_BYTES = 1 << 20


def xor_into(srcs: List[np.ndarray], dst: np.ndarray, lo: int, hi: int, chunk: int) -> None:
    """``dst[lo:hi] = XOR of srcs[j][lo:hi]``, chunked so the accumulator stays in cache."""
    xor = np.bitwise_xor
    if len(srcs) == 1:
        np.copyto(dst[lo:hi], srcs[0][lo:hi])
        return
    if len(srcs) == 2:  # one pass whatever the chunking: no need to chunk
        xor(srcs[0][lo:hi], srcs[1][lo:hi], dst[lo:hi])
        return
    s0, s1, rest = srcs[0], srcs[1], srcs[2:]
    for o in range(lo, hi, chunk):
        e = o + chunk if o + chunk < hi else hi
        d = dst[o:e]
        xor(s0[o:e], s1[o:e], d)
        for s in rest:
            xor(d, s[o:e], d)


class XorCodec(Codec):
    """Single XOR parity shard over ``k`` data shards (tolerates one lost shard)."""

    name = "xor"
    version = 1

    def __init__(self, k: int, m: int = 1, *, threads: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if isinstance(m, (int, np.integer)) and not isinstance(m, bool) and m != 1:
            raise CodecParameterError(
                f"xor: m={m} is not supported; XOR parity has exactly one parity shard (m=1). "
                f"Use the Reed-Solomon codec ('rs') for m > 1")
        k, m = validate_km("xor", k, m, XOR_MAX_K, 1)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
            raise CodecParameterError(f"xor: chunk_bytes must be an integer >= 4096, got {chunk_bytes!r}")
        super().__init__(k, m, threads)
        self.chunk_bytes = chunk_bytes
        self._descriptor = CodecDescriptor(name=self.name, version=self.version, k=k, m=1, field="gf2",
                                           matrix="all-ones", matrix_sha256="", layout="bytewise")

    @property
    def descriptor(self) -> CodecDescriptor:
        return self._descriptor

    def _encode_range(self, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        xor_into(srcs, dsts[0], lo, hi, self.chunk_bytes)

    def _decode_plan(self, survivors: Tuple[int, ...], erased: Tuple[int, ...]) -> Optional[int]:
        if len(erased) > 1:
            raise CodecDecodeError(
                f"xor parity rebuilds one lost shard; {len(erased)} requested ({list(erased)})")
        return None

    def _decode_range(self, plan: None, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        # any k of the k+1 shards XOR to the remaining one
        xor_into(srcs, dsts[0], lo, hi, self.chunk_bytes)
