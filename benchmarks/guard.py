#!/usr/bin/env python3
"""The guard's cost after a restore: checking every restored floating-point value is finite, beside
a raw copy of the same bytes (the least a restore does with them), measured side by side in one run.

The state is a model-like set of tensors (a few large matrices, many small vectors) of ``--mib``
MiB per dtype, fp32 and bf16 (a bf16 model's parameters; its fp32 main parameters and moments are
the fp32 row). Each figure is the median of ``--reps`` runs after one warm-up; the raw copy is
``torch.Tensor.copy_`` into tensors already touched, one thread, like the guard.

Usage::

    python benchmarks/guard.py [--mib 512] [--reps 7] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_ft.trainer import guard


def model_like(mib: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors totalling about ``mib`` MiB: 85 % in 8 matrices, the rest in 200 vectors."""
    total = (mib << 20) // torch.tensor([], dtype=dtype).element_size()
    out = {f"w{i}": torch.randn(int(total * 0.85) // 8, dtype=dtype) for i in range(8)}
    out.update({f"b{i}": torch.randn(int(total * 0.15) // 200, dtype=dtype) for i in range(200)})
    return out


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a restoring rank's share of cores)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("| dtype | MiB | guard (median) | raw copy (median) | guard / raw copy |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        state = model_like(args.mib, dtype)
        dst = {k: torch.empty_like(v).fill_(1) for k, v in state.items()}
        assert guard.non_finite(state) == []

        def copy() -> None:
            for k, v in state.items():
                dst[k].copy_(v)

        g = median_s(lambda: guard.non_finite(state), args.reps)
        c = median_s(copy, args.reps)
        mib = sum(v.nbytes for v in state.values()) / 2**20
        print(f"| {str(dtype).removeprefix('torch.')} | {mib:.0f} | {g * 1e3:.1f} ms | {c * 1e3:.1f} ms | {g / c:.2f}x |")


if __name__ == "__main__":
    main()
