"""Hooks into megatron-core's pipeline schedule, installed from outside (no megatron-core edits).

:func:`install` wraps, until :func:`uninstall` puts the originals back:

=====================================================  ========================================
what                                                   how (megatron-core 0.16.1)
=====================================================  ========================================
pipeline P2P (every send/recv of every schedule)       ``P2PCommunicator._communicate``, a class
                                                       attribute: the schedules build a fresh
                                                       ``P2PCommunicator`` per call and its
                                                       ``send_*``/``recv_*`` methods look
                                                       ``self._communicate`` up at call time
megatron's named timers (``forward-compute``,          ``config.timers`` of the model config and of
``backward-compute``, ``embedding-grads-all-reduce``,  every (chained) optimizer's config: a
``optimizer-*``, ...)                                  :class:`RecordingTimers` that forwards to the
                                                       timers already there (Megatron-LM's
                                                       ``Timers``) and records each start/stop
data-parallel gradient sync and parameter all-gather   ``DistributedDataParallel.start_grad_sync`` /
                                                       ``finish_grad_sync`` / ``start_param_sync``
                                                       (class attributes; ``finalize_model_grads``
                                                       and the distributed optimizer call them on
                                                       the model chunks)
the optimizer step                                     ``optimizer.step`` of the object passed in
=====================================================  ========================================

Every wrapped operation is reported twice over:

* to the **sinks** (:meth:`PipelineHooks.add_sink`) as one record ``(name, kind, start, end,
  bytes, src)`` with ``time.perf_counter()`` times - the profiler is a sink; kinds are those of
  :mod:`megatron_ft.schedule.spans` (``compute``, ``send``, ``recv``, ``collective``,
  ``optimizer``) plus ``phase`` (an enclosing or duplicate timer, shown but not summarised) and
  ``ckpt`` (checkpoint traffic, reported by whoever sends it through :meth:`PipelineHooks.emit`);
* to the **callbacks** registered for a *schedule point* (:meth:`PipelineHooks.add_callback`),
  before and after it runs, so that a scheduled transport can act at planned places of the
  iteration. Points: ``iteration.begin`` / ``iteration.end`` (fired by the training loop's
  integration, :mod:`megatron_ft.megatron.profiling`), ``p2p.before`` / ``p2p.after``,
  ``timer.start:<name>`` / ``timer.stop:<name>`` (e.g. ``timer.stop:forward-compute`` after each
  micro-batch's forward), ``grad_sync.before`` / ``grad_sync.after``, ``param_sync.before`` /
  ``param_sync.after``, ``optimizer.before`` / ``optimizer.after``. A callback gets
  ``(point, info)``; ``info`` has ``iteration``, ``elapsed`` (seconds since ``iteration.begin``),
  ``count`` (how often this point fired in the iteration, from 0) and point-specific fields:
``p2p.*`` the bytes sent to ``send_next`` / ``send_prev``, the flags ``recv_prev`` / ``recv_next``
and, after, ``recv_prev_bytes`` / ``recv_next_bytes``; the others ``name``.

With no sink and no callback the wrappers cost one attribute test each; :func:`uninstall`
removes them entirely.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any, Callable, Optional

COMPUTE, SEND, RECV, COLLECTIVE, OPTIMIZER = "compute", "send", "recv", "collective", "optimizer"
PHASE, CKPT = "phase", "ckpt"

#: megatron-core timer name -> kind. The P2P timers are ``phase`` because ``_communicate`` reports
#: the same operation with its bytes; ``all-grads-sync`` and ``params-all-gather`` because the DDP
#: wrappers report them with their bytes; the ``optimizer-*`` steps lie inside ``optimizer.step``.
TIMER_KINDS = {
    "forward-compute": COMPUTE,
    "backward-compute": COMPUTE,
    "embedding-grads-all-reduce": COLLECTIVE,
    "non-tensor-parallel-grads-all-reduce": COLLECTIVE,
    "conditional-embedder-grads-all-reduce": COLLECTIVE,
}

Sink = Callable[[str, str, float, float, int, str], None]
Callback = Callable[[str, dict], None]


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if t is not None else 0


class PipelineHooks:
    """Sinks and schedule-point callbacks; one instance, :data:`HOOKS`."""

    def __init__(self) -> None:
        self.sinks: list[Sink] = []
        self.callbacks: dict[str, list[Callback]] = defaultdict(list)
        self.iteration: Optional[int] = None
        self.iteration_start = 0.0
        self._counts: dict[str, int] = defaultdict(int)

    # -------------------------------------------------------------- registration
    def add_sink(self, sink: Sink) -> Sink:
        self.sinks.append(sink)
        return sink

    def remove_sink(self, sink: Sink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)

    def add_callback(self, point: str, fn: Callback) -> tuple[str, Callback]:
        """Call ``fn(point, info)`` every time the schedule reaches ``point``; returns a handle for
        :meth:`remove_callback`."""
        self.callbacks[point].append(fn)
        return point, fn

    def remove_callback(self, handle: tuple[str, Callback]) -> None:
        point, fn = handle
        if fn in self.callbacks.get(point, []):
            self.callbacks[point].remove(fn)
            if not self.callbacks[point]:
                del self.callbacks[point]

    @property
    def active(self) -> bool:
        return bool(self.sinks or self.callbacks)

    # -------------------------------------------------------------- reporting
    def emit(self, name: str, kind: str, start: float, end: float, nbytes: int = 0, src: str = "") -> None:
        """Report one operation (``time.perf_counter()`` times) to every sink."""
        for sink in list(self.sinks):
            sink(name, kind, start, end, nbytes, src)

    def fire(self, point: str, **info: Any) -> None:
        """Run the callbacks registered for ``point``."""
        fns = self.callbacks.get(point)
        count = self._counts[point]
        self._counts[point] = count + 1
        if not fns:
            return
        info.update(iteration=self.iteration, count=count,
                    elapsed=time.perf_counter() - self.iteration_start)
        for fn in list(fns):
            fn(point, info)

    def begin_iteration(self, iteration: int) -> None:
        self.iteration, self.iteration_start = iteration, time.perf_counter()
        self._counts.clear()
        self.fire("iteration.begin")

    def end_iteration(self) -> None:
        self.fire("iteration.end")


HOOKS = PipelineHooks()


# ------------------------------------------------------------------------------ timers
class _RecordingTimer:
    __slots__ = ("_owner", "_name", "_inner", "_kind")

    def __init__(self, owner: "RecordingTimers", name: str, inner: Any) -> None:
        self._owner, self._name, self._inner = owner, name, inner
        self._kind = TIMER_KINDS.get(name, PHASE)

    def start(self, barrier: bool = False) -> None:
        if self._inner is not None:
            self._inner.start(barrier=barrier)
        HOOKS.fire("timer.start:" + self._name)
        self._owner._started[self._name] = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        end = time.perf_counter()
        if self._inner is not None:
            self._inner.stop(barrier=barrier)
        start = self._owner._started.pop(self._name, None)
        if start is not None and HOOKS.sinks:
            HOOKS.emit(self._name, self._kind, start, end, 0, "timer")
        HOOKS.fire("timer.stop:" + self._name)

    def __getattr__(self, attr: str) -> Any:  # reset(), elapsed(), active, ... of the real timer
        if self._inner is None:
            raise AttributeError(attr)
        return getattr(self._inner, attr)


class RecordingTimers:
    """Stands in for ``config.timers``: ``timers(name, log_level=None)`` returns a timer whose
    ``start``/``stop`` drive the wrapped timers (if any) and report to :data:`HOOKS`."""

    def __init__(self, inner: Optional[Callable] = None) -> None:
        self.inner = inner
        self._started: dict[str, float] = {}

    def __call__(self, name: str, log_level: Optional[int] = None) -> _RecordingTimer:
        inner = None
        if self.inner is not None:
            inner = self.inner(name) if log_level is None else self.inner(name, log_level=log_level)
        return _RecordingTimer(self, name, inner)

    def __getattr__(self, attr: str) -> Any:  # log(), write(), ... of Megatron-LM's Timers
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(attr)
        return getattr(inner, attr)


# ------------------------------------------------------------------------------ wrappers
def _wrap_communicate(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs: bool = True):
        if not HOOKS.active:
            return orig(self, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                        recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                        wait_on_reqs=wait_on_reqs)
        sends = {"send_next": _nbytes(tensor_send_next), "send_prev": _nbytes(tensor_send_prev)}
        HOOKS.fire("p2p.before", recv_prev=recv_prev, recv_next=recv_next, **sends)
        start = time.perf_counter()
        out = orig(self, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                   recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                   wait_on_reqs=wait_on_reqs)
        end = time.perf_counter()
        recvs = {"recv_prev": _nbytes(out[0]), "recv_next": _nbytes(out[1])}  # 0 when not received
        # one record per direction, all over the same interval (the call waits for all of them);
        # without wait_on_reqs the interval is only the posting of the requests
        suffix = "" if wait_on_reqs else " (posted)"
        if HOOKS.sinks:
            for name, tensor in (("send_next", tensor_send_next), ("send_prev", tensor_send_prev)):
                if tensor is not None:
                    HOOKS.emit("p2p." + name + suffix, SEND, start, end, sends[name], "p2p")
            for name, flag in (("recv_prev", recv_prev), ("recv_next", recv_next)):
                if flag:
                    HOOKS.emit("p2p." + name + suffix, RECV, start, end, recvs[name], "p2p")
        HOOKS.fire("p2p.after", **sends, recv_prev=recv_prev, recv_next=recv_next,
                   recv_prev_bytes=recvs["recv_prev"], recv_next_bytes=recvs["recv_next"])
        return out

    return _communicate


def _buffer_bytes(chunk: Any, attr: str) -> int:
    total = 0
    for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
        total += _nbytes(getattr(buf, attr, None))
    return total


def _wrap_timed(orig: Callable, name: str, kind: str, point: str, bytes_of: Callable[[Any], int]) -> Callable:
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        if not HOOKS.active:
            return orig(self, *args, **kwargs)
        HOOKS.fire(point + ".before", name=name)
        start = time.perf_counter()
        out = orig(self, *args, **kwargs)
        end = time.perf_counter()
        if HOOKS.sinks:
            HOOKS.emit(name, kind, start, end, bytes_of(self), "ddp" if kind == COLLECTIVE else "optimizer")
        HOOKS.fire(point + ".after", name=name)
        return out

    return wrapper


class _Installation:
    def __init__(self) -> None:
        self.patched: list[tuple[Any, str, Any, bool]] = []  # (owner, attr, original, was_own_attr)

    def patch(self, owner: Any, attr: str, new: Any) -> None:
        own = attr in vars(owner) if isinstance(owner, type) else attr in owner.__dict__
        self.patched.append((owner, attr, getattr(owner, attr), own))
        setattr(owner, attr, new)

    def undo(self) -> None:
        for owner, attr, orig, own in reversed(self.patched):
            if own or isinstance(owner, type):
                setattr(owner, attr, orig)
            else:
                delattr(owner, attr)  # an instance attribute we added: the class's method shows again
        self.patched.clear()


_installation: Optional[_Installation] = None


def is_installed() -> bool:
    return _installation is not None


def install(config: Any = None, optimizer: Any = None) -> PipelineHooks:
    """Wrap megatron-core's P2P communicator and DDP grad/param sync (module level), and, when
    given, ``config.timers`` of the model config and the optimizer's configs and ``optimizer.step``.
    Idempotent: a second call only returns :data:`HOOKS`."""
    global _installation
    if _installation is not None:
        return HOOKS
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    inst = _Installation()
    inst.patch(P2PCommunicator, "_communicate", _wrap_communicate(P2PCommunicator._communicate))
    for attr, name, attr_bytes in (("start_grad_sync", "grad-sync.start", "grad_data"),
                                   ("finish_grad_sync", "grad-sync", "grad_data"),
                                   ("start_param_sync", "params-all-gather", "param_data")):
        point = "param_sync" if "param" in attr else "grad_sync"
        inst.patch(DistributedDataParallel, attr,
                   _wrap_timed(getattr(DistributedDataParallel, attr), name, COLLECTIVE, point,
                               functools.partial(lambda a, chunk: _buffer_bytes(chunk, a), attr_bytes)))
    configs = [config] if config is not None else []
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            if getattr(opt, "config", None) is not None:
                configs.append(opt.config)
    seen: dict[int, RecordingTimers] = {}
    for cfg in configs:
        if id(cfg) in seen or isinstance(cfg.timers, RecordingTimers):
            continue
        seen[id(cfg)] = RecordingTimers(cfg.timers)
        inst.patch(cfg, "timers", seen[id(cfg)])
    if optimizer is not None:
        step = optimizer.step  # bound method; the wrapper is an instance attribute
        inst.patch(optimizer, "step", functools.partial(
            _wrap_timed(lambda _self, *a, **k: step(*a, **k), "optimizer.step", OPTIMIZER, "optimizer",
                        lambda _self: 0), optimizer))
    _installation = inst
    return HOOKS


def uninstall() -> None:
    """Put every wrapped function and ``config.timers`` back."""
    global _installation
    if _installation is not None:
        _installation.undo()
        _installation = None
