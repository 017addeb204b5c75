"""torchrun's rendezvous of a job's nodes by node id: the ``megatron-ft`` rendezvous backend.

torch's own ``c10d`` rendezvous admits nodes in any order and, when one is lost, keeps it as a
participant of the completed round until its keep-alives lapse (``keep_alive_interval`` x
``keep_alive_max_attempt``, whole seconds), while the others poll the round's state once a second: of a
node loss taken over by a warm standby, 3.3 s of 4.7 s went there (docs/benchmarks.md, "A warm standby's
takeover"). In a megatron-ft job a node's identity is fixed - its ``--node-rank``, its agent, the memory
its ranks restore from - whoever runs it, and whether a node is alive is the agents' verdict, not the
rendezvous'. So here:

* round ``k`` is complete once every node id ``0 .. N-1`` has joined it: one key per node
  (``<k>/n<node>``) in the generation host's TCPStore, waited for with the store's own blocking wait -
  the last join wakes every waiting node, nothing polls;
* a node joins the newest round unless that round is complete - then it is a replacement of one of
  its nodes (a standby that claimed it, or the node relaunched) and opens the next round - and a node
  that leaves a round (its workers failed) opens the next one: ``round`` in the store, raised by
  compare-and-set, and every node's ``wake/<node>/<k>`` set in one request for whoever waits for it;
* a running node learns that another opened a round (torchrun's ``num_nodes_waiting``, which makes
  it restart its workers and join) from one watcher thread blocked on its own ``wake/<node>/<k+1>``: no
  polling while training runs. The key is its own so that the node can wake its watcher to stop it
  (:meth:`NodeRendezvous.stop_watching`, before the process exits: a thread still inside the store's
  blocking wait when the interpreter finalizes aborts the process);
* its rank in every round is its node id (``node=`` in ``--rdzv-conf``): ranks never move between nodes.

The store is the one torchrun's ``c10d`` backend would use: a TCPStore at ``--rdzv-endpoint``, hosted
by the generation's host (``is_host=true`` in ``--rdzv-conf``). If the host's node is lost the store
goes with it, every join fails at once and the launcher moves the job to its next generation
(:mod:`megatron_ft.rendezvous`), as with ``c10d``. Bounded: a join waits at most ``join_timeout`` seconds
(``launch.start_timeout_s``), then :class:`RendezvousTimeoutError`.

A join is a key, not a heartbeat: a node that joins a round and dies before the round completes still
counts as joined, so the round completes without it; its trainers then cannot form their group, fail
when their own join bound ends (``launch.start_timeout_s``), and the next round waits for the node's
replacement - as with ``c10d``, whose keep-alive outlives so short a window too.

Messages at the host's store, per node and round: a read of ``round``, a look at the round's
``done``, at most a few compare-and-sets, its join, one wait for the N joins (answered once), ``done``,
its watcher's one wait; the node that opens a round one more (every node's wake key, one request of N
keys); O(N) per round job-wide and none while training runs.

Registered with torch's rendezvous registry as ``megatron-ft`` by :func:`register`, which the
launcher's torchrun (``python -m megatron_ft.torchrun``) calls before torch's own ``main``; the
launcher picks it with ``launch.rendezvous: megatron-ft`` (the default; ``c10d``: torch's).

Worked example, the rule for which round a node joins (:func:`round_to_join`) - a job starting, a
node whose workers failed in round 3, and a replacement arriving while round 3 runs or after the
survivors opened round 4:

>>> round_to_join(newest=0, newest_complete=False, last=-1)
0
>>> round_to_join(newest=3, newest_complete=True, last=3)
4
>>> round_to_join(newest=3, newest_complete=True, last=-1), round_to_join(newest=4, newest_complete=False, last=-1)
(4, 4)
"""
from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Optional

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousConnectionError,
                                                  RendezvousHandler, RendezvousInfo, RendezvousParameters,
                                                  RendezvousStoreInfo, RendezvousTimeoutError,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..clock import Deadline

BACKEND = "megatron-ft"
log = logging.getLogger("megatron_ft.launch.rendezvous")
#: a join waits in slices of this long, looking between them whether a newer round opened meanwhile
#: (then it joins that one: a node that joined and failed again before the round completed)
SLICE_S = 1.0
#: the watcher's wait for the next round, in slices of this long (it is woken by the round's opening or
#: by its own node's stop: the slices only bound one request)
WATCH_SLICE_S = 300.0
OPENED, STOPPED = "opened", "stopped"  # the values of a wake key
#: this process's handlers (one per torchrun), whose watchers :func:`stop_all` stops before it exits
HANDLERS: list["NodeRendezvous"] = []


