"""torchrun worker for tests/integration/test_local_manager.py: Megatron-LM's local-tier calls, made by hand.

Megatron-LM's ``megatron.training`` is not installed here (only megatron-core), so this script
does what ``save_checkpoint`` / ``load_checkpoint`` (core_v0.16.1) do for the local tier, on a real
megatron-core GPT with the distributed optimizer (scripts/pretrain_gpt.py builds it):

* ``generate_state_dict``: model and optimizer ``sharded_state_dict`` with the metadata of
  ``_build_sharded_state_dict_metadata`` (dp_reshardable), scheduler state, the RNG state as the
  ``ShardedObject`` of ``get_rng_state``, args, iteration;
* save: ``tensor_aware_state_dict_cls.from_state_dict(..., algo="fully_parallel",
  parallelization_group=DP)`` then ``manager.save(tasd, iteration, is_async=...)``;
* load: ``find_latest()``, ``load()`` + ``to_state_dict(None)`` (the rank0 pass), ``load()`` +
  ``to_state_dict(sharded_state_dict, ...)``, then ``load_state_dict`` of model, optimizer and
  scheduler, RNG and args as ``load_checkpoint`` does.

``--phase save``: call ``training_loop`` as the patched ``train()`` does (the manager then knows model
and optimizer, and copies in the background); train iterations 1..N; after each, dump digests
(``save.it{i}``), then save (1..N/2 as Megatron's synchronous caller, the rest as its ``--async-save``
caller); then train iteration N+1 (its optimizer step must wait for the last copy) and dump
``save.it{N+1}``. The state dict also holds ``probe``, a tensor that is neither a parameter nor
optimizer state, set to the iteration before each save and overwritten right after it returns (as
a MoE router's expert bias changes before the next step), and the run's arguments change right after
it too (a list among them, in place): the snapshot must hold the values at save.
``--phase load``: fresh model, scrambled (random parameters, other RNG seeds); restore; write ``found.json``; dump ``load.it{F}``;
train one iteration; dump ``load.it{F+1}``.
"""
import argparse
import json
import os
import random
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import pretrain_gpt as pg  # noqa: E402
from megatron.core import parallel_state as ps, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.transformer.enums import AttnBackend  # noqa: E402

from megatron_ft.megatron.local_manager import InMemoryLocalCheckpointManager  # noqa: E402


