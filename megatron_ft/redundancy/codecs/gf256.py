"""GF(2^8) arithmetic, Cauchy matrices, bit matrices and a byte-wise numpy reference coder.

The field is GF(2)[x] / (x^8 + x^4 + x^3 + x^2 + 1) (polynomial 0x11d, generator 2), the one
ISA-L and Jerasure (w=8) use. Matrices here are tiny (at most 40 x 32), so they are plain Python
lists of ints; only shard bytes go through numpy.

Worked example (k=2, m=2, ISA-L's ``gf_gen_cauchy1_matrix``): parity row ``i`` (shard
``k+i``), column ``j`` holds ``1 / ((k+i) ^ j)``::

    row 2: 1/(2^0)=inv(2)=0x8e, 1/(2^1)=inv(3)=0xf4
    row 3: 1/(3^0)=inv(3)=0xf4, 1/(3^1)=inv(2)=0x8e

so parity byte ``p2 = 0x8e*d0 + 0xf4*d1`` (``+`` is XOR, ``*`` is field multiplication).

A coefficient ``e`` acts on a byte as a linear map over GF(2): the 8x8 *bit matrix* ``B(e)``
whose column ``c`` holds the bits of ``e * 2^c``. Because ``B`` is a ring homomorphism
(``B(a*b) = B(a) B(b)``, ``B(a+b) = B(a) ^ B(b)``), inverting a matrix over GF(2^8) and then
expanding it gives the inverse of the expanded bit matrix; the bit-matrix codec relies on it.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import List, Sequence

import numpy as np

POLY = 0x11D
FIELD_NAME = "gf256/0x11d"

Matrix = List[List[int]]


def _build_tables():
    exp = [0] * 512
    log = [0] * 256
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    for i in range(255, 512):
        exp[i] = exp[i - 255]
    return exp, log


EXP, LOG = _build_tables()


def mul(a: int, b: int) -> int:
    """Product of two field elements."""
    if a == 0 or b == 0:
        return 0
    return EXP[LOG[a] + LOG[b]]


def inv(a: int) -> int:
    """Multiplicative inverse; ``inv(0)`` raises ``ZeroDivisionError``."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return EXP[255 - LOG[a]]


@lru_cache(maxsize=1)
def mul_table() -> np.ndarray:
    """``T[a, b] = a * b`` as a 256x256 uint8 array (64 KiB), for byte-wise table lookups."""
    a = np.arange(256)
    la = np.array(LOG)[a]
    t = np.array(EXP, dtype=np.uint8)[(la[:, None] + la[None, :])]
    t[0, :] = 0
    t[:, 0] = 0
    return t


# ---- matrices --------------------------------------------------------------------------------
def mat_mul(a: Matrix, b: Matrix) -> Matrix:
    """Matrix product over GF(2^8)."""
    n, p = len(b), len(b[0])
    out = []
    for row in a:
        r = [0] * p
        for t in range(n):
            c = row[t]
            if c:
                bt = b[t]
                for j in range(p):
                    if bt[j]:
                        r[j] ^= mul(c, bt[j])
        out.append(r)
    return out


def mat_inv(a: Matrix) -> Matrix:
    """Inverse of a square matrix over GF(2^8) (Gauss-Jordan); ``ValueError`` if singular."""
    n = len(a)
    m = [list(r) + [1 if i == j else 0 for j in range(n)] for i, r in enumerate(a)]
    for col in range(n):
        piv = next((r for r in range(col, n) if m[r][col]), None)
        if piv is None:
            raise ValueError("matrix is singular over GF(2^8)")
        m[col], m[piv] = m[piv], m[col]
        f = inv(m[col][col])
        m[col] = [mul(f, v) for v in m[col]]
        for r in range(n):
            if r != col and m[r][col]:
                g = m[r][col]
                pr = m[col]
                m[r] = [v ^ mul(g, pv) for v, pv in zip(m[r], pr)]
    return [row[n:] for row in m]


def cauchy1_matrix(k: int, m: int) -> Matrix:
    """ISA-L's ``gf_gen_cauchy1_matrix`` parity rows: ``a[i][j] = 1 / ((k+i) ^ j)``, ``i < m, j < k``.

    The full encoding matrix is ``[I_k; a]``; every square submatrix of a Cauchy matrix is
    invertible, so any ``k`` of the ``k+m`` rows are (MDS).
    """
    if k + m > 256:
        raise ValueError(f"k+m={k + m} exceeds 256, the limit for GF(2^8) Cauchy matrices")
    return [[inv((k + i) ^ j) for j in range(k)] for i in range(m)]


