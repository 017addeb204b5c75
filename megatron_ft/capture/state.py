"""What a snapshot contains: named tensors plus a small JSON record, and how to put them back.

A *state adapter* knows a training framework (megatron-core, DeepSpeed, plain torch). It
declares the tensors to snapshot, most as views of live training state (no copy: parameters
and optimizer state do not change until the next optimizer step), and the non-tensor state as
JSON-able values. On restore it names a destination for every saved tensor, creating missing
ones (e.g. optimizer state of a fresh process) and applies the JSON record.

``StateTensor.shard`` marks a tensor replicated across a data-parallel group of which this rank
saves only its slice (REFT); ``group`` is the process group that re-assembles it on restore.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional, Protocol

import numpy as np
import torch

from . import rng
from .layout import Layout, ShardSpec, TensorSpec, dtype_from_name, dtype_name


@dataclass
class StateTensor:
    name: str
    tensor: torch.Tensor  # the full (replicated) tensor when ``shard`` is set
    shard: Optional[ShardSpec] = None
    group: Any = None  # process group to all-gather a sharded tensor on restore
    #: restore destinations only: False for bytes the job never reads as values (a framework's padding,
    #: e.g. megatron-core's uninitialised gaps between parameters in its optimizer buckets), which the
    #: restore's check for NaN and infinities skips: their bytes are restored and verified all the same
    values_checked: bool = True

    def saved_view(self) -> torch.Tensor:
        """The part of ``tensor`` this rank saves, flattened (contiguous)."""
        flat = self.tensor.reshape(-1)
        if self.shard is None:
            return flat
        lo, hi = self.shard.bounds()
        return flat[lo:hi]

    def spec(self) -> TensorSpec:
        if not self.tensor.is_contiguous():
            raise ValueError(f"state tensor {self.name!r} is not contiguous; snapshots take contiguous tensors")
        if self.shard is None:
            shape = tuple(self.tensor.shape)
        else:
            if self.shard.full_numel != self.tensor.numel():
                raise ValueError(f"{self.name}: shard full_numel {self.shard.full_numel} != numel {self.tensor.numel()}")
            lo, hi = self.shard.bounds()
            shape = (hi - lo,)
        return TensorSpec(self.name, dtype_name(self.tensor.dtype), shape, self.shard)


@dataclass(frozen=True)
class LaterCapture:
    """A step's state taken on the training thread and encoded on the snapshot worker (an adapter's
    ``capture_later()``): ``encode()`` returns what :meth:`StateAdapter.capture` would have returned
    when the state was taken - it reads only what stays unchanged until the next optimizer step (the
    adapter copied the rest when taking it). ``device``: the CUDA device of its tensors (None: host),
    whose current stream the worker's copies wait for from the moment of taking."""
    encode: Callable[[], "tuple[list[StateTensor], dict]"]
    device: Optional[torch.device] = None


class StateAdapter(Protocol):
    """An adapter may also offer ``capture_later() -> LaterCapture`` (Megatron-LM's checkpoint tier): the
    trainer then takes the state on the training thread and leaves its encoding to the snapshot worker."""

    def capture(self) -> tuple[list[StateTensor], dict]:
        """Tensors (views or small owned clones) and the JSON-able record of this step."""

    def targets(self, layout: Layout, extra: dict) -> dict[str, StateTensor]:
        """Destinations for every tensor in a saved layout (allocating missing optimizer state);
        ``extra``: the snapshot's JSON record (what :meth:`capture` returned with its tensors), for an
        adapter that allocates each destination where the saved tensor lived."""

    def finish_restore(self, extra: dict) -> None:
        """Apply the JSON record and anything that depends on restored tensors (RNG, schedulers)."""


