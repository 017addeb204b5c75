"""Training-loop hooks that wire megatron-ft into a megatron-core training script.

``scripts/pretrain_gpt.py`` calls, in order: ``restore`` once after building the model,
optimizer and scheduler; ``before_optimizer_step`` and ``after_iteration`` every iteration;
``close`` at the end. ``objs`` is anything with ``model`` (list of DDP chunks), ``optimizer``,
``scheduler`` and ``args`` attributes.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Optional

import torch.distributed as dist

from .. import config as ftconfig
from ..trainer import in_process
from ..trainer.checkpointer import InMemoryCheckpointer
from .generation_restore import generation_record, restore_generation
from .loop import TrainingLoop
from .state import MegatronStateAdapter

log = logging.getLogger("megatron_ft")


def megatron_topology() -> dict:
    from megatron.core import parallel_state as ps

    topo = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
    }
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if ep != 1 or etp != topo["tp"]:  # a dense job's identity stays what it was
        topo.update(ep=ep, etp=etp)
    return topo


def checked_topology(cfg: ftconfig.FTConfig) -> dict:
    """The job's topology, after checking it against the megatron-ft config's ``parallel`` section."""
    topo = megatron_topology()
    want = (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert)
    if (topo["tp"], topo["pp"], topo.get("ep", 1)) != want:
        raise ftconfig.ConfigError(
            f"parallel.tensor={want[0]}, parallel.pipeline={want[1]}, parallel.expert={want[2]} in the megatron-ft "
            f"config do not match the job's --tensor-model-parallel-size={topo['tp']} "
            f"--pipeline-model-parallel-size={topo['pp']} --expert-model-parallel-size={topo.get('ep', 1)}; "
            f"they must be equal")
    return topo


class MegatronCheckpointHooks:
    def __init__(self, args: argparse.Namespace):
        self.cfg = ftconfig.from_args(args)
        self.ckpt: Optional[InMemoryCheckpointer] = None
        self.loop: Optional[TrainingLoop] = None  # the scheduled transport, when configured (no profiler here)

    def restore(self, objs: Any, iteration: int, consumed_samples: int) -> tuple[int, int]:
        topo = checked_topology(self.cfg)
        adapter = MegatronStateAdapter(objs.model, objs.optimizer, objs.scheduler)
        self.ckpt = InMemoryCheckpointer(self.cfg, adapter, dist.get_rank(), dist.get_world_size(), topo)
        res = self.ckpt.restore()
        if res.source == "none" and (gen := generation_record()) is not None:
            # a new generation's first start: from the previous generation's containers, re-sliced
            res = restore_generation(self.cfg, adapter, dist.get_rank(), self.ckpt.node, gen)
            self.ckpt.restored_elsewhere(res)
        in_process.check_restored(res.source != "none")  # weights built uninitialised: never train on them
        self.loop = TrainingLoop(self.cfg, self.ckpt, objs, profiler=None)
        if res.source == "none":
            return iteration, consumed_samples
        progress = adapter.restored_progress or {}
        return int(progress["iteration"]), int(progress["consumed_samples"])

    def before_iteration(self, objs: Any, iteration: int) -> None:
        if self.loop is not None:
            self.loop.before_iteration(iteration)

    def before_optimizer_step(self, objs: Any, iteration: int) -> None:
        if self.ckpt is not None:
            self.ckpt.before_optimizer_step()

    def after_iteration(self, objs: Any, iteration: int, consumed_samples: int, loss: Optional[float] = None) -> None:
        """``loss``: the iteration's training loss on the ranks that have it (the last pipeline stage),
        recorded with the snapshot and judged by the guard after a restore."""
        if self.loop is not None:  # before the snapshot of this step starts: the engine is idle
            self.loop.after_iteration(iteration)
        if self.ckpt is not None and not (self.loop is not None and self.loop.snapshots_off):
            self.ckpt.after_iteration(iteration, consumed_samples, loss)

    def close(self) -> None:
        try:
            if self.loop is not None:
                self.loop.close()
        finally:
            if self.ckpt is not None:
                self.ckpt.close()
