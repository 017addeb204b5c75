"""torchrun worker: megatron-core's own distributed checkpoint (``dist_checkpointing``, format ``torch_dist``)
of scripts/pretrain_gpt.py's full training state on CPU/gloo, saved at one data-parallel size and loaded at
another (TP1 PP1, DP = the world size), e.g. saved by 3 processes and loaded by 2.

``--mode save``: build (pretrain_gpt's builders), train ``--iters`` iterations and save into ``--dir``, as
Megatron-LM's torch_dist checkpoint does: the model (the unwrapped ``GPTModel``'s ``sharded_state_dict()``), the
optimizer (``optimizer.sharded_state_dict(model_sd, is_loading, metadata=...)``: with ``--dist-opt [TYPE]`` the
distributed optimizer in sharding type TYPE, default ``dp_reshardable``; without it the plain fp32 optimizer,
its state keyed by the model's sharded tensors) and, as common state, the scheduler, the iteration, the
consumed samples and the RNG state.
``--mode load``: build fresh, uninitialised objects at this world size and load ``--dir`` into them.
Both then write into ``--out`` each rank's ``rank{R}.model.{name}.npy`` (the parameter as the rank holds it),
``rank{R}.opt.{name}.{param,exp_avg,exp_avg_sq}.npy`` (the optimizer's main parameter and Adam moments, the DP
shards all-gathered to the full parameter) and ``rank{R}.json`` (iteration, scheduler, Adam steps).
``--mode compare --dir SAVE_OUT --out LOAD_OUT`` (no torchrun) checks every rank's dumps in LOAD_OUT against
rank 0's in SAVE_OUT, bit for bit; exit status 1 on any difference.

The save and the load are :mod:`megatron_ft.megatron.dist_reference`'s (``save_reference`` /
``load_reference``, with its workarounds for megatron-core without Apex/TE); this helper trains, dumps and
compares around them.
"""
import argparse
import glob
import json
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import pretrain_gpt as pg  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from megatron_ft.megatron.dist_reference import load_reference, save_reference  # noqa: E402

from reslice_job import ResumeAt, start_gpt  # noqa: E402


def _no_dist_opt(cls):
    """pretrain_gpt's builders always ask for the distributed optimizer; this config class refuses it."""
    return lambda **kw: cls(**{**kw, "use_distributed_optimizer": False})


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
    ckpt = {"optimizer_sharding": a.dist_opt or None, "fully_parallel": a.fully_parallel}
    os.makedirs(a.out, exist_ok=True)
    if a.mode == "save":
        args.train_iters = a.iters  # (built for iters + more: the same scheduler as the loading job's)
        args.iteration, consumed = pg.train(objs)
        save_reference(objs, a.dir, args.iteration, consumed, **ckpt)
    else:
        args.iteration, consumed = load_reference(objs, a.dir, **ckpt)
        if a.more:
            dump(objs, a.restored_out, a.dist_opt)
            args.iteration, _ = pg.train(objs, ResumeAt(args.iteration, consumed))
    dump(objs, a.out, a.dist_opt)
    pg.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
