#!/usr/bin/env python3
"""Erasure-codec throughput: our codecs beside ISA-L called directly and plain numpy XOR.

For k in {2,4,8} and m in {1,2}, on shards of --shard-mib MiB (default 64), in one process and
on the same preallocated, pre-faulted buffers:

* ``ISA-L direct``: the thinnest ctypes loop: tables and pointer arrays built once outside the
  timer, then one ``ec_encode_data`` call per repetition (decode: the same with the decode rows);
* ``rs-isal``: ``IsalRSCodec.encode`` / ``.decode`` (buffer checks, plan lookup, the same kernel);
* ``rs-numpy``: the numpy XOR-only Cauchy bit-matrix codec (what runs without ISA-L);
* m=1 also: ``numpy XOR`` (``np.bitwise_xor(a, b, out=p)`` then in place for the other shards,
  the obvious numpy loop) beside ``XorCodec``.

Decode rebuilds m lost *data* shards (0..m-1), the expensive case. GB/s counts data bytes:
k x shard bytes per encode or decode (10^9 bytes). Each figure is the median of --reps timed
runs; the compared pair alternates inside each repetition so that machine noise hits both.

    python3 benchmarks/codecs.py                       # full size, updates docs/benchmarks.md
    python3 benchmarks/codecs.py --shard-mib 4 --reps 3 --no-docs   # quick look
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Callable, List, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ft.redundancy.codecs import BitmatrixRSCodec, IsalRSCodec, XorCodec, gf256, load_isal  # noqa: E402

SECTION = "## Codecs"
TARGET_RS = 0.8
TARGET_XOR = 0.8


def timeit(fns: List[Callable[[], None]], reps: int) -> List[float]:
    """Median seconds of each fn; the fns alternate within every repetition (after one warm-up)."""
    for f in fns:
        f()
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def isal_direct(lib, k: int, rows: List[List[int]], srcs: List[np.ndarray], dsts: List[np.ndarray]) -> Callable[[], None]:
    """The thinnest possible ISA-L call: everything prepared once, one C call per run."""
    r = len(rows)
    tbls = lib.init_tables(k, np.array(rows, np.uint8).reshape(r, k))
    sp = (ctypes.c_void_p * k)(*[s.ctypes.data for s in srcs])
    dp = (ctypes.c_void_p * r)(*[d.ctypes.data for d in dsts])
    n = srcs[0].size
    enc = lib.ec_encode_data
    tb = tbls.ctypes.data

    def run() -> None:
        enc(n, k, r, tb, sp, dp)
    return run


def numpy_xor(srcs: List[np.ndarray], dst: np.ndarray) -> Callable[[], None]:
    def run() -> None:
        np.bitwise_xor(srcs[0], srcs[1], out=dst)
        for s in srcs[2:]:
            np.bitwise_xor(dst, s, out=dst)
    return run


def gbps(k: int, n: int, t: float) -> float:
    return k * n / t / 1e9


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}"


def run(args) -> Tuple[str, List[str]]:
    n = int(args.shard_mib * (1 << 20))
    ks = [int(x) for x in args.k.split(",")]
    ms = [int(x) for x in args.m.split(",")]
    kmax, mmax = max(ks), max(ms)
    lib, problems = load_isal()
    rng = np.random.default_rng(0)
    # preallocate and pre-fault everything once (first touch of fresh pages is ~10x slower)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(kmax)]
    parity = [np.ones(n, np.uint8) for _ in range(mmax)]
    out = [np.ones(n, np.uint8) for _ in range(mmax)]
    out2 = [np.ones(n, np.uint8) for _ in range(mmax)]

    rs_rows: List[str] = []
    xor_rows: List[str] = []
    misses: List[str] = []
    for k in ks:
        for m in ms:
            d, p = data[:k], parity[:m]
            lost = list(range(m))
            npy = BitmatrixRSCodec(k, m)
            line = {"k": k, "m": m}
            if lib is not None:
                isal = IsalRSCodec(k, m)
                # encode
                t_dir, t_cod = timeit([isal_direct(lib, k, gf256.cauchy1_matrix(k, m), d, out2[:m]),
                                       lambda: isal.encode(d, p)], args.reps)
                line.update(enc_dir=gbps(k, n, t_dir), enc_isal=gbps(k, n, t_cod))
                shards = d + p
                surv = [i for i in range(k + m) if i not in lost][:k]
                avail = {i: shards[i] for i in surv}
                dec_rows = gf256.decode_matrix(k, isal.parity_rows, surv, lost)
                outd = {e: out[e] for e in lost}
                t_dir, t_cod = timeit([isal_direct(lib, k, dec_rows, [shards[i] for i in surv], out2[:m]),
                                       lambda: isal.decode(avail, lost, outd)], args.reps)
                line.update(dec_dir=gbps(k, n, t_dir), dec_isal=gbps(k, n, t_cod))
                assert all(np.array_equal(out[e], d[e]) for e in lost), "rs-isal decode is wrong"
            # rs-numpy
            (t_enc,) = timeit([lambda: npy.encode(d, p)], args.reps)
            shards = d + p
            avail = {i: shards[i] for i in range(k + m) if i not in lost}
            outd = {e: out[e] for e in lost}
            (t_dec,) = timeit([lambda: npy.decode(avail, lost, outd)], args.reps)
            assert all(np.array_equal(out[e], d[e]) for e in lost), "rs-numpy decode is wrong"
            line.update(enc_npy=gbps(k, n, t_enc), dec_npy=gbps(k, n, t_dec))
            if lib is not None:
                r_enc = line["enc_isal"] / line["enc_dir"]
                r_dec = line["dec_isal"] / line["dec_dir"]
                rs_rows.append(
                    f"| {k} | {m} | {line['enc_dir']:.2f} | {line['enc_isal']:.2f} | **{r_enc:.2f}x** | "
                    f"{line['enc_npy']:.2f} | {line['dec_dir']:.2f} | {line['dec_isal']:.2f} | {r_dec:.2f}x | "
                    f"{line['dec_npy']:.2f} |")
                if r_enc < TARGET_RS:
                    misses.append(f"rs-isal encode k={k} m={m}: {r_enc:.2f}x ISA-L direct (< {TARGET_RS}x)")
            else:
                rs_rows.append(f"| {k} | {m} | n/a | n/a | n/a | {line['enc_npy']:.2f} | n/a | n/a | n/a | "
                               f"{line['dec_npy']:.2f} |")
            if m == 1:
                xc = XorCodec(k)
                t_np, t_x = timeit([numpy_xor(d, out2[0]), lambda: xc.encode(d, p)], args.reps)
                e_np, e_x = gbps(k, n, t_np), gbps(k, n, t_x)
                avail = {i: (d + p)[i] for i in range(1, k + 1)}
                t_np, t_x = timeit([numpy_xor([avail[i] for i in range(1, k + 1)], out2[0]),
                                    lambda: xc.decode(avail, [0], {0: out[0]})], args.reps)
                assert np.array_equal(out[0], d[0]), "xor decode is wrong"
                d_np, d_x = gbps(k, n, t_np), gbps(k, n, t_x)
                xor_rows.append(f"| {k} | {e_np:.2f} | {e_x:.2f} | **{e_x / e_np:.2f}x** | {d_np:.2f} | {d_x:.2f} | "
                                f"{d_x / d_np:.2f}x |")
                if e_x / e_np < TARGET_XOR:
                    misses.append(f"xor encode k={k}: {e_x / e_np:.2f}x numpy XOR (< {TARGET_XOR}x)")
            print(f"  done k={k} m={m}", file=sys.stderr, flush=True)

    lib_line = (f"ISA-L: `{lib.path}` ({lib.source})" if lib is not None
                else f"ISA-L: **not found** ({'; '.join(problems)}); ISA-L columns are n/a")
    md = [
        f"{SECTION}",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine()}; {lib_line}.",
        f"Shards of {args.shard_mib:g} MiB, median of {args.reps} runs, single thread, load average (1/5/15 min) "
        f"before/after {args.load_before} / {' '.join(f'{x:.2f}' for x in os.getloadavg())}. "
        "GB/s = k x shard bytes / time (10^9 B/s). Decode rebuilds m lost data shards. Command:",
        "",
        "```bash",
        f"python3 benchmarks/codecs.py {' '.join(sys.argv[1:])}".rstrip(),
        "```",
        "",
        "Reed-Solomon (`rs-isal` = `IsalRSCodec`, target encode >= 0.8x ISA-L called directly; "
        "`rs-numpy` = XOR-only Cauchy bit-matrix code used without ISA-L, not byte-compatible):",
        "",
        "| k | m | encode ISA-L direct | encode rs-isal | ratio | encode rs-numpy | decode ISA-L direct | "
        "decode rs-isal | ratio | decode rs-numpy |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rs_rows,
        "",
        "XOR parity, m=1 (`XorCodec`, target >= 0.8x numpy `bitwise_xor(..., out=)`):",
        "",
        "| k | encode numpy XOR | encode xor codec | ratio | decode numpy XOR | decode xor codec | ratio |",
        "|---|---|---|---|---|---|---|",
        *xor_rows,
        "",
        ("Targets: all met." if not misses else "Targets missed: " + "; ".join(misses) + "."),
        "",
    ]
    return "\n".join(md), misses


def write_section(path: str, section: str) -> None:
    """Replace (or append) the '## Codecs' section, leaving the rest of the file alone."""
    from _docs import write_section as write

    write(path, SECTION, section.split("\n", 1)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard-mib", type=float, default=64, help="bytes per shard, MiB (default 64)")
    ap.add_argument("--k", default="2,4,8", help="data shard counts (default 2,4,8)")
    ap.add_argument("--m", default="1,2", help="parity shard counts (default 1,2)")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per figure (median; default 7)")
    ap.add_argument("--docs", default=os.path.join(REPO, "docs", "benchmarks.md"),
                    help="markdown file whose '## Codecs' section is replaced")
    ap.add_argument("--no-docs", action="store_true", help="print only, do not touch the docs file")
    args = ap.parse_args()
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    md, misses = run(args)
    print(md)
    if not args.no_docs:
        write_section(args.docs, md)
        print(f"wrote section {SECTION!r} in {args.docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
