"""The coordination key-value store the agents share (GEMINI's health KV store).

Embedded default: every agent hosts a store server (:mod:`.wire_store`: the project's wire, every
connection proving the job's secret) at ``endpoint(node)``, on that address only; the *root* agent's
server is the store. The root is node 0 at start; when the root's server stops
answering, every agent moves to the lowest-numbered other node whose server answers (all agents
compute the same one), that node's agent makes itself root, and everyone re-publishes its keys.
A node joining later (a replacement) asks the other nodes' servers which of them is root.

``store: etcd://host:port`` uses an external etcd cluster instead (:mod:`.etcd`); it needs no
election of a store (etcd is replicated), the root agent is then the holder of a lease-bound ``root``
key (:mod:`.etcd_liveness`: put-if-absent with the agent's lease, gone with it).

The root serves its own calls from its map in process (:class:`~.wire_store.LocalKV`: no TCP to
itself; its monitor reads every heartbeat there) and keeps the job record there
(:class:`~.job_record.RecordKeeper`, derived from the keys as they are set and deleted).

Keys (all under ``mft/<run_id>/``): ``root`` (node id), ``addr/<node>`` (peer transport
``host:port``), ``hb/<node>`` (heartbeat JSON), ``failed/<node>`` (root's failure verdict JSON),
``claim/<node>/<failed agent pid>`` (the standby launcher that took the failed node's place),
``job/*`` (the job record, :mod:`.job_record`).
"""
from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from typing import Optional

from ..clock import Deadline
from . import fencing
from .etcd import EtcdKV, EtcdStore, EtcdTLS
from .job_record import JobView, RecordKeeper
from .job_view_etcd import EtcdJobView
from .kv import KV, StoreUnavailable
from .wire_store import KVServer, LocalKV, WireKV

__all__ = ["KV", "StoreUnavailable", "EmbeddedStore", "StoreClient", "make_store", "job_view"]

log = logging.getLogger("megatron_ft.health")


#: how long asking another node's server whether it is the root may take: short, and retried with
#: jitter (a loaded machine answers the next probe), so that agents asking each other at once during a
#: failover do not wait out long timeouts in lockstep
PROBE_TIMEOUT_S = 1.0


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def endpoint(hosts, base_port: int, node: int) -> tuple[str, int]:
    """Node ``node``'s embedded store server: ``hosts[node]:port`` on real clusters; one machine
    (no hosts): ``127.0.0.1:port + node``."""
    if hosts:
        return hosts[node], base_port
    return "127.0.0.1", base_port + node


#: a probe's answers (:func:`probe_node`): the node's server holds the root key naming itself; its agent
#: follows the node in ``follows``; it answers knowing neither (an agent starting); it does not answer
ROOT, ANSWERS, SILENT = "root", "answers", "silent"
#: the key a following agent sets in its *own* server: the root it follows (a hint for whoever asks it)
FOLLOWS_KEY = "follows"


def probe_node(hosts, base_port: int, node: int, prefix: str, timeout_s: float,
               secret: Optional[bytes]) -> "str | int":
    """What node ``node``'s server says of the root: :data:`ROOT` (it is the root), the node id its
    agent follows, :data:`ANSWERS` (neither) or :data:`SILENT` (no answer within ``timeout_s``:
    refused, unreachable or too slow). One connection, at most two requests."""
    try:
        kv = WireKV(*endpoint(hosts, base_port, node), prefix, timeout_s, secret)
    except StoreUnavailable:
        return SILENT
    try:
        v = kv.get("root")
        if v is not None and int(v) == node:
            return ROOT
        f = kv.get(FOLLOWS_KEY)
        return int(f) if f is not None else ANSWERS
    except (StoreUnavailable, ValueError):
        return SILENT
    finally:
        kv.close()


