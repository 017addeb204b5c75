"""torchrun worker for tests/integration/test_moe_state.py: a MoE GPT's capture and restore, in process.

A real megatron-core MoE GPT (scripts/pretrain_gpt.py's build: ``--num-experts 4 --moe-router-topk 2``,
expert parallelism ``--ep``, the load-balancing loss, the router's expert bias, the chained distributed
optimizer) trains ``--iters`` iterations uninterrupted; after iteration ``--at`` each rank captures its
state with :class:`megatron_ft.megatron.state.MegatronStateAdapter` (its saved bytes kept as the
snapshot would hold them) and at the end dumps its final state (``ref.rank{R}.json``).

Then every rank builds a fresh job with other seeds (other weights, other RNG streams), restores the
captured state the way :mod:`megatron_ft.trainer.recovery` does it - the adapter's destinations, this
rank's saved bytes copied into them, each shard re-gathered over its group by recovery's own
``gather_shard``, the record applied - and trains on to ``--iters``; it dumps ``res.rank{R}.json``.
Right after the restore it also dumps its RNG tracker streams and module buffers (``restored.rank{R}.json``),
next to those captured (the test compares every rank's streams and checks that expert-parallel ranks' differ, so a
stream restored from another rank is seen). No agent: the restore's tiers are the demo's test.
"""
import argparse
import hashlib
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import pretrain_gpt as pg  # noqa: E402
from megatron.core import parallel_state as ps, tensor_parallel  # noqa: E402

from megatron_ft.capture.layout import plan_layout  # noqa: E402
from megatron_ft.megatron.cpu_compat import install_cpu_compat  # noqa: E402
from megatron_ft.megatron.state import MegatronStateAdapter  # noqa: E402
from megatron_ft.trainer import recovery  # noqa: E402


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def tracker_digests() -> dict:
    return {name: digest(st) for name, st in sorted(tensor_parallel.get_cuda_rng_tracker().get_states().items())}


def buffer_digests(objs) -> dict:
    """The model's module buffers (the routers' expert bias and token counts)."""
    return {name: digest(t) for name, t in objs.model[0].module.named_buffers()}


class Capture(pg.TrainingHooks):
    """Captures after iteration ``at`` (the uninterrupted run)."""

    def __init__(self, at: int):
        self.at = at
        self.saved = None

    def after_iteration(self, objs, iteration, consumed_samples, loss=None):
        if iteration != self.at:
            return
        adapter = MegatronStateAdapter(objs.model, objs.optimizer, objs.scheduler)
        adapter.progress = {"iteration": iteration, "consumed_samples": consumed_samples}
        tensors, extra = adapter.capture()
        self.saved = {
            "specs": [t.spec() for t in tensors],
            "bytes": {t.name: t.saved_view().clone() for t in tensors},
            "extra": json.loads(json.dumps(extra)),  # as the snapshot's JSON record holds it
            "tracker": tracker_digests(),
            "buffers": buffer_digests(objs),
        }


class Restore(pg.TrainingHooks):
    """Restores what :class:`Capture` took, as recovery does."""

    def __init__(self, saved: dict, out: str, rank: int):
        self.saved, self.out, self.rank = saved, out, rank

    def restore(self, objs, iteration, consumed_samples):
        adapter = MegatronStateAdapter(objs.model, objs.optimizer, objs.scheduler)
        layout = plan_layout(self.saved["specs"], 1 << 20)
        targets = adapter.targets(layout, self.saved["extra"])
        for e in layout.entries:
            t = targets[e.spec.name]
            assert t.spec() == e.spec, (t.spec(), e.spec)
            t.saved_view().copy_(self.saved["bytes"][e.spec.name])
        for e in layout.entries:
            if e.spec.shard is not None:
                recovery.gather_shard(targets[e.spec.name])
        adapter.finish_restore(self.saved["extra"])
        with open(os.path.join(self.out, f"restored.rank{self.rank}.json"), "w") as f:
            json.dump({"rank": self.rank, "ep_rank": ps.get_expert_model_parallel_rank(),
                       "captured": self.saved["tracker"], "restored": tracker_digests(),
                       "buffers_captured": self.saved["buffers"], "buffers_restored": buffer_digests(objs)}, f)
        p = adapter.restored_progress
        return int(p["iteration"]), int(p["consumed_samples"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--at", type=int, default=2)
    a = p.parse_args()
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(a.iters),
            "--lr-warmup-iters", "1", "--num-experts", "4", "--moe-router-topk", "2",
            "--expert-model-parallel-size", str(a.ep), "--moe-aux-loss-coeff", "1e-2",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "1e-2"]
    install_cpu_compat()
    torch.set_num_threads(1)
    args = pg.parse_args(argv)
    pg.init_distributed(args)
    rank = args.rank

    objs = pg.build_training_objects(args)
    cap = Capture(a.at)
    pg.train(objs, cap)
    pg.dump_final_state(objs, os.path.join(a.out, "ref"))

    args2 = pg.parse_args([*argv, "--seed", "4321"])  # other weights, other RNG streams
    args2.rank, args2.world_size = args.rank, args.world_size
    args2.data_parallel_size, args2.num_microbatches = args.data_parallel_size, args.num_microbatches
    objs2 = pg.build_training_objects(args2)
    objs2.dataset = objs.dataset  # the same data (the seed also seeds the synthetic tokens)
    pg.train(objs2, Restore(cap.saved, a.out, rank))
    pg.dump_final_state(objs2, os.path.join(a.out, "res"))
    pg.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
