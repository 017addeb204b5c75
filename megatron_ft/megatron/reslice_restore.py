"""A megatron-core rank restored at another data-parallel size from the old ranks' snapshots.

A job that lost a node and goes on with fewer data-parallel replicas (TP x PP unchanged), or grows back,
restores each rank at the new size DP' from the snapshots its tensor/pipeline coordinate's ranks took at
the old size DP - without touching disk when the containers are in memory. The rules:

* **parameters and the distributed optimizer's state** (its fp32 main copies, ``exp_avg``, ``exp_avg_sq``)
  - re-sliced: each old rank's shards record what they hold of the parameters (``extents``), this rank's
  shards at DP' are cut from them (:mod:`megatron_ft.trainer.reslice_read`), bucket padding never
  copied; the buckets are then all-gathered over the new data-parallel group, as after any restore;
* **RNG streams, module buffers, the optimizer's step counters** - data-parallel replica 0's (Megatron's
  own reshard loads every rank's RNG state from replica 0's copy, ``replica_id`` = the data-parallel
  rank); the step counters are the same on every rank and parameter, and refused if they are not;
* **the LR scheduler, the parameter groups' hyper-parameters, the progress** (iteration, consumed
  samples) - replica 0's JSON record. The global batch stays the same, each step's micro-batches per
  rank scale with DP', and the data position (consumed samples) carries over: Megatron's sampler cuts
  each global batch by the new data-parallel rank, so no sample is skipped or seen twice.

Collective: the final all-gather of the buckets runs over each bucket's data-parallel group, so every
rank of the new size calls :func:`restore_resliced` together. Everything before it is local.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..capture.layout import dtype_from_name
from ..capture.state import StateTensor
from ..trainer.recovery import Container, gather_shard
from ..trainer.reslice_read import extents_of, read_resliced
from .state import MegatronStateAdapter


@dataclass(frozen=True)
class ReslicedRestore:
    """What :func:`restore_resliced` did: the step, the old ranks read, the copies and elements re-sliced."""
    step: int
    containers: list[int]
    copies: int
    elements: int


def _replica_state(name: str) -> bool:
    """Whether an entry is restored from data-parallel replica 0 as it is: RNG streams, module buffers."""
    return name.startswith("rng.") or ".buffer." in name


def restore_resliced(adapter: MegatronStateAdapter, sources: Mapping[int, Container], replica0: int,
                     step: int, identity: dict) -> ReslicedRestore:
    """Restore ``adapter``'s model and optimizer at this process's data-parallel size from ``sources``
    (old rank -> its open container of ``step``: every old data-parallel rank of this rank's tensor and
    pipeline coordinate; ``replica0`` among them is the old data-parallel rank 0). Each container must
    be CLEAN, hold ``step`` and match ``identity`` (the keys that do not change with the data-parallel
    size: the run, the model's layout) - else ``SnapshotFormatError``; a range no old rank holds, a dtype
    that differs, or step counters that differ are ``ValueError``; all before the collective part.
    Collective over the new data-parallel groups (see the module)."""
    for container in sources.values():
        container.check_identity(identity, step)
    holders = {rank: extents_of(c) for rank, c in sources.items()}
    keys = {e.param.rsplit(":", 1)[1] for held in holders.values() for e in held if ":" in e.param}
    targets, wanted = adapter.resliced_targets(keys)
    first = sources[replica0]
    direct = adapter.targets(first.layout, first.version.get("extra", {}),
                             only={e.spec.name for e in first.layout.entries if _replica_state(e.spec.name)})
    counters = {e.spec.name: torch.empty(e.spec.shape, dtype=dtype_from_name(e.spec.dtype))
                for e in first.layout.entries if e.spec.name.startswith("optim.") and e.spec.name.endswith(".step")}
    direct.update({n: StateTensor(n, t) for n, t in counters.items()})
    done = read_resliced(sources, {n: t.saved_view() for n, t in targets.items()}, wanted, {replica0: direct},
                         holders)
    adapter.set_step_counters(list(counters.values()))
    for t in targets.values():
        if t.shard is not None:
            gather_shard(t)
    adapter.finish_restore(first.version.get("extra", {}))
    return ReslicedRestore(step, done.containers, done.copies, done.elements)
