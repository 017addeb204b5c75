"""What a megatron-core rank snapshots, and how it is put back (a StateAdapter).

Per rank, following REFT's sharding:

* ``model.c{chunk}.b{buffer}.k{bucket}.param_data`` - each DDP bucket's contiguous parameter
  storage is replicated across the data-parallel group, so this rank saves only its 1/DP slice
  of every bucket; on restore every replica all-gathers the slices (one full copy per sharding
  group). ``model.c{chunk}.e{buffer}.k{bucket}.param_data`` - a MoE model's expert buckets: the
  same over the *expert*-data-parallel group (EDP = DP x TP / (EP x ETP) ranks hold each expert),
  1/EDP per rank, gathered there (each buffer's own group: :func:`_param_buckets`). Per bucket, not per buffer: with the distributed optimizer a bucket's slice ``r`` is
  exactly what rank ``r``'s optimizer step writes, synchronously, while the other slices arrive by
  megatron-core's all-gather - which ``--overlap-param-gather`` defers into the next forward pass,
  after the snapshot has started. A 1/DP slice of the whole buffer would span other ranks' slices
  of its buckets and copy them while they change (torn) or before they arrive (stale).
* ``optim.o{k}.g{group}.p{index}.{param|exp_avg|exp_avg_sq|step|...}`` - the distributed
  optimizer's shard (already 1/DP; for the expert part of a chained optimizer 1/EDP), taken as is
  from each inner torch optimizer ``k`` of the chain (dense, expert), step counters included. A main param
  that is a view of a parameter buffer (fp32 training) is not saved twice: the buffer slice
  holds it.
* ``model.c{chunk}.buffer.<module path>`` - the model's module buffers (a MoE router's
  ``expert_bias`` and ``local_tokens_per_expert``), each rank's own, copied at capture.
* ``rng.cpu``, ``rng.cuda`` (when present) and ``rng.tracker.<name>`` - the torch generators and
  megatron's RNG tracker states, every stream of this rank (``model-parallel-rng``,
  ``data-parallel-rng``, ``expert-parallel-rng``: the last differs per expert-parallel and
  expert-tensor rank), small owned clones taken at capture; each rank restores its own.
* JSON: Python and numpy RNG, the LR scheduler's state, the inner optimizer's param-group
  hyper-parameters, the job's progress (iteration, consumed samples), and ``extents``: what each
  data-parallel shard above holds of the parameters (:func:`shard_extents`), so that the shards can be
  re-sliced for another data-parallel size (:mod:`megatron_ft.redundancy.reslice`).

Parameters and optimizer state change only in ``optimizer.step()`` (the slices saved here; the
rest of a bucket also in the deferred all-gather), so the views stay valid while the background
copy runs during the next forward/backward.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..capture import rng
from ..capture.layout import Layout, ShardSpec, dtype_from_name
from ..capture.state import StateTensor, json_safe, restore_like
from ..redundancy.reslice import Extent, extents_of_slice


def _buckets(model_chunks: list):
    """Every DDP bucket with a parameter storage, as ``(entry name, buffer, bucket)``: named by chunk,
    buffer (``b``, or ``e`` for expert-parallel ones) and bucket - the names a snapshot's entries carry."""
    for c, chunk in enumerate(model_chunks):
        for kind, bufs in (("b", getattr(chunk, "buffers", [])), ("e", getattr(chunk, "expert_parallel_buffers", []))):
            for b, buf in enumerate(bufs):
                if buf.param_data is None:
                    continue
                for k, bucket in enumerate(buf.buckets):
                    yield f"model.c{c}.{kind}{b}.k{k}.param_data", buf, bucket


def _param_buckets(model_chunks: list) -> list[tuple[str, torch.Tensor, Any]]:
    """Every DDP bucket's parameter storage (a view into its buffer, :func:`_buckets`' names), with the
    process group its buffer is sharded over: megatron-core's DDP gives each buffer its group - the
    data-parallel group (with context parallelism) for dense parameters, the expert-data-parallel group
    for experts' - and pads each bucket to a multiple of that group's size; the distributed optimizer's
    step on rank ``r`` of it writes slice ``r``. (An expert's parameters live only on its
    expert-data-parallel ranks: sharded over the whole data-parallel group, a slice would hold another
    expert's bytes.)"""
    out = [(name, bucket.param_data, buf.data_parallel_group) for name, buf, bucket in _buckets(model_chunks)]
    if not out:
        raise ValueError("no megatron DDP parameter buffers found: wrap the model chunks in "
                         "megatron.core.distributed.DistributedDataParallel")
    return out


