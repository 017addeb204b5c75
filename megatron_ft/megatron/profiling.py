"""``--inmem-ckpt-profile-iterations W``: profile the first W iterations of a megatron-core job.

:class:`LoopProfiler` does it for any loop; :class:`ProfilingHooks` wraps ``scripts/pretrain_gpt.py``'s
hooks (``TrainingHooks`` or :class:`~megatron_ft.megatron.checkpointing.MegatronCheckpointHooks`) with
it, and upstream Megatron-LM's loop reaches it through
:meth:`~megatron_ft.megatron.local_manager.InMemoryLocalCheckpointManager.training_loop`: after
``restore`` it installs :mod:`.hooks` on the model config and the optimizer with a
:class:`~megatron_ft.schedule.profiler.Profiler` as sink; ``before_iteration`` /
``after_iteration`` delimit iterations (the wrapped ``after_iteration`` runs inside the iteration,
so a snapshot's start shows in the timeline); after W iterations it writes
``<dir>/node<N>/rank<R>.json`` (:mod:`megatron_ft.rank_files`) and removes the wrappers again (unless a scheduled transport still has
callbacks registered), so later iterations run exactly as without profiling.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Optional

import torch.distributed as dist

from . import hooks as mhooks
from ..schedule.profiler import Profiler

log = logging.getLogger("megatron_ft")


def profile_dir(args: argparse.Namespace) -> str:
    d = getattr(args, "inmem_ckpt_profile_dir", None)
    if d:
        return d
    run_dir = os.environ.get("MFT_RUN_DIR")
    if not run_dir:
        raise ValueError("--inmem-ckpt-profile-iterations needs --inmem-ckpt-profile-dir or MFT_RUN_DIR "
                         "(megatron-ft launch sets it)")
    return os.path.join(run_dir, "profile")


def _topology() -> dict:
    from megatron.core import parallel_state as ps

    return {"world_size": dist.get_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size()}


def snapshot_bytes(objs: Any) -> Optional[int]:
    """Bytes this rank's in-memory snapshot holds (the tensors :class:`MegatronStateAdapter`
    captures: its 1/DP parameter slice, optimizer shard and RNG states), measured without copying."""
    from .state import MegatronStateAdapter

    try:
        tensors, _ = MegatronStateAdapter(objs.model, objs.optimizer, objs.scheduler).capture()
        return sum(t.spec().nbytes for t in tensors)
    except (ValueError, AttributeError) as e:  # no DDP buffers, foreign optimizer: the plan needs --ckpt-bytes
        log.warning("profile: snapshot size not measured (%s)", e)
        return None


def end_profile(prof: Profiler, directory: Optional[str], nbytes: Optional[int] = None,
                node: Optional[int] = None) -> Optional[str]:
    """Stop feeding ``prof``, take megatron-core's wrappers off when nothing else uses them (the
    iterations after the profile run exactly as without it), and write the profile (when
    ``directory`` is given and it recorded something) under ``node``'s directory (None: this
    process's node); returns the file's path."""
    mhooks.HOOKS.remove_sink(prof.record)
    if not mhooks.HOOKS.active:
        mhooks.uninstall()
    if directory is None or not prof.iterations:
        return None
    path = prof.write(directory, nbytes, node)
    log.info("profile: %d iterations of rank %d in %s", len(prof.iterations), prof.rank, path)
    return path


class LoopProfiler:
    """Profiles the first ``iterations`` iterations of a megatron-core training loop into
    ``directory``: :meth:`start` (after the model and optimizer exist) installs :mod:`.hooks` with a
    :class:`~megatron_ft.schedule.profiler.Profiler` as sink; :meth:`begin` / :meth:`end` delimit
    each iteration; after the last one (or at :meth:`finish`) the profile is written and the
    wrappers come off. Not collective; owns nothing but its profiler."""

    def __init__(self, iterations: int, directory: str) -> None:
        self.iterations, self.directory = iterations, directory
        self.profiler: Optional[Profiler] = None
        self.path: Optional[str] = None
        self._objs: Any = None

    def start(self, objs: Any) -> None:
        """``objs``: ``model`` (chunks), ``optimizer``, ``scheduler`` and ``config`` (the model config)."""
        self._objs = objs
        self.profiler = Profiler(dist.get_rank(), self.iterations, _topology())
        mhooks.install(objs.config, objs.optimizer).add_sink(self.profiler.record)

    def begin(self, iteration: int) -> None:
        if self.profiler is not None:
            self.profiler.begin_iteration(iteration)
        mhooks.HOOKS.begin_iteration(iteration)

    def end(self) -> None:
        mhooks.HOOKS.end_iteration()
        if self.profiler is not None and self.profiler.end_iteration():
            self.finish()

    def finish(self) -> None:
        """Write what was recorded (``complete: false`` before W iterations); idempotent."""
        prof, self.profiler = self.profiler, None
        if prof is not None:
            self.path = end_profile(prof, self.directory, snapshot_bytes(self._objs))


class ProfilingHooks:
    """Training-loop hooks that profile the first ``iterations`` iterations around ``inner``
    (``scripts/pretrain_gpt.py``'s hooks; the inner ``after_iteration`` runs inside the profiled
    iteration, so a snapshot's start shows in the timeline)."""

    def __init__(self, inner: Any, iterations: int, directory: str) -> None:
        self.inner = inner
        self.loop = LoopProfiler(iterations, directory)

    @property
    def path(self) -> Optional[str]:
        return self.loop.path

    @classmethod
    def from_args(cls, inner: Any, args: argparse.Namespace) -> "ProfilingHooks":
        return cls(inner, args.inmem_ckpt_profile_iterations, profile_dir(args))

    def restore(self, objs: Any, iteration: int, consumed_samples: int) -> tuple[int, int]:
        out = self.inner.restore(objs, iteration, consumed_samples)
        self.loop.start(objs)
        return out

    def before_iteration(self, objs: Any, iteration: int) -> None:
        if hasattr(self.inner, "before_iteration"):
            self.inner.before_iteration(objs, iteration)
        self.loop.begin(iteration)

    def before_optimizer_step(self, objs: Any, iteration: int) -> None:
        self.inner.before_optimizer_step(objs, iteration)

    def after_iteration(self, objs: Any, iteration: int, consumed_samples: int, loss: Optional[float] = None) -> None:
        self.inner.after_iteration(objs, iteration, consumed_samples, loss=loss)
        self.loop.end()

    def close(self) -> None:
        try:
            self.loop.finish()
        finally:
            if hasattr(self.inner, "close"):
                self.inner.close()
