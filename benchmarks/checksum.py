"""The snapshot's chunk checksum: the product's fused copy + fl32x8 (and the fl64x4 it replaced) against CRC32C (SSE4.2, one
chain and three interleaved chains) fused into the same copy, and XXH3 (the ``xxhash`` package:
a copy, then the hash - two passes, no fused form exists in Python), each as throughput relative to
a plain copy of the same bytes measured in the same repetitions, plus how often each misses the
corruptions a snapshot can suffer (bit flips, bursts, swapped words and chunks).

    python benchmarks/checksum.py [--mib 256] [--reps 7] [--trials 2000] [--out docs/benchmarks.md]

Writes the "## Checksum" section of docs/benchmarks.md. CRC32C candidates are compiled from
``benchmarks/_checksum_candidates.c`` with the system C compiler (nothing of them is installed);
XXH3 is skipped when ``xxhash`` is not installed (``pip install -e '.[bench]'``).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from megatron_ft.capture import checksum as fl  # noqa: E402
from _docs import write_section  # noqa: E402

SECTION = "## Checksum"
CHUNK = 4 << 20  # the snapshot's default chunk (snapshot.chunk_mib)


def build_candidates() -> ctypes.CDLL:
    out = os.path.join(tempfile.mkdtemp(prefix="mft-cksum-"), "cand.so")
    subprocess.run(["cc", "-O3", "-msse4.2", "-fPIC", "-shared", "-o", out,
                    os.path.join(HERE, "_checksum_candidates.c")], check=True)
    lib = ctypes.CDLL(out)
    for name in ("crc32c_copy_1", "crc32c_copy_3"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32]
        fn.restype = ctypes.c_uint32
    lib.crc32c_reference.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.crc32c_reference.restype = ctypes.c_uint32
    return lib


def xxh3():
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash


def methods(lib, xx) -> dict:
    """name -> fn(dst, src) copying src to dst and returning a digest, chunk by chunk."""

    def chunked(one):
        def run(dst, src):
            out = 0
            for lo in range(0, src.size, CHUNK):
                out ^= one(dst[lo: lo + CHUNK], src[lo: lo + CHUNK])
            return out
        return run

    def ptr(a):
        return a.ctypes.data

    m = {
        "copy (np.copyto)": chunked(lambda d, s: (np.copyto(d, s), 0)[1]),
        f"{fl.ALGORITHM} fused (product)": chunked(lambda d, s: fl.copy_checksum(d, s)),
        "fl64x4-v2 fused (format 2)": chunked(lambda d, s: fl.copy_checksum(d, s, "fl64x4-v2")),
        "CRC32C fused, 1 chain": chunked(lambda d, s: lib.crc32c_copy_1(ptr(d), ptr(s), s.size, 0)),
        "CRC32C fused, 3 chains": chunked(lambda d, s: lib.crc32c_copy_3(ptr(d), ptr(s), s.size, 0)),
    }
    if xx is not None:
        m["XXH3-64: copy, then hash"] = chunked(lambda d, s: (np.copyto(d, s), xx.xxh3_64_intdigest(d))[1])
    return m


def digests(lib, xx) -> dict:
    """name -> fn(bytes as uint8 array) -> digest (detection experiments)."""
    out = {alg: (lambda a, alg=alg: fl.checksum(a, alg)) for alg in fl.READS}
    out["CRC32C"] = lambda a: lib.crc32c_copy_3(None, a.ctypes.data, a.size, 0)
    if xx is not None:
        out["XXH3-64"] = lambda a: xx.xxh3_64_intdigest(a)
    return out


def check_crc(lib) -> None:
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 9, 24575, 24576, 24577, 3 * 8192 * 5 + 13, 1 << 20):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        ref = lib.crc32c_reference(a.ctypes.data, n)
        d1, d3 = np.empty_like(a), np.empty_like(a)
        assert lib.crc32c_copy_1(d1.ctypes.data, a.ctypes.data, n, 0) == ref, n
        assert lib.crc32c_copy_3(d3.ctypes.data, a.ctypes.data, n, 0) == ref, n
        assert np.array_equal(d1, a) and np.array_equal(d3, a)
    assert lib.crc32c_reference(b"123456789", 9) == 0xE3069283  # the CRC32C check value


def throughput(ms: dict, mib: int, reps: int) -> dict:
    src = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    for fn in ms.values():  # warm up: page in dst, load code
        fn(dst, src)
    times: dict[str, list[float]] = {k: [] for k in ms}
    for r in range(reps):  # interleaved, a different order each repetition
        order = list(ms)[r % len(ms):] + list(ms)[: r % len(ms)]
        for name in order:
            t0 = time.perf_counter()
            ms[name](dst, src)
            times[name].append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------ detection
def corruptions(rng: np.random.Generator, n: int) -> dict:
    """kind -> fn(array copy) that corrupts it in place (one random instance per call)."""
    def flip1(a):
        i = int(rng.integers(0, n * 8))
        a[i // 8] ^= 1 << (i % 8)

    def flip2(a):
        for i in rng.choice(n * 8, 2, replace=False):
            a[int(i) // 8] ^= 1 << (int(i) % 8)

    def burst(a):  # up to 32 consecutive bits, first and last flipped
        length = int(rng.integers(2, 33))
        start = int(rng.integers(0, n * 8 - length))
        bits = [start, start + length - 1] + [start + k for k in range(1, length - 1) if rng.random() < 0.5]
        for b in bits:
            a[b // 8] ^= 1 << (b % 8)

    def swap_words(a):  # two different 8-byte words trade places
        w = a.view("<u8")
        while True:
            i, j = (int(x) for x in rng.choice(w.size, 2, replace=False))
            if w[i] != w[j]:
                w[i], w[j] = w[j], w[i]
                return

    def swap_4k(a):
        blocks = n // 4096
        i, j = (int(x) for x in rng.choice(blocks, 2, replace=False))
        x = a[i * 4096:(i + 1) * 4096].copy()
        a[i * 4096:(i + 1) * 4096] = a[j * 4096:(j + 1) * 4096]
        a[j * 4096:(j + 1) * 4096] = x

    def sign_pair(a):  # the sign bits of two float64 words 8 lane-words apart (same fl64x4 lane)
        w = a.view("<u8")
        i = int(rng.integers(0, w.size - 32))
        w[i] ^= np.uint64(1 << 63)
        w[i + 32] ^= np.uint64(1 << 63)

    def neg_swap(a):  # x and -x trade places 8 lane-words apart (a sign error in a swapped pair)
        w = a.view("<u8")
        i = int(rng.integers(0, w.size - 32))
        w[i + 32] = w[i] ^ np.uint64(1 << 63)
        w[i], w[i + 32] = w[i + 32], w[i]

    return {"1 bit flipped": flip1, "2 bits flipped": flip2, "burst of <= 32 bits": burst,
            "two 8-byte words swapped": swap_words, "two 4 KiB blocks swapped": swap_4k,
            "sign bits of 2 float64 32 words apart": sign_pair, "x and -x swapped 32 words apart": neg_swap}


def detection(dg: dict, trials: int, n: int = 64 << 10) -> dict:
    rng = np.random.default_rng(7)
    base = rng.standard_normal(n // 8).view(np.uint8)  # float64 data, as model state is
    kinds = corruptions(rng, n)
    missed = {k: {a: 0 for a in dg} for k in kinds}
    ref = {a: f(base) for a, f in dg.items()}
    for kind, corrupt in kinds.items():
        for _ in range(trials):
            bad = base.copy()
            corrupt(bad)
            if np.array_equal(bad, base):
                continue
            for a, f in dg.items():
                missed[kind][a] += f(bad) == ref[a]
    return missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes copied per measurement (MiB)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--trials", type=int, default=2000, help="corruptions per kind in the detection experiment")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md"))
    args = ap.parse_args()
    if not fl.HAVE_NATIVE:
        print("the native fl64x4 library is not built (pip install -e .): the comparison would be unfair")
        return 1
    lib = build_candidates()
    check_crc(lib)
    xx = xxh3()
    ms = methods(lib, xx)
    times = throughput(ms, args.mib, args.reps)
    base = times["copy (np.copyto)"]
    rows = []
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base))
        rows.append((name, statistics.median(ts), (args.mib / 1024) / statistics.median(ts), ratio))
    missed = detection(digests(lib, xx), args.trials)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    lines = [f"Measured {when} on {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, with "
             f"`python benchmarks/checksum.py --mib {args.mib} --reps {args.reps} --trials {args.trials}`: "
             f"{args.mib} MiB copied in {CHUNK >> 20} MiB chunks (the snapshot's chunk), each method's time "
             f"and, paired per repetition, its ratio to a plain copy of the same bytes (median of {args.reps}).",
             "", "| method | median s | GiB/s | / plain copy |", "|---|---|---|---|"]
    lines += [f"| {n} | {s:.4f} | {g:.2f} | {r:.2f} |" for n, s, g, r in rows]
    if xx is None:
        lines += ["", "XXH3 not measured: the `xxhash` package is not installed."]
    algs = list(next(iter(missed.values())))
    lines += ["", f"Missed corruptions out of {args.trials} per kind (64 KiB of float64 data):", "",
              "| corruption | " + " | ".join(algs) + " |", "|---|" + "---|" * len(algs)]
    lines += [f"| {k} | " + " | ".join(str(v[a]) for a in algs) + " |" for k, v in missed.items()]
    body = "\n".join(lines)
    print(body)
    if args.out:
        write_section(args.out, SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
