"""torchrun worker: scripts/pretrain_gpt.py's GPT restored at another data-parallel size from megatron-ft
snapshots (TP1 PP1, DP = the world size, the distributed optimizer), for tests/integration/test_reslice_restore.py.

``--mode save``: train ``--iters`` iterations, then write this rank's snapshot (what
:class:`~megatron_ft.megatron.state.MegatronStateAdapter` captures, its ``extents`` included) as a container
file ``--dir/rank{R}.mft`` (:func:`~megatron_ft.trainer.snapshot_file.write_snapshot_file`).
``--mode load``: build fresh objects at this world size and restore them from every container in ``--dir``
with :func:`~megatron_ft.megatron.reslice_restore.restore_resliced` (replica 0: the old rank 0). Both modes
build the job for ``--iters`` + ``--more`` iterations (the scheduler's length); with ``--more`` the load
dumps the restored state into ``--restored-out`` and trains the remaining iterations.
Both modes then dump the state as tests/integration/dcp_reshard_job.py does (every parameter, the optimizer's
state gathered to full, the iteration, scheduler and Adam step), so that its ``compare`` mode checks them,
and ``rank{R}.resliced.json`` says what the restore read.
"""
import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dcp_reshard_job as dcp  # noqa: E402  (its dump and compare, the GPT's builders)
from reslice_job import ResumeAt, pg, start_gpt  # noqa: E402

from megatron_ft.megatron.reslice_restore import restore_resliced  # noqa: E402
from megatron_ft.megatron.state import MegatronStateAdapter  # noqa: E402
from megatron_ft.trainer.recovery import Container  # noqa: E402
from megatron_ft.trainer.snapshot_file import write_snapshot_file  # noqa: E402

RUN = "reslice-test"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "load"], required=True)
    p.add_argument("--dir", required=True, help="the snapshot containers, one per old rank")
    p.add_argument("--out", required=True, help="where the state's dumps go")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--more", type=int, default=0, help="the job trains for iters + more: save after iters; "
                   "restore, dump into --restored-out, then train the remaining ones")
    p.add_argument("--restored-out", help="load with --more: where the state is dumped right after the restore")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    args, objs = start_gpt(a.iters + a.more, initialise=a.mode == "save")
    adapter = MegatronStateAdapter(objs.model, objs.optimizer, objs.scheduler)
    if a.mode == "save":
        args.train_iters = a.iters  # (built for iters + more: the same scheduler as the restoring job's)
        iteration, consumed = pg.train(objs)
        adapter.progress = {"iteration": iteration, "consumed_samples": consumed}
        tensors, extra = adapter.capture()
        write_snapshot_file(os.path.join(a.dir, f"rank{args.rank}.mft"), iteration, tensors, extra,
                            {"run_id": RUN, "rank": args.rank, "world_size": args.world_size})
        args.iteration = iteration
    else:
        paths = sorted(glob.glob(os.path.join(a.dir, "rank*.mft")))
        sources = {int(os.path.basename(f)[4:-4]): Container(f) for f in paths}
        try:
            done = restore_resliced(adapter, sources, 0, sources[0].header.step, {"run_id": RUN})
        finally:
            for c in sources.values():
                c.close()
        with open(os.path.join(a.out, f"rank{args.rank}.resliced.json"), "w") as f:
            json.dump({**done.__dict__, "old_world": len(sources), "progress": adapter.restored_progress}, f)
        args.iteration = adapter.restored_progress["iteration"]
        if a.more:
            dcp.dump(objs, a.restored_out, True)
            args.iteration, _ = pg.train(objs, ResumeAt(args.iteration, adapter.restored_progress["consumed_samples"]))
    dcp.dump(objs, a.out, True)
    pg.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