def round_to_join(newest: int, newest_complete: bool, last: int) -> int:
    """The round a node joins: the newest one, unless it is complete (the node replaces one of its
    nodes: the next) or the node took part in it already (its workers failed there: the next)."""
    k = max(newest, last + 1)
    return k + 1 if k == newest and newest_complete else k


class NodeRendezvous(RendezvousHandler):
    """Node ``node`` of ``nodes`` in run ``run_id``'s rendezvous on ``store`` (see the module). Its calls
    are torchrun's agent's (one thread) but for :meth:`num_nodes_waiting`'s flag, set by the watcher."""

    def __init__(self, run_id: str, store: Store, node: int, nodes: int, join_timeout_s: float,
                 local_addr: Optional[str], watch_store: Optional[Store] = None):
        if not 0 <= node < nodes:
            raise ValueError(f"megatron-ft rendezvous: node={node} is not in [0, {nodes - 1}]")
        self.run_id, self.node, self.nodes = run_id, node, nodes
        self.join_timeout_s, self.local_addr = join_timeout_s, local_addr
        self.store = PrefixStore(f"mft-rdzv/{run_id}/", store)
        self._watch_store = PrefixStore(f"mft-rdzv/{run_id}/", watch_store) if watch_store is not None else None
        self.round = -1  # the last round this node completed
        self._waiting = threading.Event()  # another node opened the round after ours
        self._gone: Optional[str] = None  # the watcher found the host's store gone (why)
        self._watcher: Optional[threading.Thread] = None
        HANDLERS.append(self)

    # ------------------------------------------------------------------ torch's RendezvousHandler
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the round :func:`round_to_join` names and wait until every node joined it (a newer round
        opened meanwhile: that one). :class:`RendezvousClosedError` once a node closed the rendezvous;
        :class:`RendezvousTimeoutError` after ``join_timeout``; :class:`RendezvousConnectionError`
        when the host's store is gone."""
        deadline = Deadline(self.join_timeout_s, f"rendezvous {self.run_id}: every node's join")
        self.stop_watching()
        try:
            k = self._join(deadline)
        except (RendezvousClosedError, RendezvousTimeoutError):
            raise
        except Exception as e:  # the host's store gone (its node lost), or not reachable
            raise RendezvousConnectionError(f"rendezvous {self.run_id}: the store at the generation's host "
                                            f"does not answer: {e}") from e
        self.round = k
        self._waiting.clear()
        self._gone = None
        self._watch(k)
        store = PrefixStore(f"{k}/", self.store)
        log.info("node %d: rendezvous %s round %d complete (%d nodes)", self.node, self.run_id, k, self.nodes)
        return RendezvousInfo(store, self.node, self.nodes,
                              RendezvousStoreInfo.build(self.node, store, self.local_addr))

    def _join(self, deadline: Deadline) -> int:
        while True:
            if self.is_closed():
                raise RendezvousClosedError(f"rendezvous {self.run_id} is closed")
            newest = int(self.store.add("round", 0))
            k = self._open(round_to_join(newest, self.store.check([f"{newest}/done"]), self.round), newest)
            self.store.set(f"{k}/n{self.node}", str(os.getpid()))
            joins = [f"{k}/n{n}" for n in range(self.nodes)]
            while True:
                try:
                    self.store.wait(joins, timedelta(seconds=max(0.01, min(SLICE_S, deadline.left()))))
                    self.store.set(f"{k}/done", "1")
                    return k
                except Exception as e:  # the slice ran out (or the store is gone: the next call says)
                    if "timeout" not in str(e).lower():
                        raise
                if deadline.expired():
                    missing = [n for n in range(self.nodes) if not self.store.check([f"{k}/n{n}"])]
                    raise RendezvousTimeoutError(f"{deadline.timeout(f'round {k}: nodes {missing} never joined')}")
                if int(self.store.add("round", 0)) > k:
                    break  # a node opened a newer round while this one waited: join that one

    def _open(self, k: int, cur: int) -> int:
        """Raise ``round`` (``cur`` as last read) to at least ``k`` (compare-and-set); the round to join.
        Whoever raises it wakes every node's watcher (``wake/<n>/<k>``: N keys in one request, per round)."""
        while cur < k:
            got = int(self.store.compare_set("round", str(cur), str(k)).decode())
            if got == k:
                self.store.multi_set([f"wake/{n}/{k}" for n in range(self.nodes)], [OPENED] * self.nodes)
            cur = got
        return cur

    def _watch(self, k: int) -> None:
        """One thread blocked on ``wake/<node>/<k+1>``: another node opened the next round (or this node
        stops the watch). No polling: a long wait, in slices of :data:`WATCH_SLICE_S`."""
        if self._watch_store is None:
            return
        watch, key = self._watch_store, f"wake/{self.node}/{k + 1}"

        def run() -> None:
            while self.round == k:
                try:
                    watch.wait([key], timedelta(seconds=WATCH_SLICE_S))
                except Exception as e:
                    if "timeout" in str(e).lower():
                        continue
                    if self.round == k:  # the host's store gone (its node lost): num_nodes_waiting says so
                        self._gone = str(e).splitlines()[0] if str(e) else type(e).__name__
                    return
                if self.round == k and watch.get(key) == OPENED.encode():
                    self._waiting.set()
                return

        self._watcher = threading.Thread(target=run, name=f"mft-rdzv-watch-{k}", daemon=True)
        self._watcher.start()

    def stop_watching(self, wait_s: float = 5.0) -> None:
        """Wake this node's watcher with a stop of its own (its key, nobody else's) and wait for it to
        end, at most ``wait_s``. Idempotent; called before each join and before the process exits."""
        t, self._watcher = self._watcher, None
        if t is None or not t.is_alive():
            return
        try:
            self.store.compare_set(f"wake/{self.node}/{self.round + 1}", "", STOPPED)
        except Exception:  # the store gone: the watcher's wait fails on its own
            pass
        t.join(wait_s)

    def num_nodes_waiting(self) -> int:
        """1 once another node opened the round after this node's (torchrun then restarts its workers and
        joins it), else 0: a flag, no store request. Once the watcher found the generation host's store
        gone, :class:`RendezvousConnectionError`: torchrun ends at once and its launcher moves the job to
        its next generation (torch's ``c10d`` fails the same way, on its next look at the store) - rather
        than its workers first waiting out their own bounds on the lost host's stores."""
        if self._gone is not None:
            raise RendezvousConnectionError(f"rendezvous {self.run_id}: the store at the generation's host is "
                                            f"gone ({self._gone})")
        return 1 if self._waiting.is_set() else 0

    def is_closed(self) -> bool:
        return bool(self.store.check(["closed"]))

    def set_closed(self) -> None:
        self.store.set("closed", "1")

    def shutdown(self) -> bool:
        """The job is over for this node's torchrun: the rendezvous closed for every node (as torch's
        ``c10d`` does); its watcher stopped."""
        self.stop_watching()
        try:
            self.set_closed()
            return True
        except Exception as e:  # the host's store gone first
            log.warning("node %d: could not close rendezvous %s: %s", self.node, self.run_id, e)
            return False


