"""The node's watcher: one process per node that follows the fast restart rounds (:mod:`.fast_restart`)
in torchrun's job store and the root agent's failure verdicts for every keeper (:mod:`.keeper`) of
the node, woken by the stores instead of polling them.

Without it each keeper (one per rank) asked the job store for a newer round every 50 ms and read the
root's ``last_verdict`` every 0.25 s for ``health.timeout_s + 1`` s after each round: at 16,384 ranks
327,000 requests/s on the store the trainers rendezvous on, and 65,500 reads/s at the root. Now, per
node and per torchrun attempt (N nodes, L ranks per node):

* **one round stream** (:class:`RoundStream`): a thread blocked in ``TCPStore.wait`` on the next
  round's key (``round/<n+1>``), then on its store's port (``port/<n>``), a ``get`` of the port, and
  one ``check`` for a round newer still; a second thread writes what the node's keepers ask: a round's
  ``add`` (once per node and round, however many of its keepers' trainers failed) and torchrun's rank
  0's ``set`` of the port. Idle: one ``wait`` per :data:`ROUND_WAIT_S` (a liveness ``check`` after each
  that ended unchanged): ``2 / 300`` requests per node per second, whatever N and L. Per round: 4
  requests per node (+1 ``add`` on each node that saw a failure first, +1 ``set`` on rank 0's), so
  ``4N + O(N)`` at the job store, none of them O(L).
* **one verdict stream** (:class:`VerdictStream`) per job configuration: a long poll
  (``watch("last_verdict", known, wait_s)`` at the root agent, or an etcd watch) held only while a
  keeper's window is open (``health.timeout_s + 1`` s from each round's start; each keeper's round
  start extends it). Per node and round: one outstanding request, returning at a change or at the
  window's end (1 + changes; 2 the first time, when a verdict of earlier rounds is already known);
  idle: none. At the root: N outstanding watches for a few seconds per round, not L * N polls.

Keepers talk to it over a ``SOCK_SEQPACKET`` socket pair each (the pool hands the watcher one end of
each new keeper's, :func:`WatcherHandle.attach`): ``rounds``/``open``/``publish``/``verdicts`` in,
``opened``/``port``/``gone``/``verdict`` out (:mod:`.messages`). A stream's news goes to every
subscribed keeper (L local packets); a keeper that subscribes late is caught up at once. A stream
ends when its store does (``gone`` to its keepers: no more rounds, as a failed request ended them
before), when it reached the attempt's budget, or when its last keeper left.

Every generation's and every torchrun attempt's job store listens on the same port
(``launch.trainer_port``), and torch's client retries a refused connection for its whole timeout: a
stream's client made as its store goes may reach the next one's. So each client first reads the
store's stamp (its rendezvous' run id, set by its host: :func:`~.fast_restart.store_stamp`; one
``get`` per client, counted as ``stamp``) and ends its stream when it is another's, and the writer
writes nothing once the watch thread saw the store end (a stale ``add`` would open a round in the
next attempt that its other nodes' trainers never join).

Contracts: the watcher never forks (it runs threads; the pool and the keepers stay single-threaded),
dies with the pool (``PR_SET_PDEATHSIG``) and ends when the pool's control socket closes. Every
wait is bounded: a job-store ``wait`` by :data:`ROUND_WAIT_S` (then a ``check`` with the store's
request timeout, :data:`~.fast_restart.STORE_TIMEOUT_S`), a root watch by the window and the wire's
timeout. Each stream counts its requests (:attr:`RoundStream.counts`, :attr:`VerdictStream.counts`;
a node's totals: :meth:`NodeWatch.counts`) for the scale bed and the tests.
"""
from __future__ import annotations

import collections
import datetime
import logging
import os
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..transport import wire
from . import fast_restart as fr
from .lifetime import die_with_parent, set_process_name
from .messages import TO_WATCHER, Open, RoundOpened, Rounds, Verdicts

