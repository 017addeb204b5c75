"""Megatron's own reshard, as the reference for a resume at another data-parallel size.

:func:`save_reference` writes ``scripts/pretrain_gpt.py``'s full training state as megatron-core's
distributed checkpoint (:mod:`megatron.core.dist_checkpointing`, format ``torch_dist``), laid out as
Megatron-LM's ``save_checkpoint`` lays it out; :func:`load_reference` loads it into the objects of a job
of any data-parallel size (same TP and PP). A job saved at DP ``a`` after iteration N and loaded at DP
``b`` is what Megatron itself does to change the data-parallel size mid-run, so it is the reference a
megatron-ft resume at another size is checked against.

Contract:

* Both functions are collective: every rank of the job calls them, in the same order, with the same
  ``directory`` (a path every rank reaches; the save creates it, and overwrites what is there).
* What is saved: the model (each unwrapped model chunk's ``sharded_state_dict()``: under ``model``, or
  ``model0``, ``model1``, ... with a virtual pipeline, as Megatron-LM keys them); the optimizer
  (``optimizer.sharded_state_dict``: the distributed optimizer in sharding type ``optimizer_sharding``,
  by default ``dp_reshardable``, or the plain fp32 optimizer when ``optimizer_sharding`` is None); and, as
  common state, the LR scheduler (``opt_param_scheduler``), the ``iteration``, the ``consumed_samples``
  and the RNG state (``rng_state``, as Megatron-LM saves it for torch_dist without
  ``--data-parallel-random-init``: data-parallel replica 0's generators of each (PP, TP) coordinate).
* The load overwrites every one of those in the given objects (which may be built fresh, with their
  weights uninitialised) and returns ``(iteration, consumed_samples)``: the point the training loop
  resumes at. The objects must be built for the same model, TP, PP and job length (``--train-iters``:
  the scheduler's), the data-parallel size may differ.

megatron-core 0.16.1 (and core_v0.19.0) need three workarounds for the distributed optimizer's load
without Apex/TE (on top of :func:`~megatron_ft.megatron.cpu_compat.install_cpu_compat` on CPU), none
patching megatron-core: :func:`init_adam_state` (a fresh optimizer's ``state_dict()`` asserts),
``torch.no_grad()`` around ``optimizer.load_state_dict`` (fp32 main params are views of leaf parameters)
and :func:`restore_adam_step` (the Adam step comes back as 0, in one tensor shared by all parameters).
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.utils import unwrap_model

#: the distributed optimizer's sharding type Megatron-LM saves by default: reshardable across DP sizes
DEFAULT_OPTIMIZER_SHARDING = "dp_reshardable"


def save_reference(objs: Any, directory: str, iteration: int, consumed_samples: int, *,
                   optimizer_sharding: Optional[str] = DEFAULT_OPTIMIZER_SHARDING,
                   fully_parallel: bool = False) -> None:
    """Collective: save ``objs`` (pretrain_gpt's ``TrainingObjects``) after ``iteration`` completed
    iterations and ``consumed_samples`` samples into ``directory`` (see the module's contract).
    ``optimizer_sharding``: the distributed optimizer's sharding type (None: the plain optimizer);
    ``fully_parallel``: spread the writing over the data-parallel ranks (``FullyParallelSaveStrategyWrapper``).
    With ``--overlap-param-gather`` the last step's parameter all-gather is finished first, as Megatron-LM does."""
    for chunk in objs.model:  # as Megatron-LM before a save: finish the last step's overlapped param all-gather
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    sd, content_metadata = sharded_state_dict(objs, iteration, consumed_samples, optimizer_sharding,
                                              is_loading=False)
    strategy = get_default_save_sharded_strategy("torch_dist")
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, _dp_group())
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, directory, strategy, content_metadata=content_metadata)