def create_handler(params: RendezvousParameters) -> NodeRendezvous:
    """torch's registry calls this with torchrun's rendezvous parameters: ``--rdzv-endpoint`` (the host's
    store), ``--rdzv-id``, ``--nnodes`` (min = max: the job's nodes) and from ``--rdzv-conf`` ``node``
    (this node's id), ``is_host``, ``join_timeout`` (s), ``read_timeout`` (s, each store request)."""
    if params.min_nodes != params.max_nodes:
        raise ValueError(f"the {BACKEND} rendezvous needs a fixed number of nodes, not {params.min_nodes}:"
                         f"{params.max_nodes}")
    node = params.get_as_int("node")
    if node is None:
        raise ValueError(f"the {BACKEND} rendezvous needs node=<this node's id> in --rdzv-conf")
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    is_host = bool(params.get_as_bool("is_host", False))
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    store = TCPStore(host, port, is_master=is_host, multi_tenant=True, timeout=timeout)
    watch = TCPStore(host, port, is_master=False, timeout=timeout)  # the watcher's own connection
    return NodeRendezvous(params.run_id, store, node, params.max_nodes,
                          float(params.get_as_int("join_timeout", 600) or 600), params.local_addr, watch)


def stop_all() -> None:
    """Stop every handler's watcher of this process (torchrun's ``main`` returned or raised)."""
    for h in HANDLERS:
        h.stop_watching()


def register() -> None:
    """Make ``--rdzv-backend=megatron-ft`` known to torch's rendezvous registry (once per process)."""
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:  # registered already
        pass