def bitmatrix_ones(e: int) -> int:
    """Number of ones in the 8x8 bit matrix of ``e`` (the XOR cost of multiplying by ``e``)."""
    return sum(bin(mul(e, 1 << c)).count("1") for c in range(8))


def cauchy_good_matrix(k: int, m: int) -> Matrix:
    """Cauchy matrix scaled to need few XORs as a bit matrix (Jerasure's "cauchy good").

    Starts from :func:`cauchy1_matrix`, divides each column by its first-row entry (row 0
    becomes all ones: parity ``k`` is the plain XOR of the data, like RAID-5), then divides each
    other row by whichever of its entries minimises the row's bit-matrix ones. Scaling rows and
    columns by non-zero elements keeps every square submatrix invertible, so the code stays MDS.
    """
    a = cauchy1_matrix(k, m)
    for j in range(k):
        f = inv(a[0][j])
        for i in range(m):
            a[i][j] = mul(a[i][j], f)
    for i in range(1, m):
        best, best_cost = 1, None
        for d in sorted(set(a[i])):
            di = inv(d)
            cost = sum(bitmatrix_ones(mul(v, di)) for v in a[i])
            if best_cost is None or cost < best_cost:
                best, best_cost = d, cost
        di = inv(best)
        a[i] = [mul(v, di) for v in a[i]]
    return a


def matrix_fingerprint(rows: Matrix) -> str:
    """First 16 hex digits of SHA-256 over the row-major coefficient bytes."""
    return hashlib.sha256(bytes(v for r in rows for v in r)).hexdigest()[:16]


def encode_matrix(k: int, parity_rows: Matrix) -> Matrix:
    """The full ``(k+m) x k`` systematic encoding matrix ``[I_k; parity_rows]``."""
    return [[1 if i == j else 0 for j in range(k)] for i in range(k)] + [list(r) for r in parity_rows]


def decode_matrix(k: int, parity_rows: Matrix, survivors: Sequence[int], erased: Sequence[int]) -> Matrix:
    """Rows that rebuild ``erased`` shards from the ``k`` ``survivors`` (shard indices).

    With ``E`` the full encoding matrix and ``S`` its rows at ``survivors``, data shard ``d`` is
    row ``d`` of ``S^-1`` and parity shard ``p`` is ``E[p] S^-1`` (ECHECK eq. 5).
    """
    full = encode_matrix(k, parity_rows)
    s_inv = mat_inv([full[i] for i in survivors])
    out = []
    for e in erased:
        out.append(list(s_inv[e]) if e < k else mat_mul([full[e]], s_inv)[0])
    return out


def to_bitmatrix(rows: Matrix) -> List[int]:
    """Expand an ``r x c`` GF(2^8) matrix into ``8r`` bit rows of ``8c`` bits (Python int masks).

    Bit row ``8i + l``, bit ``8j + x`` is bit ``l`` of ``rows[i][j] * 2^x``: output packet
    ``(i, l)`` is the XOR of the input packets ``(j, x)`` whose bit is set (Jerasure's
    ``jerasure_matrix_to_bitmatrix``).
    """
    out = []
    for row in rows:
        for l in range(8):
            mask = 0
            for j, e in enumerate(row):
                for x in range(8):
                    if (mul(e, 1 << x) >> l) & 1:
                        mask |= 1 << (8 * j + x)
            out.append(mask)
    return out


# ---- byte-wise reference coder (ISA-L byte-compatible) ------------------------------------------
_REF_CHUNK = 1 << 16


def matvec_bytes(rows: Matrix, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], lo: int, hi: int) -> None:
    """``dsts[i][lo:hi] = sum_j rows[i][j] * srcs[j][lo:hi]`` byte by byte (table lookups).

    Produces exactly ISA-L's ``ec_encode_data`` bytes for the same matrix. Slow (~0.2-1 GB/s):
    used for bit-matrix tails, as the fallback when ISA-L is missing, and as a test oracle.
    """
    table = mul_table()
    tmp = np.empty(min(_REF_CHUNK, max(hi - lo, 0)), dtype=np.uint8)
    for o in range(lo, hi, _REF_CHUNK):
        e = min(hi, o + _REF_CHUNK)
        t = tmp[: e - o]
        for row, dst in zip(rows, dsts):
            d = dst[o:e]
            first = True
            for c, src in zip(row, srcs):
                if c == 0:
                    continue
                s = src[o:e]
                if c == 1:
                    if first:
                        d[...] = s
                    else:
                        np.bitwise_xor(d, s, out=d)
                else:
                    np.take(table[c], s, out=t if not first else d)
                    if not first:
                        np.bitwise_xor(d, t, out=d)
                first = False
            if first:
                d.fill(0)