log = logging.getLogger("megatron_ft.spares")

WATCH_PROCESS_NAME = "mft-watch"  # the watcher's process name (psutil's name(), /proc/PID/comm)
ROUND_WAIT_S = 300.0  # one blocking wait on the job store (then a liveness check, and the next)
VERDICT_TIMEOUT_S = 2.0  # each request to the root (a watch: this plus its wait)
VERDICT_WAIT_MAX_S = 60.0  # the longest one watch of the root waits (the embedded store's bound)
VERDICT_RETRY_S = 1.0  # after a root that did not answer, within the window
IDLE_TICK_S = 1.0  # the main loop's longest sleep (nothing is due on it: a bound, not a poll)
VERDICT_KEY = "last_verdict"

Emit = Callable[[object, dict], None]


def watch_key(client, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
    """``key``'s value in the job's health store once it differs from ``value`` (None: absent), or
    after ``wait_s`` unchanged, through ``client`` (a :class:`megatron_ft.health.store.StoreClient`):
    the embedded store's long poll, or on etcd one read and a watch stream from its revision."""
    return client.watch(key, value, wait_s)


class RoundStream:
    """The rounds of one torchrun attempt's job store (``addr:port``), for every keeper of the node.

    Two threads: the watch (blocking ``wait``s, see the module) and the writer (``add``/``set`` the
    keepers asked for, in order). What they learn goes through ``emit`` to the main thread, which keeps
    the stream's view (:attr:`newest`, :attr:`ports`, :attr:`gone`: touched by the main thread only).
    Requests per node: idle ``2 / ROUND_WAIT_S`` per second; per round 4, +1 ``add`` (+1 ``set`` on
    torchrun's rank 0's node); independent of N and of the L keepers subscribed."""

    def __init__(self, addr: str, port: int, limit: int, emit: Emit, wait_s: float = ROUND_WAIT_S,
                 timeout_s: float = fr.STORE_TIMEOUT_S, stamp: Optional[str] = None):
        self.addr, self.port, self.limit, self.emit = addr, port, limit, emit
        self.wait_s, self.timeout_s, self.stamp = wait_s, timeout_s, stamp
        self._counts = collections.Counter()  # the watch thread's requests: wait, check, get, connect, stamp
        self._write_counts = collections.Counter()  # the writer's: add, set, connect, stamp
        self.stopped = threading.Event()
        # the watch thread's store failed: this attempt's store is gone, and whatever listens on its port
        # from now on is another's (the next torchrun attempt's or generation's, on the same trainer port)
        self.lost = threading.Event()
        self.newest, self.opening, self.gone = 0, 0, None
        self.ports: dict[int, int] = {}
        self._writes: "queue.SimpleQueue[Optional[tuple[str, int, int]]]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._watch_loop, name=f"mft-rounds-{port}", daemon=True),
                         threading.Thread(target=self._write_loop, name=f"mft-round-writes-{port}", daemon=True)]

    @property
    def counts(self) -> collections.Counter:
        """Requests to the job store so far, by kind (``wait``, ``wait-timeout`` of those, ``check``,
        ``get``, ``add``, ``set``, ``connect``)."""
        return self._counts + self._write_counts

    def start(self) -> "RoundStream":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """No keeper follows it any more: the threads end at their next wake (a blocked ``wait`` within
        :data:`ROUND_WAIT_S`, or when the store goes)."""
        self.stopped.set()
        self._writes.put(None)

    # ------------------------------------------------------------------ the main thread's side
    def open(self, n: int) -> None:
        """A keeper asks for round ``n``: one ``add`` per node and round (none when it is known open)."""
        if n <= max(self.newest, self.opening) or n > self.limit or self.gone is not None:
            return
        self.opening = n
        self._writes.put(("open", n, 0))

    def publish(self, n: int, port: int) -> None:
        self._writes.put(("publish", n, port))

    def seen(self, msg: dict) -> bool:
        """Take in news the threads (or a local keeper's ``publish``) emitted; False when it is none."""
        if msg["op"] == "opened":
            if msg["round"] <= self.newest:
                return False
            self.newest = msg["round"]
        elif msg["op"] == "port":
            if self.ports.get(msg["round"]) == msg["port"]:
                return False
            self.ports[msg["round"]] = msg["port"]
            self.newest = max(self.newest, msg["round"])
        elif msg["op"] == "gone":
            if self.gone is not None:
                return False
            self.gone = msg["reason"]
        return True

    def replay(self) -> list[dict]:
        """What a keeper that subscribes now must be told to be where the others are."""
        out: list[dict] = []
        if self.newest:
            out.append({"op": "opened", "round": self.newest})
        if self.newest in self.ports:
            out.append({"op": "port", "round": self.newest, "port": self.ports[self.newest]})
        if self.gone is not None:
            out.append({"op": "gone", "reason": self.gone})
        return out

    # ------------------------------------------------------------------ the threads
    def _client(self, counts: collections.Counter):
        """A client of this attempt's job store. torch's client retries a refused connection for its
        whole timeout, so one made after the store went may reach the next attempt's store on the same
        port: the store's stamp (:func:`~.fast_restart.store_stamp`, one ``get``) must be this stream's,
        else a :class:`RuntimeError` says whose it is."""
        from torch.distributed import PrefixStore, TCPStore

        counts["connect"] += 1
        base = TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=self.timeout_s))
        if self.stamp is not None:
            counts["stamp"] += 1
            try:
                got = base.get(fr.STAMP_KEY).decode(errors="replace")
            except Exception as e:
                raise RuntimeError(f"the job store at {self.addr}:{self.port} has no stamp of its rendezvous "
                                   f"within {self.timeout_s:g} s ({_first_line(e)}): not this attempt's "
                                   f"({self.stamp!r}) store") from None
            if got != self.stamp:
                raise RuntimeError(f"the store at {self.addr}:{self.port} is rendezvous {got!r}'s, not "
                                   f"{self.stamp!r}'s: this attempt's job store is gone (a later one listens "
                                   f"on its port)")
        return PrefixStore("mft/fast", base)

    def _stale(self) -> bool:
        """Whether the writer must not write any more: no keeper follows the stream, or the watch thread
        saw this attempt's store end (a client connected since reached another's)."""
        return self.stopped.is_set() or self.lost.is_set()

    def _wait(self, store, key: str) -> bool:
        """Block until ``key`` exists (True), or the stream is stopped (False). The store's end raises."""
        from torch.distributed import DistStoreError

        while not self.stopped.is_set():
            self._counts["wait"] += 1
            try:
                store.wait([key], datetime.timedelta(seconds=self.wait_s))
                return True
            except DistStoreError as e:
                if "timeout" not in str(e).lower():
                    raise
            self._counts["wait-timeout"] += 1
            if self.stopped.is_set():
                break
            self._counts["check"] += 1
            if store.check([key]):  # alive (it raises when not), and maybe set just now
                return True
        return False

    def _watch_loop(self) -> None:
        try:
            store = self._client(self._counts)
            k = 0
            while k < self.limit:
                if not self._wait(store, f"round/{k + 1}"):
                    return
                n = k + 1
                while n < self.limit:
                    self._counts["check"] += 1
                    if not store.check([f"round/{n + 1}"]):
                        break
                    n += 1
                self.emit(self, {"op": "opened", "round": n})
                if not self._wait(store, f"port/{n}"):
                    return
                self._counts["get"] += 1
                self.emit(self, {"op": "port", "round": n, "port": int(store.get(f"port/{n}"))})
                k = n
        except Exception as e:  # the store is gone (its host ended: the attempt is over, or rank 0 failed)
            self.lost.set()
            if not self.stopped.is_set():
                self.emit(self, {"op": "gone", "reason": _first_line(e)})

    def _write_loop(self) -> None:
        store = None
        while True:
            item = self._writes.get()
            if item is None or self.stopped.is_set():
                return
            what, n, port = item
            try:
                if store is None:
                    store = self._client(self._write_counts)  # lazily: may take the client's whole timeout
                if self._stale():  # never a write of this attempt's rounds into another attempt's store
                    log.warning("spares: node watcher: round %d of the job store at %s:%d not %s: that store "
                                "is gone", n, self.addr, self.port, "opened" if what == "open" else "published")
                    return
                if what == "open":
                    self._write_counts["add"] += 1
                    store.add(f"round/{n}", 1)
                else:
                    self._write_counts["set"] += 1
                    store.set(f"port/{n}", str(port))
            except Exception as e:
                if not self.stopped.is_set():
                    self.emit(self, {"op": "gone", "reason": _first_line(e)})
                return


