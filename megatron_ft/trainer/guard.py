"""The guard after every restore: bytes that pass their checksums are not yet values to train on.

A chunk checksum proves a snapshot holds the bytes its writer wrote; a snapshot taken while the
model already held NaN (or a copy damaged and re-summed on the way) passes it and would be trained
on. Before any rank trains on a restored version, every rank checks the values it restored:

* **finite**: every floating-point tensor it restored holds only finite values (NaN and +-Inf are
  refused). Integer tensors (RNG states, counters) are not checked.

The check runs inside :meth:`megatron_ft.trainer.recovery.Restorer.restore`, after a candidate's
bytes were read and verified and before the ranks agree on it: a version that fails it on any rank
fails on every rank together, is invalidated where it is held, and the restore goes on to the next
older version (local, peer, disk) - a *rollback*. At most ``recovery.max_rollbacks`` such rollbacks
per restore; one more ends the job (exit :data:`megatron_ft.fatal.EXIT_ROLLBACKS_EXHAUSTED`, 3) instead of looping through
restarts on a job whose every version is garbage.

Cost: one read of the restored floating-point bytes, in blocks of :data:`BLOCK_ELEMENTS` (see
:func:`_finite`), measured against a raw copy of the same bytes in docs/benchmarks.md.

Worked example::

    >>> import torch
    >>> ok = {"w": torch.ones(4), "rng": torch.zeros(3, dtype=torch.uint8)}
    >>> non_finite(ok)
    []
    >>> bad = {"w": torch.tensor([1.0, float("nan")]), "b": torch.tensor([float("inf")]), "c": torch.zeros(2)}
    >>> non_finite(bad)
    ['w', 'b']
"""
from __future__ import annotations

from typing import Mapping

import torch

#: elements checked per ``torch.isfinite`` call (its temporary: this many bytes)
BLOCK_ELEMENTS = 1 << 22


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an infinity, in order. Not
    collective; reads each tensor once (on its own device)."""
    bad = []
    for name, t in tensors.items():
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        if not all(_finite(flat[i: i + BLOCK_ELEMENTS]) for i in range(0, flat.numel(), BLOCK_ELEMENTS)):
            bad.append(name)
    return bad


def _finite(block: torch.Tensor) -> bool:
    """Every value of ``block`` finite. Screened by its sum (a NaN or an infinity anywhere makes the sum
    NaN or infinite, IEEE 754; a vectorised reduction reads memory at close to copy speed, 5-10x faster
    than ``isfinite`` here); only a block whose sum is not finite - which finite values too large to add
    up could also give - is checked value by value."""
    return bool(torch.isfinite(block.sum())) or bool(torch.isfinite(block).all())


class RollbacksExhausted(RuntimeError):
    """Every rank: more restored versions failed the guard than ``recovery.max_rollbacks`` allows.
    Nothing trustworthy is left to resume from; the job ends (exit 3, never restarted)."""
