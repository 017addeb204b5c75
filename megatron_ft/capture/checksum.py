"""Chunk checksums and the fused copy+checksum primitive.

Every chunk of a snapshot carries a checksum so that a torn or corrupted snapshot is never
restored. CRC32 in software runs far below memcpy, which would make the checksum, not the copy,
the cost of a snapshot. The written checksum is ``fl32x8-v1`` (``_native/fastcopy.c``): 32-bit
words summed in eight 64-bit Fletcher lanes, position-sensitive, computed in the same pass that
copies the bytes, so a snapshot costs one read and one write per byte. No difference can wrap
away inside a chunk, so every 1- and 2-bit error and every swap of two different words changes
it; ``benchmarks/checksum.py`` measured it beside CRC32C and XXH3 (docs/benchmarks.md). The
version record names the algorithm; a restore verifies with the one it names (:data:`READS`).

The C library is loaded with ctypes (the call releases the GIL, so a background copy
overlaps with training). ``checksum_numpy`` is the slow reference used when the library is
not built and, in tests, as a cross-check.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

if TYPE_CHECKING:
    import torch

#: written into every new snapshot's version record
ALGORITHM = "fl32x8-v1"
#: what a restore verifies with, the record's ``checksum`` naming it. fl64x4 (container formats 1
#: and 2): 64-bit words in four lanes, whose sums mod 2^64 lose a difference in the top bit
#: multiplied by an even number (two sign flips of one lane an even number of rows apart went
#: unnoticed); v1 also folded the lanes with an FNV multiply that let about 1 % of single-bit
#: flips cancel, v2 with MurmurHash3's finalizer.
READS = ("fl32x8-v1", "fl64x4-v2", "fl64x4-v1")

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
_SYMBOLS = ("mft_copy_checksum8", "mft_f8_update", "mft_f8_update_nt", "mft_f8_zeros", "mft_f8_final",
            "mft_fl_update", "mft_fl_update_nt", "mft_fl_zeros", "mft_fl_final", "mft_fl_final2")


def _load_native() -> Optional[ctypes.CDLL]:
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_native")
    for path in sorted(glob.glob(os.path.join(here, "_fastcopy*.so"))):
        try:
            lib = ctypes.CDLL(path)
            for sym in _SYMBOLS:
                getattr(lib, sym)
        except (OSError, AttributeError) as e:  # e.g. a build older than fastcopy.c
            logging.getLogger("megatron_ft").warning(
                "ignoring the native copy+checksum library %s (%s); the numpy fallback is slower. "
                "Rebuild it with `pip install -e .` (or `python setup.py build_ext --inplace`)", path, e)
            continue
        lib.mft_copy_checksum8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        lib.mft_copy_checksum8.restype = ctypes.c_uint64
        for name in ("mft_f8_update", "mft_f8_update_nt", "mft_fl_update", "mft_fl_update_nt"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
            getattr(lib, name).restype = None
        for name in ("mft_f8_zeros", "mft_fl_zeros"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_uint64]
            getattr(lib, name).restype = None
        for name in ("mft_f8_final", "mft_fl_final", "mft_fl_final2"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_uint64]
            getattr(lib, name).restype = ctypes.c_uint64
        return lib
    return None


_LIB = _load_native()
HAVE_NATIVE = _LIB is not None


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    return k ^ (k >> 33)


@dataclass(frozen=True)
class _Algorithm:
    """One checksum: its word size and lanes, how its lanes are folded, and its native functions."""
    word: str  # numpy dtype of a word
    lanes: int
    fmix: bool  # fold with MurmurHash3's finalizer (else the FNV multiply of fl64x4-v1)
    update: str
    update_nt: str
    zeros: str
    final: str

    def fold(self, values: list[int]) -> int:
        h = _FNV_OFFSET
        for v in values:
            h = _fmix64(h ^ int(v)) if self.fmix else ((h ^ int(v)) * _FNV_PRIME) & _MASK
        return h

    def native(self, name: str) -> Callable[..., Any]:
        return getattr(_LIB, getattr(self, name))


_ALGORITHMS = {
    "fl32x8-v1": _Algorithm("<u4", 8, True, "mft_f8_update", "mft_f8_update_nt", "mft_f8_zeros", "mft_f8_final"),
    "fl64x4-v2": _Algorithm("<u8", 4, True, "mft_fl_update", "mft_fl_update_nt", "mft_fl_zeros", "mft_fl_final2"),
    "fl64x4-v1": _Algorithm("<u8", 4, False, "mft_fl_update", "mft_fl_update_nt", "mft_fl_zeros", "mft_fl_final"),
}


def _algorithm(name: str) -> _Algorithm:
    if name not in _ALGORITHMS:
        raise ValueError(f"checksum algorithm {name!r} is not one this build reads: {READS}")
    return _ALGORITHMS[name]


def checksum_numpy(buf: np.ndarray, algorithm: str = ALGORITHM) -> int:
    """Reference implementation over the bytes of ``buf`` (``algorithm``: one of :data:`READS`)."""
    alg = _algorithm(algorithm)
    raw = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    a, c = _numpy_lanes(raw, alg)
    rows = -(-raw.size // 32)
    with np.errstate(over="ignore"):
        b = np.uint64(rows) * a - c  # sum_r (rows - r) * w[r]
    return alg.fold([*a, *b, raw.size])


def _numpy_lanes(raw: np.ndarray, alg: "_Algorithm") -> tuple[np.ndarray, np.ndarray]:
    """Per lane, mod 2^64: the words' sum a and their row-weighted sum c = sum_r r * w[r] (the bytes
    zero-padded to whole 32-byte rows)."""
    if raw.size % 32:
        raw = np.concatenate([raw, np.zeros(32 - raw.size % 32, np.uint8)])
    words = raw.view(alg.word).reshape(-1, alg.lanes).astype(np.uint64)
    with np.errstate(over="ignore"):
        a = words.sum(axis=0, dtype=np.uint64)
        c = (words * np.arange(words.shape[0], dtype=np.uint64).reshape(-1, 1)).sum(axis=0, dtype=np.uint64)
    return a, c


def _is_tensor(t: Any) -> bool:
    """A torch tensor? Without importing torch: the agent, which handles only numpy views of its
    shared memory, starts without it (a restarted or standby agent is up in well under a second)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def _address(t: torch.Tensor | np.ndarray) -> int:
    if _is_tensor(t):
        return t.data_ptr()
    return t.ctypes.data


