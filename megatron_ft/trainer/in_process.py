"""In-process restart: a trainer that survives a peer's failure rejoins the next round in place.

With fast restart rounds (:mod:`megatron_ft.spares.fast_restart`) a failed trainer's keeper opens
round ``n + 1`` and every keeper replaces its trainer. A trainer run through :func:`run` is not
replaced: it tells its keeper so at start (``{"in_process": true}`` on the control socket the keeper
passes in ``MFT_IN_PROCESS_FD``), and when the keeper sends ``{"round": n + 1, "port": P}`` it

1. aborts its process groups' connections at once (a reader thread: every TCP connection the process
   opened since its round's process group began, :func:`mark_round_start`, is shut down, so a
   collective blocked on the dead peer - or on a survivor blocked on it - raises at once instead of
   waiting for gloo's timeout; NCCL groups are aborted with torch's ``abort``);
2. lets the training function unwind (the exception of its aborted collective ends it, its
   ``finally`` blocks close what it opened), says ``{"restarting": n + 1}`` to the keeper, points
   ``MASTER_PORT`` and ``MFT_FAST_ROUND`` at round ``n + 1``;
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
without in-process restart. ``SystemExit`` (a clean end, :mod:`megatron_ft.fatal`'s exit) and
``KeyboardInterrupt`` are never restarted. Used by ``scripts/pretrain_gpt.py``, upstream Megatron-LM's
``pretrain_gpt.py`` (through :mod:`megatron_ft.megatron.upstream`) and ``scripts/pretrain_deepspeed.py``.

Contracts: one reader thread (daemon) per process; :func:`run` is called once, on the main thread;
every wait is bounded (``REPLY_TIMEOUT_S`` for the keeper's answer). Messages are one JSON object per
``SOCK_SEQPACKET`` datagram.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

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


def _abort_nccl() -> None:  # GPU only: not run on this project's CPU CI
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        for pg in list(dist.distributed_c10d._world.pg_map):
            if dist.get_backend(pg) == "nccl":
                pg.abort()
    except Exception as e:  # best effort: the keeper's grace ends a trainer that stays blocked
        log.warning("in-process restart: aborting NCCL groups failed: %s", e)


class Channel:
    """The trainer's end of its keeper's control socket, with the reader thread."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.cond = threading.Condition()
        self.round: Optional[dict] = None  # the newest round message
        self.exit = False  # the keeper said: no round, end as before
        self.closed = False
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
                    if self.round is None or int(msg["round"]) > int(self.round["round"]):
                        self.round = msg
                    self.cond.notify_all()
                shut = abort_round_connections()
                _abort_nccl()
                log.warning("in-process restart: round %s opened: %d connections of the old round shut down",
                            msg["round"], shut)
            else:  # exit: no round
                with self.cond:
                    self.exit = True
                    self.cond.notify_all()

    def next_round(self, after: int, timeout: float) -> Optional[dict]:
        """The newest round after ``after`` the keeper sent, waiting up to ``timeout`` for it; None when
        the keeper says exit, went away, or stays silent."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
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
            here = current_round()
            nxt = channel.next_round(here, 0.0)
            if nxt is None:  # not aborted by a new round: this failure asks for one
                channel.send({"op": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})
                nxt = channel.next_round(here, REPLY_TIMEOUT_S)
            if nxt is None:
                raise
            log.warning("in-process restart: rank %s rejoins in round %s (attempt %d ended: %s: %s)",
                        os.environ.get("RANK"), nxt["round"], number, type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "")
            os.environ["MASTER_PORT"] = str(nxt["port"])
            os.environ["MFT_FAST_ROUND"] = str(nxt["round"])
            channel.send({"op": "restarting", "round": int(nxt["round"])})
            number += 1
            _ATTEMPT = (number, time.time())
