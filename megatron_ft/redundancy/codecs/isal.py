"""Cauchy Reed-Solomon over GF(2^8) with Intel ISA-L, called directly through ctypes.

The library is found at run time, in this order:

1. ``$MEGATRON_FT_ISAL_LIB`` (a path to ``libisal.so*``), if set;
2. the system library: Debian/Ubuntu/RHEL paths such as
   ``/usr/lib/x86_64-linux-gnu/libisal.so.2`` (Debian package ``libisal2``, which
   ``scripts/setup.sh`` installs), then ``ctypes.util.find_library("isal")``;
3. the copy bundled in PyPI's ``pyeclib`` wheel (``pyeclib.libs/libisal*.so*``; install with
   ``pip install 'megatron-ft[isal]'``).

Each candidate must export the five functions used here and pass a self-test against the numpy
reference (:func:`gf256.matvec_bytes`) before it is used.

Encoding builds ``ec_init_tables`` once for the ``m x k`` Cauchy rows of
``gf_gen_cauchy1_matrix`` and then makes one ``ec_encode_data`` call per byte range over the
caller's buffers (pointer arrays, no copies; ctypes releases the GIL). Decoding inverts the
``k x k`` survivor submatrix over GF(2^8) (:func:`gf256.decode_matrix`, cross-checked against
ISA-L's ``gf_invert_matrix`` in the tests) and runs the same kernel with the decode rows;
tables are cached per erasure pattern.

Without the library, :class:`IsalRSCodec` can still *decode* (or encode) the same bytes with
the slow numpy reference coder (``allow_reference=True``, what :func:`get_codec` does for a
recorded ``rs-isal`` descriptor), so a node lacking ISA-L can still recover.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from . import gf256
from .base import RS_MAX_K, RS_MAX_M, MatrixCodec, CodecDescriptor, CodecUnavailableError, LRUCache, validate_km

log = logging.getLogger("megatron_ft.redundancy.codecs")

ENV_VAR = "MEGATRON_FT_ISAL_LIB"
SYSTEM_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libisal.so.2",
    "/usr/lib/aarch64-linux-gnu/libisal.so.2",
    "/usr/lib64/libisal.so.2",
    "/usr/local/lib/libisal.so.2",
    "/usr/local/lib64/libisal.so.2",
    "/usr/lib/libisal.so.2",
)
INSTALL_HINT = ("install it with `apt-get install -y libisal2` (Debian/Ubuntu; scripts/setup.sh does this "
                "when run as root) or `pip install 'megatron-ft[isal]'` (PyPI pyeclib wheel, which bundles "
                f"libisal), or point ${ENV_VAR} at a libisal.so")

# ec_encode_data takes an int length: call it on ranges of at most this many bytes
_MAX_CALL_BYTES = 1 << 30

_u8p = ctypes.POINTER(ctypes.c_ubyte)


@dataclass
class IsalLibrary:
    """A loaded, self-tested ISA-L with typed entry points."""

    path: str
    cdll: ctypes.CDLL
    source: str  # "env", "system" or "pyeclib"

    def __post_init__(self) -> None:
        c = self.cdll
        self.gf_gen_cauchy1_matrix = c.gf_gen_cauchy1_matrix
        self.gf_gen_cauchy1_matrix.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self.gf_gen_cauchy1_matrix.restype = None
        self.ec_init_tables = c.ec_init_tables
        self.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.ec_init_tables.restype = None
        self.ec_encode_data = c.ec_encode_data
        self.ec_encode_data.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p]
        self.ec_encode_data.restype = None
        self.gf_invert_matrix = c.gf_invert_matrix
        self.gf_invert_matrix.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.gf_invert_matrix.restype = ctypes.c_int
        self.gf_mul = c.gf_mul
        self.gf_mul.argtypes = [ctypes.c_ubyte, ctypes.c_ubyte]
        self.gf_mul.restype = ctypes.c_ubyte

    # thin helpers (used by the codec, the tests and the benchmark) --------------------------------
    def cauchy1(self, k: int, m: int) -> np.ndarray:
        """``gf_gen_cauchy1_matrix`` for ``k+m`` rows: the full ``(k+m) x k`` matrix."""
        a = np.zeros((k + m) * k, dtype=np.uint8)
        self.gf_gen_cauchy1_matrix(a.ctypes.data, k + m, k)
        return a.reshape(k + m, k)

    def init_tables(self, k: int, rows: np.ndarray) -> np.ndarray:
        """``ec_init_tables`` for an ``r x k`` coefficient matrix; returns the 32*k*r-byte table."""
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        r = rows.shape[0]
        tbls = np.zeros(32 * k * max(r, 1), dtype=np.uint8)
        self.ec_init_tables(k, r, rows.ctypes.data, tbls.ctypes.data)
        return tbls

    def invert(self, mat: np.ndarray) -> Optional[np.ndarray]:
        """``gf_invert_matrix`` (``None`` if singular)."""
        n = mat.shape[0]
        src = np.ascontiguousarray(mat, dtype=np.uint8).copy()
        out = np.zeros((n, n), dtype=np.uint8)
        return None if self.gf_invert_matrix(src.ctypes.data, out.ctypes.data, n) else out


_lib_lock = threading.Lock()
_lib_cache: Optional[Tuple[Optional[IsalLibrary], List[str]]] = None


def _pyeclib_candidates() -> List[str]:
    try:
        spec = importlib.util.find_spec("pyeclib")
    except (ImportError, ValueError):
        spec = None
    roots = []
    if spec is not None:
        for loc in (spec.submodule_search_locations or []):
            roots.append(os.path.dirname(os.path.abspath(loc)))
        if spec.origin:
            roots.append(os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))))
    out: List[str] = []
    for root in dict.fromkeys(roots):
        out += sorted(glob.glob(os.path.join(root, "pyeclib.libs", "libisal*.so*")))
        out += sorted(glob.glob(os.path.join(root, "pyeclib", ".libs", "libisal*.so*")))
    return out


def _candidates() -> List[Tuple[str, str]]:
    cands: List[Tuple[str, str]] = []
    env = os.environ.get(ENV_VAR)
    if env:
        cands.append((env, "env"))
    cands += [(p, "system") for p in SYSTEM_PATHS if os.path.exists(p)]
    found = ctypes.util.find_library("isal")  # a bare soname such as "libisal.so.2" (ldconfig)
    if found:
        cands.append((found, "system"))
    cands += [(p, "pyeclib") for p in _pyeclib_candidates()]
    seen, uniq = set(), []
    for p, s in cands:
        if p not in seen:
            seen.add(p)
            uniq.append((p, s))
    return uniq


def _self_test(lib: IsalLibrary) -> None:
    k, m, n = 5, 3, 1000  # odd length: exercises the library's non-SIMD tail
    want = gf256.encode_matrix(k, gf256.cauchy1_matrix(k, m))
    got = lib.cauchy1(k, m).tolist()
    if got != want:
        raise RuntimeError("gf_gen_cauchy1_matrix differs from the documented construction")
    rng = np.random.default_rng(1234)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]
    par = [np.zeros(n, np.uint8) for _ in range(m)]
    ref = [np.zeros(n, np.uint8) for _ in range(m)]
    rows = np.array(want[k:], dtype=np.uint8)
    tbls = lib.init_tables(k, rows)
    dp = (ctypes.c_void_p * k)(*[d.ctypes.data for d in data])
    pp = (ctypes.c_void_p * m)(*[p.ctypes.data for p in par])
    lib.ec_encode_data(n, k, m, tbls.ctypes.data, dp, pp)
    gf256.matvec_bytes(want[k:], data, ref, 0, n)
    if any(not np.array_equal(a, b) for a, b in zip(par, ref)):
        raise RuntimeError("ec_encode_data output differs from the GF(2^8) reference")
    if lib.gf_mul(0x8E, 0x02) != gf256.mul(0x8E, 0x02):
        raise RuntimeError("gf_mul uses a different field polynomial")


def load_isal(refresh: bool = False) -> Tuple[Optional[IsalLibrary], List[str]]:
    """Find, load and self-test ISA-L. Returns ``(library or None, reasons candidates failed)``."""
    global _lib_cache
    with _lib_lock:
        if _lib_cache is not None and not refresh:
            return _lib_cache
        problems: List[str] = []
        lib: Optional[IsalLibrary] = None
        cands = _candidates()
        if not cands:
            problems.append(f"no libisal found (looked at ${ENV_VAR}, ldconfig, {', '.join(SYSTEM_PATHS[:1])} "
                            f"and friends, and the pyeclib wheel)")
        for path, source in cands:
            try:
                cdll = ctypes.CDLL(path)
                cand = IsalLibrary(path=path, cdll=cdll, source=source)
                _self_test(cand)
            except (OSError, AttributeError, RuntimeError) as e:
                problems.append(f"{path}: {e}")
                continue
            lib = cand
            break
        env = os.environ.get(ENV_VAR)
        if env and (lib is None or lib.source != "env"):
            log.warning("$%s=%s is not a usable ISA-L (%s); %s", ENV_VAR, env,
                        next((p for p in problems if p.startswith(env)), "not loadable"),
                        f"using {lib.path}" if lib is not None else "no ISA-L available")
        _lib_cache = (lib, problems)
        return _lib_cache


def isal_available() -> bool:
    return load_isal()[0] is not None


@dataclass
class _Plan:
    rows: List[List[int]]  # decode rows (len(erased) x k) over the chosen survivors
    tables: Optional[np.ndarray] = None
    extra: dict = field(default_factory=dict)


class IsalRSCodec(MatrixCodec):
    """``rs-isal``: Cauchy Reed-Solomon, byte-wise over GF(2^8), ISA-L's matrix and kernels.

    ``k`` in 1..32, ``m`` in 1..8. Byte ``t`` of parity shard ``k+i`` is
    ``sum_j C[i][j] * data_j[t]`` with ``C = gf_gen_cauchy1_matrix`` rows (see :mod:`gf256`).
    """

    name = "rs-isal"
    version = 1
    range_align = 4096

    def __init__(self, k: int, m: int, *, threads: int = 1, allow_reference: bool = False):
        k, m = validate_km(self.name, k, m, RS_MAX_K, RS_MAX_M)
        super().__init__(k, m, threads)
        lib, problems = load_isal()
        if lib is None and not allow_reference:
            raise CodecUnavailableError(
                f"rs-isal needs the ISA-L library, which was not found: {'; '.join(problems)}. "
                f"Either {INSTALL_HINT}, or use the numpy bit-matrix codec (get_codec('rs', k, m) "
                f"falls back to 'rs-numpy' automatically).")
        self.lib = lib
        #: ``"isal"`` (native kernels) or ``"numpy-reference"`` (same bytes, ~100x slower)
        self.implementation = "isal" if lib is not None else "numpy-reference"
        if lib is None:
            log.warning("ISA-L not found (%s); rs-isal (k=%d, m=%d) runs on the slow numpy reference "
                        "coder (same bytes). To fix: %s", "; ".join(problems), k, m, INSTALL_HINT)
        self.parity_rows = gf256.cauchy1_matrix(k, m)
        self._descriptor = CodecDescriptor(
            name=self.name, version=self.version, k=k, m=m, field=gf256.FIELD_NAME, matrix="cauchy1",
            matrix_sha256=gf256.matrix_fingerprint(self.parity_rows), layout="bytewise")
        self._enc_plan = self._make_plan(self.parity_rows)
        self._plans = LRUCache(256)

    @property
    def descriptor(self) -> CodecDescriptor:
        return self._descriptor

    def _make_plan(self, rows: List[List[int]]) -> _Plan:
        plan = _Plan(rows=rows)
        if self.lib is not None:
            plan.tables = self.lib.init_tables(self.k, np.array(rows, dtype=np.uint8).reshape(len(rows), self.k))
        return plan

    def _run_plan(self, plan: _Plan, srcs: List[np.ndarray], dsts: List[np.ndarray], lo: int, hi: int) -> None:
        if self.lib is None:
            gf256.matvec_bytes(plan.rows, srcs, dsts, lo, hi)
            return
        k, r = len(srcs), len(dsts)
        enc = self.lib.ec_encode_data
        tb = plan.tables.ctypes.data
        sp = (ctypes.c_void_p * k)()
        dp = (ctypes.c_void_p * r)()
        sa = [s.ctypes.data for s in srcs]
        da = [d.ctypes.data for d in dsts]
        for o in range(lo, hi, _MAX_CALL_BYTES):
            n = min(hi - o, _MAX_CALL_BYTES)
            for j in range(k):
                sp[j] = sa[j] + o
            for i in range(r):
                dp[i] = da[i] + o
            enc(n, k, r, tb, sp, dp)

