"""In-process restart: a trainer that survives a peer's failure rejoins the next round in place.

With fast restart rounds (:mod:`megatron_ft.spares.fast_restart`) a failed trainer's keeper opens
round ``n + 1`` and every keeper replaces its trainer. A trainer run through :func:`run` is not
replaced: it tells its keeper so at start (``{"in_process": true}`` on the control socket the keeper
passes in ``MFT_IN_PROCESS_FD``), and when the keeper sends ``{"round": n + 1, "port": P}`` it

1. aborts the round's collectives at once, on a reader thread (:func:`abort_round`): first its NCCL
   communicators (every NCCL group's ``abort()`` inside one NCCL group start/end,
   :func:`_abort_nccl_groups`), then every TCP connection the process opened since its round's process
   group began (:func:`mark_round_start`: the store client, gloo's connections), so a collective blocked
   on the dead peer - or on a survivor blocked on it - raises at once instead of waiting for its
   timeout. NCCL goes first: its own connections are among the round's, and a communicator whose
   sockets were shut down under it errs on its own instead of being aborted. A torch that offers no
   safe abort of several NCCL communicators means no rejoin in place;
2. lets the training function unwind (the exception of its aborted collective ends it, its
   ``finally`` blocks close what it opened), checks the device (:func:`device_problem`: on a GPU a
   ``torch.cuda.synchronize()`` bounded by half the grace; a sticky CUDA error, :func:`sticky_cuda_error`,
   leaves the context unusable), says ``{"restarting": n + 1}`` to the keeper, points ``MASTER_PORT``
   and ``MFT_FAST_ROUND`` at round ``n + 1``;
3. calls the training function again, ``attempt + 1``: it tears down the aborted round's groups (and
   whatever its framework keeps of them), creates the new round's through the new store, builds its
   model and optimizer and restores from its agent exactly as the round's fresh trainers do, so every
   rank makes the same collectives in the same order (megatron-core's model and optimizer build make
   some). What the process keeps is what a fresh one pays for: its imports and, on a GPU, its CUDA
   context (``docs/recovery-time.md``). Its weights are not initialised again when its agent holds a
   version of its rank (:func:`build_uninitialised`): the restore overwrites every one of them; if it
   then restores nothing, :class:`NothingRestored` ends the process and a fresh one (which initialises)
   takes its place.

A training function that raises on its own (a peer's death reached it first) asks the keeper for the
next round (``{"failed": why}``); the keeper answers with the round or ``{"exit": true}`` (budget spent,
a lost node: torchrun's turn), and the exception then ends the process as before. A trainer that does
not say ``restarting`` within ``launch.in_process_grace_s`` of the round's message (stuck in a long
kernel, or in a C call no abort reaches) is killed by its keeper and replaced by a fresh fork, as
without in-process restart. A trainer that cannot rejoin in place (a sticky CUDA error, a device that
does not synchronise within its deadline, NCCL groups it could not abort) ends instead, its exception
raised: its keeper forks a fresh trainer into the round it was asked to join. ``SystemExit`` (a clean
end, :mod:`megatron_ft.fatal`'s exit) and ``KeyboardInterrupt`` are never restarted. With in-process
restart on, the trainers' environment gets :func:`nccl_env_defaults` (``megatron-ft launch``), so
torch's NCCL watchdog does not end a survivor before its abort. Used by ``scripts/pretrain_gpt.py``, upstream Megatron-LM's
``pretrain_gpt.py`` (through :mod:`megatron_ft.megatron.upstream`) and ``scripts/pretrain_deepspeed.py``.

Contracts: one reader thread (daemon) per process; :func:`run` is called once, on the main thread;
every wait is bounded (``REPLY_TIMEOUT_S`` for the keeper's answer). Messages are one JSON object per
``SOCK_SEQPACKET`` datagram.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from ..spares.fast_restart import AUTO_GRACE_S, in_process_grace
from ..spares.messages import TO_TRAINER, RoundOpened
from ..transport import wire

log = logging.getLogger("megatron_ft.in_process")

ENV_FD = "MFT_IN_PROCESS_FD"
REPLY_TIMEOUT_S = 60.0  # the keeper's answer to "failed" (it opens the round and learns its port)

_ROUND_SOCKETS: Optional[set[int]] = None  # inodes of the sockets open before this round's group
_ATTEMPT: tuple[int, Optional[float]] = (0, None)  # this process's attempt, and when it began (wall clock)
_UNINITIALISED = False  # this attempt built its model without initialising the weights


class NothingRestored(RuntimeError):
    """An attempt that built its model without initialising the weights restored nothing into them.
    :func:`run` never restarts it in place: the process ends (exit 1), and the fresh process its keeper
    starts builds the model with initialised weights."""


def build_uninitialised(holds_a_version: Callable[[], bool]) -> bool:
    """Whether this attempt builds its model without initialising the weights (megatron-core's
    ``perform_initialization=False``, upstream's ``--no-initialization``); remembered for
    :func:`check_restored`. True only in a later attempt (a survivor rejoining a round) whose node
    agent holds a version of its rank (``holds_a_version()``, asked only then): the restore that follows
    overwrites every weight, so initialising them is work thrown away (RNG kernels over the whole model;
    minutes for a large model initialised on the CPU). A process's first attempt always initialises: a
    job's start, and a restart at iteration 0, stay bit-exact."""
    global _UNINITIALISED
    _UNINITIALISED = _ATTEMPT[0] > 0 and holds_a_version()
    return _UNINITIALISED


def uninitialised() -> bool:
    """Whether this attempt built its model without initialising the weights."""
    return _UNINITIALISED


def check_restored(restored: bool) -> None:
    """After the restore of an attempt: nothing restored into weights built uninitialised raises
    :class:`NothingRestored` (they hold whatever the memory held; never trained on)."""
    if _UNINITIALISED and not restored:
        raise NothingRestored(f"rank {os.environ.get('RANK', '?')}: in-process attempt {_ATTEMPT[0]} built its model "
                              f"without initialising the weights (its agent held a version to restore), then "
                              f"restored nothing: ending this process so that a fresh one, which initialises "
                              f"its weights, takes its place")


def attempt() -> tuple[int, Optional[float]]:
    """(the number of this process's current attempt, when it began): ``(0, None)`` in a process's
    first; a later one is an in-process restart, and its start stands for the process start of a
    replaced trainer in the recovery's timeline."""
    return _ATTEMPT


def _socket_inodes() -> dict[int, int]:
    """fd -> inode of every socket this process has open."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
    return out


def mark_round_start() -> None:
    """Called just before a round's process group is created: every TCP connection opened from now
    on (the group's store client, gloo's connections to its peers, the subgroups' connections)
    belongs to this round and is shut down when the round is aborted."""
    global _ROUND_SOCKETS
    _ROUND_SOCKETS = set(_socket_inodes().values())


def abort_round_connections() -> int:
    """Shut down (both ways) every connected TCP socket opened since :func:`mark_round_start`: a
    collective blocked on one raises ("connection closed"), and so do the peers blocked on this
    process, and theirs. Listening sockets are left alone (gloo's listener thread ends the process
    when its socket is shut down under it). Returns how many were shut down; none before a round."""
    if _ROUND_SOCKETS is None:
        return 0
    done = 0
    for fd, inode in _socket_inodes().items():
        if inode in _ROUND_SOCKETS:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                s.getpeername()  # raises for a listener
                s.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only
    return done


def nccl_env_defaults(in_process_restart: bool) -> dict[str, str]:
    """The ``TORCH_NCCL_*`` settings the trainers' environment gets where it does not set them (the
    user's values always win: ``megatron-ft launch`` applies these with ``setdefault``). Nothing when
    in-process restart is off: a failed round then replaces every trainer, and torch's behaviour (tear
    the process down on an NCCL error) is what it wants. gloo reads none of them.

    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly): on an NCCL error or a collective's timeout
      torch's watchdog aborts the communicators and does *not* tear the process down. Torch's default
      is 3 (SkipCleanUp: tear down without aborting), and torchrun gives its workers 1 (TearDown)
      unless its own environment sets it (``local_elastic_agent.py``); either ends a survivor as soon
      as the dead peer's error reaches its watchdog, before it can rejoin in place. 2 rather than 0
      (NoHandling, what ``distributed_c10d._abort_process_group``'s note asks for): a collective that
      times out for another reason still errs, the training function raises and asks for a round.
    * ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: no flight-recorder dump on a watchdog timeout or error. The
      dump (and the wait for it, ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``) would run while the survivor
      must unwind within its grace, and it asks the peers for theirs through the round's store, which
      the round's end takes away.
    * Not set: ``TORCH_NCCL_ENABLE_MONITORING`` and ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``. The monitor
      ends a process whose watchdog is stuck for the heartbeat timeout (default 480 s), far above any
      grace: such a process is replaced by its keeper first.

    Semantics as documented in torch 2.13.0's ``ProcessGroupNCCL.hpp`` (``ErrorHandlingMode``).

    >>> nccl_env_defaults(True)
    {'TORCH_NCCL_ASYNC_ERROR_HANDLING': '2', 'TORCH_NCCL_DUMP_ON_TIMEOUT': '0'}
    >>> nccl_env_defaults(False)
    {}
    """
    if not in_process_restart:
        return {}
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


#: CUDA runtime errors (``cudaError_t``) after which the CUDA context is unusable: every later CUDA call
#: of the process fails with the same error, which only a new process clears (CUDA runtime API,
#: "Error Handling"). Code -> the message ``cudaGetErrorString`` gives it (what torch's "CUDA error: ..."
#: quotes).
STICKY_CUDA_ERRORS = {
    214: "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable
    700: "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    702: "the launch timed out and was terminated",  # cudaErrorLaunchTimeout
    710: "device-side assert triggered",  # cudaErrorAssert
    714: "hardware stack error",  # cudaErrorHardwareStackError
    715: "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    716: "misaligned address",  # cudaErrorMisalignedAddress
    717: "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace
    718: "invalid program counter",  # cudaErrorInvalidPc
    719: "unspecified launch failure",  # cudaErrorLaunchFailure
    999: "unknown error",  # cudaErrorUnknown
}
_CUDA_MESSAGE = re.compile(r"CUDA error: ([^\n]+)")
_CUDA_CODE = re.compile(r"(?:cuda failure|CUDA error)[ :]+(\d+)", re.IGNORECASE)  # NCCL: "Cuda failure 700 '...'"


def sticky_cuda_error(error: Any) -> bool:
    """Whether ``error`` is a CUDA error that leaves the context unusable (:data:`STICKY_CUDA_ERRORS`):
    a ``cudaError_t`` code, or an exception - its ``error_code`` (torch's ``AcceleratorError``), else
    its message (torch's "CUDA error: <cudaGetErrorString>", NCCL's "Cuda failure <code>"), else the
    exception it was raised from or during (``__cause__``, ``__context__``; a few levels).

    >>> sticky_cuda_error(700), sticky_cuda_error(2), sticky_cuda_error(RuntimeError("CUDA error: out of memory"))
    (True, False, False)
    >>> sticky_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered\\nCUDA kernel errors ..."))
    True
    >>> sticky_cuda_error(RuntimeError("ncclUnhandledCudaError: Call to CUDA function failed. Cuda failure 719 'x'"))
    True
    """
    for _ in range(8):  # an exception's chain, bounded
        if error is None:
            return False
        if isinstance(error, int) and not isinstance(error, bool):
            return error in STICKY_CUDA_ERRORS
        code = getattr(error, "error_code", None)
        if isinstance(code, int) and not isinstance(code, bool):
            return code in STICKY_CUDA_ERRORS
        text = str(error)
        if (m := _CUDA_CODE.search(text)) and int(m.group(1)) in STICKY_CUDA_ERRORS:
            return True
        if (m := _CUDA_MESSAGE.search(text)) and any(m.group(1).strip().startswith(known)
                                                     for known in STICKY_CUDA_ERRORS.values()):
            return True
        if not isinstance(error, BaseException):
            return False
        error = error.__cause__ or error.__context__
    return False


def device_check_s(grace_s: float) -> float:
    """How long :func:`device_problem` waits for the device: half the grace, so that a trainer whose
    device answers late still says it rejoins (or ends) before its keeper's grace runs out.

    >>> device_check_s(10.0), device_check_s(2.0)
    (5.0, 1.0)
    """
    return grace_s / 2


def device_problem(deadline_s: float) -> Optional[str]:
    """Why this process's device cannot serve another attempt, or None. On CUDA (initialised in this
    process) ``torch.cuda.synchronize()`` runs on a daemon thread, waited for ``deadline_s``: no answer,
    or a sticky CUDA error (:func:`sticky_cuda_error`), is a problem; another error was reported and
    cleared by it (logged). Without CUDA (CPU, gloo) nothing is checked: None at once. GPU path: run on
    a GPU machine only (``tests/unit/test_in_process_nccl.py`` tests its decisions on CPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    outcome: list[Optional[BaseException]] = []

    def synchronize() -> None:
        try:
            torch.cuda.synchronize()
            outcome.append(None)
        except BaseException as e:  # noqa: B902 - judged below, on the caller's thread
            outcome.append(e)

    worker = threading.Thread(target=synchronize, name="mft-device-check", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if not outcome:
        return f"torch.cuda.synchronize() did not return within {deadline_s:.1f} s"
    error = outcome[0]
    if error is None:
        return None
    if sticky_cuda_error(error):
        return f"a sticky CUDA error ({_first_line(error)}): the CUDA context is unusable"
    log.warning("in-process restart: the device check reported a CUDA error, cleared: %s", _first_line(error))
    return None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


NO_NCCL, ABORTED, NO_SAFE_ABORT = "no NCCL group", "aborted", "no safe abort"


def _abort_nccl_groups(c10d: Any, cuda: Any) -> str:
    """Abort every NCCL communicator of this process, newest group first, inside one NCCL group
    start/end of the oldest NCCL group's backend (concurrent aborts of several communicators can
    deadlock each other otherwise: pytorch#119797). ``c10d`` is ``torch.distributed.distributed_c10d``
    (or a stand-in), ``cuda`` the device whose backend is NCCL (``torch.device("cuda")``). Returns
    :data:`NO_NCCL` (none: gloo only, or not initialised), :data:`ABORTED`, or :data:`NO_SAFE_ABORT`
    (several NCCL groups and no group start/end in this torch: nothing was aborted).

    The groups stay registered: the training function's next attempt tears them down as after any
    failure (``destroy_process_group``, megatron-core's ``destroy_model_parallel``, both behind
    ``dist.is_initialized()`` in the scripts). That is why torch's own ``_abort_process_group()``,
    which makes the same aborts inside the same group start/end, is not called: it also unregisters
    every group, ``is_initialized()`` turns False, the scripts skip megatron-core's teardown and its
    next ``initialize_model_parallel`` asserts "already initialized".

    The one place that uses torch's private distributed API: ``_world.pg_map`` (the registry, in
    creation order), ``ProcessGroup._get_backend(device)``, and ``ProcessGroupNCCL._group_start`` /
    ``_group_end``. Checked against torch 2.13.0 (the torch of this project's environment); its
    ``_abort_process_group`` does this loop with these calls."""
    if not c10d.is_initialized():
        return NO_NCCL
    groups = [pg for pg in c10d._world.pg_map if "nccl" in str(c10d.get_backend(pg))]
    if not groups:
        return NO_NCCL
    backend = groups[0]._get_backend(cuda)
    start, end = getattr(backend, "_group_start", None), getattr(backend, "_group_end", None)
    if len(groups) > 1 and (start is None or end is None):
        return NO_SAFE_ABORT
    if start is not None and end is not None:
        start()
        try:
            for pg in reversed(groups):
                pg.abort()
        finally:
            end()
    else:  # a single communicator: nothing to deadlock with
        groups[0].abort()
    return ABORTED


_ON_ABORT: list[Callable[[], None]] = []  # what else blocks in a round: the restore's agent connection


def on_round_abort(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn`` (quick, best effort) when this round is aborted, beside its TCP connections: e.g. shut
    down the restore's connection to its agent, on which a job-wide decision may be waiting. Returns the
    function that unregisters it."""
    _ON_ABORT.append(fn)
    return lambda: _ON_ABORT.remove(fn) if fn in _ON_ABORT else None


def _abort_registered() -> int:
    done = 0
    for fn in list(_ON_ABORT):
        try:
            fn()
            done += 1
        except Exception as e:
            log.warning("in-process restart: aborting %s: %s", getattr(fn, "__name__", fn), _first_line(e))
    return done


def abort_round(round_: Any) -> Optional[str]:
    """Abort this round's collectives because round ``round_`` opened, in this order: every NCCL
    communicator (:func:`_abort_nccl_groups`), then the round's TCP connections
    (:func:`abort_round_connections`); the device is checked later, once the attempt has unwound
    (:func:`device_problem`). Returns None when the process may rejoin the next round in place, else
    why not (logged; a fresh process takes its place): a torch with no safe abort of several NCCL
    communicators, or an abort that failed."""
    why = None
    if "torch" in sys.modules:  # no torch, no process group
        try:
            import torch
            import torch.distributed as dist

            if dist.is_available():
                done = _abort_nccl_groups(dist.distributed_c10d, torch.device("cuda"))
                if done == NO_SAFE_ABORT:
                    why = (f"torch {torch.__version__} offers no NCCL group start/end to abort several NCCL "
                           f"communicators safely")
        except Exception as e:  # a communicator in an unknown state: not one to rejoin with
            why = f"aborting the NCCL groups failed: {_first_line(e)}"
    shut = abort_round_connections() + _abort_registered()
    log.warning("in-process restart: round %s opened: %d connections of the old round shut down%s", round_, shut,
                f"; this process does not rejoin in place ({why}): a fresh process takes its place" if why else "")
    return why


class Channel:
    """The trainer's end of its keeper's control socket, with the reader thread."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.cond = threading.Condition()
        self.round: Optional[dict] = None  # the newest round message
        self.exit = False  # the keeper said: no round, end as before
        self.closed = False
        self.aborting = False  # a round's message is being handled: its round is published after the abort
        self.no_rejoin: Optional[str] = None  # why this process cannot rejoin in place (its abort)
        threading.Thread(target=self._read, name="mft-in-process", daemon=True).start()

    def send(self, obj: dict) -> None:
        """One message to the keeper (:data:`megatron_ft.spares.messages.FROM_TRAINER`), best effort."""
        try:
            wire.send_packet(self.sock, obj)
        except OSError:
            pass

    def _read(self) -> None:
        while True:
            try:
                got, _ = wire.recv_packet(self.sock, TO_TRAINER)
            except wire.WireError as e:
                log.error("in-process restart: the keeper's control socket: %s", e)
                continue
            except OSError:
                with self.cond:
                    self.closed = True
                    self.cond.notify_all()
                return
            if isinstance(got, RoundOpened):
                msg = got.model_dump(include={"round", "port"})
                with self.cond:
                    self.aborting = True
                why = "the abort failed"
                try:  # the round is published after the abort: no attempt starts while it runs
                    why = abort_round(msg["round"])
                finally:
                    with self.cond:
                        self.aborting = False
                        self.no_rejoin = self.no_rejoin or why
                        if self.round is None or int(msg["round"]) > int(self.round["round"]):
                            self.round = msg
                        self.cond.notify_all()
            else:  # exit: no round
                with self.cond:
                    self.exit = True
                    self.cond.notify_all()

    def next_round(self, after: int, timeout: float) -> Optional[dict]:
        """The newest round after ``after`` the keeper sent, waiting up to ``timeout`` for it - and, whatever
        the timeout, up to ``REPLY_TIMEOUT_S`` for an abort under way (its round follows it); None when
        the keeper says exit, went away, or stays silent."""
        deadline = time.monotonic() + timeout
        abort_deadline = time.monotonic() + REPLY_TIMEOUT_S
        with self.cond:
            while True:
                if self.aborting and time.monotonic() < abort_deadline:
                    self.cond.wait(abort_deadline - time.monotonic())
                    continue
                if self.round is not None and int(self.round["round"]) > after:
                    return self.round
                left = deadline - time.monotonic()
                if self.exit or self.closed or left <= 0:
                    return None
                self.cond.wait(left)


def offered() -> bool:
    """Does this process's keeper offer in-process restart (a control socket in its environment)?"""
    return os.environ.get(ENV_FD, "").isdigit()


def current_round() -> int:
    try:
        return int(os.environ.get("MFT_FAST_ROUND", "0"))
    except ValueError:
        return 0


def _grace_s() -> float:
    """This trainer's grace (its keeper's, ``MFT_IN_PROCESS_GRACE_S``) as a trainer on NCCL, the only
    one whose device :func:`device_problem` checks; NCCL's ``auto`` grace where unset."""
    return in_process_grace(os.environ, "nccl") or AUTO_GRACE_S["nccl"]


def run(train_fn: Callable[[int], int]) -> int:
    """Run ``train_fn(0)``; after a failure the keeper turns into a new round, run ``train_fn(1)``,
    ``train_fn(2)``, ... in this process. Returns what the last attempt returned; an attempt's
    exception propagates when no round follows it. Without a keeper's control socket (no warm spares,
    in-process restart off, a plain ``python`` run) this is ``train_fn(0)``."""
    global _ATTEMPT, _UNINITIALISED
    fd = os.environ.pop(ENV_FD, None)
    if fd is None or not fd.isdigit():
        return train_fn(0)
    channel = Channel(int(fd))
    channel.send({"op": "rejoinable", "pid": os.getpid()})
    number, _ATTEMPT = 0, (0, None)
    while True:
        _UNINITIALISED = False
        try:
            return train_fn(number)
        except NothingRestored:
            raise  # never in place: a fresh process initialises its weights
        except Exception as e:
            if sticky_cuda_error(e):  # its CUDA context is unusable: as if it had crashed
                log.error("in-process restart: rank %s ends: %s is a sticky CUDA error; a fresh process takes "
                          "its place", os.environ.get("RANK"), _first_line(e))
                raise
            here = current_round()
            nxt = channel.next_round(here, 0.0)
            if nxt is None:  # not aborted by a new round: this failure asks for one
                channel.send({"op": "failed", "reason": _first_line(e)})
                nxt = channel.next_round(here, REPLY_TIMEOUT_S)
            if nxt is None:
                raise
            why = channel.no_rejoin or device_problem(device_check_s(_grace_s()))
            if why:
                log.error("in-process restart: rank %s does not rejoin round %s in place (%s): it ends, and a "
                          "fresh process takes its place", os.environ.get("RANK"), nxt["round"], why)
                raise
            log.warning("in-process restart: rank %s rejoins in round %s (attempt %d ended: %s: %s)",
                        os.environ.get("RANK"), nxt["round"], number, type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "")
            os.environ["MASTER_PORT"] = str(nxt["port"])
            os.environ["MFT_FAST_ROUND"] = str(nxt["round"])
            channel.send({"op": "restarting", "round": int(nxt["round"])})
            number += 1
            _ATTEMPT = (number, time.time())
