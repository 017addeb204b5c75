"""Upstream Megatron-LM's local-checkpoint restore at another data-parallel size, from the old ranks' snapshots.

A job run by upstream Megatron-LM's own ``pretrain_gpt.py`` restores through its local checkpoint tier
(:mod:`megatron_ft.megatron.local_manager`): Megatron takes a tensor-aware state dict from the manager's
``load()`` and calls its ``to_state_dict(sharded_state_dict, ...)`` with the sharded state dict of the model
and optimizer as they are now - at the new data-parallel size DP', after a lost node (or at DP again after a
grow-back). Each snapshot the old ranks took at DP holds the same kind of sharded state dict (megatron-core's
``ShardedTensor``/``ShardedObject`` entries, deduplicated over the old data-parallel group: each shard's data
on one old rank). :class:`ReshardedStateDict` answers that call from the old data-parallel ranks of this
rank's tensor and pipeline coordinate, read from memory (the containers the launcher imported,
:func:`~megatron_ft.megatron.generation_restore.open_imports`):

* **every sharded tensor** is filled by its global coordinates from the old shards of the same key - the
  box each covers in the global tensor (``global_offset``, the prepended axes, the local shape), as megatron-core's ``dist_checkpointing`` fills it from a
  ``torch_dist`` checkpoint on disk. This covers the model's parameters (replicated over DP, saved by one
  old rank each) and the distributed optimizer's ``dp_reshardable`` bucket shards (one global 1-D tensor
  per bucket, cut by DP at save and by DP' here); a wanted element no old shard holds is refused by name;
* **every sharded object** (the RNG streams, the buckets' sizes) is the old main replica's - data-parallel
  replica 0's, which is what a ``torch_dist`` checkpoint stores and so what Megatron's own reshard gives
  every rank. The distributed optimizer's unpadded bucket sizes must equal the new ones (Megatron's own
  rule for ``dp_reshardable``): a difference is refused with the sizes;
* **the common part** (the run's arguments, the iteration, the scheduler, the consumed samples) is old
  data-parallel replica 0's record; Megatron sees the checkpoint's data-parallel size differ from the
  run's and behaves as after its own reshard (its rerun state is not loaded, the sampler cuts each global
  batch by the new data-parallel rank, so no sample is skipped or seen twice).

Each old container is read whole, every chunk's checksum verified, into buffers of its own, one at a time
(at most two alive: the one being filled from and the next being read); nothing is written to a destination from a container
that failed. Not collective: megatron-core's own ``to_state_dict`` finishes the job (its ``atomic`` path,
every shard local) and no access-integrity check runs across the world.

Worked example of the coordinates (pure): the old rank held rows 2..5 of a (6, 4) tensor, the new one wants
rows 4..5 - rows 2..3 of the old shard, 0..1 of the new.

>>> overlap(((2, 0), (4, 4)), ((4, 0), (2, 4)))
((slice(2, 4, None), slice(0, 4, None)), (slice(0, 2, None), slice(0, 4, None)))
>>> overlap(((0,), (3,)), ((3,), (3,))) is None
True
"""
from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import replace
from typing import Any, Callable, Iterable, NoReturn, Optional

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
from megatron.core.dist_checkpointing.utils import (_sharded_object_id, _sharded_tensor_shard_id,
                                                   extract_sharded_base)

from ..capture import tree as treecodec
from ..capture.snapfile import SnapshotFormatError
from ..capture.state import StateTensor, fresh_targets
from ..trainer.recovery import Container

#: a box in a global tensor: (offset, shape), one entry per global axis
Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_of(sh: ShardedTensor) -> Box:
    """The box ``sh`` covers in its global tensor (its prepended axes have length 1)."""
    return tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape)


