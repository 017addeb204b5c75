"""``rs-numpy``: XOR-only Cauchy Reed-Solomon bit-matrix code (Jerasure style), pure numpy.

Used where ISA-L is absent (and as a cross-check of the ISA-L path in the tests). It is a
different code from ``rs-isal``: its parity bytes differ, so the descriptor records which one
produced a snapshot and decoding refuses the other.

Byte layout (format version 1), with packet size ``P`` (``packet_bytes``, default 64 KiB):

* each shard is cut into blocks of ``8P`` bytes; block ``b`` of shard ``j`` holds the eight
  packets ``(j, x)``, ``x = 0..7``, packet ``x`` being bytes ``[8Pb + xP, 8Pb + (x+1)P)``;
* parity packet ``(i, l)`` of a block is the XOR of the data packets ``(j, x)`` for which bit
  ``l`` of ``C[i][j] * 2^x`` is set, ``C`` the coefficient matrix (:func:`gf256.to_bitmatrix`);
* a final partial block of ``R`` bytes (``R`` not a multiple of ``8P``) uses packets of
  ``R // 8`` bytes; its last ``R % 8`` bytes (at most 7 per shard) are coded byte-wise over
  GF(2^8) with the same ``C`` (:func:`gf256.matvec_bytes`). Every length works.

``C`` is the Cauchy matrix of ISA-L's construction scaled to need few XORs
(:func:`gf256.cauchy_good_matrix`): its first row is all ones, so parity ``k`` is the plain XOR
of the data. Any ``k`` of the ``k+m`` shards decode (MDS), because bit-matrix expansion is a
ring homomorphism: decoding uses the bit matrix of the GF(2^8) inverse (ECHECK section III-B).

Worked example, ``k=2, m=1``: ``C = [[1, 1]]``, ``B(1)`` is the 8x8 identity, so parity packet
``(0, l) = (0, l) ^ (1, l)`` of the data: parity is ``d0 ^ d1``, exactly RAID-5.

Speed: each set bit is one packet XOR. A schedule (Jerasure's "smart" scheduling) computes
each parity row either from scratch or from an already computed row plus the difference,
whichever needs fewer XORs; a second schedule shares common sub-expressions through temporary
packets (:func:`cse_schedule`, up to ~45% fewer XORs for k=8, m=2); the cheaper one is used.
Schedules change the speed, never the bytes. One block at a time (``8P`` bytes per shard, a
few MiB for all shards, so it stays in cache), one numpy call per packet XOR.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from . import gf256
from .base import RS_MAX_K, RS_MAX_M, MatrixCodec, CodecDescriptor, CodecParameterError, LRUCache, validate_km

#: packet size of new rs-numpy codecs (recorded in the descriptor: it determines the bytes).
#: 1-D packets this large keep numpy's per-call overhead small beside the XOR itself.
DEFAULT_PACKET_BYTES = 64 << 10
#: scratch for common sub-expression temporaries, per thread
SCRATCH_BYTES = 4 << 20

Op = Tuple[int, int, int]  # (dst, a, b): dst = a ^ b; b == -1: dst = a; a == b == -1: dst = 0


def popcount(x: int) -> int:
    return bin(x).count("1")


def xor_ops(dst: int, srcs: List[int]) -> List[Op]:
    """The ops making packet ``dst`` the XOR of packets ``srcs``, in their order: zeros for none, a
    copy of one, else the first two XORed and each further one XORed in."""
    if len(srcs) < 2:
        return [(dst, srcs[0] if srcs else -1, -1)]
    return [(dst, srcs[0], srcs[1])] + [(dst, dst, x) for x in srcs[2:]]


def smart_schedule(bitrows: List[int], nsrc: int) -> List[Op]:
    """XOR schedule computing ``len(bitrows)`` output packets from ``nsrc`` input packets.

    Packet numbering: inputs ``0..nsrc-1``, output row ``r`` is packet ``nsrc + r``. Greedy, as
    Jerasure's ``jerasure_smart_bitmatrix_to_schedule``: repeatedly emit the cheapest pending
    row, costed either from scratch (``ones - 1`` XORs) or from an already emitted row
    (``popcount(row ^ other)`` XORs), then update the costs of the rest.

    Example: rows ``0b0111`` and ``0b1111`` over 4 inputs: the first needs 2 XORs
    (``o0 = i0 ^ i1; o0 ^= i2``), the second 1 XOR from it (``o1 = o0 ^ i3``) instead of 3.
    """
    n = len(bitrows)
    cost = []
    for r in bitrows:
        c = popcount(r)
        cost.append(max(c - 1, 1))
    base = [-1] * n
    pending = set(range(n))
    ops: List[Op] = []
    while pending:
        i = min(pending, key=lambda j: (cost[j], j))
        pending.discard(i)
        dst = nsrc + i
        if base[i] < 0:
            ops += xor_ops(dst, [b for b in range(nsrc) if (bitrows[i] >> b) & 1])
        else:  # the emitted row, then the inputs where this row differs from it
            diff = bitrows[i] ^ bitrows[base[i]]
            ops += xor_ops(dst, [nsrc + base[i]] + [b for b in range(nsrc) if (diff >> b) & 1])
        for j in pending:
            c = max(popcount(bitrows[j] ^ bitrows[i]), 1)
            if c < cost[j]:
                cost[j] = c
                base[j] = i
    return ops


def cse_schedule(bitrows: List[int], nsrc: int, max_temps: int) -> Tuple[List[Op], int]:
    """XOR schedule with common sub-expressions shared through temporary packets.

    Greedy pair extraction: while some pair of symbols ``(a, b)`` occurs together in two or
    more rows, the most frequent pair becomes a temporary ``t = a ^ b`` substituted in those
    rows (at most ``max_temps`` temporaries). Each row is then the XOR of its remaining symbols.
    Packet numbering: inputs ``0..nsrc-1``, outputs ``nsrc..nsrc+R-1``, temporaries after.
    Returns ``(ops, number_of_temporaries)``; temporaries are computed before the outputs.

    Example: rows ``{i0,i1,i2}`` and ``{i0,i1,i3}`` share ``i0^i1``: ``t=i0^i1; o0=t^i2; o1=t^i3``
    (3 XORs instead of 4).
    """
    nrows = len(bitrows)
    max_temps = min(max_temps, sum(popcount(r) for r in bitrows))  # each temporary removes >= 1 one
    width = nsrc + max_temps
    # A[r, s] = 1 if symbol s (input, then temporaries) is still XORed into row r
    A = np.zeros((nrows, width), dtype=np.int32)
    nbytes = (nsrc + 7) // 8
    for r, mask in enumerate(bitrows):
        A[r, :nsrc] = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), np.uint8),
                                    bitorder="little")[:nsrc]
    C = A.T @ A  # C[a, b]: rows that contain both a and b
    np.fill_diagonal(C, 0)
    temps: List[Tuple[int, int]] = []
    while len(temps) < max_temps:
        w = nsrc + len(temps)  # symbols in use so far
        flat = int(np.argmax(C[:w, :w]))
        a, b = divmod(flat, w)
        if C[a, b] < 2:
            break
        t = w
        col = A[:, a] & A[:, b]
        A[:, a] -= col
        A[:, b] -= col
        A[:, t] = col
        temps.append((a, b))
        act = A[:, : w + 1]
        for c in (a, b, t):
            v = act.T @ A[:, c]
            C[c, : w + 1] = v
            C[: w + 1, c] = v
            C[c, c] = 0

    def packet(sym: int) -> int:  # symbol -> packet number (temporaries come after the outputs)
        return sym if sym < nsrc else sym + nrows

    rows = [[packet(int(x)) for x in np.flatnonzero(A[r])] for r in range(nrows)]
    temps = [(packet(a), packet(b)) for a, b in temps]
    ops: List[Op] = []
    base = nsrc + nrows
    for i, (a, b) in enumerate(temps):
        ops.append((base + i, a, b))
    for ri, r in enumerate(rows):
        ops += xor_ops(nsrc + ri, r)  # inputs first, then temporaries (ascending symbol order)
    return ops, len(temps)


def schedule_xors(ops: List[Op]) -> int:
    return sum(1 for _, a, b in ops if b >= 0)


@dataclass
class _BitPlan:
    rows: List[List[int]]  # GF(2^8) rows (outputs x inputs), for the byte-wise tail
    ops: List[Op]
    ntemps: int
    xor_only: bool


class BitmatrixRSCodec(MatrixCodec):
    """``rs-numpy``: Cauchy Reed-Solomon as an XOR-only bit-matrix code (``k`` 1..32, ``m`` 1..8)."""

    name = "rs-numpy"
    version = 1

    def __init__(self, k: int, m: int, *, packet_bytes: int = DEFAULT_PACKET_BYTES, threads: int = 1):
        k, m = validate_km(self.name, k, m, RS_MAX_K, RS_MAX_M)
        if (isinstance(packet_bytes, bool) or not isinstance(packet_bytes, int)
                or not 64 <= packet_bytes <= (1 << 20) or packet_bytes % 64):
            raise CodecParameterError(
                f"rs-numpy: packet_bytes must be a multiple of 64 in 64..{1 << 20}, got {packet_bytes!r}")
        super().__init__(k, m, threads)
        self.packet_bytes = packet_bytes
        self.range_align = 8 * packet_bytes
        self.piece_align = 8 * packet_bytes
        self.max_temps = max(16, min(256, SCRATCH_BYTES // packet_bytes))
        self.parity_rows = gf256.cauchy_good_matrix(k, m)
        self._descriptor = CodecDescriptor(
            name=self.name, version=self.version, k=k, m=m, field=gf256.FIELD_NAME, matrix="cauchy1-good",
            matrix_sha256=gf256.matrix_fingerprint(self.parity_rows), layout="bitmatrix-w8",
            packet_bytes=packet_bytes)
        self._local = threading.local()
        self._enc_plan = self._make_plan(self.parity_rows)
        self._plans = LRUCache(256)

    @property
    def descriptor(self) -> CodecDescriptor:
        return self._descriptor

    def _make_plan(self, rows: List[List[int]]) -> _BitPlan:
        """The cheaper of the smart and the common-sub-expression schedules (same bytes either way)."""
        bitrows = gf256.to_bitmatrix(rows)
        nsrc = 8 * len(rows[0])
        ops, ntemps = smart_schedule(bitrows, nsrc), 0
        if ops and schedule_xors(ops) > 8:
            cse_ops, cse_t = cse_schedule(bitrows, nsrc, self.max_temps)
            if schedule_xors(cse_ops) < schedule_xors(ops):
                ops, ntemps = cse_ops, cse_t
        return _BitPlan(rows=rows, ops=ops, ntemps=ntemps, xor_only=all(y >= 0 for _, _, y in ops))

    def _scratch(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.size < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            self._local.scratch = buf
        return buf

    # ---- kernels -----------------------------------------------------------------------------
    def _blocks(self, plan: _BitPlan, srcs: List[np.ndarray], dsts: List[np.ndarray],
                start: int, nblocks: int, psize: int) -> None:
        """Run the schedule on ``nblocks`` blocks of packet size ``psize`` starting at byte ``start``."""
        xor = np.bitwise_xor
        ops = plan.ops
        stop = start + nblocks * 8 * psize
        s3 = [s[start:stop].reshape(nblocks, 8, psize) for s in srcs]
        d3 = [d[start:stop].reshape(nblocks, 8, psize) for d in dsts]
        temps: List[np.ndarray] = []
        if plan.ntemps:
            temps = list(self._scratch(plan.ntemps * psize)[: plan.ntemps * psize].reshape(plan.ntemps, psize))
        for blk in range(nblocks):
            pk: List[np.ndarray] = []
            for v in s3:
                pk.extend(v[blk])
            for v in d3:
                pk.extend(v[blk])
            pk.extend(temps)
            if plan.xor_only:
                for dst, x, y in ops:
                    xor(pk[x], pk[y], pk[dst])
                continue
            for dst, x, y in ops:
                if y >= 0:
                    xor(pk[x], pk[y], pk[dst])
                elif x >= 0:
                    np.copyto(pk[dst], pk[x])
                else:
                    pk[dst].fill(0)

    def _run_plan(self, plan: _BitPlan, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        P = self.packet_bytes
        B = 8 * P
        nfull = (hi - lo) // B
        if nfull:
            self._blocks(plan, srcs, dsts, lo, nfull, P)
        pos = lo + nfull * B
        if pos == hi:
            return
        # the final partial block (only the last range can have one: inner bounds are multiples of B)
        pt = (hi - pos) // 8
        if pt:
            self._blocks(plan, srcs, dsts, pos, 1, pt)
            pos += 8 * pt
        if pos < hi:
            gf256.matvec_bytes(plan.rows, srcs, dsts, pos, hi)

