"""Codec interface, descriptor and errors shared by every erasure codec.

A codec turns ``k`` equal-length data shards into ``m`` parity shards and rebuilds any lost
shards from any ``k`` survivors. Shard indices are ``0..k-1`` for data and ``k..k+m-1`` for
parity. Every buffer is a caller-owned, preallocated, C-contiguous ``numpy.uint8`` array
(typically a slice of a pre-faulted shared-memory slot); codecs write in place and never copy
shard bytes into ``bytes`` objects.

Parity bytes depend on more than ``(k, m)``: two Reed-Solomon codes over the same field with
the same matrix still produce different bytes if one works byte by byte (ISA-L) and the other
on bit-matrix packets (Jerasure style). Each codec therefore has a :class:`CodecDescriptor`
naming everything that determines its bytes; it is recorded as JSON with each snapshot version
and checked before decoding (:class:`CodecMismatchError` names each field that differs).
"""
from __future__ import annotations

import abc
import dataclasses
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

DESCRIPTOR_FORMAT = "megatron-ft-codec"
DESCRIPTOR_FORMAT_VERSION = 1

# Parameter limits. Reed-Solomon over GF(2^8) could go to k+m <= 256; these bounds keep the
# decode-matrix cache and bit-matrix schedules small and match what the placement plans use.
RS_MAX_K = 32
RS_MAX_M = 8
XOR_MAX_K = 256


class CodecError(Exception):
    """Base class of every codec error."""


class CodecParameterError(CodecError, ValueError):
    """Bad ``k``, ``m``, packet size, thread count or codec name."""


class CodecBufferError(CodecError, ValueError):
    """A shard buffer has the wrong type, dtype, layout, length, or overlaps another one."""


class CodecDecodeError(CodecError, ValueError):
    """The requested shards cannot be rebuilt (too few survivors, bad indices)."""


class CodecUnavailableError(CodecError, RuntimeError):
    """The codec needs a native library (ISA-L) that was not found."""


class CodecDescriptorError(CodecError, ValueError):
    """A recorded descriptor is malformed (not JSON, missing or unknown fields)."""


class CodecMismatchError(CodecError):
    """Parity was produced by a different codec (or parameters) than the one asked to decode.

    ``differences`` lists ``(field, recorded_value, this_codec_value)`` tuples.
    """

    def __init__(self, message: str, differences: Sequence[Tuple[str, Any, Any]] = ()):
        super().__init__(message)
        self.differences = list(differences)


ShardArray = np.ndarray
DescriptorLike = Union["CodecDescriptor", Mapping[str, Any], str]