def _nbytes(t: torch.Tensor | np.ndarray) -> int:
    if _is_tensor(t):
        return t.numel() * t.element_size()
    return t.nbytes


def _as_bytes(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if _is_tensor(t):
        return t.detach().reshape(-1).view(sys.modules["torch"].uint8).numpy()
    return t.reshape(-1).view(np.uint8)


def copy_checksum(dst: torch.Tensor | np.ndarray | None, src: torch.Tensor | np.ndarray,
                  algorithm: str = ALGORITHM) -> int:
    """Copy the bytes of contiguous CPU ``src`` into ``dst`` (same byte size) and return the
    checksum of those bytes. ``dst=None`` only computes the checksum."""
    alg = _algorithm(algorithm)
    n = _nbytes(src)
    if dst is not None and _nbytes(dst) != n:
        raise ValueError(f"copy_checksum: dst has {_nbytes(dst)} bytes, src has {n}")
    if _LIB is not None:
        d = _address(dst) if dst is not None else None
        if algorithm == ALGORITHM:
            return int(_LIB.mft_copy_checksum8(d, _address(src), n))
        state = (ctypes.c_uint64 * (2 * alg.lanes))()
        alg.native("update")(state, d, _address(src), n)
        return int(alg.native("final")(state, n))
    if dst is not None:
        np.copyto(_as_bytes(dst), _as_bytes(src))
    return checksum_numpy(_as_bytes(src), algorithm)


def checksum(buf: torch.Tensor | np.ndarray, algorithm: str = ALGORITHM) -> int:
    return copy_checksum(None, buf, algorithm)


class ChunkSum:
    """The checksum of one chunk of ``nbytes``, fed piece by piece in address order, as if
    ``checksum(chunk)`` were computed over the assembled bytes.

    Pieces start at 32-byte aligned offsets; the bytes between pieces (alignment padding) are
    zero. ``write`` copies a piece into the chunk's destination while summing it (one pass);
    ``add`` sums bytes that are already in place (e.g. just read into a tensor). Without the
    native library the pieces are assembled in a bounce buffer and summed with numpy."""

    def __init__(self, nbytes: int, dst_chunk: Optional[np.ndarray] = None, algorithm: str = ALGORITHM):
        self._alg = _algorithm(algorithm)
        self.algorithm = algorithm
        if _LIB is not None:  # resolved once: write/add run once per piece of every chunk
            self._update, self._update_nt, self._zeros, self._final = (
                self._alg.native(n) for n in ("update", "update_nt", "zeros", "final"))
        self.nbytes = nbytes
        self.dst = dst_chunk
        self.pos = 0  # bytes accounted for (a multiple of 32 between pieces)
        self._state = (ctypes.c_uint64 * (2 * self._alg.lanes))() if _LIB is not None else None
        self._bounce = np.zeros(nbytes, np.uint8) if _LIB is None and dst_chunk is None else None

    def _advance(self, offset: int, n: int) -> None:
        if offset < self.pos or offset % 32 or offset + n > self.nbytes:
            raise ValueError(f"piece [{offset}, {offset + n}) of a {self.nbytes}-byte chunk is out of order, "
                             f"out of range or not 32-byte aligned")
        if self._state is not None:
            self._zeros(self._state, (offset - self.pos) // 32)
        self.pos = offset + -(-n // 32) * 32

    def write(self, offset: int, src: torch.Tensor | np.ndarray) -> None:
        assert self.dst is not None, "ChunkSum.write needs a destination chunk"
        n = _nbytes(src)
        dst = self.dst[offset: offset + n]
        self._advance(offset, n)
        if self._state is None:
            np.copyto(dst, _as_bytes(src))
        else:
            self._update(self._state, dst.ctypes.data, _address(src), n)

    def copy_to(self, offset: int, dst: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
        """Copy the piece ``src`` (at ``offset`` of the chunk) into ``dst`` (any CPU buffer of the same
        size) while summing it, in one pass. The native copy uses streaming (non-temporal) stores: for
        a restore, whose destination is not read again soon, that saves reading every destination
        line into the cache first. ``src`` should be small enough to be in cache (a read buffer)."""
        n = _nbytes(src)
        if _nbytes(dst) != n:
            raise ValueError(f"copy_to: dst has {_nbytes(dst)} bytes, src has {n}")
        if self._state is None:
            np.copyto(_as_bytes(dst), _as_bytes(src))
            self.add(offset, src)
            return
        self._advance(offset, n)
        self._update_nt(self._state, _address(dst), _address(src), n)

    def add(self, offset: int, buf: torch.Tensor | np.ndarray) -> None:
        n = _nbytes(buf)
        self._advance(offset, n)
        if self._state is None:
            target = self.dst if self.dst is not None else self._bounce
            if self.dst is None:
                np.copyto(target[offset: offset + n], _as_bytes(buf))
        else:
            self._update(self._state, None, _address(buf), n)

    def finish(self) -> int:
        if self._state is None:
            return checksum_numpy(self.dst if self.dst is not None else self._bounce, self.algorithm)
        self._zeros(self._state, max(0, -(-self.nbytes // 32) - self.pos // 32))
        return int(self._final(self._state, self.nbytes))


# ---- lanes: pieces summed apart (on a GPU, say) and combined into a chunk's checksum ----------------
# fl32x8 is linear in the words. A piece's lanes, relative to its own first row: a_l = sum_r w[r, l] and
# c_l = sum_r r * w[r, l] (mod 2^64; words zero-padded to whole 32-byte rows). In a chunk of R rows, a
# piece that starts at row r0 adds a_l to the chunk's A_l and (R - r0) * a_l - c_l to its B_l; rows no
# piece covers (alignment padding) are zero and add nothing. So the pieces of one chunk can be summed on
# different devices, in any order, and combined on the host: the digest is the one ChunkSum computes.

#: bytes of a piece summed per step by :func:`tensor_lanes` (bounds its temporaries to about this much)
LANE_BLOCK = 64 << 20
#: rows summed together in :func:`tensor_lanes` (see there)
ROW_GROUP = 1024


def tensor_lanes(buf: "torch.Tensor", out: "Optional[torch.Tensor]" = None) -> "torch.Tensor":
    """The 16 fl32x8 lanes (a0..a7, c0..c7) of the bytes of the flat uint8 tensor ``buf``, computed
    with torch where ``buf`` lives (on a GPU at its memory speed, on the current stream, no host
    synchronisation): an int64 tensor on that device (``out`` if given), the values mod 2^64.

    On a GPU with Triton: :func:`pieces_lanes` of the one piece (one read of every word). Otherwise with
    torch reductions (temporaries: about :data:`LANE_BLOCK` bytes of that device's memory): the rows are
    grouped, ``ROW_GROUP`` at a time, into a (Q, K, 8) view of 32-bit words. Two
    reductions of the words themselves give each group's sums ``S[q]`` and each in-group position's
    sums ``T[j]`` (accumulated in int64; a word read as negative int32 is corrected by 2^32, counted
    from its sign bit), and then a = sum_q S[q], c = K * sum_q q * S[q] + sum_j j * T[j], since row
    r = K * q + j. Four reads and one write per word: no int64 copy of the data is made."""
    import torch

    if out is None:
        out = torch.empty(16, dtype=torch.int64, device=buf.device)
    if _kernel_for(buf) is not None:
        pieces_lanes([buf], out.view(1, 16))
        return out
    buf = _word_aligned(buf)
    full = buf.numel() - buf.numel() % 32
    out.zero_()
    for start in range(0, full, LANE_BLOCK):
        end = min(full, start + LANE_BLOCK)
        _add_row_lanes(buf[start:end].view(torch.int32).view(-1, 8), start // 32, out)
    _add_tail_lanes(buf, out)
    return out


def _word_aligned(buf: "torch.Tensor") -> "torch.Tensor":
    """``buf``, or a copy of it where it does not start on a 4-byte boundary (32-bit words)."""
    return buf if buf.data_ptr() % 4 == 0 else buf.clone()


def _add_tail_lanes(buf: "torch.Tensor", out: "torch.Tensor") -> None:
    """Add the lanes of ``buf``'s last partial row (under 32 bytes, zero-padded), if it has one, to ``out``."""
    import torch

    n = buf.numel()
    full = n - n % 32
    if full < n:
        tail = torch.zeros(32, dtype=torch.uint8, device=buf.device)
        tail[: n - full] = buf[full:]
        _add_row_lanes(tail.view(torch.int32).view(1, 8), full // 32, out)


def _kernel_for(t: "torch.Tensor") -> Any:
    """:mod:`.lanes_kernel` if it sums ``t``'s device bytes: on a CUDA device when Triton is there (and
    did not fail), or anywhere under ``TRITON_INTERPRET=1`` (the CPU tests); else None."""
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    from . import lanes_kernel

    return lanes_kernel if lanes_kernel.AVAILABLE else None


def pieces_lanes(pieces: "list[torch.Tensor]", out: "torch.Tensor") -> "torch.Tensor":
    """:func:`tensor_lanes` of each flat uint8 tensor of ``pieces`` (all on one device) into row k of
    ``out`` ((len(pieces), 16) int64 on that device), asynchronously on the current stream. With the
    Triton kernel, every piece's whole rows in one launch (:func:`.lanes_kernel.segment_row_lanes`: under
    a training load each launch waits for SMs, so a snapshot's sums are one launch, not hundreds) and a
    tail of under 32 bytes, where a piece has one, with a few small torch operations. A kernel that
    fails (e.g. no compiler for this device) is turned off for the process, said once; the torch
    reductions sum instead."""
    import torch

    kernel = _kernel_for(pieces[0]) if pieces else None
    if kernel is not None:
        aligned = [_word_aligned(p) for p in pieces]
        try:
            kernel.segment_row_lanes(
                [p[: p.numel() - p.numel() % 32].view(torch.int32).view(-1, 8) for p in aligned], out)
        except Exception as e:
            kernel.AVAILABLE = False
            logging.getLogger("megatron_ft").warning("the Triton checksum kernel failed (%s: %s); summing device "
                                                     "bytes with torch reductions instead", type(e).__name__, e)
        else:
            for k, p in enumerate(aligned):
                _add_tail_lanes(p, out[k])
            return out
    for k, p in enumerate(pieces):
        tensor_lanes(p, out=out[k])
    return out


def _add_row_lanes(words: "torch.Tensor", first_row: int, out: "torch.Tensor") -> None:
    """Add the lanes of ``words`` (int32, one row of 8 per 32 bytes), whose first row is row
    ``first_row`` of the piece, to ``out`` (see :func:`tensor_lanes`)."""
    import torch

    rows = words.shape[0]
    while rows:
        k = min(ROW_GROUP, rows)
        q = rows // k
        x = words[: q * k].view(q, k, 8)
        negative = x >> 31  # -1 where the word, read unsigned, is 2^31 or more
        s = x.sum(1) - negative.sum(1) * (1 << 32)  # (q, 8) unsigned sums per group (int64, exact)
        t = x.sum(0) - negative.sum(0) * (1 << 32)  # (k, 8) per position in the group
        qi = torch.arange(q, dtype=torch.int64, device=words.device).unsqueeze(1)
        ji = torch.arange(k, dtype=torch.int64, device=words.device).unsqueeze(1)
        a = s.sum(0)
        out[:8] += a
        out[8:] += (s * qi).sum(0) * k + (t * ji).sum(0) + a * first_row
        words, first_row, rows = words[q * k:], first_row + q * k, rows - q * k


def host_lanes(buf: "torch.Tensor | np.ndarray") -> list[int]:
    """:func:`tensor_lanes` of a host buffer, with the native library (one pass) or numpy."""
    n = _nbytes(buf)
    rows = -(-n // 32)
    if _LIB is None or n == 0:
        a, c = _numpy_lanes(_as_bytes(buf), _algorithm(ALGORITHM))
        return [int(v) for v in a] + [int(v) for v in c]
    state = (ctypes.c_uint64 * 16)()
    _LIB.mft_f8_update(state, None, _address(buf), n)  # b_l = sum_r (rows - r) w[r, l]
    a, b = list(state[:8]), list(state[8:])
    return a + [(rows * a[l] - b[l]) & _MASK for l in range(8)]


def combine_lanes(nbytes: int, parts: list[tuple[int, Any]]) -> int:
    """The :data:`ALGORITHM` checksum of a chunk of ``nbytes`` whose pieces were summed apart:
    ``parts`` = [(offset of the piece in the chunk, a multiple of 32; its 16 lanes)]."""
    rows = -(-nbytes // 32)
    A, B = [0] * 8, [0] * 8
    for offset, lanes in parts:
        if offset % 32:
            raise ValueError(f"a piece at offset {offset} of a chunk is not 32-byte aligned")
        r0 = offset // 32
        for l in range(8):
            a, c = int(lanes[l]) & _MASK, int(lanes[8 + l]) & _MASK
            A[l] = (A[l] + a) & _MASK
            B[l] = (B[l] + (rows - r0) * a - c) & _MASK
    return _algorithm(ALGORITHM).fold([*A, *B, nbytes])