class VerdictStream:
    """The root's ``last_verdict`` for every keeper of the node with one job configuration (``config``,
    the path in ``MFT_CONFIG``): one thread holding one long poll while a window is open (:meth:`extend`;
    no request otherwise). Requests per node: per round ``1 + verdicts`` (each watch returns at a change
    or at the window's end, at most :data:`VERDICT_WAIT_MAX_S`); idle none; independent of N and L.
    Best effort: a root that does not answer is no news (retried every :data:`VERDICT_RETRY_S` within
    the window); a job without a health store (:func:`~megatron_ft.health.store.store_needed`) is
    never asked."""

    def __init__(self, config: str, emit: Emit, timeout_s: float = VERDICT_TIMEOUT_S):
        self.config, self.emit, self.timeout_s = config, emit, timeout_s
        self.counts: collections.Counter = collections.Counter()  # by request: watch, error
        self.known: Optional[str] = None  # the main thread's: the newest value sent to the keepers
        self._deadline = 0.0
        self._stopped = False
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def extend(self, settle_s: float) -> None:
        """Keep watching for ``settle_s`` from now (a keeper's round started)."""
        with self._cond:
            self._deadline = max(self._deadline, time.monotonic() + settle_s)
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mft-verdicts", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _left(self) -> Optional[float]:
        """Seconds of the window left, after waiting (bounded ticks) for one to open; None: stopped."""
        with self._cond:
            while not self._stopped and time.monotonic() >= self._deadline:
                self._cond.wait(IDLE_TICK_S * 10)
            return None if self._stopped else self._deadline - time.monotonic()

    def _client(self):
        from .. import config as ftconfig
        from ..health.store import StoreClient, store_needed

        cfg = ftconfig.load(self.config or None)
        return StoreClient(cfg, timeout_s=self.timeout_s) if store_needed(cfg) else None

    def _loop(self) -> None:
        try:
            client = self._client()
        except Exception as e:
            log.warning("spares: no failure verdicts for the fast rounds (%s)", _first_line(e))
            client = None
        if client is None:
            return
        value: Optional[str] = None
        while (left := self._left()) is not None:
            self.counts["watch"] += 1
            try:
                got = watch_key(client, VERDICT_KEY, value, min(left, VERDICT_WAIT_MAX_S))
            except Exception:
                self.counts["error"] += 1
                with self._cond:
                    self._cond.wait(min(VERDICT_RETRY_S, max(left, 0.0)))
                continue
            if got != value:
                value = got
                if got is not None:
                    self.emit(self, {"op": "verdict", "value": got})