def find_root(ask, nodes: int, first: int = 0, exclude=()) -> Optional[int]:
    """The root node, found by asking as few servers as possible (pure: ``ask(j)`` is
    :func:`probe_node` for node j); None: not known yet (ask again later).

    Starting at ``first`` (the root last known, else node 0) and going on in node order, silent
    nodes are passed over; the first node that answers ends the search: it is the root, or names the
    root its agent follows (asked once to confirm), or knows none (an agent starting: the root is
    being chosen). A named root that is silent, excluded (``exclude``: this node, a root being
    replaced) or does not confirm means the root is slow or moving: None, rather than asking every
    other node (a slow root must not set every agent asking every node: N agents x N probes).
    Cost: one probe per silent node before the first answering one, plus at most two.

    >>> answers = {0: "silent", 1: 2, 2: "root", 3: 2}
    >>> asked = []
    >>> find_root(lambda j: asked.append(j) or answers[j], 4), asked
    (2, [0, 1, 2])
    >>> find_root(lambda j: {0: "silent", 1: 0, 2: 0}[j], 3) is None   # node 0 slow: ask again later
    True
    """
    asked: set[int] = set()
    for j in [first, *(j for j in range(nodes) if j != first)]:
        if j in exclude:
            continue
        a = ask(j)
        asked.add(j)
        if a == SILENT:
            continue
        if a == ROOT:
            return j
        if a == ANSWERS or a in exclude or a in asked:
            return None
        return a if ask(a) == ROOT else None
    return None


class WatchConnections:
    """The connections an agent's long polls on the root use: one per watch in progress, kept idle for the
    next, so that there are never more than the most watches at once (a thread per restore must not mean a
    root connection per restore). Thread-safe; ``client(node)`` opens a connection to node ``node``'s server.

    :meth:`reserve` keeps ``n`` of them open to every root from the moment it is followed, so that the
    watches an agent runs at most at once (the agreement's verdict and a restore's decision) borrow one
    instead of opening one: without it, every node's first restore after a node loss opens a root
    connection at the same moment - N authenticated handshakes in one burst at the root (at 2,048
    simulated nodes the root's handshakes timed out). Best effort: one that cannot be opened now is
    opened by the watch that needs it."""

    def __init__(self, client):
        self._client = client
        self._lock = threading.Lock()
        self._idle: list[tuple[int, WireKV]] = []
        self._all: list[tuple[int, WireKV]] = []  # closed with the store
        self.reserved = 0

    def reserve(self, n: int, root: int) -> None:
        """From now on keep ``n`` open to the root; open them now to ``root`` (-1: no root to open them to)."""
        self.reserved = n
        self.open_reserved(root)

    def open_reserved(self, root: int) -> None:
        """Open connections to ``root`` until :attr:`reserved` exist (-1: none)."""
        if root < 0:
            return
        with self._lock:
            missing = self.reserved - sum(1 for r, _ in self._all if r == root)
        for _ in range(missing):
            try:
                kv = self._client(root)
            except StoreUnavailable as e:
                log.debug("a watch connection to the root (node %d) not opened now: %s", root, e)
                return
            with self._lock:
                self._all.append((root, kv))
                self._idle.append((root, kv))

    def borrow(self, root: int) -> WireKV:
        """An idle connection to ``root``, or a new one (idle ones to an earlier root are closed)."""
        with self._lock:
            while self._idle:
                r, kv = self._idle.pop()
                if r == root:
                    return kv
                self._all.remove((r, kv))
                kv.close()
        kv = self._client(root)
        with self._lock:
            self._all.append((root, kv))
        return kv

    def give_back(self, root: int, kv: WireKV) -> None:
        with self._lock:
            self._idle.append((root, kv))

    def drop(self, kv: WireKV) -> None:
        """A connection that failed: closed and forgotten."""
        kv.close()
        with self._lock:
            self._all = [(r, c) for r, c in self._all if c is not kv]

    def count(self) -> int:
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        with self._lock:
            conns, self._all, self._idle = self._all, [], []
        for _, kv in conns:
            kv.close()


