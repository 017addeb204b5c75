"""megatron-ft as Megatron-LM's non-persistent ``local`` checkpoint tier (``--non-persistent-ckpt-type in_memory``).

Megatron-LM (``core_v0.16.1``) drives its local tier through ``checkpointing_context
['local_checkpoint_manager']``, created in ``megatron/training/training.py``, and calls exactly:

* ``save(state_dict, iteration, is_async=...)`` from ``save_checkpoint(..., non_persistent_ckpt=True)``,
  every ``--non-persistent-save-interval`` iterations (only when ``--save`` is set). ``state_dict`` is
  the ``MCoreTensorAwareStateDict`` built by ``tensor_aware_state_dict_cls.from_state_dict``: the
  common part (args, iteration, scheduler, ...) plus the ``ShardedTensor``/``ShardedObject`` part;
  with ``--non-persistent-local-ckpt-algo fully_parallel`` (the default) each data-parallel replica
  keeps only the shards it is the main replica of. With ``is_async`` it must return an
  ``AsyncRequest`` (Megatron adds finalize functions to it and schedules it), otherwise ``None``.
* ``find_latest()`` from ``load_checkpoint`` (only when ``--load`` is set): the newest iteration
  every rank can restore, or -1. If it is at least as new as the persistent checkpoint,
* ``load()`` returns ``(tensor_aware_state_dict, checkpoint_name)``; Megatron calls
  ``.to_state_dict(sharded_state_dict, algo=..., parallelization_group=...)`` on the first item
  (which re-distributes the deduplicated shards) and loads model, optimizer, scheduler, RNG and
  args from the result. It calls ``load()`` twice (``rank0=True`` for the common part, then for
  everything).
* In a new generation of a job that went on at another data-parallel size (``recovery.elastic_after_s``),
  where nothing of the generation itself is held yet, ``find_latest`` answers the step the previous
  generation's snapshots hold and ``load`` a :class:`~.resharded_state_dict.ReshardedStateDict`, whose
  ``to_state_dict`` fills the load's sharded tensors from those snapshots by their global coordinates.
* ``local_ckpt_dir``: only printed (and joined into names); here it is the agents' persist dir.
* ``training_loop(model, optimizer, scheduler, config)`` (megatron-ft's patch ``0005``, not Megatron's
  contract): once before the first iteration; the returned :class:`TrainingLoop` is called at each
  iteration's start and end, for the scheduled transport and the profiler.

The mapping onto megatron-ft: ``save`` encodes the state dict with :mod:`megatron_ft.capture.tree` (tensors by
reference, the rest as a versioned JSON record - no pickle) and hands it to the trainer's
:class:`~megatron_ft.trainer.checkpointer.InMemoryCheckpointer` as the state of ``iteration``: the snapshot
engine copies the tensors into this rank's agent slot in the background (fused copy + checksum),
commits, and all ranks agree on the newest complete step. A global optimizer step pre-hook waits
for that copy before the next ``optimizer.step()`` modifies the tensors - the only point where it
can block training, with Megatron's ``--async-save`` or without: parameters and optimizer state
are taken by reference, anything else in the state dict (which may change before that step) is
copied when ``save`` is called. ``find_latest`` runs megatron-ft's restore (newest step every rank holds,
verified by checksum and run/rank/topology identity; local memory, then the agents' persisted
copies) into freshly allocated tensors, so a torn or corrupt snapshot is never offered; ``load``
rebuilds the tensor-aware state dict from those tensors. A failed snapshot is logged and costs only
that snapshot; it never raises into training.

Example (what the patched ``training.py`` does; all ranks, after ``initialize_megatron``)::

    from megatron_ft.megatron.local_manager import InMemoryLocalCheckpointManager
    checkpointing_context = {"local_checkpoint_manager": InMemoryLocalCheckpointManager.from_args(args)}

Nothing here needs nvidia-resiliency-ext: :class:`InMemoryTensorAwareStateDict` is megatron-core's
``MCoreTensorAwareStateDict`` with a ``from_state_dict`` that does not insist on it.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import logging
import os
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Collection, NoReturn, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

from .. import config as ftconfig
from .. import fatal
from ..capture import tree as treecodec
from ..capture.layout import Layout
from ..capture.state import LaterCapture, StateTensor, fresh_targets
from ..trainer import in_process
from ..launch.generation import GenerationRecord
from .generation_restore import generation_record, generation_result, open_imports
from .resharded_state_dict import ReshardedStateDict
from ..trainer.checkpointer import InMemoryCheckpointer
from ..trainer.recovery import RestoreFailed
from . import cpu_compat
from .checkpointing import checked_topology
from .loop import TrainingLoop
from .state import StepOnlyStorages
from .profiling import LoopProfiler, profile_dir

log = logging.getLogger("megatron_ft")

CKPT_TYPE = "in_memory"


class InMemoryTensorAwareStateDict(MCoreTensorAwareStateDict):
    """``MCoreTensorAwareStateDict`` whose ``from_state_dict`` works without nvidia-resiliency-ext.

    megatron-core's version refuses to run without NVRx only because NVRx's ``LocalCheckpointManager``
    consumes it; the preprocessing, deduplication and ``to_state_dict`` are megatron-core's own,
    reused here unchanged. It also notes which tensors megatron-core marks as padding
    (:func:`padding_tensor_ids`), before its preprocessing drops the marks."""

    #: ``id()`` of the padding tensors of the state dict this was built from (see :func:`padding_tensor_ids`)
    padding_ids: frozenset = frozenset()

    @classmethod
    def from_state_dict(cls, sharded_state_dict: Any, algo: str = "fully_parallel",
                        parallelization_group: Any = None, cached_metadata: Any = None):
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

        if algo not in ("atomic", "fully_parallel"):
            raise ValueError(f"--non-persistent-local-ckpt-algo {algo!r} is not supported; "
                             f"allowed: 'atomic', 'fully_parallel'")
        fully_parallel = algo == "fully_parallel"
        padding = padding_tensor_ids(sharded_state_dict)
        sharded_part, common = save_preprocess(sharded_state_dict, cached_metadata is None)
        distribution = cls._get_distribution(fully_parallel, sharded_part, parallelization_group, cached_metadata)
        if distribution is not None:
            cls._remove_redundant_data(fully_parallel, sharded_part, distribution[0], parallelization_group)
        built = cls(common=common, sharded_state_dict=sharded_part)
        built.padding_ids = padding
        return built, distribution


def padding_tensor_ids(tree: Any) -> frozenset:
    """``id()`` of every tensor megatron-core marks as padding in a sharded state dict: the distributed
    optimizer's ``dp_reshardable`` state puts the gaps between parameters in a bucket beside them, as
    ``{"param": ShardedTensor, "exp_avg": ..., "padding": LocalNonpersistentObject(True)}`` whose
    tensors are ``torch.empty`` - uninitialised bytes that may hold NaN patterns, and that a load
    discards. Their bytes are snapshotted and restored like any other, but a restore does not judge
    them by their values (:attr:`megatron_ft.capture.state.StateTensor.values_checked`)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    found: set[int] = set()
    stack = [tree]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            flag = v.get("padding")
            if isinstance(flag, LocalNonpersistentObject) and flag.unwrap() is True:
                found.update(id(x.data) for x in v.values() if isinstance(x, ShardedTensor) and x.data is not None)
            stack.extend(x for x in v.values() if type(x) in (dict, list))
        elif type(v) is list:
            stack.extend(x for x in v if type(x) in (dict, list))
    return frozenset(found)


