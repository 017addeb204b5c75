"""What ``TORCH_GLOO_LAZY_INIT=1`` (set by ``megatron-ft launch`` for its trainers:
``megatron_ft.launch.GLOO_ENV_DEFAULTS``) changes in the torch installed here: a gloo group of four
ranks connects each rank to its three peers when it is made (a full mesh) without it, and to none
with it, until an operation needs a pair (a ring all-reduce: two). Counted as this process's
established TCP connections, four real processes on gloo."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

PROBE = r"""
import json, os, sys, time
import psutil, torch, torch.distributed as dist, torch.multiprocessing as mp

def established():
    return sum(1 for c in psutil.Process().net_connections("tcp") if c.status == "ESTABLISHED")

def everyone(out, name):  # a barrier that opens no connection of its own
    open(os.path.join(out, f"{name}{dist.get_rank()}"), "w").close()
    while not all(os.path.exists(os.path.join(out, f"{name}{r}")) for r in range(4)):
        time.sleep(0.01)

def counts(out, name):
    base = established()
    group = dist.new_group([0, 1, 2, 3], backend="gloo")
    made = established() - base
    everyone(out, name)  # every rank counted before any uses the group
    dist.all_reduce(torch.ones(1), group=group)
    used = established() - base
    everyone(out, name + "-used")
    return {"made": made, "used": used}

def main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    eager = counts(out, "eager")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read when a group is made
    lazy = counts(out, "lazy")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"eager": eager, "lazy": lazy}, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=4)
"""


def connections(tmp_path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = tmp_path / "probe.py"  # a file: the spawned processes import its main
    probe.write_text(PROBE)
    p = subprocess.run([sys.executable, str(probe), str(port), str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]


def test_lazy_gloo_connects_pairs_on_first_use_instead_of_a_full_mesh_at_creation(tmp_path):
    ranks = connections(tmp_path)
    assert all(r["eager"]["made"] == 3 for r in ranks), ranks  # every peer, when the group is made
    assert all(r["lazy"]["made"] == 0 for r in ranks), ranks  # none until an operation
    assert all(0 < r["lazy"]["used"] < 3 for r in ranks), ranks  # the ring's neighbours only
