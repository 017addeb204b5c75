"""The guard after every restore: bytes that pass their checksums are not yet values to train on.

A chunk checksum proves a snapshot holds the bytes its writer wrote; a snapshot taken while the
model already held NaN (or a copy damaged and re-summed on the way) passes it and would be trained
on. Before any rank trains on a restored version, every rank checks the values it restored:

* **finite**: every floating-point tensor it restored holds only finite values (NaN and +-Inf are
  refused). Integer tensors (RNG states, counters) are not checked.

* **losses** (where the training loop reports its loss: the project's script, not upstream
  Megatron-LM's ``train()``): each node's agent keeps the loss of every committed snapshot's step (the
  last ``megatron_ft.agent.guard_memory.LOSS_HISTORY`` steps per rank). For ``recovery.guard_iterations`` iterations after a
  restore, each iteration's loss is judged by :func:`loss_anomaly` against that history - a step
  that was trained before the failure (a replayed, lost iteration) must come out within
  ``recovery.loss_tolerance`` of its recorded loss; a step beyond the history must not exceed
  ``recovery.loss_spike`` times the largest of the last :data:`SPIKE_WINDOW` recorded losses (the rule
  when no iteration was lost); a non-finite loss is always an anomaly. The ranks agree on the
  verdict every iteration (an all-reduce), take no snapshot meanwhile (the older versions stay in
  the slots), and on an anomaly every rank drops the restored version and everything newer (its
  agent's ``refuse``) and exits (:data:`EXIT_ROLLBACK`): the restart restores the
  next older version. The agents count these rollbacks; past ``recovery.max_rollbacks`` the job ends.

The value check runs inside :meth:`megatron_ft.trainer.recovery.Restorer.restore`, after a candidate's
bytes were read and verified and before the ranks agree on it: a version that fails it on any rank
fails on every rank together, is invalidated where it is held, and the restore goes on to the next
older version (local, peer, disk) - a *rollback*. At most ``recovery.max_rollbacks`` such rollbacks
per restore; one more ends the job (exit :data:`megatron_ft.fatal.EXIT_ROLLBACKS_EXHAUSTED`, 3) instead of looping through
restarts on a job whose every version is garbage.

**Certified versions** (``recovery.prefer: certified``): every iteration's loss is judged by the same
rules (against the run's recent losses), the ranks agree, and :class:`Certifier` marks the version
the job trained ``recovery.certify_after`` iterations past with no anomaly; its agent keeps it, and a
restore takes the newest certified version rather than the newest.

Cost: one read of the restored floating-point bytes, in blocks of :data:`BLOCK_ELEMENTS` (see
:func:`_block_sums_finite`), measured against a raw copy of the same bytes in docs/benchmarks.md.

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

import logging
import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from ..agent.certification import Certification, Certifier  # noqa: F401 (the trainer's, with the collective agreement)
from .device_staging import stream_point

log = logging.getLogger("megatron_ft.trainer.guard")

#: elements checked per ``torch.isfinite`` call (its temporary: this many bytes)
BLOCK_ELEMENTS = 1 << 22


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an infinity, in order. Not
    collective; reads each tensor once (on its own device)."""
    return ValueScreen(tensors).result()