@dataclass
class _Keeper:
    """One keeper's subscriptions."""

    rounds: Optional[tuple] = None
    verdicts: Optional[str] = None


class NodeWatch:
    """The watcher's main thread: the keepers' sockets, the streams they follow, the news the
    streams' threads emit (a queue, and a pipe that wakes the ``select``). Run by :func:`serve` in the
    watcher process; a test may run one in a thread of its own (:meth:`add`, :meth:`step`)."""

    def __init__(self, ctl: Optional[socket.socket] = None, round_wait_s: float = ROUND_WAIT_S):
        self.ctl, self.round_wait_s = ctl, round_wait_s
        self.keepers: dict[socket.socket, _Keeper] = {}
        self.rounds: dict[tuple, RoundStream] = {}
        self.verdicts: dict[str, VerdictStream] = {}
        self._retired: collections.Counter = collections.Counter()  # the counts of streams that ended
        self._events: "queue.SimpleQueue[tuple[object, dict]]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def emit(self, stream: object, msg: dict) -> None:
        """From any thread: ``msg`` is news of ``stream`` for its keepers."""
        self._events.put((stream, msg))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def add(self, sock: socket.socket) -> None:
        self.keepers[sock] = _Keeper()

    def counts(self) -> collections.Counter:
        """This node's requests so far, by store and request (``"job store wait"``, ``"root watch"``, ...)."""
        out = collections.Counter(self._retired)
        for s in list(self.rounds.values()):
            out.update({f"job store {k}": v for k, v in s.counts.items()})
        for v in list(self.verdicts.values()):
            out.update({f"root {k}": n for k, n in v.counts.items()})
        return out

    def step(self, timeout: float = IDLE_TICK_S) -> bool:
        """One wait for a message or news (at most ``timeout``); False once the pool is gone."""
        watched = [self._wake_r, *self.keepers] + ([self.ctl] if self.ctl is not None else [])
        ready, _, _ = select.select(watched, [], [], timeout)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        self._deliver()
        for sock in ready:
            if sock is self.ctl:
                if not self._from_pool():
                    return False
            elif sock in self.keepers:
                self._from_keeper(sock)
        return True

    def close(self) -> None:
        for sock in list(self.keepers):
            self._drop(sock)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # ------------------------------------------------------------------ messages
    def _from_pool(self) -> bool:
        try:
            _, fds = wire.recv_packet(self.ctl, TO_WATCHER, max_fds=1)  # type: ignore[arg-type]
        except wire.WireError as e:
            log.error("spares: node watcher: from the pool: %s", e)
            return True
        except OSError:
            return False
        for fd in fds:
            self.add(socket.socket(fileno=fd))
        return True

    def _from_keeper(self, sock: socket.socket) -> None:
        try:
            msg, fds = wire.recv_packet(sock, TO_WATCHER)
        except wire.WireError as e:
            log.error("spares: node watcher: from a keeper: %s", e)
            return
        except OSError:  # the keeper ended
            self._drop(sock)
            return
        sub = self.keepers[sock]
        if isinstance(msg, Rounds):
            key = (msg.addr, msg.port, msg.attempt)
            stream = self.rounds.get(key)
            if stream is None or stream.gone is not None:  # a store of this name again: a new one
                if stream is not None:
                    self._retire(key, stream)
                stream = self.rounds[key] = RoundStream(msg.addr, msg.port, msg.limit, self.emit,
                                                        wait_s=self.round_wait_s,
                                                        stamp=msg.attempt.rsplit("/", 1)[0]).start()
            sub.rounds = key
            for news in stream.replay():
                self._send(sock, news)
        elif isinstance(msg, Open) and sub.rounds in self.rounds:
            self.rounds[sub.rounds].open(msg.round)
        elif isinstance(msg, RoundOpened) and sub.rounds in self.rounds:  # publish: torchrun's rank 0 hosts it
            stream = self.rounds[sub.rounds]
            news = {"op": "port", "round": msg.round, "port": msg.port}
            if stream.seen(news):  # the node's other keepers hear it now, not through the store
                self._tell(lambda k: k.rounds == sub.rounds, news)
            stream.publish(msg.round, msg.port)
        elif isinstance(msg, Verdicts):
            stream = self.verdicts.get(msg.config)
            if stream is None:
                stream = self.verdicts[msg.config] = VerdictStream(msg.config, self.emit)
            sub.verdicts = msg.config
            if stream.known is not None:
                self._send(sock, {"op": "verdict", "value": stream.known})
            stream.extend(msg.settle_s)

    def _deliver(self) -> None:
        while True:
            try:
                stream, msg = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(stream, RoundStream):
                key = next((k for k, s in self.rounds.items() if s is stream), None)
                if key is not None and stream.seen(msg):
                    self._tell(lambda k: k.rounds == key, msg)
            elif isinstance(stream, VerdictStream) and self.verdicts.get(stream.config) is stream:
                stream.known = msg["value"]
                self._tell(lambda k: k.verdicts == stream.config, msg)

    def _tell(self, who: Callable[[_Keeper], bool], msg: dict) -> None:
        for sock, sub in list(self.keepers.items()):
            if who(sub):
                self._send(sock, msg)

    def _send(self, sock: socket.socket, msg: dict) -> None:
        try:
            wire.send_packet(sock, msg)
        except OSError:  # the keeper ended: its end of the socket is read next
            pass

    def _drop(self, sock: socket.socket) -> None:
        sub = self.keepers.pop(sock)
        sock.close()
        left = self.keepers.values()
        if sub.rounds in self.rounds and not any(k.rounds == sub.rounds for k in left):
            self._retire(sub.rounds, self.rounds[sub.rounds])
        if sub.verdicts in self.verdicts and not any(k.verdicts == sub.verdicts for k in left):
            stream = self.verdicts.pop(sub.verdicts)
            stream.stop()
            self._retired.update({f"root {k}": n for k, n in stream.counts.items()})

    def _retire(self, key: tuple, stream: RoundStream) -> None:
        del self.rounds[key]
        stream.stop()
        self._retired.update({f"job store {k}": v for k, v in stream.counts.items()})