def fresh_targets(layout: Layout, on_device: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """A new tensor for every entry of a saved layout (restore destinations for adapters whose state
    is rebuilt from the snapshot rather than written into live tensors: Megatron-LM's checkpoint
    tier, DeepSpeed): in host memory, or for the names in ``on_device`` (tensors saved from a GPU) on
    the current CUDA device, so that the restore copies them there through its pinned, device-verified
    path instead of into pageable memory and then across. Entries sharded over data-parallel ranks
    are refused: those adapters snapshot whole tensors."""
    out = {}
    device = torch.device("cuda", torch.cuda.current_device()) if on_device else None  # GPU path
    for e in layout.entries:
        if e.spec.shard is not None:
            raise ValueError(f"{e.spec.name}: a data-parallel shard; this adapter restores whole tensors only")
        out[e.spec.name] = torch.empty(e.spec.shape, dtype=dtype_from_name(e.spec.dtype),
                                       device=device if e.spec.name in on_device else None)
    return out


def json_safe(value: Any, where: str = "state") -> Any:
    """Check and convert non-tensor state to JSON values. Python's JSON round-trips floats
    exactly (repr), so numbers stay numbers; tuples become lists; tensors are refused (they
    belong in the flat area as StateTensors)."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: tensor of shape {tuple(value.shape)} must be snapshotted as a StateTensor")
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [json_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): json_safe(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(f"{where}: value of type {type(value).__name__} cannot be stored in a snapshot record")


def restore_like(current: dict, saved: dict) -> dict:
    """``saved`` with lists turned back into tuples where ``current`` holds tuples (e.g. Adam betas)."""
    return {k: tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else v
            for k, v in saved.items()}


# ---------------------------------------------------------------- a plain torch adapter


class TorchStateAdapter:
    """Adapter for a plain ``nn.Module`` + ``torch.optim`` optimizer (tests, benchmarks, simple jobs).

    ``extra`` is a dict the caller keeps up to date (iteration, data position); it is saved and
    handed back through ``restored_extra``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 dp_rank: int = 0, dp_size: int = 1, dp_group: Any = None):
        self.model = model
        self.optimizer = optimizer
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.extra: dict = {}
        self.restored_extra: Optional[dict] = None
        self._rng: dict[str, torch.Tensor] = {}  # restore targets of the generators' states

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters()]

    def capture(self) -> tuple[list[StateTensor], dict]:
        out = []
        for name, p in self._params():
            shard = ShardSpec(self.dp_rank, self.dp_size, p.numel()) if self.dp_size > 1 else None
            out.append(StateTensor(f"model.{name}", p.data, shard, self.dp_group))
        groups = []
        if self.optimizer is not None:
            index = {id(p): i for i, (_, p) in enumerate(self._params())}
            for gi, g in enumerate(self.optimizer.param_groups):
                groups.append({k: v for k, v in g.items() if k != "params"})
                for p in g["params"]:
                    for key, val in sorted(self.optimizer.state.get(p, {}).items()):
                        if isinstance(val, torch.Tensor):
                            out.append(StateTensor(f"optim.p{index[id(p)]}.{key}", val.detach().clone()
                                                   if val.dim() == 0 else val))
        rng_tensors, extra = rng.capture()
        out += [StateTensor(n, t) for n, t in rng_tensors]
        extra.update({"param_groups": json_safe(groups, "param_groups"), "user": json_safe(self.extra, "extra")})
        return out, extra

    def targets(self, layout: Layout, extra: dict) -> dict[str, StateTensor]:
        params = self._params()
        out: dict[str, StateTensor] = {}
        for e in layout.entries:
            name, spec = e.spec.name, e.spec
            if name.startswith("model."):
                p = dict(params)[name[len("model."):]]
                out[name] = StateTensor(name, p.data, spec.shard, self.dp_group)
            elif name.startswith("optim."):
                assert self.optimizer is not None, "snapshot has optimizer state but no optimizer was given"
                pi, key = name[len("optim.p"):].split(".", 1)
                p = params[int(pi)][1]
                st = self.optimizer.state.setdefault(p, {})
                if key not in st or tuple(st[key].shape) != spec.shape:
                    # beside its parameter, as torch.optim creates it (a scalar such as Adam's step on the host)
                    device = p.device if spec.shape else torch.device("cpu")
                    st[key] = torch.zeros(spec.shape, dtype=dtype_from_name(spec.dtype), device=device)
                out[name] = StateTensor(name, st[key])
            elif name in rng.TENSORS:
                self._rng[name] = torch.empty(spec.shape, dtype=torch.uint8)
                out[name] = StateTensor(name, self._rng[name])
            else:
                raise KeyError(f"snapshot tensor {name!r} has no destination in this model")
        return out

    def finish_restore(self, extra: dict) -> None:
        rng.restore(self._rng, extra)
        if self.optimizer is not None:
            for g, saved in zip(self.optimizer.param_groups, extra["param_groups"]):
                g.update(restore_like(g, saved))
        self.restored_extra = extra["user"]
