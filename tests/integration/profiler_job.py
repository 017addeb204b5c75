"""torchrun worker for tests/integration/test_profiler.py: the real megatron-core GPT of scripts/pretrain_gpt.py
(PP = number of processes), trained through ``pretrain_gpt.train`` with :class:`ProfilingHooks`
and, around it, schedule-point callbacks registered on :data:`megatron_ft.megatron.hooks.HOOKS`.

One callback stands in for a scheduled transport: after the first micro-batch's forward of every
iteration it really copies ``--chunk-bytes`` of this rank's parameter buffer into a host buffer and
reports that as a ``ckpt`` event. Writes ``OUT/job.rank{R}.json``: the callbacks seen, whether the
wrappers stayed installed after the profile (they must, callbacks are registered) and whether
uninstall put megatron-core's originals back.
"""
import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import pretrain_gpt as pg  # noqa: E402
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402

from megatron_ft.megatron import hooks as mhooks  # noqa: E402
from megatron_ft.megatron.cpu_compat import install_cpu_compat  # noqa: E402
from megatron_ft.megatron.profiling import ProfilingHooks  # noqa: E402


def main() -> int:
    a = argparse.ArgumentParser()
    a.add_argument("--out", required=True)
    a.add_argument("--iters", type=int, default=4)
    a.add_argument("--profile", type=int, default=3)
    a.add_argument("--chunk-bytes", type=int, default=65536)
    job = a.parse_args()
    pp = int(os.environ["WORLD_SIZE"])
    args = pg.parse_args(["--pipeline-model-parallel-size", str(pp), "--num-layers", "2", "--global-batch-size", "8",
                          "--train-iters", str(job.iters)])
    install_cpu_compat()
    torch.set_num_threads(1)
    pg.init_distributed(args)
    objs = pg.build_training_objects(args)
    originals = {"communicate": P2PCommunicator._communicate, "finish_grad_sync": DistributedDataParallel.finish_grad_sync,
                 "timers": objs.config.timers, "own_step": "step" in vars(objs.optimizer)}

    seen = []
    host = bytearray(job.chunk_bytes)

    def log(point, info):
        seen.append({"point": point, **{k: v for k, v in info.items() if isinstance(v, (int, float, bool, str))}})

    def transport(point, info):  # a stand-in scheduled transport: a real copy at a planned point
        if info["count"] == 0:
            src = objs.model[0].buffers[0].param_data.view(torch.uint8)[:job.chunk_bytes]
            start = time.perf_counter()
            memoryview(host)[:src.numel()] = src.numpy().tobytes()
            mhooks.HOOKS.emit("ckpt.copy", mhooks.CKPT, start, time.perf_counter(), src.numel(), "test-transport")

    handles = [mhooks.HOOKS.add_callback(p, log) for p in
               ("iteration.begin", "iteration.end", "p2p.before", "p2p.after", "timer.stop:forward-compute",
                "grad_sync.after", "optimizer.before", "optimizer.after")]
    handles.append(mhooks.HOOKS.add_callback("timer.stop:forward-compute", transport))
    hooks = ProfilingHooks(pg.TrainingHooks(), job.profile, os.path.join(job.out, "profile"))
    pg.train(objs, hooks)
    hooks.close()
    after_profile = {"installed": mhooks.is_installed(), "profile_path": hooks.path,
                     "timers_wrapped": isinstance(objs.config.timers, mhooks.RecordingTimers)}
    for h in handles:
        mhooks.HOOKS.remove_callback(h)
    mhooks.uninstall()
    restored = {"communicate": P2PCommunicator._communicate is originals["communicate"],
                "finish_grad_sync": DistributedDataParallel.finish_grad_sync is originals["finish_grad_sync"],
                "timers": objs.config.timers is originals["timers"],
                "step": ("step" in vars(objs.optimizer)) == originals["own_step"]}
    rank = torch.distributed.get_rank()
    with open(os.path.join(job.out, f"job.rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "seen": seen, "after_profile": after_profile, "restored": restored,
                   "num_microbatches": args.num_microbatches}, f)
    pg.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