def bucket_shard(tensor: torch.Tensor, group: Any) -> ShardSpec:
    """This rank's part of a bucket sharded over ``group``: slice ``group.rank()`` of ``group.size()``."""
    return ShardSpec(group.rank(), group.size(), tensor.numel())


def _module_buffers(model_chunks: list) -> list[tuple[str, torch.Tensor]]:
    """Every module buffer of the model chunks (``model.c{chunk}.buffer.<name>``): state that is not a
    parameter, e.g. a MoE router's ``expert_bias`` (aux-loss-free load balancing, updated every step by
    the gradient finalisation) and its ``local_tokens_per_expert`` count. Each rank holds its own."""
    out = []
    for c, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)
        for name, buf in module.named_buffers():
            if buf is not None:
                out.append((f"model.c{c}.buffer.{name}", buf))
    return out


def _inner_optimizers(optimizer: Any) -> list[Any]:
    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in opts]


def _step_only_tensors(model_chunks: list, optimizer: Any):
    """Every model parameter (under megatron's DDP, views into its buffers' storage), and the inner
    torch optimizers' parameters (the main parameters) and state tensors."""
    for chunk in model_chunks:
        yield from chunk.parameters()
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                yield p
                yield from (v for v in inner.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0)


class StepOnlyStorages:
    """The storages (``untyped_storage().data_ptr()``) that only the optimizer step writes (and
    megatron-core's parameter all-gather after it): the model's parameters and the optimizer's
    parameters and state. A snapshot may copy these in the background until the next optimizer
    step; anything else in a state dict (module buffers such as a MoE router's expert bias, which
    the gradient finalisation updates before the step) must be copied when the snapshot is taken.

    Calling it returns the set. It is computed again only when the optimizers' state changes
    shape (the first step creates Adam's moments, a load may replace the state): walking every
    parameter's storage costs a few tenths of a millisecond on each snapshot's training-thread
    path. The cached storages are held, so while cached no other tensor can be given one of their
    addresses: a tensor that is not step-only is never mistaken for one (a stale entry can only
    make a step-only tensor be copied when taken, which is safe)."""

    def __init__(self, model_chunks: list, optimizer: Any) -> None:
        self._model, self._optimizer = model_chunks, optimizer
        self._key: Optional[tuple] = None
        self._held: list = []  # the cached storages
        self._ptrs: frozenset[int] = frozenset()
        self._states: list = []  # the optimizers' state dicts the key names by id (held: ids stay unique)

    def _shape(self) -> tuple:
        inners = _inner_optimizers(self._optimizer)
        return tuple((id(o), id(o.state), len(o.state), tuple(len(g["params"]) for g in o.param_groups))
                     for o in inners) + tuple(map(id, self._model))

    def __call__(self) -> frozenset[int]:
        key = self._shape()
        if key != self._key:
            storages = (t.untyped_storage() for t in _step_only_tensors(self._model, self._optimizer))
            self._held = list(storages)
            self._ptrs = frozenset(s.data_ptr() for s in self._held)
            self._states = [o.state for o in _inner_optimizers(self._optimizer)]
            self._key = key
        return self._ptrs


def _param_names(model_chunks: list) -> dict[int, str]:
    """Every model parameter's name, ``c{chunk}.{qualified name}`` (the same at every data-parallel size)."""
    return {id(p): f"c{c}.{name}" for c, chunk in enumerate(model_chunks) for name, p in chunk.named_parameters()}