class EmbeddedStore:
    """This agent's own store server plus a client of the root's, with root failover. ``secret``: the
    job's (every connection to every node's server proves it)."""

    def __init__(self, run_id: str, node: int, nodes: int, hosts: list[str], port: int, timeout_s: float = 5.0,
                 secret: Optional[bytes] = None, bind: Optional[str] = None, adopted: bool = False):
        self.node, self.nodes, self.timeout_s = node, nodes, timeout_s
        self.hosts = hosts
        self.base_port = port
        self.secret = secret
        self.prefix = f"mft/{run_id}/"
        # a node served from a host other than its configured one (a standby took its place): the others
        # look for the store only under the configured names, so it never becomes the root
        self.adopted = adopted
        # on the address the other nodes reach it at (its host's name or its interface's address; one
        # machine: loopback), nowhere else
        host, p = self.endpoint(node)
        self._server = KVServer((bind or host, p), secret).start()
        # the job record, kept by whichever server is the root's (its epoch: this server's)
        RecordKeeper(nodes, f"{node}/{os.getpid()}/{time.time():.6f}").install(self._server, self.prefix)
        # a standby's claim fences the claimed agent's writes, in the same step (:mod:`.fencing`)
        self.derive(fencing.CLAIM_PREFIX, fencing.derive_fences)
        self.fence = fencing.Fence()  # armed by the agent (:meth:`fence_as`); a launcher's writes are not fenced
        self.root = -1
        self.kv: Optional[WireKV | LocalKV] = None
        self.published: dict[str, str] = {}  # re-set on the new root after a failover
        self._lock = threading.RLock()
        self.watchers = WatchConnections(self._client)  # watch()'s connections to the root

    def endpoint(self, node: int) -> tuple[str, int]:
        return endpoint(self.hosts, self.base_port, node)

    def _client(self, node: int) -> WireKV:
        host, p = self.endpoint(node)
        return WireKV(host, p, self.prefix, self.timeout_s, self.secret)

    def _probe(self, node: int) -> "str | int":
        return probe_node(self.hosts, self.base_port, node, self.prefix, min(self.timeout_s, PROBE_TIMEOUT_S),
                          self.secret)

    def _find_root(self, exclude=()) -> Optional[int]:
        return find_root(self._probe, self.nodes, max(self.root, 0), {self.node, *exclude})

    def _use(self, kv: WireKV | LocalKV) -> None:
        """``kv`` is the client of the root's server from now on (the previous one closed)."""
        if self.kv is not None and self.kv is not kv:
            self.kv.close()
        self.kv = kv

    def connect(self, deadline_s: float = 60.0) -> int:
        """Find (or become) the root; returns the root node id. A store that does not answer in time
        (a root moving, a machine loaded by a whole node starting) is asked again until ``deadline_s``."""
        deadline = Deadline(deadline_s, "the root agent")
        why = f"no root agent found among {self.nodes} nodes"
        while True:
            try:
                j = self._find_root()
                if j is not None:
                    return self._follow(j)
                if not self.adopted and (self.node == 0 or (self.root >= 0 and self._next_root_is_me())):
                    return self._become_root()
            except StoreUnavailable as e:
                why = str(e)
                log.warning("node %d: %s; asking again", self.node, why)
            if not deadline.pause(random.uniform(0.1, 0.3)):  # a back-off, jittered: not every agent at once
                raise StoreUnavailable(f"node {self.node}: no root agent within {deadline_s:g} s: {why}")

    def _next_root_is_me(self) -> bool:
        """After the root failed: am I the lowest-numbered node (other than the failed root)
        whose server answers?"""
        for j in range(self.nodes):
            if j == self.root or (j == self.node and self.adopted):
                continue
            if j == self.node:
                return True
            if port_open(*self.endpoint(j)):
                return False
        return False

    def _become_root(self) -> int:
        with self._lock:
            self._use(self._server.local(self.prefix))  # its own map, in process: no TCP to itself
            self.kv.delete(FOLLOWS_KEY)  # type: ignore[union-attr]
            self.kv.set("root", str(self.node))  # type: ignore[union-attr]
            self.root = self.node
            log.warning("node %d: this agent is the root (store at %s:%d)", self.node, *self.endpoint(self.node))
            self._republish()
            return self.node

    def _follow(self, j: int) -> int:
        with self._lock:
            self._use(self._client(j))
            self._server.local(self.prefix).set(FOLLOWS_KEY, str(j))  # for whoever asks this node's server
            if self.root != j:
                log.info("node %d: root agent is node %d", self.node, j)
            self.root = j
            self._republish()
            self.watchers.open_reserved(j)
            return j

    def fence_as(self, pid: int, on_fenced) -> None:
        """Every write of this store from now on is agent ``pid``'s of this node: refused once a standby
        claimed the node after a verdict on that agent; ``on_fenced(why)`` then, once (:mod:`.fencing`)."""
        self.fence.arm(self.node, pid, on_fenced)

    def _republish(self) -> None:
        for k, v in self.published.items():
            try:
                self.kv.set(k, v, fence=self.fence.key)  # type: ignore[union-attr]
            except fencing.Fenced as e:
                self.fence.refused(e)

    def failover(self) -> int:
        """The root's store stopped answering: elect the next root and reconnect."""
        with self._lock:
            old = self.root
            log.warning("node %d: root agent (node %d) unreachable; electing a new root", self.node, old)
            deadline = Deadline(10 * self.timeout_s, "a new root")
            while not deadline.expired():
                try:
                    if self._next_root_is_me():
                        return self._become_root()
                    j = self._find_root(exclude=(old,))
                    if j is not None:
                        return self._follow(j)
                except StoreUnavailable as e:  # a store slow to answer while the others move too: again
                    log.warning("node %d: %s; asking again", self.node, e)
                deadline.pause(random.uniform(0.1, 0.3))
            raise StoreUnavailable(f"node {self.node}: no new root after node {old} failed")

    def _reconnect(self) -> None:
        """The root's connection broke: the same root again if its server still says it is the root
        (a restarted root agent that took the role back), else elect a new one. An answer on the root's
        address alone is not enough: a replacement agent serves its own store there and follows the
        new root."""
        with self._lock:
            if self.root == self.node:
                self._become_root()
            elif self.root >= 0 and self._probe(self.root) == ROOT:
                self._follow(self.root)
            else:
                self.failover()

    def _do(self, fn):
        for attempt in range(2):
            kv = self.kv
            try:
                if kv is None:
                    raise StoreUnavailable("not connected")
                return fn(kv)
            except fencing.Fenced as e:
                self.fence.refused(e)
            except StoreUnavailable:
                if attempt:
                    raise
                self._reconnect()

    def publish(self, key: str, value: str) -> None:
        """Set a key this node owns (kept and re-set on a new root after a failover)."""
        with self._lock:
            self.published[key] = value
        self._do(lambda kv: kv.set(key, value, fence=self.fence.key))

    def set(self, key: str, value: str) -> None:
        """Set ``key`` at the root (fenced once :meth:`fence_as` armed it: :class:`~.fencing.Fenced`);
        likewise :meth:`compare_set`, :meth:`delete`."""
        self._do(lambda kv: kv.set(key, value, fence=self.fence.key))

    def get(self, key: str) -> Optional[str]:
        return self._do(lambda kv: kv.get(key))

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self._do(lambda kv: kv.compare_set(key, expected, desired, fence=self.fence.key))

    def delete(self, key: str) -> None:
        self._do(lambda kv: kv.delete(key, fence=self.fence.key))

    def watch(self, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
        """The key's value at the root once it differs from ``value``, or after ``wait_s`` unchanged
        (a long poll on a connection of the calling thread's own, so that it blocks no other call).
        A root that does not answer raises :class:`StoreUnavailable` (the caller asks again later, when
        :meth:`get` and the other calls have found the new root). The root itself waits on its map."""
        root = self.root
        if root == self.node:
            return self._server.local(self.prefix).watch(key, value, wait_s)
        kv = self.watchers.borrow(root)
        try:
            got = kv.watch(key, value, wait_s)
        except StoreUnavailable:
            self.watchers.drop(kv)
            raise
        self.watchers.give_back(root, kv)
        return got

    def reserve_watchers(self, n: int) -> None:
        """Keep ``n`` watch connections to the root open from now on (:meth:`WatchConnections.reserve`)."""
        with self._lock:
            self.watchers.reserve(n, self.root if self.root != self.node else -1)

    def derive(self, prefix: str, fn) -> None:
        """Keys this node's own server derives when it is the root (:meth:`KVServer.derive`; ``prefix``
        under the job's)."""
        self._server.derive(self.prefix + prefix, lambda k, v: {self.prefix + dk: dv for dk, dv in fn(k, v).items()})

    @property
    def is_root(self) -> bool:
        return self.root == self.node

    def close(self) -> None:
        """Stop this node's server and close the client (the agent's end)."""
        self.watchers.close()
        if self.kv is not None:
            self.kv.close()
        self._server.close()


def job_view(store, nodes: int) -> "JobView | EtcdJobView":
    """The job record's reader on ``store`` (an :class:`EmbeddedStore`, :class:`EtcdStore`,
    :class:`StoreClient` or :class:`EtcdKV`): the record the root keeps on the embedded store, the keys' own events folded
    by the reader on etcd."""
    kv = store if isinstance(store, EtcdKV) else getattr(store, "kv", None)
    return EtcdJobView(kv, nodes) if isinstance(kv, EtcdKV) else JobView(store, nodes)


def store_needed(cfg) -> bool:
    """Whether the job's agents run the coordination store (heartbeats, failure verdicts, the rendezvous
    record): every job of more than one node, whatever ``redundancy.scheme`` says - the rendezvous
    moves off a lost host and an orphaned agent learns that the job ended through it - and every job
    with peer redundancy."""
    return cfg.cluster.nodes > 1 or cfg.redundancy.scheme != "none"


def make_store(cfg, node: int, secret: Optional[bytes]):
    """The store an agent of node ``node`` joins, from ``cfg.health`` (an :class:`FTConfig`); ``secret``:
    the job's (the embedded store's connections prove it)."""
    from .. import network

    h = cfg.health
    if h.store.startswith("etcd://"):
        return EtcdStore(h.store, cfg.run_id, node, cfg.cluster.nodes, h.timeout_s, EtcdTLS.of(h))
    hosts = h.host_list(cfg.cluster.nodes)
    return EmbeddedStore(cfg.run_id, node, cfg.cluster.nodes, hosts, h.store_port, h.timeout_s, secret,
                         bind=network.listen_address(cfg, node) if hosts else None,
                         adopted=network.adopted(cfg, node))


class StoreClient:
    """A client of the job's store for a process that is no agent (a standby launcher, an
    operator's tool): with the embedded store it finds the root agent's server the way
    :meth:`EmbeddedStore.connect` does and finds it again when the root moves; with etcd it talks
    to etcd. Methods: get, set, compare_set, delete (:class:`KV`). The job's secret comes from the
    configuration (``security.secret_file``, else ``MFT_JOB_SECRET_FILE``: the launcher names it in the
    node's configuration file)."""

    def __init__(self, cfg, timeout_s: Optional[float] = None):
        from ..transport.credential import configured_secret

        h = cfg.health
        self.cfg, self.timeout_s = cfg, timeout_s if timeout_s is not None else h.timeout_s
        self.secret = configured_secret(cfg, os.environ)
        self.prefix = f"mft/{cfg.run_id}/"
        self.kv: Optional[KV] = None
        self.root = -1
        self._watcher: Optional[tuple[int, WireKV]] = None  # (root, its connection for watch)
        if h.store.startswith("etcd://"):
            self.kv = EtcdKV(h.store, self.prefix, self.timeout_s, EtcdTLS.of(h))
        self.hosts = h.host_list(cfg.cluster.nodes)
        self.where = h.store if self.kv is not None else (
            f"embedded store (node servers from {':'.join(map(str, endpoint(self.hosts, h.store_port, 0)))})")

    def connect(self, deadline_s: float = 60.0) -> "StoreClient":
        deadline = Deadline(deadline_s, "the root agent")
        if self.cfg.health.store.startswith("etcd://"):
            self.kv.wait_ready(deadline_s)  # type: ignore[union-attr]
            return self
        h = self.cfg.health
        probe = lambda j: probe_node(self.hosts, h.store_port, j, self.prefix,  # noqa: E731
                                     min(self.timeout_s, PROBE_TIMEOUT_S), self.secret)
        while True:
            j = find_root(probe, self.cfg.cluster.nodes, max(self.root, 0))
            if j is not None:
                self.kv, self.root = WireKV(*endpoint(self.hosts, h.store_port, j), self.prefix,
                                            self.timeout_s, self.secret), j
                return self
            if not deadline.pause(random.uniform(0.1, 0.3)):  # a back-off, jittered: not every client at once
                raise StoreUnavailable(f"no root agent answered within {deadline_s:g} s ({self.where}, "
                                       f"{self.cfg.cluster.nodes} nodes)")

    def _do(self, fn):
        try:
            if self.kv is None:
                self.connect(10 * self.timeout_s)
            return fn(self.kv)
        except StoreUnavailable:
            if self.cfg.health.store.startswith("etcd://"):
                raise
            if self.kv is not None:
                self.kv.close()  # type: ignore[union-attr]
            self.kv = None  # the root moved (embedded): find it again, once
            self.connect(10 * self.timeout_s)
            return fn(self.kv)

    def get(self, key: str) -> Optional[str]:
        return self._do(lambda kv: kv.get(key))

    def set(self, key: str, value: str) -> None:
        self._do(lambda kv: kv.set(key, value))

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self._do(lambda kv: kv.compare_set(key, expected, desired))

    def delete(self, key: str) -> None:
        self._do(lambda kv: kv.delete(key))

    def watch(self, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
        """The key's value once it differs from ``value``, or after ``wait_s`` unchanged (a long poll;
        embedded: on a connection to the root of its own, so that the other calls of this client do not
        wait behind it - one caller at a time; etcd: a range read and a watch stream). A root that stops
        answering is a :class:`StoreUnavailable`; the next call finds the new root."""
        if self.cfg.health.store.startswith("etcd://"):
            from .etcd import watch_key

            return watch_key(self.kv, key, value, wait_s)  # type: ignore[arg-type]
        if self.kv is None:
            self.connect(10 * self.timeout_s)
        if self._watcher is None or self._watcher[0] != self.root:
            if self._watcher is not None:
                self._watcher[1].close()
            self._watcher = (self.root, WireKV(*endpoint(self.hosts, self.cfg.health.store_port, self.root),
                                               self.prefix, self.timeout_s, self.secret))
        try:
            return self._watcher[1].watch(key, value, wait_s)
        except StoreUnavailable:
            self._watcher[1].close()
            self._watcher = None
            if self.kv is not None:  # the root moved, probably: the next call looks for it again
                self.kv.close()  # type: ignore[union-attr]
                self.kv = None
            raise

    def close(self) -> None:
        """Close the connections (etcd: end the watch streams open now)."""
        if self._watcher is not None:
            self._watcher[1].close()
            self._watcher = None
        if self.kv is not None:
            self.kv.close()  # type: ignore[union-attr]
            if not self.cfg.health.store.startswith("etcd://"):
                self.kv = None