@dataclasses.dataclass(frozen=True)
class CodecDescriptor:
    """Everything that determines a codec's parity bytes; recorded with each snapshot version.

    Fields:
      name:          ``"xor"``, ``"rs-isal"`` (ISA-L byte-wise Reed-Solomon) or ``"rs-numpy"``
                     (XOR-only Cauchy bit-matrix code).
      version:       version of that codec's byte format (bumped if its bytes ever change).
      k, m:          data and parity shard counts.
      field:         arithmetic: ``"gf2"`` (plain XOR) or ``"gf256/0x11d"`` (GF(2^8), x^8+x^4+x^3+x^2+1).
      matrix:        how the parity rows are built (e.g. ``"cauchy1"``: ISA-L's
                     ``gf_gen_cauchy1_matrix``, ``a[i][j] = 1/(i ^ j)``).
      matrix_sha256: first 16 hex digits of SHA-256 over the ``m x k`` parity coefficients
                     (row-major bytes); catches any change in construction.
      layout:        how bytes map to symbols: ``"bytewise"`` or ``"bitmatrix-w8"``.
      packet_bytes:  bit-matrix packet size (bytes per packet, 8 packets per block); 0 if unused.
    """

    name: str
    version: int
    k: int
    m: int
    field: str
    matrix: str
    matrix_sha256: str
    layout: str
    packet_bytes: int = 0

    # ---- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"format": DESCRIPTOR_FORMAT, "format_version": DESCRIPTOR_FORMAT_VERSION}
        d.update(dataclasses.asdict(self))
        return d

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal descriptors give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_any(cls, obj: DescriptorLike) -> "CodecDescriptor":
        """Accept a descriptor, its ``to_dict()`` mapping, or its JSON string."""
        if isinstance(obj, CodecDescriptor):
            return obj
        if isinstance(obj, (str, bytes, bytearray)):
            try:
                obj = json.loads(obj)
            except ValueError as e:
                raise CodecDescriptorError(f"codec descriptor is not valid JSON: {e}") from None
        if not isinstance(obj, Mapping):
            raise CodecDescriptorError(
                f"codec descriptor must be a CodecDescriptor, a mapping or a JSON string, got {type(obj).__name__}")
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CodecDescriptor":
        d = dict(d)
        fmt = d.pop("format", DESCRIPTOR_FORMAT)
        fver = d.pop("format_version", DESCRIPTOR_FORMAT_VERSION)
        if fmt != DESCRIPTOR_FORMAT:
            raise CodecDescriptorError(f"codec descriptor format is {fmt!r}, expected {DESCRIPTOR_FORMAT!r}")
        if fver != DESCRIPTOR_FORMAT_VERSION:
            raise CodecDescriptorError(
                f"codec descriptor format_version {fver!r} is not supported (this build reads "
                f"{DESCRIPTOR_FORMAT_VERSION}); upgrade megatron-ft to decode this snapshot")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise CodecDescriptorError(
                f"codec descriptor has unknown field(s) {unknown}; it was written by a newer "
                f"megatron-ft (known fields: {sorted(fields)})")
        missing = sorted(n for n, f in fields.items()
                         if n not in d and f.default is dataclasses.MISSING)
        if missing:
            raise CodecDescriptorError(f"codec descriptor is missing field(s) {missing}: {d}")
        for n in ("version", "k", "m", "packet_bytes"):
            if n in d and (isinstance(d[n], bool) or not isinstance(d[n], int)):
                raise CodecDescriptorError(f"codec descriptor field {n!r} must be an integer, got {d[n]!r}")
        for n in ("name", "field", "matrix", "matrix_sha256", "layout"):
            if not isinstance(d[n], str):
                raise CodecDescriptorError(f"codec descriptor field {n!r} must be a string, got {d[n]!r}")
        return cls(**d)

    # ---- comparison --------------------------------------------------------------------------
    def differences(self, other: "CodecDescriptor") -> List[Tuple[str, Any, Any]]:
        """``[(field, self_value, other_value), ...]`` for every field that differs."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def short(self) -> str:
        s = f"{self.name} v{self.version} (k={self.k}, m={self.m}, {self.field}, matrix={self.matrix}, layout={self.layout}"
        if self.packet_bytes:
            s += f", packet_bytes={self.packet_bytes}"
        return s + ")"


# ---- buffer validation -----------------------------------------------------------------------
def as_shard(buf: Any, what: str, writable: bool = False) -> np.ndarray:
    """Return a flat uint8 *view* of ``buf`` (never a copy) or raise :class:`CodecBufferError`."""
    if not isinstance(buf, np.ndarray):
        raise CodecBufferError(
            f"{what} must be a numpy.ndarray of dtype uint8, got {type(buf).__name__} "
            f"(wrap shared memory with numpy.frombuffer(..., dtype=numpy.uint8) or tensor.numpy())")
    if buf.dtype != np.uint8:
        raise CodecBufferError(f"{what} must have dtype uint8, got {buf.dtype} (use arr.view(numpy.uint8))")
    if not buf.flags.c_contiguous:
        raise CodecBufferError(f"{what} must be C-contiguous (got strides {buf.strides}); codecs do not copy")
    if writable and not buf.flags.writeable:
        raise CodecBufferError(f"{what} is read-only; output buffers must be writable")
    return buf.reshape(-1)


def check_disjoint(outputs: Sequence[Tuple[str, np.ndarray]], inputs: Sequence[Tuple[str, np.ndarray]]) -> None:
    """Outputs must not overlap each other or any input (bounds check, O(n^2) on a few shards)."""
    for i, (na, a) in enumerate(outputs):
        for nb, b in list(outputs[i + 1:]) + list(inputs):
            if a.size and b.size and np.may_share_memory(a, b):
                raise CodecBufferError(f"{na} overlaps {nb}; output buffers must not alias any other shard")


def split_ranges(length: int, parts: int, align: int) -> List[Tuple[int, int]]:
    """Split ``[0, length)`` into at most ``parts`` ranges whose inner boundaries are multiples of ``align``."""
    if parts <= 1 or length <= align:
        return [(0, length)]
    units = length // align
    per = max(1, -(-units // parts))
    bounds = list(range(0, units, per)) + [None]
    out = []
    for i in range(len(bounds) - 1):
        lo = bounds[i] * align
        hi = bounds[i + 1] * align if bounds[i + 1] is not None else length
        out.append((lo, hi))
    return out


class LRUCache(OrderedDict):
    """A small thread-safe LRU map (decode plans per erasure pattern)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.lock = threading.Lock()

    def get_or(self, key, make):
        with self.lock:
            if key in self:
                self.move_to_end(key)
                return self[key]
        val = make()
        with self.lock:
            self[key] = val
            while len(self) > self.size:
                self.popitem(last=False)
        return val


