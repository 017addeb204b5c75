"""torchrun worker: megatron-core's own distributed checkpoint (``dist_checkpointing``, format ``torch_dist``)
of scripts/pretrain_gpt.py's full training state on CPU/gloo, saved at one data-parallel size and loaded at
another (TP1 PP1, DP = the world size), e.g. saved by 3 processes and loaded by 2.

``--mode save``: build (pretrain_gpt's builders), train ``--iters`` iterations and save into ``--dir``, as
Megatron-LM's torch_dist checkpoint does: the model (the unwrapped ``GPTModel``'s ``sharded_state_dict()``), the
optimizer (``optimizer.sharded_state_dict(model_sd, is_loading, metadata=...)``: with ``--dist-opt [TYPE]`` the
distributed optimizer in sharding type TYPE, default ``dp_reshardable``; without it the plain fp32 optimizer,
its state keyed by the model's sharded tensors) and, as common state, the scheduler and the iteration.
``--mode load``: build fresh, uninitialised objects at this world size and load ``--dir`` into them.
Both then write into ``--out`` each rank's ``rank{R}.model.{name}.npy`` (the parameter as the rank holds it),
``rank{R}.opt.{name}.{param,exp_avg,exp_avg_sq}.npy`` (the optimizer's main parameter and Adam moments, the DP
shards all-gathered to the full parameter) and ``rank{R}.json`` (iteration, scheduler, Adam steps).
``--mode compare --dir SAVE_OUT --out LOAD_OUT`` (no torchrun) checks every rank's dumps in LOAD_OUT against
rank 0's in SAVE_OUT, bit for bit; exit status 1 on any difference.

On top of ``install_cpu_compat()``, megatron-core 0.16.1 (and core_v0.19.0) need three workarounds on CPU
without Apex/TE, none patching megatron-core, all for the distributed optimizer's load (see the functions):
``init_adam_state`` (fresh optimizer: ``state_dict()`` asserts), ``torch.no_grad()`` around
``optimizer.load_state_dict`` (fp32 main params are views of leaf parameters) and ``restore_adam_step`` (the
Adam step comes back as 0, in one tensor shared by all parameters).
"""
import argparse
import glob
import json
import os
import random
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import pretrain_gpt as pg  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.dist_checkpointing.serialization import (  # noqa: E402
    get_default_load_sharded_strategy, get_default_save_sharded_strategy)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)
from megatron.core.utils import unwrap_model  # noqa: E402

from reslice_job import ResumeAt, start_gpt  # noqa: E402


def _no_dist_opt(cls):
    """pretrain_gpt's builders always ask for the distributed optimizer; this config class refuses it."""
    return lambda **kw: cls(**{**kw, "use_distributed_optimizer": False})


def init_adam_state(objs) -> None:
    """Workaround 1: without Apex/TE, DistributedOptimizer.state_dict() reads a ``step`` from every inner
    torch Adam state (``assert len(steps) == 1`` fails on a fresh optimizer, which has no state yet)."""
    for opt in objs.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if not opt.optimizer.state[p]:
                    opt.optimizer.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                                                  exp_avg_sq=torch.zeros_like(p))


def restore_adam_step(objs, optim_state) -> None:
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


def sharded_state_dict(objs, dist_opt: str, is_loading: bool):
    """The training state as Megatron-LM's generate_state_dict builds it (torch_dist, one model chunk)."""
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if dist_opt:
        meta["distrib_optim_sharding_type"] = dist_opt
    sd = {"model": unwrap_model(objs.model[0]).sharded_state_dict(metadata=meta)}  # keys as Megatron-LM's
    sd["optimizer"] = objs.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=meta)
    sd["opt_param_scheduler"] = objs.scheduler.state_dict()
    sd["rng_state"] = rng_state()
    sd["iteration"] = objs.args.iteration
    return sd, {k: v for k, v in meta.items() if k != "dp_cp_group"}


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


