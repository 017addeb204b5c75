"""What a training loop calls around every iteration, apart from the snapshot itself: the
scheduled transport (``redundancy.transport: scheduled``: the trainers send the peer copies in the
planned idle spans) and the profiler of ``--inmem-ckpt-profile-iterations``. Used by upstream
Megatron-LM's patched ``train()`` (through
:meth:`~megatron_ft.megatron.local_manager.InMemoryLocalCheckpointManager.training_loop`) and by
``scripts/pretrain_gpt.py``'s hooks (:class:`~megatron_ft.megatron.checkpointing.MegatronCheckpointHooks`).
"""
from __future__ import annotations

from typing import Any, Optional

from .. import config as ftconfig
from ..trainer.checkpointer import InMemoryCheckpointer
from .profiling import LoopProfiler


class TrainingLoop:
    """``before_iteration(i)`` before
    ``train_step`` of iteration ``i`` (0-based), ``after_iteration(n)`` once ``n`` iterations are
    complete, before Megatron checkpoints iteration ``n``. There the scheduled transport
    (``redundancy.transport: scheduled``: the trainers send the peer copies in the planned idle spans)
    and the profiler of ``--inmem-ckpt-profile-iterations`` act. Built collectively (the scheduled
    transport creates its process groups); the calls are not collective unless the transport plans."""

    def __init__(self, cfg: ftconfig.FTConfig, ckpt: InMemoryCheckpointer, objs: Any,
                 profiler: Optional[LoopProfiler]) -> None:
        self.sched = None
        if cfg.redundancy.scheme != "none" and cfg.redundancy.transport == "scheduled" and ckpt.engine is not None:
            from .scheduled import ScheduledHooks

            self.sched = ScheduledHooks(cfg, ckpt, objs)
        self.profiler = profiler
        if profiler is not None:
            profiler.start(objs)

    @property
    def snapshots_off(self) -> bool:
        """A ``schedule.compare_modes`` segment of ``off`` (benchmarks): no snapshot this iteration."""
        return self.sched is not None and self.sched.snapshots_off

    def before_iteration(self, iteration: int) -> None:
        if self.sched is not None:
            self.sched.before_iteration(iteration)
        if self.profiler is not None:
            self.profiler.begin(iteration)

    def after_iteration(self, iteration: int) -> None:
        if self.sched is not None:  # before the snapshot of this step starts: the engine is idle
            self.sched.after_iteration(iteration)
        if self.profiler is not None:
            self.profiler.end()

    def close(self) -> None:
        try:
            if self.sched is not None:
                self.sched.close()
        finally:
            if self.profiler is not None:
                self.profiler.finish()