def _main_params(optimizer: Any) -> list[dict[int, tuple[Any, int, int]]]:
    """Per inner optimizer of the chain: id(its parameter) -> (model parameter, start, end), the elements of
    the model parameter it holds. The distributed optimizer's main parameters are shards (its range map
    says which); another optimizer's parameters are the model's own, whole."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        found: dict[int, tuple[Any, int, int]] = {}
        if hasattr(opt, "model_param_gbuf_map"):  # the distributed optimizer
            pairs = [(getattr(opt, m, []), getattr(opt, s, [])) for m, s in
                     (("model_float16_groups", "shard_fp32_from_float16_groups"), ("model_fp32_groups", "shard_fp32_groups"))]
            for models, shards in pairs:
                for mg, sg in zip(models, shards):
                    for model_param, shard in zip(mg, sg):
                        if shard is not None:
                            r = opt._get_model_param_range_map(model_param)["param"]
                            found[id(shard)] = (model_param, r.start, r.end)
        else:
            inner = getattr(opt, "optimizer", opt)
            for group in inner.param_groups:
                for p in group["params"]:
                    found[id(p)] = (p, 0, p.numel())
        out.append(found)
    return out


def shard_extents(model_chunks: list, optimizer: Any, saved: set[str]) -> dict[str, list[list]]:
    """What each saved data-parallel shard holds of the parameters (the re-slicing's input,
    :mod:`megatron_ft.redundancy.reslice`): saved entry -> ``[offset, param, lo, length]`` extents
    (``Extent(entry, *record)``), where
    ``param`` names a parameter's value (``c0.module.decoder...weight``) or an optimizer state of it
    (``...weight:exp_avg``; ``:param`` the distributed optimizer's fp32 main copy). A bucket's slice is
    this rank's slice of its storage (padding holds no parameter); an optimizer entry the range of its
    parameter it holds. Entries that are not data-parallel shards (step counters, RNG, module buffers)
    have none, and so do entries not in ``saved`` (the names the snapshot holds). Computed from
    megatron-core's own maps; pure bookkeeping, no collective."""
    names = _param_names(model_chunks)
    out: dict[str, list[list]] = {}
    for entry, buf, bucket in _buckets(model_chunks):
        lo, hi = bucket_shard(bucket.param_data, buf.data_parallel_group).bounds()
        # where each parameter really is: the buffer's param_index_map (the distributed optimizer pads
        # parameter starts), less the bucket's offset in the buffer
        params = [(names[id(p)], buf.param_index_map[p][0] - bucket.offset, buf.param_index_map[p][1] - bucket.offset)
                  for p in bucket.params_list]
        out[entry] = [[x.offset, x.param, x.lo, x.length] for x in extents_of_slice(entry, lo, hi, params)]
    mains = _main_params(optimizer)
    for k, inner in enumerate(_inner_optimizers(optimizer)):
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                held = mains[k].get(id(p)) if k < len(mains) else None
                if held is None or held[2] <= held[1]:
                    continue
                model_param, start, end = held
                prefix, name = f"optim.o{k}.g{g}.p{j}", names.get(id(model_param))
                if name is None:
                    continue
                for key, val in [*inner.state.get(p, {}).items(), ("param", p)]:
                    if (f"{prefix}.{key}" in saved and isinstance(val, torch.Tensor) and val.dim() > 0
                            and val.shape == p.shape and val.numel() == end - start):
                        out[f"{prefix}.{key}"] = [[0, f"{name}:{key}", start, end - start]]
    return out


class MegatronStateAdapter:
    """StateAdapter for megatron-core model chunks + (distributed) optimizer + LR scheduler."""

    def __init__(self, model_chunks: list, optimizer: Any, scheduler: Any = None):
        self.model = model_chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.progress: dict = {"iteration": 0, "consumed_samples": 0}
        self.restored_progress: Optional[dict] = None
        self._rng_targets: dict[str, torch.Tensor] = {}
        self._extents: Optional[dict] = None  # shard_extents, once: the buckets and shards never move

    # ------------------------------------------------------------------ capture
    def _buffer_storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for _, t, _ in _param_buckets(self.model)}

    def _optimizer_tensors(self) -> list[tuple[str, torch.Tensor, Any, str]]:
        """(name, tensor, param, key) for the optimizer shard, in a deterministic order."""
        aliased = self._buffer_storages()
        out = []
        for k, inner in enumerate(_inner_optimizers(self.optimizer)):
            for g, group in enumerate(inner.param_groups):
                for j, p in enumerate(group["params"]):
                    prefix = f"optim.o{k}.g{g}.p{j}"
                    if p.untyped_storage().data_ptr() not in aliased:
                        out.append((f"{prefix}.param", p.data, p, "param"))
                    for key, val in sorted(inner.state.get(p, {}).items()):
                        if isinstance(val, torch.Tensor):
                            out.append((f"{prefix}.{key}", val, p, key))
        return out

    @staticmethod
    def _rng() -> tuple[list[tuple[str, torch.Tensor]], dict]:
        """The process's generators (:mod:`megatron_ft.capture.rng`) plus Megatron's tensor-parallel
        tracker states (``rng.tracker.<name>``)."""
        from megatron.core import tensor_parallel

        from . import cpu_compat

        # the GPU's generator, or its CPU stand-in (cpu_compat)
        out, record = rng.capture(cuda=lambda: torch.cuda.is_available() or cpu_compat.is_installed())
        for name, st in sorted(tensor_parallel.get_cuda_rng_tracker().get_states().items()):
            out.append((f"rng.tracker.{name}", st.detach().cpu().clone()))
        return out, record

    def capture(self) -> tuple[list[StateTensor], dict]:
        tensors = [StateTensor(name, t, bucket_shard(t, group), group) for name, t, group in _param_buckets(self.model)]
        # module buffers change outside the optimizer step (a router's expert bias in the gradient
        # finalisation): owned copies, taken now (they are small)
        tensors += [StateTensor(name, t.detach().clone()) for name, t in _module_buffers(self.model)]
        for name, t, _, key in self._optimizer_tensors():
            if t.dim() == 0:  # e.g. Adam's step counter: tiny, and updated in place -> own it
                t = t.detach().clone()
            tensors.append(StateTensor(name, t))
        rng_tensors, rng_record = self._rng()
        tensors += [StateTensor(name, t) for name, t in rng_tensors]
        groups = []
        nontensor_state = {}
        for k, inner in enumerate(_inner_optimizers(self.optimizer)):
            groups.append([{key: v for key, v in g.items() if key != "params"} for g in inner.param_groups])
            for g, group_ in enumerate(inner.param_groups):
                for j, p in enumerate(group_["params"]):
                    rest = {key: v for key, v in inner.state.get(p, {}).items() if not isinstance(v, torch.Tensor)}
                    if rest:
                        nontensor_state[f"o{k}.g{g}.p{j}"] = rest
        extra = {
            **rng_record,
            "scheduler": json_safe(self.scheduler.state_dict(), "scheduler") if self.scheduler else None,
            "param_groups": json_safe(groups, "param_groups"),
            "optimizer_nontensor": json_safe(nontensor_state, "optimizer state"),
            "progress": json_safe(self.progress, "progress"),
        }
        if self._extents is None:
            self._extents = shard_extents(self.model, self.optimizer, {t.name for t in tensors})
        extra["extents"] = self._extents
        return tensors, extra

    # ------------------------------------------------------------------ restore
    def targets(self, layout: Layout, extra: dict, only: Optional[set[str]] = None) -> dict[str, StateTensor]:
        """Destinations for the saved entries of ``layout`` (``only``: for those named there only)."""
        out: dict[str, StateTensor] = {}
        groups: dict[str, Any] = {}
        for name, t, group in _param_buckets(self.model):
            out[name] = StateTensor(name, t, None, group)
            groups[name] = group
        buffers = dict(_module_buffers(self.model))
        # optimizer state: map saved names onto this process's optimizer, creating missing state
        inners = _inner_optimizers(self.optimizer)
        params = {}
        for k, inner in enumerate(inners):
            for g, group_ in enumerate(inner.param_groups):
                for j, p in enumerate(group_["params"]):
                    params[f"optim.o{k}.g{g}.p{j}"] = (inner, p)
        self._rng_targets = {}
        for e in layout.entries:
            name, spec = e.spec.name, e.spec
            if only is not None and name not in only:
                continue
            if name in groups:
                t, group = out[name].tensor, groups[name]
                want = bucket_shard(t, group)
                if spec.shard != want:
                    raise ValueError(
                        f"snapshot tensor {name!r} is shard {spec.shard} but this rank's bucket is "
                        f"{want} (slice {group.rank()} of its {group.size()}-rank sharding group): a "
                        f"snapshot of another parallel layout or sharding cannot be restored here")
                out[name] = StateTensor(name, t, spec.shard, group)
            elif name in buffers:
                buf = buffers[name]
                if tuple(buf.shape) != spec.shape or dtype_from_name(spec.dtype) != buf.dtype:
                    raise ValueError(f"snapshot buffer {name!r} is {spec.dtype}{list(spec.shape)}, the model's "
                                     f"is {buf.dtype}{list(buf.shape)}")
                out[name] = StateTensor(name, buf)
            elif name.startswith("optim."):
                prefix, key = name.rsplit(".", 1)
                if prefix not in params:
                    raise KeyError(f"snapshot has optimizer state for {prefix}, which this optimizer lacks")
                inner, p = params[prefix]
                if key == "param":
                    out[name] = StateTensor(name, p.data)
                    continue
                st = inner.state.setdefault(p, {})
                cur = st.get(key)
                if not isinstance(cur, torch.Tensor) or tuple(cur.shape) != spec.shape:
                    st[key] = torch.zeros(spec.shape, dtype=dtype_from_name(spec.dtype), device=p.device)
                out[name] = StateTensor(name, st[key])
            elif name.startswith("rng."):
                buf = torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype))
                self._rng_targets[name] = buf
                out[name] = StateTensor(name, buf)
            else:
                raise KeyError(f"snapshot tensor {name!r} has no destination in this model")
        return out if only is None else {n: t for n, t in out.items() if n in only}

    # ------------------------------------------------------------------ restore at another data-parallel size
    def resliced_targets(self, keys: set[str]) -> tuple[dict[str, StateTensor], list[Extent]]:
        """This rank's data-parallel shards at its current data-parallel size as restore destinations - its
        slice of every DDP bucket (``shard``/``group`` set, for the all-gather after the restore) and, for
        every optimizer parameter, its state ``keys`` (``exp_avg``, ``exp_avg_sq``; ``param``: the
        distributed optimizer's fp32 main copy where it is not a view of a bucket), created as zeros where
        the optimizer has none yet - with what each holds of the parameters (:func:`shard_extents`)."""
        out = {name: StateTensor(name, t, bucket_shard(t, group), group) for name, t, group in _param_buckets(self.model)}
        aliased = self._buffer_storages()
        for k, inner in enumerate(_inner_optimizers(self.optimizer)):
            for g, group in enumerate(inner.param_groups):
                for j, p in enumerate(group["params"]):
                    state = inner.state.setdefault(p, {})
                    for key in sorted(keys):
                        name = f"optim.o{k}.g{g}.p{j}.{key}"
                        if key == "param":
                            if p.untyped_storage().data_ptr() not in aliased:
                                out[name] = StateTensor(name, p.data)
                            continue
                        if not isinstance(state.get(key), torch.Tensor) or state[key].shape != p.shape:
                            state[key] = torch.zeros_like(p.data)
                        out[name] = StateTensor(name, state[key])
        extents = shard_extents(self.model, self.optimizer, set(out))
        return out, [Extent(entry, *rec) for entry, recs in extents.items() for rec in recs]

    def set_step_counters(self, saved: list[torch.Tensor]) -> None:
        """Every optimizer parameter's ``step`` counter from ``saved`` (an old rank's, one per parameter it
        held): they must agree - every parameter steps with every optimizer step - else ``ValueError``."""
        values = {float(t.reshape(-1)[0]) for t in saved if t.numel() == 1}
        if len(values) > 1:
            raise ValueError(f"the saved optimizer step counters differ ({sorted(values)}): not re-sliceable")
        if not saved:
            return
        for inner in _inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state.setdefault(p, {})["step"] = saved[0].detach().clone().to(p.device)

    def finish_restore(self, extra: dict) -> None:
        from megatron.core import tensor_parallel

        targets = self._rng_targets
        rng.restore({n: t for n, t in targets.items() if n in rng.TENSORS}, extra)
        tracker = {n[len("rng.tracker."):]: t for n, t in targets.items() if n.startswith("rng.tracker.")}
        if tracker:
            tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
        inners = _inner_optimizers(self.optimizer)
        for inner, saved_groups in zip(inners, extra["param_groups"]):
            for g, saved in zip(inner.param_groups, saved_groups):
                g.update(restore_like(g, saved))
        for key, rest in extra.get("optimizer_nontensor", {}).items():
            k, g, j = (int(x[1:]) for x in key.split("."))
            p = inners[k].param_groups[g]["params"][j]
            inners[k].state.setdefault(p, {}).update(rest)
        if self.scheduler is not None and extra.get("scheduler") is not None:
            # load_state_dict() *adds* the saved step count (it calls step(increment=num_steps)),
            # so start from zero: right for a fresh scheduler and for an in-process rollback alike
            self.scheduler.num_steps = 0
            self.scheduler.load_state_dict(extra["scheduler"])
        self.restored_progress = dict(extra["progress"])
        self.progress = dict(extra["progress"])