class _StateDictAdapter:
    """StateAdapter over one tensor-aware state dict (save) or freshly allocated tensors (restore)."""

    def __init__(self) -> None:
        self.state_dict: Optional[MCoreTensorAwareStateDict] = None
        self.iteration = -1
        self.loaded: dict[str, torch.Tensor] = {}
        # the storages only the optimizer step writes (state.StepOnlyStorages), or None: then every
        # snapshot is finished before save() returns
        self.step_only: Optional[Callable[[], Collection[int]]] = None
        self._told_copied = False
        self._told_omitted = False
        self._told_padding = False

    def capture(self) -> tuple[list[StateTensor], dict]:
        """The state dict's tensors and JSON record, now (:meth:`capture_later`, encoded at once)."""
        return self.capture_later().encode()

    def capture_later(self) -> LaterCapture:
        """Training thread: the state dict taken - its containers, namespaces and objects copied
        (:func:`~megatron_ft.capture.tree.freeze`: training may change the run's arguments and anything
        else Megatron put in it as soon as ``save()`` returns), its tensors by reference where only
        the optimizer step writes them (the snapshot is finished before that step), the others copied
        now. The walk into a JSON record and the layout run on the snapshot worker
        (:class:`~megatron_ft.capture.state.LaterCapture`): about half the training thread's
        time of encoding it here."""
        sd = self.state_dict
        assert sd is not None
        stable = self.step_only() if self.step_only is not None else None
        padding = getattr(sd, "padding_ids", frozenset())
        copied = [0]
        devices: list[torch.device] = []
        unchecked: set[int] = set()  # id() of the taken padding tensors (held by the frozen tree)

        def take(t: torch.Tensor) -> torch.Tensor:
            if not t.is_contiguous():
                kept = t.contiguous()
            elif t.dim() == 0 or (stable is not None and t.untyped_storage().data_ptr() not in stable):
                kept = t.clone()  # e.g. Adam's step (updated in place) or a module buffer: own it
                copied[0] += kept.nbytes
            else:
                kept = t
            if id(t) in padding:
                unchecked.add(id(kept))
            if kept.is_cuda and not devices:
                devices.append(kept.device)
            return kept

        with cpu_compat.bypassed():  # on the CPU layer: no torch call below asks for a device
            frozen = treecodec.freeze({"common": sd.common, "sharded": sd.sharded_state_dict}, take)
        iteration, step_only = self.iteration, stable is not None
        return LaterCapture(lambda: self._encode(frozen, iteration, copied[0] if step_only else None, unchecked),
                            devices[0] if devices else None)

    def _encode(self, frozen: dict, iteration: int, copied: Optional[int],
                unchecked: set[int]) -> tuple[list[StateTensor], dict]:
        """The frozen state dict as the snapshot's tensors and JSON record (snapshot worker)."""
        with cpu_compat.bypassed():
            record, tensors = treecodec.encode(frozen, "state_dict")
        if record["omitted"] and not self._told_omitted:
            self._told_omitted = True
            log.info("in-memory checkpoint: args attributes that are not data are not kept: %s",
                     ", ".join(record["omitted"][:10]))
        out = [StateTensor(tensor_name(i, path), t) for i, (path, t) in enumerate(zip(record["names"], tensors))]
        if not self._told_copied and copied is not None:
            self._told_copied = True
            log.info("in-memory checkpoint: %d of %d bytes copied when taken (not parameters or optimizer state), "
                     "the rest in the background", copied, sum(t.tensor.nbytes for t in out))
        extra = {"state_dict": record, "iteration": iteration}
        padding = [i for i, t in enumerate(tensors) if id(t) in unchecked]
        if padding:
            extra["padding"] = padding  # tensor indices whose values a restore does not judge
            if not self._told_padding:
                self._told_padding = True
                log.info("in-memory checkpoint: %d of %d tensors are megatron-core's padding (kept, not judged "
                         "by their values on restore)", len(padding), len(tensors))
        return out, extra

    def targets(self, layout: Layout, extra: dict) -> dict[str, StateTensor]:
        """New tensors, each where its saved tensor lived (a GPU's on the current device)."""
        specs = treecodec.tensor_specs(extra["state_dict"]) if "state_dict" in extra else []
        names = [tensor_name(i, s["name"]) for i, s in enumerate(specs)]
        self.loaded = fresh_targets(layout, {n for n, s in zip(names, specs) if s["device"] == "cuda"})
        padding = {names[i] for i in extra.get("padding", ()) if i < len(names)}
        return {name: StateTensor(name, t, values_checked=name not in padding) for name, t in self.loaded.items()}

    def finish_restore(self, extra: dict) -> None:
        pass