class ValueScreen:
    """:func:`non_finite` in two steps, so that a restore can queue the reads on the device while its
    copies are still landing: the constructor queues every tensor's reads on the current stream of its
    device (no host synchronisation; on the CPU they run there and then) and records where they end;
    :meth:`result` waits for them, once per device, on the caller's current stream. The tensors must not
    change in between. Not thread-safe; not collective.

    On the CPU each tensor is read in blocks (:func:`_block_sums_finite`); the floating-point tensors of a
    CUDA device are read together by one fused reduction (:func:`_norms_finite`: a few launches for the
    whole state, where blocks cost several launches per tensor - about 1 ms for 32 tensors on the H200).

    >>> s = ValueScreen({"w": torch.tensor([1.0, float("inf")]), "b": torch.ones(2)})
    >>> s.result()
    ['w']
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.screened = [(name, t.detach().reshape(-1)) for name, t in tensors.items()
                         if (t.is_floating_point() or t.is_complex()) and t.numel()]
        #: (indices into ``screened``, whether each one's sums are finite), queued where the tensors live
        self.pending: list[tuple[list[int], torch.Tensor]] = []
        fused: dict[tuple[torch.device, torch.dtype], list[int]] = {}  # (the fused kernel takes one dtype)
        for i, (_, flat) in enumerate(self.screened):
            if _fusable(flat):
                fused.setdefault((flat.device, flat.dtype), []).append(i)
            else:
                self.pending.append(([i], _block_sums_finite(flat).reshape(1)))
        for idx in fused.values():
            flats = [self.screened[i][1] for i in idx]
            try:
                self.pending.append((idx, _norms_finite(flats)))
            except (RuntimeError, TypeError) as e:  # this torch cannot: blocks, as on the CPU (said once)
                _FUSED["usable"] = False
                log.warning("the value guard's fused reduction failed (%s): reading tensors block by block", e)
                self.pending.extend(([i], _block_sums_finite(f).reshape(1)) for i, f in zip(idx, flats))
        self.queued = {d: stream_point(d) if d.type == "cuda" else None for d in {f.device for _, f in self.screened}}

    def result(self) -> list[str]:
        ok = [True] * len(self.screened)
        by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        for idx, finite in self.pending:
            by_device.setdefault(finite.device, []).append((idx, finite))
        for device, parts in by_device.items():  # one wait per device
            ev = self.queued.get(device)
            if ev is not None:  # the reads were queued on another stream, perhaps
                torch.cuda.current_stream(device).wait_event(ev)
            flags = torch.cat([finite for _, finite in parts]).cpu().tolist()
            for i, flag in zip([i for idx, _ in parts for i in idx], flags):
                ok[i] = bool(flag)
        return [name for (name, flat), fine in zip(self.screened, ok)
                if not fine and not bool(torch.isfinite(flat).all())]


#: whether :func:`_norms_finite` works with this torch (turned off the first time it raises)
_FUSED = {"usable": True}


def _fusable(flat: torch.Tensor) -> bool:
    """Whether ``flat`` is read by the fused reduction: a floating-point tensor on a CUDA device."""
    return flat.device.type == "cuda" and flat.is_floating_point() and _FUSED["usable"]


def _norms_finite(flats: list[torch.Tensor]) -> torch.Tensor:
    """Whether each floating-point tensor of ``flats`` (all of one device and dtype) has a finite L1 norm,
    summed in fp32: a bool tensor of ``len(flats)``, no host synchronisation. ``torch._foreach_norm`` (what
    ``clip_grad_norm_`` uses) reads every tensor in one fused multi-tensor kernel on CUDA. A NaN or an
    infinity anywhere makes the norm NaN or infinite; finite values whose norm overflows (the last one
    here) are then checked value by value, as with the blocks.

    >>> _norms_finite([torch.ones(3), torch.tensor([1.0, float("nan")]), torch.full((2,), 3e38)])
    tensor([ True, False, False])
    """
    return torch.isfinite(torch.stack(torch._foreach_norm(flats, 1, dtype=torch.float32)))


def _block_sums_finite(flat: torch.Tensor) -> torch.Tensor:
    """Whether every block of ``BLOCK_ELEMENTS`` values of ``flat`` has a finite sum: a 0-d bool tensor on
    ``flat``'s device, no host synchronisation. A NaN or an infinity anywhere makes its block's sum NaN or
    infinite (IEEE 754); a vectorised reduction reads memory at close to copy speed, 5-10x faster than
    ``isfinite`` here. Only a tensor with a block whose sum is not finite - which finite values too large
    to add up could also give - is then checked value by value (:func:`non_finite`)."""
    full = flat.numel() - flat.numel() % BLOCK_ELEMENTS
    parts = [flat[:full].view(-1, BLOCK_ELEMENTS).sum(dim=1)] if full else []
    if full < flat.numel():
        parts.append(flat[full:].sum().reshape(1))
    return torch.isfinite(torch.cat(parts)).all()


#: the exit code of a trainer that rolls back after a failed loss check: its restart (a fast round or
#: torchrun's) restores the next older version
EXIT_ROLLBACK = 4
#: recorded losses the spike rule looks back on
SPIKE_WINDOW = 8


@dataclass(frozen=True)
class LossRule:
    """``recovery.loss_tolerance`` and ``recovery.loss_spike`` (see :func:`loss_anomaly`)."""

    tolerance: float = 0.05
    spike: float = 2.0


def loss_anomaly(step: int, loss: Optional[float], history: Mapping[int, float], rule: LossRule = LossRule()) -> Optional[str]:
    """Why the loss of ``step``, trained after a restore, is an anomaly - or ``None``. Pure.

    >>> h = {3: 2.0, 4: 1.9, 5: 1.8}
    >>> loss_anomaly(5, 1.8, h), loss_anomaly(6, 1.7, h), loss_anomaly(7, None, h)  # replayed, new, no loss here
    (None, None, None)
    >>> loss_anomaly(5, 2.5, h)
    'step 5: loss 2.5 replayed, 1.8 recorded before the failure (more than 5% apart)'
    >>> loss_anomaly(6, 4.5, h)
    'step 6: loss 4.5 > 2 x 2, the largest of the 3 losses recorded before it'
    >>> loss_anomaly(6, float("nan"), h)
    'step 6: loss nan is not finite'
    """
    if loss is None:
        return None
    if not math.isfinite(loss):
        return f"step {step}: loss {loss} is not finite"
    if step in history:
        want = history[step]
        if abs(loss - want) > rule.tolerance * max(abs(want), 1e-12):
            return (f"step {step}: loss {loss:.6g} replayed, {want:.6g} recorded before the failure (more than "
                    f"{rule.tolerance:.0%} apart)")
        return None
    before = [history[s] for s in sorted(history) if s < step][-SPIKE_WINDOW:]
    if before and loss > rule.spike * max(before):
        return (f"step {step}: loss {loss:.6g} > {rule.spike:g} x {max(before):.6g}, the largest of the "
                f"{len(before)} losses recorded before it")
    return None


class RollbacksExhausted(RuntimeError):
    """Every rank: more restored versions failed the guard than ``recovery.max_rollbacks`` allows.
    Nothing trustworthy is left to resume from; the job ends (exit 3, never restarted)."""
