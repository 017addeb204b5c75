"""Fast restart rounds: a failed trainer's job restarts beneath torchrun, from warm spares.

torchrun restarts a job by tearing down every worker of every node and running its rendezvous
round again (~1.7 s on the demo: its monitor, the teardown, a rendezvous that polls once a second).
With warm spares (:mod:`.pool`) the process torchrun watches is a stand-in (:mod:`.worker`) and the
trainer is forked by a *keeper* (:mod:`.keeper`); so a trainer's failure need not reach torchrun at
all. When a trainer fails, its keeper opens round ``n + 1`` in torchrun's own store; every keeper
of the job (told by its node's watcher, :mod:`.node_watch`, which waits on the store for all the
node's keepers: no keeper polls) kills its trainer of round ``n`` (those still alive: blocked on
the failed peer, or fine) and forks a fresh one from its warm zygote; the new trainers form their
process group in a store of round ``n + 1`` hosted by the keeper of torchrun's rank 0, and restore
from their node agents' memory like any restarted trainer. torchrun sees nothing; it stays the outer
layer for everything a round cannot handle:

* a clean exit (0), the end-the-job code of :mod:`megatron_ft.fatal` (2), or a stop torchrun asked for
  (a forwarded SIGTERM/SIGINT/SIGHUP) are reported to the stand-in as always;
* the budget: at most ``launch.fast_restarts`` rounds per torchrun attempt (none with
  ``launch.max_restarts: 0``), then the failure is reported and torchrun restarts as before;
* a lost node: its ranks cannot join a round. Its replacement (or standby) joins torchrun's
  rendezvous, which makes every surviving torchrun stop its workers (the stop above). Without one, the
  keepers see the root agent's failure verdict (``last_verdict`` in the agents' health store, a time
  since this torchrun attempt's start: :func:`verdict_time`; the node's watcher long-polls it while a
  round settles) within ``health.timeout_s`` of a round's start and hand the failure to torchrun.

The job's store: ``MASTER_ADDR:MASTER_PORT`` of torchrun's attempt. ``megatron-ft launch`` has torchrun
make a fresh store per attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), where its rank-0 trainer would
host it and take it along when it dies; torchrun would put it on an ephemeral port, so the launcher
names ``launch.trainer_port`` (``MFT_TRAINER_PORT``, :func:`adopt_trainer_port` makes it ``MASTER_PORT``)
and every attempt's store listens there (the previous attempt's trainers are gone before torchrun
starts the next: its rendezvous waits for every node to stop its workers). With fast restarts the keeper of torchrun's rank 0 hosts
it instead (a forked process, :func:`host_round_store`) and every trainer is its client
(``TORCHELASTIC_USE_AGENT_STORE=True``, ``MFT_FRESH_STORE=1``: no per-restart key prefix, since a
replacement node's torchrun counts its restarts from 0). Keys, under ``mft/fast/``:
``round/<n>`` (created by whoever opens round ``n``; a counter, so two keepers opening the same round
agree) and ``port/<n>`` (the port of round ``n``'s own store at ``MASTER_ADDR``: the job store's port
``+ n``, :func:`round_port`). A round's trainers
get ``MASTER_PORT`` = that port and ``MFT_FAST_ROUND`` = ``n``; nothing else of their environment
changes.

The decisions are pure (:func:`after_exit`, :func:`joins`); the node's watcher (:mod:`.node_watch`)
does the store I/O; :func:`host_round_store` forks the process that hosts a round's store.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, replace
from typing import Mapping, MutableMapping, Optional

from ..clock import Deadline
from ..fatal import JOB_ENDING
from .lifetime import die_with_parent, set_process_name

REPORT, OPEN_NEXT = "report", "open-next"
POLL_S = 0.05  # how often a keeper looks at its trainer where the kernel gives no pidfd to wake it
log = logging.getLogger("megatron_ft.spares")
STORE_PROCESS_NAME = "mft-store"  # the process name of a store host (psutil's name(), /proc/PID/comm)
STORE_TIMEOUT_S = 10.0  # every request to torchrun's store
BIND_WAIT_S = 10.0  # a store's port still held by the previous holder, going away


@dataclass(frozen=True)
class Round:
    """One keeper's view: the round its trainer belongs to, how many rounds this torchrun attempt
    allows, and whether torchrun asked the worker to stop."""

    number: int = 0
    budget: int = 0
    stopping: bool = False

    def stop(self) -> "Round":
        return replace(self, stopping=True)


def after_exit(r: Round, code: int, node_lost: bool = False) -> str:
    """What a keeper does when its trainer of round ``r`` exited with ``code`` (``-N``: signal N).

    >>> after_exit(Round(0, budget=3), -9), after_exit(Round(0, budget=3), 1)
    ('open-next', 'open-next')
    >>> after_exit(Round(0, budget=3), 0), after_exit(Round(0, budget=3), 2), after_exit(Round(3, budget=3), 1)
    ('report', 'report', 'report')
    >>> after_exit(Round(0, budget=3).stop(), -15), after_exit(Round(1, budget=3), 1, node_lost=True)
    ('report', 'report')
    """
    if code == 0 or code in JOB_ENDING or r.stopping or node_lost or r.number >= r.budget:
        return REPORT
    return OPEN_NEXT


def rejoins_fresh(r: Round, code: int, node_lost: bool = False) -> bool:
    """A trainer asked to rejoin round ``r`` in place exited with ``code`` before saying it does (it
    found it cannot: :mod:`megatron_ft.trainer.in_process`): whether a fresh fork takes its place in
    ``r``, as when its grace runs out. Not for an exit that ends more than the trainer (a clean exit,
    the end-the-job codes, a stop torchrun asked for, a lost node): :func:`after_exit` handles those.
    The budget was spent when ``r`` opened.

    >>> rejoins_fresh(Round(3, budget=3), 1), rejoins_fresh(Round(1, budget=3), -6)
    (True, True)
    >>> rejoins_fresh(Round(1, budget=3), 0), rejoins_fresh(Round(1, budget=3), 2), rejoins_fresh(Round(1, budget=3).stop(), 1)
    (False, False, False)
    >>> rejoins_fresh(Round(1, budget=3), 1, node_lost=True)
    False
    """
    return not (code == 0 or code in JOB_ENDING or r.stopping or node_lost)


def joins(r: Round, newest: int) -> Optional[int]:
    """The round a keeper moves to when ``newest`` is the newest round opened: a newer one than
    its trainer's (its trainer, alive or not, is replaced), else None.

    >>> joins(Round(1, budget=3), 2), joins(Round(2, budget=3), 2), joins(Round(2, budget=3).stop(), 3)
    (2, None, None)
    """
    return newest if newest > r.number and not r.stopping else None


#: the grace ``launch.in_process_grace_s: auto`` gives a trainer of each collectives' backend. gloo's
#: was measured on CPU (a survivor whose round's sockets are shut down unwinds well within it); NCCL's
#: also covers the communicators' abort (``ncclCommAbort`` of every group: seconds with many groups) and
#: the device check before the trainer says it rejoins (at most half the grace:
#: :func:`megatron_ft.trainer.in_process.device_problem`)
AUTO_GRACE_S = {"gloo": 2.0, "nccl": 10.0}


def effective_grace(configured: "float | str", backend: str) -> float:
    """The grace of a trainer whose collectives run on ``backend`` when ``launch.in_process_grace_s``
    is ``configured``: a number is taken as it is, for every backend; ``auto`` is :data:`AUTO_GRACE_S`
    of the backend (NCCL's for any backend string naming nccl, such as ``cpu:gloo,cuda:nccl``).

    >>> effective_grace("auto", "gloo"), effective_grace("auto", "nccl"), effective_grace("auto", "cpu:gloo,cuda:nccl")
    (2.0, 10.0, 10.0)
    >>> effective_grace(2.5, "nccl"), effective_grace("4", "gloo")
    (2.5, 4.0)
    """
    if configured == "auto":
        return AUTO_GRACE_S["nccl" if "nccl" in backend else "gloo"]
    return float(configured)


def trainer_backend() -> str:
    """The collectives' backend of the trainers forked from this process, by the rule of
    :func:`megatron_ft.trainer.distributed.init_process_group` (and Megatron's own default): ``nccl``
    where torch sees a GPU, else ``gloo`` (also where torch is not imported here). It asks
    ``torch.cuda.device_count()``, which answers from NVML where NVML works, leaving the CUDA driver
    uninitialised in this process, so the trainers it forks can still use CUDA (as the pool's
    ``PYTORCH_NVML_BASED_CUDA_CHECK``, :mod:`.pool`)."""
    torch = sys.modules.get("torch")
    return "nccl" if torch is not None and torch.cuda.device_count() > 0 else "gloo"


def in_process_grace(env: Mapping[str, str], backend: Optional[str] = None) -> Optional[float]:
    """How long a trainer asked to rejoin a round in place may take to say it does
    (``MFT_IN_PROCESS_GRACE_S``: ``launch.in_process_grace_s``, a number of seconds or ``auto``, set by
    ``megatron-ft launch`` when ``launch.in_process_restart`` is on), for a trainer whose collectives run
    on ``backend`` (None: :func:`trainer_backend`, asked only for ``auto``); see :func:`effective_grace`.
    None: in-process restart is off and every round replaces every trainer.

    >>> in_process_grace({"MFT_IN_PROCESS_GRACE_S": "2.5"}), in_process_grace({}), in_process_grace({"MFT_IN_PROCESS_GRACE_S": "x"})
    (2.5, None, None)
    >>> in_process_grace({"MFT_IN_PROCESS_GRACE_S": "auto"}, "gloo"), in_process_grace({"MFT_IN_PROCESS_GRACE_S": "auto"}, "nccl")
    (2.0, 10.0)
    """
    value = env.get("MFT_IN_PROCESS_GRACE_S")
    if value is None:
        return None
    if value == "auto" and backend is None:
        backend = trainer_backend()
    try:
        grace = effective_grace(value, backend or "")
    except ValueError:
        return None
    return grace if grace > 0 else None


def adopt_trainer_port(env: MutableMapping[str, str]) -> None:
    """Make ``launch.trainer_port`` (``MFT_TRAINER_PORT``, set by ``megatron-ft launch``) the job store's
    ``MASTER_PORT`` in ``env``, in place; once: the variable is removed, so a fast round's own
    ``MASTER_PORT`` is left alone. Without it (a plain torchrun) ``env`` is unchanged.

    >>> env = {"MASTER_PORT": "41234", "MFT_TRAINER_PORT": "29700"}
    >>> adopt_trainer_port(env); env
    {'MASTER_PORT': '29700'}
    """
    port = env.pop("MFT_TRAINER_PORT", None)
    if port:
        env["MASTER_PORT"] = port


def round_port(env: Mapping[str, str], n: int) -> int:
    """The port of fast restart round ``n``'s store: the job store's ``+ n`` (``launch.trainer_port + n``)."""
    return int(env["MASTER_PORT"]) + n


def budget(env: dict) -> int:
    """Fast rounds allowed for a worker with environment ``env`` (``MFT_FAST_RESTARTS``, set by
    ``megatron-ft launch``; 0 without torchrun's ``MASTER_ADDR``/``MASTER_PORT``)."""
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return 0
    try:
        return max(0, int(env.get("MFT_FAST_RESTARTS", "0")))
    except ValueError:
        return 0


def store_bind_address(addr: str, resolved: str, local: set[str]) -> Optional[str]:
    """Where the trainers' store reached at ``addr`` (resolved here to ``resolved``) listens: that
    address when it is one of this host's (``local``) - a loopback one only when ``addr`` names loopback
    itself - else ``None``, every interface: a host name that resolves to loopback here (Debian's
    ``127.0.1.1``) or to an address that is not this host's (a virtual one) is reached by the other hosts
    under another address. Pure.

    >>> local = {"10.0.0.1", "127.0.0.1"}
    >>> store_bind_address("node0", "10.0.0.1", local), store_bind_address("127.0.0.1", "127.0.0.1", local)
    ('10.0.0.1', '127.0.0.1')
    >>> store_bind_address("node0", "127.0.1.1", local), store_bind_address("trainers", "10.96.0.5", local)
    (None, None)
    """
    try:
        loopback = ipaddress.ip_address(resolved).is_loopback
    except ValueError:
        return None
    if loopback:
        named_loopback = addr == "localhost" or addr == resolved
        return resolved if named_loopback else None
    return resolved if resolved in local else None


def store_listener(addr: str, port: int) -> Optional[int]:
    """A listening TCP socket for the trainers' store reached at ``addr:port``, on the address
    :func:`store_bind_address` picks: its file descriptor, for ``TCPStore(..., master_listen_fd=)`` -
    which then listens there and nowhere else (given a host and port alone, torch's store binds every
    interface); the descriptor is the store's from then on. ``None`` where it must listen on every
    interface (said in the log). ``OSError`` when the port is held."""
    import psutil

    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    bind = store_bind_address(addr, where[0], local)
    if bind is None:
        log.warning("the trainers' store at %s:%d listens on every interface: %s resolves to %s here, not an "
                    "address of this host it is reached at", addr, port, addr, where[0])
        return None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def hosted_store(addr: str, port: int, world: Optional[int], timeout: datetime.timedelta,
                 wait_for_workers: bool = True):
    """The server side of a ``TCPStore`` reached at ``addr:port``, listening on ``addr``'s address only
    (:func:`store_listener`)."""
    from torch.distributed import TCPStore

    return TCPStore(addr, port, world, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
                    master_listen_fd=store_listener(addr, port))


def store_stamp(env: Mapping[str, str]) -> str:
    """What names one torchrun rendezvous's job store (:data:`STAMP_KEY`): its run id
    (``TORCHELASTIC_RUN_ID``; ``megatron-ft launch`` makes it ``<run_id>-g<generation>``), the same on
    every node of it. Every generation's store listens on the same ``launch.trainer_port``, so a client
    that connects late (torch's client retries a refused connection for its whole timeout) may reach
    the next generation's store: the stamp tells it so (:mod:`.node_watch`). Not the restart count: a
    replacement node's torchrun counts from 0.

    >>> store_stamp({"TORCHELASTIC_RUN_ID": "job-g1"}), store_stamp({})
    ('job-g1', '')
    """
    return env.get("TORCHELASTIC_RUN_ID", "")


STAMP_KEY = "mft/fast/run"  # the job store's stamp (store_stamp), set by its host before it is announced


def host_round_store(addr: str, port: int, stamp: Optional[str] = None) -> tuple[int, int]:
    """Fork the process that hosts a store (a ``TCPStore`` server on ``port``, reached at ``addr``):
    (its pid, the port). It dies with its keeper; the keeper kills it when it is no longer needed. The
    server's threads run in that process, so the keeper stays single-threaded. A port still held (a
    previous host not yet gone) is tried again for up to ``BIND_WAIT_S``; then a :class:`RuntimeError`.
    ``stamp``: the job store's :data:`STAMP_KEY` (:func:`store_stamp`), set before any client can use it
    (a client's read of it waits for it)."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rd)
            die_with_parent()
            set_process_name(STORE_PROCESS_NAME)
            deadline = Deadline(BIND_WAIT_S, f"the round store's port {port}")
            while True:
                try:
                    store = hosted_store(addr, port, None, datetime.timedelta(seconds=STORE_TIMEOUT_S),
                                         wait_for_workers=False)
                    break
                except (OSError, RuntimeError):  # the port is held (by the previous host, going away)
                    if not deadline.pause(0.1):
                        raise
            if stamp is not None:
                store.set(STAMP_KEY, stamp)
            os.write(wr, str(store.port).encode())
            os.close(wr)
            while True:
                signal.pause()
        finally:
            os._exit(0)
    os.close(wr)
    try:
        data = os.read(rd, 32)
    finally:
        os.close(rd)
    if not data:
        os.waitpid(pid, 0)
        raise RuntimeError(f"the store at {addr}:{port} did not start within {BIND_WAIT_S:g} s (the port is held "
                           f"by another process: free it or move launch.trainer_port)")
    return pid, int(data)


def verdict_time(value: Optional[str]) -> float:
    """The time of a ``last_verdict`` value (``-inf`` for none or a malformed one).

    >>> verdict_time("1/4242/1764126123.5"), verdict_time(None)
    (1764126123.5, -inf)
    """
    try:
        return float(str(value).rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return float("-inf")
