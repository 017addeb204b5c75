"""Chunk checksums and the fused copy+checksum primitive.

Every chunk of a snapshot carries a checksum so that a torn or corrupted snapshot is never
restored. CRC32 runs at ~2 GB/s here, far below memcpy (~7-10 GB/s), which would make the
checksum, not the copy, the cost of a snapshot. We therefore use ``fl64x4`` (see
``_native/fastcopy.c``): four interleaved Fletcher-64 lanes, position-sensitive, computed in
the same pass that copies the bytes, so a snapshot costs one read and one write per byte.

The C library is loaded with ctypes (the call releases the GIL, so a background copy
overlaps with training). ``checksum_numpy`` is the slow reference used when the library is
not built and, in tests, as a cross-check.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Any, Optional

import numpy as np
import torch

#: written into every new snapshot's version record
ALGORITHM = "fl64x4-v2"
#: what a restore verifies with, the record's ``checksum`` naming it: v1 folds the lanes with an
#: FNV multiply (snapshots written before v2; about 1 % of single-bit flips in the top bits of a
#: word went unnoticed), v2 with MurmurHash3's finalizer (every single-bit flip noticed)
READS = ("fl64x4-v2", "fl64x4-v1")

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def _load_native() -> Optional[ctypes.CDLL]:
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_native")
    for path in sorted(glob.glob(os.path.join(here, "_fastcopy*.so"))):
        try:
            lib = ctypes.CDLL(path)
            for sym in ("mft_copy_checksum", "mft_fl_update", "mft_fl_update_nt", "mft_fl_zeros", "mft_fl_final",
                        "mft_fl_final2"):
                getattr(lib, sym)
        except (OSError, AttributeError) as e:  # e.g. a build older than fastcopy.c
            import logging

            logging.getLogger("megatron_ft").warning(
                "ignoring the native copy+checksum library %s (%s); the numpy fallback is slower. "
                "Rebuild it with `pip install -e .` (or `python setup.py build_ext --inplace`)", path, e)
            continue
        fn = lib.mft_copy_checksum
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        fn.restype = ctypes.c_uint64
        lib.mft_fl_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        lib.mft_fl_update.restype = None
        lib.mft_fl_update_nt.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        lib.mft_fl_update_nt.restype = None
        lib.mft_fl_zeros.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.mft_fl_zeros.restype = None
        for final in (lib.mft_fl_final, lib.mft_fl_final2):
            final.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
            final.restype = ctypes.c_uint64
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


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in READS:
        raise ValueError(f"checksum algorithm {algorithm!r} is not one this build reads: {READS}")


def _fold(a: np.ndarray, b: np.ndarray, nbytes: int, algorithm: str = ALGORITHM) -> int:
    _check_algorithm(algorithm)
    h = _FNV_OFFSET
    for v in list(a) + list(b) + [nbytes]:
        h = _fmix64(h ^ int(v)) if algorithm == "fl64x4-v2" else ((h ^ int(v)) * _FNV_PRIME) & _MASK
    return h


def _final(state: Any, nbytes: int, algorithm: str) -> int:
    _check_algorithm(algorithm)
    fn = _LIB.mft_fl_final2 if algorithm == "fl64x4-v2" else _LIB.mft_fl_final  # type: ignore[union-attr]
    return int(fn(state, nbytes))


def checksum_numpy(buf: np.ndarray, algorithm: str = ALGORITHM) -> int:
    """Reference implementation of ``fl64x4`` (``algorithm``: v2 or v1) over the bytes of ``buf``."""
    raw = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    nbytes = raw.size
    pad = (-nbytes) % 32
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    words = raw.view("<u8").reshape(-1, 4)
    rows = words.shape[0]
    with np.errstate(over="ignore"):
        a = words.sum(axis=0, dtype=np.uint64)
        weights = (np.uint64(rows) - np.arange(rows, dtype=np.uint64)).reshape(-1, 1)
        b = (words * weights).sum(axis=0, dtype=np.uint64)
    return _fold(a, b, nbytes, algorithm)


def _address(t: torch.Tensor | np.ndarray) -> int:
    if isinstance(t, torch.Tensor):
        return t.data_ptr()
    return t.ctypes.data


def _nbytes(t: torch.Tensor | np.ndarray) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return t.nbytes


def _as_bytes(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().reshape(-1).view(torch.uint8).numpy()
    return t.reshape(-1).view(np.uint8)


def copy_checksum(dst: torch.Tensor | np.ndarray | None, src: torch.Tensor | np.ndarray,
                  algorithm: str = ALGORITHM) -> int:
    """Copy the bytes of contiguous CPU ``src`` into ``dst`` (same byte size) and return the
    checksum of those bytes. ``dst=None`` only computes the checksum."""
    n = _nbytes(src)
    if dst is not None and _nbytes(dst) != n:
        raise ValueError(f"copy_checksum: dst has {_nbytes(dst)} bytes, src has {n}")
    if _LIB is not None:
        if algorithm == ALGORITHM:
            return int(_LIB.mft_copy_checksum(_address(dst) if dst is not None else None, _address(src), n))
        state = (ctypes.c_uint64 * 8)()
        _LIB.mft_fl_update(state, _address(dst) if dst is not None else None, _address(src), n)
        return _final(state, n, algorithm)
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
        _check_algorithm(algorithm)
        self.algorithm = algorithm
        self.nbytes = nbytes
        self.dst = dst_chunk
        self.pos = 0  # bytes accounted for (a multiple of 32 between pieces)
        self._state = (ctypes.c_uint64 * 8)() if _LIB is not None else None
        self._bounce = np.zeros(nbytes, np.uint8) if _LIB is None and dst_chunk is None else None

    def _advance(self, offset: int, n: int) -> None:
        if offset < self.pos or offset % 32 or offset + n > self.nbytes:
            raise ValueError(f"piece [{offset}, {offset + n}) of a {self.nbytes}-byte chunk is out of order, "
                             f"out of range or not 32-byte aligned")
        if self._state is not None:
            _LIB.mft_fl_zeros(self._state, (offset - self.pos) // 32)
        self.pos = offset + -(-n // 32) * 32

    def write(self, offset: int, src: torch.Tensor | np.ndarray) -> None:
        assert self.dst is not None, "ChunkSum.write needs a destination chunk"
        n = _nbytes(src)
        dst = self.dst[offset: offset + n]
        self._advance(offset, n)
        if self._state is None:
            np.copyto(dst, _as_bytes(src))
        else:
            _LIB.mft_fl_update(self._state, dst.ctypes.data, _address(src), n)

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
        _LIB.mft_fl_update_nt(self._state, _address(dst), _address(src), n)

    def add(self, offset: int, buf: torch.Tensor | np.ndarray) -> None:
        n = _nbytes(buf)
        self._advance(offset, n)
        if self._state is None:
            target = self.dst if self.dst is not None else self._bounce
            if self.dst is None:
                np.copyto(target[offset: offset + n], _as_bytes(buf))
        else:
            _LIB.mft_fl_update(self._state, None, _address(buf), n)

    def finish(self) -> int:
        if self._state is None:
            return checksum_numpy(self.dst if self.dst is not None else self._bounce, self.algorithm)
        _LIB.mft_fl_zeros(self._state, max(0, -(-self.nbytes // 32) - self.pos // 32))
        return _final(self._state, self.nbytes, self.algorithm)
