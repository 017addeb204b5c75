#!/usr/bin/env python3
"""What reading a slot costs the kernel: mapping, populating and unmapping a shared-memory file, against
copying its bytes, in one process, side by side in one run.

A restore that maps the agent's slot pays page-table work per page at both ends of the mapping's life
(4 KiB pages on the default ``/dev/shm``); a raw copy into an already mapped buffer pays none. This
measures each part for one file of ``--mib`` MiB (median of ``--reps``), which is why a process maps each
slot once (``megatron_ft/trainer/mapped_slots.py``):

* ``raw copy``: the bytes copied between two touched buffers (the memory limit);
* ``map + populate``: ``mmap`` + ``MADV_POPULATE_READ`` of the whole file, then the copy, then ``munmap``;
* ``map, fault in``: the same, the pages faulted in by the copy itself;
* ``chunks``: each 4 MiB chunk mapped, populated, copied and unmapped in turn;
* ``pread``: the file read in 4 MiB blocks straight into the destination;
* ``kept mapping``: the copy from a mapping made and populated before (what a restore through the
  engine's mapping does).

Usage::

    python benchmarks/slot_mapping.py [--mib 256] [--reps 7] [--dir /dev/shm]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
import uuid

import numpy as np

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # (Linux 5.14+; Python 3.12 names it)
CHUNK = 4 << 20


def timed(fn) -> dict[str, float]:
    t0 = time.perf_counter()
    parts = fn()
    parts["total"] = time.perf_counter() - t0
    return parts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default="/dev/shm")
    a = p.parse_args()
    n = a.mib << 20
    path = os.path.join(a.dir, f"mft-bench-mapping-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as m:
            m.write(b"\1" * n)
        dst = np.zeros(n, np.uint8)
        src = np.ones(n, np.uint8)

        def raw():
            np.copyto(dst, src)
            return {}

        def whole(populate: bool):
            def run():
                t0 = time.perf_counter()
                mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                if populate:
                    mm.madvise(MADV_POPULATE_READ)
                t1 = time.perf_counter()
                view = np.frombuffer(mm, np.uint8)
                np.copyto(dst, view)
                t2 = time.perf_counter()
                del view
                mm.close()
                return {"map": t1 - t0, "copy": t2 - t1, "unmap": time.perf_counter() - t2}
            return run

        def chunks():
            for off in range(0, n, CHUNK):
                with mmap.mmap(fd, min(CHUNK, n - off), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=off) as mm:
                    mm.madvise(MADV_POPULATE_READ)
                    view = np.frombuffer(mm, np.uint8)
                    np.copyto(dst[off: off + view.size], view)
                    del view
            return {}

        def pread():
            mv = memoryview(dst)
            for off in range(0, n, CHUNK):
                os.preadv(fd, [mv[off: off + CHUNK]], off)
            return {}

        kept = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        kept_view = np.frombuffer(kept, np.uint8)

        def through_kept():
            np.copyto(dst, kept_view)
            return {}

        cases = {"raw copy": raw, "map + populate": whole(True), "map, fault in": whole(False),
                 "chunks": chunks, "pread": pread, "kept mapping": through_kept}
        print(f"{a.mib} MiB in {a.dir}, median of {a.reps} (ms):")
        for name, fn in cases.items():
            runs = [timed(fn) for _ in range(a.reps)]
            med = {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0]}
            parts = "  ".join(f"{k} {v:6.1f}" for k, v in med.items() if k != "total")
            print(f"  {name:15s} total {med['total']:6.1f}  {parts}")
        del kept_view
        kept.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