def state_dict(objs, iteration, is_loading=False):
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    meta = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True, "dp_cp_group": dp}
    sd = {"args": objs.args, "checkpoint_version": 3.0}
    if iteration is not None:
        sd["iteration"] = iteration
    sd["model"] = objs.model[0].module.sharded_state_dict(metadata=meta)  # save_checkpoint unwraps DDP
    sd["optimizer"] = objs.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=meta)
    sd["opt_param_scheduler"] = objs.scheduler.state_dict()
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    sd["rng_state"] = ShardedObject("rng_state", [rng], (ps.get_pipeline_model_parallel_world_size(),
                                    ps.get_tensor_model_parallel_world_size()),
                                    (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                                    replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    sd["num_floating_point_operations_so_far"] = 1.5e12
    sd["probe"] = PROBE
    return sd


PROBE = torch.zeros(1024)


def init_optimizer_state(objs):
    """A fresh optimizer has no state; megatron-core without Apex/TE then fails in
    ``DistributedOptimizer.state_dict`` (``assert len(steps) == 1``) before any load can start.
    Give it Adam's initial state, as a first step would (on GPU, TE's optimizer does not need this)."""
    for opt in objs.optimizer.chained_optimizers:
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                st.setdefault("step", torch.tensor(0.0))
                st.setdefault("exp_avg", torch.zeros_like(p))
                st.setdefault("exp_avg_sq", torch.zeros_like(p))


def set_adam_steps(objs, optimizer_sd):
    """megatron-core 0.16.1 without Apex/TE keeps Adam's step in the param groups of the state dict
    (DistributedOptimizer.state_dict) but, when the optimizer state already exists, its
    load_state_dict leaves torch Adam's per-parameter ``step`` at its old value. The loaded state
    dict holds the right step (checked here); put it where torch Adam reads it."""
    steps = {g["step"] for g in optimizer_sd["optimizer"]["param_groups"]}
    assert len(steps) == 1, steps
    for opt in objs.optimizer.chained_optimizers:
        for st in opt.optimizer.state.values():
            st["step"] = torch.tensor(float(next(iter(steps))))  # one tensor per parameter, as torch Adam has


def scramble(objs):
    """Make the fresh job differ from the saved one everywhere a restore must write: parameters
    (and so the param buffers and fp32 main params) and every RNG. The data order stays that of
    ``--seed`` (the synthetic dataset is seeded by it), as in a restarted job."""
    with torch.no_grad():
        for p in objs.model[0].parameters():
            p.normal_()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)


def train_one(objs, iteration, consumed):
    it = pg.build_iterator(objs, consumed)
    pg.train_step(objs, it, iteration, pg.TrainingHooks())
    return iteration + 1, consumed + objs.args.global_batch_size


def dump(objs, out, tag, iteration, consumed):
    pg.dump_final_state(objs, os.path.join(out, tag), {"iteration": iteration, "consumed_samples": consumed})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    args = pg.parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                          "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2",
                          "--train-iters", str(a.iters + 2), "--seed", str(a.seed), "--inmem-ckpt"])
    pg.install_cpu_compat()
    torch.set_num_threads(1)
    pg.init_distributed(args)
    # what Megatron's args also carry: a dtype and an enum
    args.params_dtype, args.attention_backend, args.consumed_train_samples = torch.float32, AttnBackend.auto, 0
    objs = pg.build_training_objects(args)
    mgr = InMemoryLocalCheckpointManager.from_args(args)
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    for chunk in objs.model:
        chunk.train()
    if a.phase == "save":
        mgr.training_loop(objs.model, objs.optimizer, objs.scheduler, objs.config)
        iteration, consumed = 0, 0
        while iteration < a.iters:
            iteration, consumed = train_one(objs, iteration, consumed)
            args.consumed_train_samples = consumed
            dump(objs, a.out, f"save.it{iteration}", iteration, consumed)
            PROBE.fill_(iteration)
            tasd, _ = mgr.tensor_aware_state_dict_cls.from_state_dict(
                state_dict(objs, iteration), algo="fully_parallel", parallelization_group=dp)
            args.mft_probe = [iteration]
            req = mgr.save(tasd, iteration, is_async=iteration > a.iters // 2)
            PROBE.fill_(-1.0)
            # training changes its arguments as soon as save() returns (Megatron: args.curr_iteration, the
            # consumed samples): the snapshot holds them as they were at save
            args.consumed_train_samples = -1
            args.mft_probe.append(-1)
            assert (req is None) == (iteration <= a.iters // 2), req
        iteration, consumed = train_one(objs, iteration, consumed)
        dump(objs, a.out, f"save.it{iteration}", iteration, consumed)
    else:
        scramble(objs)
        found = mgr.find_latest()
        if args.rank == 0:
            with open(os.path.join(a.out, "found.json"), "w") as f:
                json.dump({"found": found}, f)
        if found >= 0:
            tasd, name = mgr.load()
            common = tasd.to_state_dict(None, algo="fully_parallel", parallelization_group=dp)  # rank0 pass
            assert common["iteration"] == found and common["args"].attention_backend is AttnBackend.auto, common
            assert torch.equal(common["probe"], torch.full((1024,), float(found))), common["probe"][:4]
            assert common["args"].mft_probe == [found], common["args"].mft_probe
            tasd, name = mgr.load()
            init_optimizer_state(objs)
            sd = tasd.to_state_dict(state_dict(objs, None, is_loading=True), algo="fully_parallel",
                                    parallelization_group=dp)
            objs.model[0].load_state_dict(sd["model"], strict=True)
            with torch.no_grad():  # fp32 training: the main params are views of the (leaf) model params
                objs.optimizer.load_state_dict(sd["optimizer"])
            set_adam_steps(objs, sd["optimizer"])
            objs.scheduler.load_state_dict(sd["opt_param_scheduler"])
            rng = sd["rng_state"][0]
            random.setstate(rng["random_rng_state"])
            np.random.set_state(rng["np_rng_state"])
            torch.set_rng_state(rng["torch_rng_state"])
            torch.cuda.set_rng_state(rng["cuda_rng_state"])
            tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
            iteration, consumed = sd["iteration"], sd["args"].consumed_train_samples
            assert sd["args"].params_dtype is torch.float32 and sd["num_floating_point_operations_so_far"] == 1.5e12
            dump(objs, a.out, f"load.it{iteration}", iteration, consumed)
            iteration, consumed = train_one(objs, iteration, consumed)
            dump(objs, a.out, f"load.it{iteration}", iteration, consumed)
    mgr.close()
    pg.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
