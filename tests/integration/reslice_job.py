"""torchrun worker for tests/integration/test_reslice_megatron.py: what a real megatron-core rank's data-parallel
shards hold of the parameters, as its snapshot records it.

A dense GPT (scripts/pretrain_gpt.py's build: DDP buckets, the distributed optimizer) trains ``--iters``
iterations at TP1 PP1 and DP = the world size; then each rank captures its state with
:class:`megatron_ft.megatron.state.MegatronStateAdapter` and writes, into ``--out``: the snapshot's
``extents`` record, the bytes of every entry that has extents (``rank{R}.{entry}.npy``), and every model
parameter's full value as this rank holds it after the step's all-gather (``rank{R}.full.{name}.npy``).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import pretrain_gpt as pg  # noqa: E402

from megatron_ft.megatron.cpu_compat import install_cpu_compat  # noqa: E402
from megatron_ft.megatron.state import MegatronStateAdapter  # noqa: E402


class ResumeAt(pg.TrainingHooks):
    """The training loop's restore point: the (iteration, consumed samples) a restored state holds."""

    def __init__(self, iteration: int, consumed_samples: int):
        self.at = (iteration, consumed_samples)

    def restore(self, objs, iteration, consumed_samples):
        return self.at


def start_gpt(iters: int, *extra: str, initialise: bool = True):
    """The tiny GPT of these tests (2 layers, hidden 32, global batch 12 - which DP 1, 2, 3, 4 and 6 divide -
    TP1 PP1, DP = the world size), its process groups made: (args, training objects), not trained yet."""
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "12", "--train-iters", str(iters),
            "--lr-warmup-iters", "1", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            *extra]
    install_cpu_compat()
    torch.set_num_threads(1)
    args = pg.parse_args(argv)
    pg.init_distributed(args)
    return args, pg.build_training_objects(args, initialise=initialise)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=2)
    a = p.parse_args()
    args, objs = start_gpt(a.iters)
    pg.train(objs)
    tensors, extra = MegatronStateAdapter(objs.model, objs.optimizer, objs.scheduler).capture()
    extra = json.loads(json.dumps(extra))  # as the snapshot's JSON record holds it
    rank = args.rank
    with open(os.path.join(a.out, f"rank{rank}.extents.json"), "w") as f:
        json.dump({"rank": rank, "world": args.world_size, "extents": extra["extents"],
                   "dtypes": {t.name: str(t.tensor.dtype) for t in tensors}}, f)
    for t in tensors:
        if t.name in extra["extents"]:
            np.save(os.path.join(a.out, f"rank{rank}.{t.name}.npy"), t.saved_view().detach().float().numpy())
    for c, chunk in enumerate(objs.model):
        for name, prm in chunk.named_parameters():
            np.save(os.path.join(a.out, f"rank{rank}.full.c{c}.{name}.npy"),
                    prm.detach().float().reshape(-1).numpy())
    pg.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