def dump(objs, out: str, dist_opt: str) -> None:
    """Every parameter as this rank holds it and the optimizer's per-parameter state, gathered to full."""
    os.makedirs(out, exist_ok=True)
    rank, module = torch.distributed.get_rank(), unwrap_model(objs.model[0])
    names = {p: n for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        np.save(os.path.join(out, f"rank{rank}.model.{n}.npy"), p.detach().numpy())
    steps = [st["step"] for o in objs.optimizer.chained_optimizers for st in o.optimizer.state.values()]
    pieces = {}  # name -> (start, end, {state: this rank's shard})
    for opt in objs.optimizer.chained_optimizers:
        if dist_opt:
            for p in opt.model_param_group_index_map:
                rng = opt._get_model_param_range_map(p)["param"]
                st = opt._get_main_param_and_optimizer_states(p)
                pieces[names[p]] = (rng.start, rng.end, {k: v.detach().clone().numpy() for k, v in st.items()})
        else:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    st = {"param": p, **opt.optimizer.state[p]}
                    pieces[names[p]] = (0, p.numel(), {k: v.detach().clone().numpy() for k, v in st.items()})
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, pieces)
    for n, p in module.named_parameters():
        full, covered = {}, np.zeros(p.numel(), bool)
        for rank_pieces in gathered:
            if n not in rank_pieces:
                continue
            start, end, st = rank_pieces[n]
            covered[start:end] = True
            for k, v in st.items():
                if k == "step":
                    continue
                full.setdefault(k, np.empty(p.numel(), v.dtype))[start:end] = v.reshape(-1)
        assert covered.all(), n
        for k, v in full.items():
            np.save(os.path.join(out, f"rank{rank}.opt.{n}.{k}.npy"), v)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"iteration": objs.args.iteration, "scheduler": objs.scheduler.state_dict(),
                   "adam_steps": sorted({float(t) for t in steps}),
                   "adam_step_tensors_shared": len({id(t) for t in steps}) < len(steps)}, f, sort_keys=True)


def compare(ref: str, new: str) -> int:
    ref_files = sorted(glob.glob(os.path.join(ref, "rank0.*.npy")))
    bad, ranks = [], sorted({os.path.basename(f).split(".")[0] for f in glob.glob(os.path.join(new, "rank*.json"))})
    ref_json = json.load(open(os.path.join(ref, "rank0.json")))
    for r in ranks:
        for f in ref_files:
            name = os.path.basename(f)[len("rank0."):]
            a, b = np.load(f), np.load(os.path.join(new, f"{r}.{name}"))
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes() or not np.array_equal(a, b):
                bad.append(f"{r}.{name}")
        if json.load(open(os.path.join(new, f"{r}.json"))) != ref_json:
            bad.append(f"{r}.json")
    print(json.dumps({"ranks": ranks, "arrays_per_rank": len(ref_files), "mismatches": bad}))
    return 1 if bad or not ref_files or not ranks else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "load", "compare"], required=True)
    p.add_argument("--dir", required=True, help="checkpoint directory (compare: the save job's --out)")
    p.add_argument("--out", required=True, help="where the .npy dumps go")
    p.add_argument("--dist-opt", nargs="?", const="dp_reshardable", default="",
                   help="distributed optimizer, saved in this sharding type (default dp_reshardable)")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--more", type=int, default=0, help="the job trains for iters + more: save after iters; "
                   "load, dump into --restored-out, then train the remaining ones")
    p.add_argument("--restored-out", help="load with --more: where the state is dumped right after the load")
    p.add_argument("--fully-parallel", action="store_true", help="wrap the strategies in FullyParallel*")
    a = p.parse_args()
    if a.mode == "compare":
        return compare(a.dir, a.out)
    if not a.dist_opt:
        pg.DistributedDataParallelConfig = _no_dist_opt(pg.DistributedDataParallelConfig)
        pg.OptimizerConfig = _no_dist_opt(pg.OptimizerConfig)
    args, objs = start_gpt(a.iters + a.more, initialise=a.mode == "save")
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    os.makedirs(a.out, exist_ok=True)
    if a.mode == "save":
        args.train_iters = a.iters  # (built for iters + more: the same scheduler as the loading job's)
        args.iteration, _ = pg.train(objs)
        sd, content_meta = sharded_state_dict(objs, a.dist_opt, is_loading=False)
        strategy = get_default_save_sharded_strategy("torch_dist")
        if a.fully_parallel:
            strategy = FullyParallelSaveStrategyWrapper(strategy, dp_group)
        if args.rank == 0:
            os.makedirs(a.dir, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(sd, a.dir, strategy, content_metadata=content_meta)
    else:
        args.iteration = -1
        if a.dist_opt:
            init_adam_state(objs)
        sd, _ = sharded_state_dict(objs, a.dist_opt, is_loading=True)
        strategy = get_default_load_sharded_strategy(a.dir)
        if a.fully_parallel:
            strategy = FullyParallelLoadStrategyWrapper(strategy, dp_group)
        state = dist_checkpointing.load(sd, a.dir, strategy)
        unwrap_model(objs.model[0]).load_state_dict(state["model"])
        with torch.no_grad():  # workaround 2: fp32 main params are views of the model's (leaf) parameters
            objs.optimizer.load_state_dict(state["optimizer"])
        objs.scheduler.load_state_dict(state["opt_param_scheduler"])
        args.iteration = state["iteration"]
        set_rng_state(state["rng_state"])
        if a.dist_opt:
            restore_adam_step(objs, state["optimizer"])
        if a.more:
            dump(objs, a.restored_out, a.dist_opt)
            args.iteration, _ = pg.train(objs, ResumeAt(args.iteration, args.iteration * args.global_batch_size))
    dump(objs, a.out, a.dist_opt)
    pg.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