def overlap(a: Box, b: Box) -> Optional[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """Where boxes ``a`` and ``b`` meet: the slices of the common part in ``a``'s local coordinates and in
    ``b``'s, or None when they do not (pure; see the module's example)."""
    (ao, ash), (bo, bsh) = a, b
    if len(ao) != len(bo):
        raise ValueError(f"boxes of {len(ao)} and {len(bo)} axes cannot overlap")
    in_a, in_b = [], []
    for x0, xn, y0, yn in zip(ao, ash, bo, bsh):
        lo, hi = max(x0, y0), min(x0 + xn, y0 + yn)
        if lo >= hi:
            return None
        in_a.append(slice(lo - x0, hi - x0))
        in_b.append(slice(lo - y0, hi - y0))
    return tuple(in_a), tuple(in_b)


class _Target:
    """One wanted sharded tensor: the fresh tensor that will hold it and how many of its elements were filled.
    (megatron-core refuses a ``flattened_range`` on a sharded tensor since 0.14: every shard is a box.)"""

    def __init__(self, sh: ShardedTensor):
        self.sh = sh
        self.box = box_of(sh)
        device = sh.data.device if sh.data is not None else torch.device("cpu")
        self.data = torch.empty(tuple(sh.local_shape), dtype=sh.dtype, device=device)
        self.wanted = self.data.numel()
        self.filled = 0

    def take(self, src: ShardedTensor) -> None:
        """Copy what ``src`` (an old shard of the same key, its data on the host) holds of this one."""
        where = overlap(box_of(src), self.box)
        if where is None:
            return
        if src.data.dtype != self.data.dtype:
            raise ValueError(f"{src.key}: the old shard is {src.data.dtype}, this run wants {self.data.dtype}")
        part = src.data.reshape(box_of(src)[1])[where[0]]
        self.data.reshape(self.box[1])[where[1]].copy_(part)
        self.filled += part.numel()


class _TargetsOfKey:
    """The wanted shards of one key, sorted by their offset along the first axis, so that an old shard finds
    the ones it meets by bisection (a distributed optimizer's bucket is one key with a shard per parameter
    and padding on every rank: a scan of all of them per old shard would be quadratic in the bucket's
    parameters)."""

    def __init__(self, targets: list[_Target]):
        self.targets = sorted(targets, key=lambda t: t.box[0][0])
        self.starts = [t.box[0][0] for t in self.targets]
        self.longest = max(t.box[1][0] for t in self.targets)

    def meeting(self, src: ShardedTensor) -> list[_Target]:
        """The targets whose first-axis range may meet ``src``'s (then checked box by box)."""
        (o, *_), (n, *_) = box_of(src)
        return self.targets[bisect_left(self.starts, o - self.longest + 1): bisect_left(self.starts, o + n)]


def read_tree(container: Container, tensor_name: Callable[[int, str], str]) -> dict:
    """One old rank's snapshot as the tree it was saved from (``{"common", "sharded"}``): the container read
    whole into host buffers, every chunk's checksum verified (raises on a mismatch). ``tensor_name(i, path)``:
    the layout's name of the record's ``i``-th tensor (the local manager's)."""
    record = container.version.get("extra", {}).get("state_dict")
    if record is None:
        raise ValueError(f"{container.path} holds no Megatron-LM state dict (a snapshot of another trainer?)")
    buffers = fresh_targets(container.layout)  # host memory: the fill copies on to each destination's device
    container.load_verified({n: StateTensor(n, t, values_checked=False) for n, t in buffers.items()})
    return treecodec.decode(record, [buffers[tensor_name(i, p)] for i, p in enumerate(record["names"])])


def fill(wanted: list, trees: Iterable[dict]) -> tuple[list, dict]:
    """Every sharded tensor and object of ``wanted`` (a load's sharded bases) with its data, from the old
    ranks' ``trees`` (:func:`read_tree`, replica 0's first; each may be dropped once the next is asked for).
    Returns the filled bases and counts (``tensors``, ``elements``, ``objects``). Raises ``ValueError`` naming
    the key where a tensor is not wholly covered, an object is missing, or the buckets differ."""
    by_key: dict[str, list[_Target]] = {}
    objects: dict[tuple, ShardedObject] = {}
    wanted_objects = [x for x in wanted if isinstance(x, ShardedObject)]
    want_ids = {_sharded_object_id(x) for x in wanted_objects}
    for x in wanted:
        if isinstance(x, ShardedTensor):
            by_key.setdefault(x.key, []).append(_Target(x))
        elif not isinstance(x, ShardedObject):
            raise TypeError(f"a load asked for {type(x).__name__} {getattr(x, 'key', '?')}: only sharded tensors "
                            f"and objects are restored from memory")
    targets = {key: _TargetsOfKey(ts) for key, ts in by_key.items()}
    seen: set[tuple] = set()
    for tree in trees:
        for old in nested_values(tree["sharded"]):
            if isinstance(old, ShardedTensor) and old.data is not None and old.key in targets:
                shard = _sharded_tensor_shard_id(old)  # megatron-core's identity of a shard's data
                if shard in seen:  # the same shard saved twice (never, deduplicated): once is enough
                    continue
                seen.add(shard)
                for t in targets[old.key].meeting(old):
                    t.take(old)
            elif isinstance(old, ShardedObject) and _sharded_object_id(old) in want_ids:
                oid = _sharded_object_id(old)
                if oid not in objects or (is_main_replica(old.replica_id)
                                          and not is_main_replica(objects[oid].replica_id)):
                    objects[oid] = old
    out = []
    for ts in by_key.values():
        for t in ts:
            if t.filled != t.wanted:
                raise ValueError(f"{t.sh.key} at {t.box[0]}: the old ranks hold {t.filled} of its {t.wanted} "
                                 f"elements")
            out.append(replace(t.sh, data=t.data))
    for x in wanted_objects:
        old = objects.get(_sharded_object_id(x))
        if old is None:
            raise ValueError(f"sharded object {x.key} at {tuple(x.global_offset)}: no old rank holds it")
        if x.key.endswith(".per_bucket_numel_unpadded") and old.data != x.data:
            raise ValueError(f"{x.key}: the distributed optimizer's buckets hold {old.data} elements at the old "
                             f"data-parallel size and {x.data} at this one; its dp_reshardable state (Megatron's "
                             f"own rule) re-shards only between sizes with the same buckets (--ddp-bucket-size)")
        out.append(replace(x, data=old.data))
    return out, {"tensors": sum(len(ts) for ts in by_key.values()), "objects": len(wanted_objects),
                 "elements": sum(t.wanted for ts in by_key.values() for t in ts)}


class ReshardedStateDict(MCoreTensorAwareStateDict):
    """The tensor-aware state dict ``load()`` hands Megatron in a new generation (see the module):
    ``to_state_dict`` fills the sharded state dict it is given from ``sources`` (old rank -> its open
    container, old data-parallel replica 0 first; closed here once read), then calls ``done(counts)``.

    Build with :meth:`of`; the common part is read at once (Megatron asks for it first, with no sharded
    state dict: its arguments, the iteration)."""

    _sources: dict
    _done: Callable[[dict], None]
    _refuse: Callable[[Exception], NoReturn]
    _first: Optional[dict]
    _names: Callable[[int, str], str]

    @classmethod
    def of(cls, sources: dict[int, Container], tensor_name: Callable[[int, str], str],
           done: Callable[[dict], None], refuse: Callable[[Exception], NoReturn]) -> "ReshardedStateDict":
        """``done(counts)`` once the fill succeeded; ``refuse(error)`` (it does not return: the job ends) where
        the old ranks' state cannot answer the load - a torn container, a range no old rank holds, other
        buckets - since a restart would find the same."""
        first = read_tree(next(iter(sources.values())), tensor_name)
        built = cls(common=first["common"], sharded_state_dict={})
        built._sources, built._names, built._first = dict(sources), tensor_name, first
        built._done, built._refuse = done, refuse
        return built

    def _trees(self) -> Iterable[dict]:
        ranks = list(self._sources)
        first, self._first = self._first, None
        yield first if first is not None else read_tree(self._sources[ranks[0]], self._names)
        del first  # its buffers go once the caller moves on (the common part is kept apart)
        for r in ranks[1:]:
            yield read_tree(self._sources[r], self._names)

    def close(self) -> None:
        for c in self._sources.values():
            c.close()
        self._sources = {}

    def to_state_dict(self, sharded_state_dict: Any, algo: str = "atomic", exchange_algo: str = "broadcast",
                      validate_access_integrity: bool = True, parallelization_group: Any = None, **kwargs: Any):
        """Megatron's call (see the module); ``algo``, ``exchange_algo``, ``validate_access_integrity`` and
        ``parallelization_group`` are for a restore at the saved size and are not used: every shard is
        local here."""
        if not sharded_state_dict:  # the common part only
            return super().to_state_dict(sharded_state_dict, algo="atomic")
        t0 = time.perf_counter()
        part, _ = extract_sharded_base(load_preprocess(sharded_state_dict)[0])
        try:
            filled, counts = fill(list(nested_values(part)), self._trees())
        except (ValueError, TypeError, SnapshotFormatError) as e:
            self._refuse(e)
        finally:
            self.close()
        loaded = MCoreTensorAwareStateDict(common=self.common, sharded_state_dict={"resharded": filled})
        out = loaded.to_state_dict(sharded_state_dict, algo="atomic", validate_access_integrity=False, **kwargs)
        self._done({**counts, "fill_seconds": round(time.perf_counter() - t0, 3)})
        return out