class Codec(abc.ABC):
    """An erasure codec with ``k`` data and ``m`` parity shards (indices ``0..k+m-1``).

    Subclasses implement :meth:`_encode_range` and :meth:`_decode_range` over a byte range
    ``[lo, hi)`` of every shard; this class validates buffers, splits the work across
    ``threads`` (the kernels release the GIL) and checks recorded descriptors.
    """

    name: ClassVar[str]
    version: ClassVar[int]
    #: inner range boundaries used for multi-threading must be multiples of this
    range_align: int = 4096
    #: Encoding a shard piece by piece (e.g. pipelined with the transfer, ECHECK IV-C) gives the
    #: same bytes as encoding it whole iff every piece but the last is a multiple of this (1 for
    #: the byte-wise codecs, ``8 * packet_bytes`` for ``rs-numpy``); decode pieces alike.
    piece_align: int = 1

    def __init__(self, k: int, m: int, threads: int = 1):
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
            raise CodecParameterError(f"threads must be an integer in 1..256, got {threads!r}")
        self.k = k
        self.m = m
        self.threads = threads
        self._pool: Optional[ThreadPoolExecutor] = None

    # ---- identity ----------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Total shard count ``k + m``."""
        return self.k + self.m

    @property
    @abc.abstractmethod
    def descriptor(self) -> CodecDescriptor:
        """The descriptor to record with every snapshot version encoded by this codec."""

    def check(self, recorded: DescriptorLike) -> None:
        """Raise :class:`CodecMismatchError` unless ``recorded`` describes exactly this codec's bytes."""
        rec = CodecDescriptor.from_any(recorded)
        mine = self.descriptor
        diffs = rec.differences(mine)
        if diffs:
            what = "; ".join(f"{f}: recorded {a!r}, this decoder {b!r}" for f, a, b in diffs)
            hint = ""
            if rec.name != mine.name:
                hint = (" ISA-L Reed-Solomon ('rs-isal') and the bit-matrix code ('rs-numpy') are not "
                        "byte-compatible.")
            raise CodecMismatchError(
                f"codec mismatch: the parity was produced by {rec.short()} but this decoder is "
                f"{mine.short()}; differs in {what}.{hint} Build the decoder from the recorded "
                f"descriptor: get_codec(recorded_descriptor).", diffs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.descriptor.short()} threads={self.threads}>"

    # ---- public API --------------------------------------------------------------------------
    def encode(self, data: Sequence[ShardArray], parity_out: Sequence[ShardArray]) -> None:
        """Compute the ``m`` parity shards of the ``k`` data shards, in place.

        ``data``: ``k`` C-contiguous uint8 arrays of equal length (any length, including 0).
        ``parity_out``: ``m`` preallocated writable arrays of the same length, overwritten.
        """
        if isinstance(data, np.ndarray) or isinstance(parity_out, np.ndarray):
            raise CodecBufferError("data and parity_out must be lists of arrays, one per shard")
        if len(data) != self.k:
            raise CodecBufferError(f"encode needs k={self.k} data shards, got {len(data)}")
        if len(parity_out) != self.m:
            raise CodecBufferError(f"encode needs m={self.m} parity buffers, got {len(parity_out)}")
        srcs = [as_shard(b, f"data shard {i}") for i, b in enumerate(data)]
        dsts = [as_shard(b, f"parity buffer {self.k + i}", writable=True) for i, b in enumerate(parity_out)]
        length = self._common_length([(f"data shard {i}", s) for i, s in enumerate(srcs)]
                                     + [(f"parity buffer {self.k + i}", d) for i, d in enumerate(dsts)])
        check_disjoint([(f"parity buffer {self.k + i}", d) for i, d in enumerate(dsts)],
                       [(f"data shard {i}", s) for i, s in enumerate(srcs)])
        if length == 0:
            return
        self._run(lambda lo, hi: self._encode_range(srcs, dsts, lo, hi), length)

    def decode(self, available: Mapping[int, ShardArray], erased: Sequence[int],
               out: Mapping[int, ShardArray], *, descriptor: Optional[DescriptorLike] = None) -> None:
        """Rebuild the shards listed in ``erased`` into ``out[i]`` from the shards in ``available``.

        ``available`` maps surviving shard indices to their buffers (at least ``k`` of them; extra
        ones are ignored, data shards are preferred). ``erased`` may name data and/or parity
        shards; ``out`` must hold a preallocated writable buffer of the shard length for each.
        If ``descriptor`` (the one recorded at encode time) is given, it is checked first.
        """
        if descriptor is not None:
            self.check(descriptor)
        if not isinstance(available, Mapping) or not isinstance(out, Mapping):
            raise CodecBufferError("available and out must be dicts mapping shard index -> array")
        erased_l = [self._index(e, "erased") for e in erased]
        if len(set(erased_l)) != len(erased_l):
            raise CodecDecodeError(f"erased lists a shard twice: {list(erased)}")
        avail = {self._index(i, "available"): b for i, b in available.items()}
        both = sorted(set(avail) & set(erased_l))
        if both:
            raise CodecDecodeError(f"shard(s) {both} are listed both as available and as erased")
        missing_out = [e for e in erased_l if e not in out]
        if missing_out:
            raise CodecBufferError(f"out has no buffer for erased shard(s) {missing_out}")
        if not erased_l:
            return
        if len(avail) < self.k:
            raise CodecDecodeError(
                f"cannot decode: {len(avail)} shard(s) available {sorted(avail)} but {self.name} with "
                f"k={self.k}, m={self.m} needs any {self.k} of the {self.n} shards "
                f"(it tolerates at most {self.m} lost)")
        survivors = self._choose_survivors(sorted(avail))
        srcs = [as_shard(avail[i], f"available shard {i}") for i in survivors]
        dsts = [as_shard(out[e], f"out buffer for shard {e}", writable=True) for e in erased_l]
        length = self._common_length([(f"available shard {i}", s) for i, s in zip(survivors, srcs)]
                                     + [(f"out buffer for shard {e}", d) for e, d in zip(erased_l, dsts)])
        check_disjoint([(f"out buffer for shard {e}", d) for e, d in zip(erased_l, dsts)],
                       [(f"available shard {i}", s) for i, s in zip(survivors, srcs)])
        if length == 0:
            return
        plan = self._decode_plan(tuple(survivors), tuple(erased_l))
        self._run(lambda lo, hi: self._decode_range(plan, srcs, dsts, lo, hi), length)

    def close(self) -> None:
        """Shut down the worker threads (only used when ``threads > 1``)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- helpers -----------------------------------------------------------------------------
    def _index(self, i: Any, what: str) -> int:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise CodecDecodeError(f"{what} shard index must be an int, got {i!r}")
        i = int(i)
        if not 0 <= i < self.n:
            raise CodecDecodeError(
                f"{what} shard index {i} out of range 0..{self.n - 1} (k={self.k} data 0..{self.k - 1}, "
                f"m={self.m} parity {self.k}..{self.n - 1})")
        return i

    def _choose_survivors(self, avail_sorted: List[int]) -> List[int]:
        """The ``k`` survivors to decode from: data shards first (identity rows are cheapest)."""
        return avail_sorted[: self.k]

    @staticmethod
    def _common_length(named: Sequence[Tuple[str, np.ndarray]]) -> int:
        sizes = {a.size for _, a in named}
        if len(sizes) > 1:
            desc = ", ".join(f"{n}={a.size}" for n, a in named)
            raise CodecBufferError(f"all shards must have the same length in bytes, got {desc}")
        return sizes.pop() if sizes else 0

    def _run(self, fn: Callable[[int, int], None], length: int) -> None:
        ranges = split_ranges(length, self.threads, self.range_align)
        if len(ranges) == 1:
            fn(0, length)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"codec-{self.name}")
        for f in [self._pool.submit(fn, lo, hi) for lo, hi in ranges]:
            f.result()

    # ---- to implement ------------------------------------------------------------------------
    @abc.abstractmethod
    def _encode_range(self, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        """Write parity bytes ``[lo, hi)`` of every ``dsts[i]`` from ``srcs``."""

    @abc.abstractmethod
    def _decode_plan(self, survivors: Tuple[int, ...], erased: Tuple[int, ...]) -> Any:
        """Precompute (and cache) what :meth:`_decode_range` needs for this erasure pattern."""

    @abc.abstractmethod
    def _decode_range(self, plan: Any, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        """Write bytes ``[lo, hi)`` of the erased shards ``dsts`` from the survivors ``srcs``."""


class MatrixCodec(Codec):
    """A Reed-Solomon codec driven by a parity matrix: encoding runs a plan built from
    ``parity_rows``; decoding runs a plan built (and cached) from the decode matrix of each
    erasure pattern. Subclasses set ``parity_rows``, ``_enc_plan = _make_plan(parity_rows)`` and
    ``_plans = LRUCache(...)``, and implement :meth:`_make_plan` and :meth:`_run_plan`."""

    parity_rows: List[List[int]]
    _enc_plan: Any
    _plans: "LRUCache"

    @abc.abstractmethod
    def _make_plan(self, rows: List[List[int]]) -> Any:
        """Precompute what :meth:`_run_plan` needs to apply the GF(2^8) matrix ``rows``."""

    @abc.abstractmethod
    def _run_plan(self, plan: Any, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        """Apply ``plan`` to bytes ``[lo, hi)``: ``dsts[i] = sum_j rows[i][j] * srcs[j]``."""

    def _encode_range(self, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        self._run_plan(self._enc_plan, srcs, dsts, lo, hi)

    def _decode_plan(self, survivors: Tuple[int, ...], erased: Tuple[int, ...]) -> Any:
        from . import gf256

        return self._plans.get_or((survivors, erased), lambda: self._make_plan(
            gf256.decode_matrix(self.k, self.parity_rows, survivors, erased)))

    def _decode_range(self, plan: Any, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        self._run_plan(plan, srcs, dsts, lo, hi)


def validate_km(name: str, k: Any, m: Any, max_k: int, max_m: int) -> Tuple[int, int]:
    """Check ``k`` and ``m`` and return them as ints (clear :class:`CodecParameterError` otherwise)."""
    for what, v, hi in (("k", k, max_k), ("m", m, max_m)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise CodecParameterError(f"{name}: {what} must be an integer, got {v!r}")
        if not 1 <= int(v) <= hi:
            raise CodecParameterError(f"{name}: {what}={int(v)} is out of range; supported {what} is 1..{hi}")
    return int(k), int(m)