def load_reference(objs: Any, directory: str, *,
                   optimizer_sharding: Optional[str] = DEFAULT_OPTIMIZER_SHARDING,
                   fully_parallel: bool = False) -> Tuple[int, int]:
    """Collective: load the checkpoint in ``directory`` into ``objs`` (pretrain_gpt's ``TrainingObjects``,
    possibly built at another data-parallel size, weights uninitialised) and return its
    ``(iteration, consumed_samples)``. ``optimizer_sharding`` and ``fully_parallel`` as the save's (the
    sharding type must be the one saved)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no megatron-core distributed checkpoint at {directory!r} (not a directory)")
    if optimizer_sharding:
        init_adam_state(objs)
    sd, _ = sharded_state_dict(objs, 0, 0, optimizer_sharding, is_loading=True)
    strategy = get_default_load_sharded_strategy(directory)
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(strategy, _dp_group())
    state = dist_checkpointing.load(sd, directory, strategy)
    missing = [k for k in ("iteration", "consumed_samples") if k not in state]
    if missing:
        raise KeyError(f"the checkpoint at {directory!r} has no {' / '.join(missing)} in its common state "
                       f"(not saved by save_reference)")
    for key, chunk in _model_keys(objs):
        chunk.load_state_dict(state[key])
    with torch.no_grad():  # workaround 2: fp32 main params are views of the model's (leaf) parameters
        objs.optimizer.load_state_dict(state["optimizer"])
    objs.scheduler.load_state_dict(state["opt_param_scheduler"])
    set_rng_state(state["rng_state"])
    if optimizer_sharding:
        restore_adam_step(objs, state["optimizer"])
    return int(state["iteration"]), int(state["consumed_samples"])


def sharded_state_dict(objs: Any, iteration: int, consumed_samples: int, optimizer_sharding: Optional[str],
                       is_loading: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The training state as Megatron-LM's ``generate_state_dict`` builds it for torch_dist, and the
    content metadata it saves with it: ``(sharded state dict, content metadata)``."""
    meta: Dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                            "dp_cp_group": _dp_group()}
    if optimizer_sharding:
        meta["distrib_optim_sharding_type"] = optimizer_sharding
    sd: Dict[str, Any] = {key: chunk.sharded_state_dict(metadata=meta) for key, chunk in _model_keys(objs)}
    sd["optimizer"] = objs.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=meta)
    sd["opt_param_scheduler"] = objs.scheduler.state_dict()
    sd["rng_state"] = rng_state()
    sd["iteration"] = iteration
    sd["consumed_samples"] = consumed_samples
    return sd, {k: v for k, v in meta.items() if k != "dp_cp_group"}


def _model_keys(objs: Any):
    """(key, unwrapped model chunk) pairs, keyed as Megatron-LM's checkpoint keys them."""
    chunks = unwrap_model(objs.model)
    if len(chunks) == 1:
        return [("model", chunks[0])]
    return [(f"model{i}", chunk) for i, chunk in enumerate(chunks)]


def _dp_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def rng_state() -> ShardedObject:
    """Megatron-LM's ``get_rng_state`` for torch_dist (without ``--data-parallel-random-init``): this rank's
    generators as one object per (pp, tp) coordinate whose replica is the data-parallel rank - replica 0's
    is saved, and every rank at any data-parallel size loads it."""
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    ps = parallel_state
    return ShardedObject("rng_state", [state], (ps.get_pipeline_model_parallel_world_size(),
                                                ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def set_rng_state(loaded: list) -> None:
    """Megatron-LM's ``load_checkpoint`` for the loaded ``rng_state`` (replica 0's)."""
    state = loaded[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def init_adam_state(objs: Any) -> None:
    """Workaround 1: without Apex/TE, DistributedOptimizer.state_dict() reads a ``step`` from every inner
    torch Adam state (``assert len(steps) == 1`` fails on a fresh optimizer, which has no state yet):
    give every parameter without state a zero one (the load overwrites it)."""
    for opt in objs.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if not opt.optimizer.state[p]:
                    opt.optimizer.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                                                  exp_avg_sq=torch.zeros_like(p))


def restore_adam_step(objs: Any, optim_state: Any) -> None:
    """Workaround 3: without Apex/TE, DistributedOptimizer.load_state_dict() puts the checkpoint's step into
    ONE tensor shared by every parameter's state, then its dp_reshardable loader copies the placeholder step
    of the is_loading state dict (a LocalNonpersistentObject: this fresh optimizer's 0) into it. Give every
    parameter its own tensor holding the checkpoint's step (saved in the param groups)."""
    chained = objs.optimizer.chained_optimizers
    for i, opt in enumerate(chained):
        sd = optim_state if len(chained) == 1 else optim_state[i]
        (step,) = {g["step"] for g in sd["optimizer"]["param_groups"]}
        for st in opt.optimizer.state.values():
            st["step"] = torch.tensor(float(step))