@functools.lru_cache(maxsize=1 << 14)  # the same names every snapshot: computed once, on the training thread
def tensor_name(index: int, path: str) -> str:
    """Layout name of the ``index``-th tensor: ``tensor_name(3, "state_dict.sharded.model.w")``
    -> ``'sd.00003.sharded.model.w'`` (the path only helps a human reading a layout)."""
    path = re.sub(r"[^A-Za-z0-9_.\[\]-]", "_", path.removeprefix("state_dict."))
    return f"sd.{index:05d}.{path[:96]}"


@dataclass
class _Loaded:
    step: int
    source: str = "none"
    record: Optional[dict] = None
    tensors: Optional[list] = None
    #: a new generation's first start: the previous generation's state dict, re-sharded when Megatron asks
    resharded: Optional[ReshardedStateDict] = None


class InMemoryLocalCheckpointManager:
    """Megatron-LM's ``local_checkpoint_manager`` contract on top of megatron-ft's agent (see module doc)."""

    tensor_aware_state_dict_cls = InMemoryTensorAwareStateDict

    def __init__(self, cfg: ftconfig.FTConfig, rank: int, world_size: int, topology: dict,
                 agent_socket: Optional[str] = None, profiler: Optional[LoopProfiler] = None):
        self.cfg = cfg
        self._profiler = profiler
        self._loop: Optional[TrainingLoop] = None
        self.rank = rank
        self.local_ckpt_dir = cfg.persist.dir
        self._adapter = _StateDictAdapter()
        self._ckpt = InMemoryCheckpointer(cfg, self._adapter, rank, world_size, topology, agent_socket=agent_socket)
        self._loaded: Optional[_Loaded] = None
        self._closed = False
        self._hook = None
        if self._ckpt.engine is not None:
            # the only wait: before the next optimizer step modifies the tensors being copied
            self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        atexit.register(self.close)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "InMemoryLocalCheckpointManager":
        """Collective: every rank, after Megatron's process groups exist."""
        cfg = ftconfig.from_args(args)
        profile = getattr(args, "inmem_ckpt_profile_iterations", 0)
        profiler = LoopProfiler(profile, profile_dir(args)) if profile else None
        return cls(cfg, dist.get_rank(), dist.get_world_size(), checked_topology(cfg), profiler=profiler)

    def training_loop(self, model: list, optimizer: Any, scheduler: Any, config: Any) -> TrainingLoop:
        """The hooks the patched ``train()`` calls around every iteration. Collective: every rank,
        once, before the first iteration (after ``find_latest``/``load``)."""
        if self._loop is None:
            objs = SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, config=config)
            self._loop = TrainingLoop(self.cfg, self._ckpt, objs, self._profiler)
            # with the model and optimizer known, snapshots copy in the background (see save())
            self._adapter.step_only = StepOnlyStorages(model, optimizer)
        return self._loop

    def _check_loop_hooks(self) -> None:
        """The scheduled transport and the profiler need the training-loop hooks (patch 0005); a tree
        patched without it would train unprotected or unprofiled without a word: end the job."""
        wants = []
        if self.cfg.redundancy.scheme != "none" and self.cfg.redundancy.transport == "scheduled":
            wants.append("redundancy.transport: scheduled")
        if self._profiler is not None:
            wants.append("--inmem-ckpt-profile-iterations")
        if wants and self._loop is None:
            _refuse(ftconfig.ConfigError(
                f"{' and '.join(wants)} need megatron-ft's training-loop hooks, but this Megatron-LM's train() "
                f"never called local_checkpoint_manager.training_loop(): apply the whole patch series "
                f"(patches/megatron-lm/*/0005-training-call-megatron-ft-s-training-loop-hooks-at-e.patch)"))

    # ------------------------------------------------------------------ save
    def save(self, state_dict: MCoreTensorAwareStateDict, iteration: int, is_async: bool = False) -> Any:
        """Snapshot ``state_dict`` as ``iteration``. Collective. Returns an ``AsyncRequest`` with
        ``is_async`` (nothing for Megatron's async caller to run), else ``None``.

        Asynchronous whether or not Megatron's ``--async-save`` is given: the copy runs on megatron-ft's
        worker thread during the next forward/backward, and the optimizer step pre-hook waits for it
        before the step modifies parameters or optimizer state; tensors that something else may modify
        sooner are copied here (:meth:`_StateDictAdapter.capture`). Only a tree without the training-loop
        hooks (which tell the manager the model and optimizer) finishes the snapshot before returning."""
        if not isinstance(state_dict, MCoreTensorAwareStateDict) or state_dict.is_hollow:
            raise TypeError(f"save() takes the MCoreTensorAwareStateDict (with tensors) that "
                            f"tensor_aware_state_dict_cls.from_state_dict built, got {type(state_dict).__name__}"
                            f"{' (hollow)' if isinstance(state_dict, MCoreTensorAwareStateDict) else ''}")
        self._check_loop_hooks()
        self._loaded = None  # a restored copy is no longer needed once training saves again
        self._adapter.state_dict, self._adapter.iteration = state_dict, iteration
        try:
            if not (self._loop is not None and self._loop.snapshots_off):
                self._ckpt.after_iteration(iteration, 0)
        except Exception as e:  # a failed checkpoint never kills training
            log.warning("rank %d: in-memory checkpoint of iteration %d failed: %s", self.rank, iteration, e)
        finally:
            self._adapter.state_dict = None
        if self._adapter.step_only is None:
            self._ckpt.before_optimizer_step()
        if not is_async:
            return None
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        return AsyncRequest(None, (), [])

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._ckpt.before_optimizer_step()

    # ------------------------------------------------------------------ load
    def find_latest(self) -> int:
        """Newest iteration every rank holds intact (verified), or -1. Collective."""
        if self._loaded is None:
            self._loaded = self._restore()
        return self._loaded.step

    def _restore(self) -> _Loaded:
        try:
            res = self._ckpt.restore()
        except RestoreFailed as e:  # only our scratch tensors were touched
            log.warning("rank %d: no in-memory checkpoint can be loaded: %s", self.rank, e)
            res = None
        if (res is None or res.source == "none") and (gen := generation_record()) is not None:
            return self._resharded(gen)  # a new generation's first start: the previous one's snapshots
        # an in-process attempt built with --no-initialization must not fall back (to an upstream
        # checkpoint that may not exist, or to its uninitialised weights): a fresh process will
        in_process.check_restored(res is not None and res.source != "none")
        if res is None or res.source == "none":
            return _Loaded(-1)
        record = res.extra["state_dict"]
        names = [tensor_name(i, p) for i, p in enumerate(record["names"])]
        tensors = [self._adapter.loaded[n] for n in names]  # each already where it was saved from
        self._adapter.loaded = {}
        return _Loaded(res.step, res.source, record, tensors)

    def _resharded(self, gen: GenerationRecord) -> _Loaded:
        """This rank of generation ``gen`` restores from the previous generation's containers imported into
        its node's memory (:mod:`.resharded_state_dict`); the restore event is written once Megatron's
        load has been answered. Nothing it can restore from ends the job, saying why (never a silent
        start at iteration 0, nor a restart that would find the same)."""
        t0 = time.perf_counter()
        node = self._ckpt.node
        try:
            sources = open_imports(self.cfg, self.rank, node, gen)
        except Exception as e:
            fatal.end_job(f"rank {self.rank}: generation {gen.number} cannot open the previous generation's "
                          f"snapshots of step {gen.step} in memory: {e}")
        read = list(sources)

        def done(counts: dict) -> None:
            res = generation_result(gen, node, read, time.perf_counter() - t0, **counts)
            self._ckpt.restored_elsewhere(res)

        def refuse(e: Exception) -> NoReturn:
            fatal.end_job(f"rank {self.rank}: generation {gen.number} cannot restore step {gen.step} from the "
                          f"previous generation's snapshots in memory: {e}")

        try:
            resharded = ReshardedStateDict.of(sources, tensor_name, done, refuse)
        except Exception as e:
            for c in sources.values():
                c.close()
            refuse(e)
        return _Loaded(gen.step, "resharded", resharded=resharded)

    def load(self) -> tuple[MCoreTensorAwareStateDict, str]:
        """``(tensor-aware state dict, checkpoint name)`` of the iteration :meth:`find_latest` found."""
        if self.find_latest() < 0:
            raise RuntimeError("load(): there is no in-memory checkpoint every rank can restore "
                               "(find_latest() returned -1)")
        loaded = self._loaded
        if loaded is not None and loaded.resharded is not None:
            return loaded.resharded, (f"megatron-ft run {self.cfg.run_id} iteration {loaded.step} rank {self.rank}, "
                                      f"re-sharded from the previous generation's snapshots")
        assert loaded is not None and loaded.record is not None and loaded.tensors is not None
        tree = treecodec.decode(loaded.record, loaded.tensors)
        tasd = InMemoryTensorAwareStateDict(common=tree["common"], sharded_state_dict=tree["sharded"])
        return tasd, f"megatron-ft {loaded.source} run {self.cfg.run_id} iteration {loaded.step} rank {self.rank}"

    def close(self) -> None:
        """Finish the last snapshot and say goodbye to the agent (also run at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        try:
            if self._loop is not None:
                self._loop.close()
        except Exception as e:
            log.warning("rank %d: closing the training-loop hooks: %s", self.rank, e)
        try:
            self._ckpt.close()
        except Exception as e:
            log.warning("rank %d: closing the in-memory checkpointer: %s", self.rank, e)


def validate_args(args: argparse.Namespace) -> None:
    """Called by the patched ``megatron/training/arguments.py:validate_args``.

    ``--inmem-ckpt`` selects ``--non-persistent-ckpt-type in_memory`` (and the other way round);
    ``--non-persistent-save-interval`` defaults to ``--inmem-ckpt-interval`` (1 for ``auto``, which
    then picks its own interval among the iterations Megatron offers). A bad value raises
    ``ConfigError`` naming it; under ``megatron-ft launch`` it ends the whole job at once instead
    (:func:`megatron_ft.fatal.end_job`, exit 2), since torchrun would only repeat it ``max_restarts`` times."""
    try:
        _validate_args(args)
    except ftconfig.ConfigError as e:
        _refuse(e)


def _refuse(e: ftconfig.ConfigError) -> None:
    """Raise ``e``; under ``megatron-ft launch`` end the whole job with it instead (exit 2)."""
    if os.environ.get("MFT_RUN_DIR") and os.environ.get("MFT_NODE_RANK") is not None:
        fatal.end_job(f"rank {os.environ.get('RANK', '?')}: {e}")
    raise e


def _validate_args(args: argparse.Namespace) -> None:
    kind = getattr(args, "non_persistent_ckpt_type", None)
    if getattr(args, "inmem_ckpt", False):
        if kind not in (None, CKPT_TYPE):
            raise ftconfig.ConfigError(f"--inmem-ckpt selects --non-persistent-ckpt-type {CKPT_TYPE}, but "
                                       f"--non-persistent-ckpt-type {kind} was given; drop one of them")
        args.non_persistent_ckpt_type = kind = CKPT_TYPE
    if kind != CKPT_TYPE:
        return
    args.inmem_ckpt = True
    if getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        raise ftconfig.ConfigError(f"--ckpt-format {args.ckpt_format}: in-memory checkpoints need "
                                   f"--ckpt-format torch_dist (Megatron builds the sharded state dict only then)")
    for flag in ("save", "load"):
        if not getattr(args, flag, None):
            raise ftconfig.ConfigError(f"--{flag} is not set: Megatron-LM takes non-persistent checkpoints only "
                                       f"with --save and restores them only with --load; pass both (the same "
                                       f"directory is fine, nothing is written there unless --save-interval says so)")
    cfg = ftconfig.from_args(args)  # validates the megatron-ft config and flags
    if getattr(args, "inmem_ckpt_profile_iterations", 0):
        try:
            profile_dir(args)
        except ValueError as e:
            raise ftconfig.ConfigError(str(e)) from None
    every = 1 if cfg.snapshot.auto else cfg.snapshot.interval
    given = getattr(args, "non_persistent_save_interval", None)
    if given is None:
        args.non_persistent_save_interval = every
    elif every != 1 and given != every:
        raise ftconfig.ConfigError(
            f"--non-persistent-save-interval {given} and --inmem-ckpt-interval "
            f"{'auto' if cfg.snapshot.auto else every} disagree; set only one of them")