def serve(ctl: socket.socket) -> None:
    """The watcher process's loop: keepers arrive on ``ctl`` (from the pool); returns when it closes."""
    watch = NodeWatch(ctl)
    while watch.step():
        pass


class WatcherHandle:
    """The pool's side: the watcher process, forked at the first keeper (and again if it died), and
    one socket pair per keeper (:meth:`attach`). Single-threaded, as the pool."""

    def __init__(self) -> None:
        self.pid: Optional[int] = None
        self.ctl: Optional[socket.socket] = None

    def _start(self, inherited: tuple) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                mine.close()
                for s in inherited:  # the pool's: its listening socket, a request's socket and streams
                    s.close() if isinstance(s, socket.socket) else os.close(s)
                die_with_parent()
                set_process_name(WATCH_PROCESS_NAME)
                serve(theirs)
            except BaseException:
                import traceback

                traceback.print_exc()  # into the pool's log
            finally:
                os._exit(0)
        theirs.close()
        self.pid, self.ctl = pid, mine

    def attach(self, inherited: tuple = ()) -> Optional[socket.socket]:
        """A new keeper's socket to the watcher (None: no watcher could be started). ``inherited``: the
        pool's sockets and descriptors a newly forked watcher closes (so that it holds no worker's
        streams open)."""
        for _ in range(2):
            if self.ctl is None:
                self._start(inherited)
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                wire.send_packet(self.ctl, {"op": "keeper"}, (theirs.fileno(),))  # type: ignore[arg-type]
                return mine
            except OSError as e:  # the watcher died: start another
                log.error("spares: the node watcher is gone (%s): starting another", e)
                mine.close()
                self.close()
            finally:
                theirs.close()
        return None

    def close(self) -> None:
        """The pool's end (in a keeper forked from the pool, so that only the pool holds it)."""
        if self.ctl is not None:
            self.ctl.close()
        self.ctl = None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines()[0] if str(e) else type(e).__name__)[:400]
