"""Process-group set-up that survives torchrun elastic restarts.

Two things differ from a plain ``init_process_group("env://")``:

* **Stable ranks.** ``megatron-ft launch`` exports ``MFT_NODE_RANK``; the rank is then
  ``MFT_NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``, the same in every restart, so a restarted
  trainer lands on the node whose agent holds its snapshots (torchrun's c10d rendezvous may
  hand out group ranks in a different order each round).
* **A fresh store per restart.** With torch 2.13's default (the rendezvous TCPStore shared with
  the workers), a restarted gloo group reads the *previous* round's peer addresses from the
  store and fails with "connectFullMesh ... Connection refused". The launcher therefore sets
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: each round gets a new store, which the worker with
  torchrun rank 0 hosts at ``launch.trainer_port`` (``MFT_TRAINER_PORT``; torchrun's own choice would
  be an ephemeral port). Under a plain torchrun that shares its store we
  prefix the keys with the restart count instead (correct on a single node).
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..clock import Deadline
from ..health import progress as hp
from . import progress


def stable_rank() -> int:
    node = os.environ.get("MFT_NODE_RANK")
    if node is not None:
        return int(node) * int(os.environ["LOCAL_WORLD_SIZE"]) + int(os.environ["LOCAL_RANK"])
    return int(os.environ["RANK"])


def torchrun_rank() -> int:
    """The rank torchrun gave this worker (``RANK`` unless a bootstrap pinned it and kept the
    original in ``MFT_TORCHRUN_RANK``): its rank 0 runs on ``MASTER_ADDR``."""
    return int(os.environ.get("MFT_TORCHRUN_RANK", os.environ.get("RANK", "0")))


def rendezvous_store(timeout: datetime.timedelta) -> dist.Store:
    """The store for this restart round's process group at ``MASTER_ADDR:MASTER_PORT``: hosted by
    torchrun's rank 0, or by the keeper of that rank (warm spares with fast restarts:
    ``MFT_FRESH_STORE``), or torchrun's own store shared across its restarts
    (``TORCHELASTIC_USE_AGENT_STORE`` alone: key-prefixed by the restart count). The first two are
    fresh per attempt and unprefixed, so a replacement node, whose torchrun counts its restarts from
    0, meets the others under the same keys."""
    from ..spares.fast_restart import adopt_trainer_port, hosted_store

    adopt_trainer_port(os.environ)  # launch.trainer_port, not torchrun's ephemeral MASTER_PORT
    world = int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        wait_for_store(addr, port, float(os.environ.get("MFT_JOIN_TIMEOUT_S") or timeout.total_seconds()))
        base = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        if os.environ.get("MFT_FRESH_STORE") == "1":
            return base
        return dist.PrefixStore(f"mft/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    if torchrun_rank() == 0:
        return hosted_store(addr, port, world, timeout)
    return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)


def wait_for_store(addr: str, port: int, within_s: float) -> None:
    """Return once something accepts connections at ``addr:port`` (the store of this rendezvous round);
    a ``RuntimeError`` naming the store and the bound after ``within_s`` (``launch.start_timeout_s``) -
    rather than torch's client retrying for the whole process-group timeout (10 minutes) against a round
    whose host is gone (its job ended, or its rank 0 failed, while this trainer started)."""
    deadline = Deadline(within_s, f"the trainers' store at {addr}:{port}")
    while True:
        try:
            socket.create_connection((addr, port), timeout=min(5.0, within_s)).close()
            return
        except OSError as e:
            if not deadline.pause(0.1):
                raise RuntimeError(f"the trainers' store at {addr}:{port} did not answer within "
                                   f"launch.start_timeout_s={within_s:g} s ({e}): the round's host is gone (the "
                                   f"job ended, or its torchrun rank 0 failed)") from None


#: wall-clock (start, end) of this process's ``init_process_group``: its rendezvous with the other
#: ranks (the recovery breakdown reports it; None until it ran)
RENDEZVOUS_SPAN: Optional[tuple[float, float]] = None


def timed_rendezvous(init: Callable[[], Any]) -> Any:
    """Run ``init`` (the process group's creation) and remember when it started and ended; the
    connections it opens belong to the round (:func:`megatron_ft.trainer.in_process.mark_round_start`)."""
    global RENDEZVOUS_SPAN
    from .in_process import mark_round_start

    mark_round_start()  # this round's connections, from here on, are what an in-process restart aborts
    t0 = time.time()
    progress.install_from_env()  # where this trainer is, for the node agent's hang watch (launch names the file)
    with progress.phase(hp.RENDEZVOUS):
        out = init()
    RENDEZVOUS_SPAN = (t0, time.time())
    return out


def init_process_group(backend: Optional[str] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default group from torchrun's environment; returns (rank, world_size)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = stable_rank(), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    timed_rendezvous(lambda: dist.init_process_group(backend, store=rendezvous_store(timeout), rank=rank,
                                                     world_size=world, timeout=timeout))
    return rank, world
