"""The trainer's side of hang detection: where the training thread is, written into the node agent's
progress file (:mod:`megatron_ft.health.progress`) - on the training thread, a few stores into a
mapping per phase change, nothing sent.

* every ``torch.distributed`` wait (``Work.wait``: what every blocking collective and every
  point-to-point receive of Megatron goes through on gloo) is :data:`~megatron_ft.health.progress.COLLECTIVE`;
* :meth:`Tracker.iteration` (from ``before_optimizer_step``, which every training path calls once
  per iteration) ends an iteration: its duration and its own work (the duration less its waits);
* :meth:`Tracker.phase` around the restore, the wait for the agent's copy, Megatron's own disk save.

Only the thread that installed the tracker is followed (the snapshot worker's and other threads'
waits are not the training's). One tracker per process (:func:`install`; a later one - the next
in-process attempt - replaces it). Without the agent's file (an older agent, ``hang.enabled: false``)
nothing is written and nothing is wrapped.

On CUDA with NCCL, ``Work.wait`` only orders streams: a rank stuck inside a kernel or a collective
is seen in the phase that launched it, not as waiting.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Iterator, Optional

from ..health import progress as hp

log = logging.getLogger("megatron_ft")

_current: Optional["Tracker"] = None
_wrapped = False
_exit_watch: Optional[threading.Event] = None  # set: the training ended in this process (close)


class Tracker:
    """The training thread's progress record (see the module)."""

    def __init__(self, writer: hp.ProgressWriter):
        self.writer = writer
        writer.steps = 0  # iterations of this attempt: a survivor kept in place warms up again after its restore
        from .in_process import attempt

        self.attempt = attempt()[0]
        self.thread = threading.get_ident()
        self.waited = 0.0  # seconds waited in this iteration
        self.iter_start: Optional[float] = None

    def on_training_thread(self) -> bool:
        return threading.get_ident() == self.thread

    @contextlib.contextmanager
    def phase(self, phase: int) -> Iterator[None]:
        """``phase`` for the block (on the training thread only; elsewhere nothing). A waiting phase
        counts as waited, not as the rank's own work."""
        if not self.on_training_thread():
            yield
            return
        left = self.writer.enter(phase)
        t0 = time.monotonic()
        try:
            yield
        finally:
            if phase in hp.WAITING:
                self.waited += time.monotonic() - t0
            self.writer.enter(left)

    def iteration(self) -> None:
        """One iteration ended (the first call only starts the clock)."""
        now = time.monotonic()
        if self.iter_start is not None:
            span = now - self.iter_start
            self.writer.step(span, max(0.0, span - self.waited))
        else:
            self.writer.enter(hp.WORK)
        self.iter_start, self.waited = now, 0.0


def _wrap_wait() -> None:
    """``Work.wait`` of torch.distributed reports :data:`~hp.COLLECTIVE` while it blocks (once per process)."""
    global _wrapped
    if _wrapped:
        return
    from torch.distributed.distributed_c10d import Work

    inner = Work.wait

    def wait(self, *args, **kwargs):
        t = _current
        if t is None or not t.on_training_thread():
            return inner(self, *args, **kwargs)
        with t.phase(hp.COLLECTIVE):
            return inner(self, *args, **kwargs)

    wait.__wrapped__ = inner  # type: ignore[attr-defined]
    Work.wait = wait
    _wrapped = True


def install(path: str, index: int) -> Optional[Tracker]:
    """The tracker of the calling thread (the training thread), writing record ``index`` of ``path``
    (the process's writer: opened at the trainer's start where the launcher named the file); None when
    the file is not there (no agent made it)."""
    global _current, _exit_watch
    writer = hp.writer_for_process(path, index)
    if writer is None:
        log.info("no progress record at %s: this trainer is not watched for hangs", path)
        return None
    if _exit_watch is not None:  # a new attempt in this process: it has not ended
        _exit_watch.set()
        _exit_watch = None
    from .in_process import attempt

    if (_current is None or _current.writer is not writer or not _current.on_training_thread()
            or _current.attempt != attempt()[0]):  # a new in-process attempt warms up again
        _current = Tracker(writer)
    _wrap_wait()
    return _current


def install_from_env() -> Optional[Tracker]:
    """:func:`install` on the file ``megatron-ft launch`` names (``MFT_PROGRESS_FILE``), at record
    ``LOCAL_RANK``; None without one."""
    path = os.environ.get(hp.ENV)
    return install(path, int(os.environ.get("LOCAL_RANK", 0))) if path else None


def current() -> Optional[Tracker]:
    return _current


@contextlib.contextmanager
def phase(which: int) -> Iterator[None]:
    """``which`` around the block on the training thread when a tracker is installed (else nothing)."""
    t = _current
    if t is None:
        yield
        return
    with t.phase(which):
        yield


_exiting = threading.Event()  # the interpreter began to end (before it joins the threads that are not daemons)


def _interpreter_ending() -> None:
    _exiting.set()


_at_thread_shutdown = getattr(threading, "_register_atexit", None)  # runs before non-daemon threads are joined
if _at_thread_shutdown is not None:
    _at_thread_shutdown(_interpreter_ending)
else:  # pragma: no cover - every supported Python has it
    import atexit

    atexit.register(_interpreter_ending)


def ended_well() -> bool:
    """Whether this process ends without an error: no exception on its way up (``close`` called from a
    ``finally``), none that reached the top (``sys.last_value``: the interpreter sets it, and so does a
    warm spare's keeper for its forked trainer)."""
    return sys.exc_info()[0] is None and getattr(sys, "last_value", None) is None


def close(exit_s: float = 0.0) -> None:
    """The training ended: :data:`~hp.DONE`, or :data:`~hp.EXITING` where the process ends on an error
    (:func:`ended_well`: a crashed node's neighbours must not read "training over" and spare a lost node
    its verdict). The record stays open: a later in-process attempt writes on. With ``exit_s``, a process that has not ended that long after its interpreter began to end
    ends itself (:func:`_end_if_still_here`): what holds it - a thread that never ends, an exit handler
    waiting on a socket - would hold the job in torchrun's exit barrier. Nothing before the interpreter
    ends counts (a final dump, an in-process restart's wait for its next round)."""
    global _current, _exit_watch
    if _current is not None:
        _current.writer.enter(hp.DONE if ended_well() else hp.EXITING)
        _current = None
    if exit_s > 0 and _exit_watch is None:
        _exit_watch = threading.Event()
        threading.Thread(target=_end_if_still_here, args=(exit_s, _exit_watch), name="exit-watch",
                         daemon=True).start()


def _end_if_still_here(exit_s: float, cancelled: threading.Event) -> None:
    """Once the interpreter began to end, and ``exit_s`` after: every thread's stack to stderr, then
    ``os._exit``: 0, or 1 where an exception ended the program (``sys.last_value``, set when one
    reached the top). A new attempt (in-process restart) cancels it."""
    while not _exiting.wait(1.0):
        if cancelled.is_set():
            return
    if cancelled.wait(exit_s):
        return
    import faulthandler

    code = 1 if getattr(sys, "last_value", None) is not None else 0
    log.error("this trainer began to exit %.0f s ago but its process has not ended: its threads' stacks follow; "
              "it ends now with %d (hang.exit_s)", exit_s, code)
    try:
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
    finally:
        os._exit(code)
