"""The embedded coordination store's server and client: a key-value map served on the project's wire
(:mod:`megatron_ft.transport.wire`), so that every TCP connection to it proves the job's secret before
its first operation, and the server listens on the node's own address only.

Each agent serves one (:class:`KVServer`); the root agent's is the job's store
(:mod:`megatron_ft.health.store` elects it). Keys and values are UTF-8 strings, bounded:

==============  ==========================  =====================================================
op              request                     reply
==============  ==========================  =====================================================
get             key                         value (``null``: absent)
set             key, value                  -
compare_set     key, expected, desired      value afterwards (``""``: absent); ``expected == ""``
                                            means "only if absent" (etcd's and the KV protocol's rule)
delete          key                         -
watch           key, value, wait_s          the key's value once it differs from ``value`` (``null``:
                                            absent), or after ``wait_s`` unchanged: a long poll, so a
                                            waiter learns of a change at once without polling
==============  ==========================  =====================================================

``set``, ``compare_set`` and ``delete`` may name a ``fence`` key: the write applies only while that key
is absent, else the reply is ``{"fenced": <its value>}`` and nothing changes (an agent whose node a
standby claimed, :mod:`.fencing`); the clients raise :class:`~.fencing.Fenced` for it.

An owner of a server may *derive* keys (:meth:`KVServer.derive`): a function called, under the map's
lock, with every ``set`` of a key under a given prefix (and, if it asks, every ``delete``), whose
returned keys are set in the same step (the root agent's job-wide agreement and the job record,
:mod:`.job_record`, are computed this way, in process, as the nodes' keys arrive).

The server's own process reads and writes its map without the wire (:class:`LocalKV`: the same rules,
the same lock, the same derived keys; counted as ``"local <op>"``): the root agent's store calls,
its monitor's reads of every heartbeat included, cost no TCP round trip to itself.

A key is at most :data:`KEY_MAX` bytes, a value :data:`VALUE_MAX`; a server holds at most
:data:`KEYS_MAX` keys and :data:`BYTES_MAX` bytes of keys and values (a ``set`` beyond either is
refused). A node holds about ten keys at once (``hb``, ``addr``, ``size``, ``failed``, ``software``,
``agree``, ``stall``, ``fatal``, a reduction's, one ``claim`` per verdict on it), the job a few more
(``root``, ``rdzv``, ``ended``, ``agreed``, ``hang``, ``last_verdict``, ``job/*``: 2 + 2 per 512 nodes):
16 per node at 16,384 nodes fit :data:`KEYS_MAX`; their values are mostly under 200 bytes (``size``:
20 per rank), about 50 MB at that size, well inside :data:`BYTES_MAX` (256 MiB, the map's memory bound
whatever the clients send). The map lives in the agent's memory only: a new root is re-filled by the
agents' re-publishing (:class:`~.store.EmbeddedStore`).

    >>> server = KVServer(("127.0.0.1", 0), secret=b"s" * 32).start()
    >>> kv = WireKV(*server.address, "mft/run/", timeout_s=2.0, secret=b"s" * 32)
    >>> kv.compare_set("root", "", "0"), kv.compare_set("root", "", "1"), kv.get("root")
    ('0', '0', '0')
    >>> kv.delete("root"); kv.get("root") is None
    True
    >>> try:
    ...     WireKV(*server.address, "mft/run/", timeout_s=2.0, secret=b"x" * 32)
    ... except StoreUnavailable as e:
    ...     print(str(e).split(": ", 1)[1])
    the connection was refused before any operation (does this process hold the job's secret? security.secret_file)
    >>> kv.close(); server.close()
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Annotated, Callable, Optional

from pydantic import Field, StrictFloat, StrictStr

from ..transport import wire
from ..transport.messages import Messages, Request
from .fencing import Fenced
from .kv import StoreUnavailable

log = logging.getLogger("megatron_ft.health")

KEY_MAX = 512
VALUE_MAX = 64 << 10
#: keys one server holds: 16 per node at 16,384 nodes (see the module)
KEYS_MAX = 1 << 18
#: bytes of keys and values one server holds (the map's memory bound)
BYTES_MAX = 1 << 28

Key = Annotated[StrictStr, Field(min_length=1, max_length=KEY_MAX)]
Value = Annotated[StrictStr, Field(max_length=VALUE_MAX)]


class Get(Request):
    key: Key


class Set(Request):
    key: Key
    value: Value
    fence: Optional[Key] = None  # applied only while this key is absent (:mod:`.fencing`)


class CompareSet(Request):
    key: Key
    expected: Value
    desired: Value
    fence: Optional[Key] = None


class Delete(Request):
    key: Key
    fence: Optional[Key] = None


#: the longest a ``watch`` may wait (the client's bound is its timeout plus this)
WATCH_MAX_S = 60.0


class Watch(Request):
    key: Key
    value: Optional[Value] = None  # the value the waiter knows (None: absent)
    wait_s: Annotated[StrictFloat, Field(ge=0.0, le=WATCH_MAX_S)]


#: the coordination store's protocol
STORE_MESSAGES = Messages("store", {"get": Get, "set": Set, "compare_set": CompareSet, "delete": Delete,
                                    "watch": Watch})

#: a derived key's function: (key under the prefix, new value; None: deleted, for a function that asked
#: for deletes) -> keys to set with it (full keys; a value None deletes the key, e.g. the one just set once
#: the function has absorbed it)
Derive = Callable[[str, Optional[str]], dict[str, Optional[str]]]


class _Map:
    """The store's map and its rules (a :class:`~megatron_ft.transport.wire.Handler` for the wire, and
    :meth:`apply` for its own process); one lock, held only while the map is read or changed."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.nbytes = 0  # keys and values held, in characters (bounded by BYTES_MAX)
        self._lock = threading.Lock()
        self._changed: dict[str, threading.Condition] = {}  # key -> its waiters (only keys watched)
        self._derived: list[tuple[str, Derive, bool]] = []  # (prefix, function, called on deletes too)
        # requests served, by op and by "op family" (the key's first part under the job's prefix, e.g.
        # "set agree", "watch agreed"; a watch that ended unchanged also as "watch-timeout <family>"; the
        # server's own process's calls as "local get", "local get hb"): the scale benchmark counts the
        # store's messages with it (benchmarks/scale.py)
        self.ops: collections.Counter = collections.Counter()

    def handle(self, conn: wire.Connection, msg: dict) -> dict:
        req = STORE_MESSAGES.parse(msg)
        return self.apply(req, "")

    def apply(self, req: Request, via: str) -> dict:
        """One validated request; ``via``: ``""`` from the wire, ``"local "`` from this process (counted
        apart). A ``set`` beyond :data:`KEYS_MAX` or :data:`BYTES_MAX` raises ValueError naming the key."""
        family = req.key.split("/")[2] if req.key.count("/") >= 2 else req.key
        with self._lock:
            self.ops[via + req.op] += 1
            self.ops[f"{via}{req.op} {family}"] += 1
            if isinstance(req, Watch):
                value = self._wait_locked(req.key, req.value, req.wait_s)
                if value == req.value:
                    self.ops[f"{via}watch-timeout {family}"] += 1
                return {"value": value}
            if isinstance(req, Get):
                return {"value": self.data.get(req.key)}
            fence = getattr(req, "fence", None)
            if fence is not None and fence in self.data:  # the writer's node was claimed: nothing changes
                self.ops[f"{via}fenced"] += 1
                return {"fenced": self.data[fence]}
            if isinstance(req, Delete):
                self._pop(req.key)
                return {}
            if isinstance(req, Set):
                self._put(req.key, req.value)
                return {}
            assert isinstance(req, CompareSet)
            cur = self.data.get(req.key)
            if (cur is None and req.expected == "") or (cur is not None and cur == req.expected):
                self._put(req.key, req.desired)
                cur = req.desired
            return {"value": cur or ""}

    def _store(self, key: str, value: str) -> None:
        old = self.data.get(key)
        self.nbytes += len(value) - (len(old) if old is not None else -len(key))
        self.data[key] = value

    def _put(self, key: str, value: str) -> None:
        old = self.data.get(key)
        if old is None and len(self.data) >= KEYS_MAX:
            raise ValueError(f"store holds {KEYS_MAX} keys already (KEYS_MAX): {key!r} refused")
        grow = len(value) - (len(old) if old is not None else -len(key))
        if grow > 0 and self.nbytes + grow > BYTES_MAX:
            raise ValueError(f"store holds {self.nbytes} bytes already (BYTES_MAX {BYTES_MAX}): {key!r} "
                             f"of {len(value)} bytes refused")
        self._store(key, value)
        self._notify(key)
        self._derive(key, value)

    def _pop(self, key: str) -> None:
        old = self.data.pop(key, None)
        if old is None:
            return
        self.nbytes -= len(key) + len(old)
        self._notify(key)
        self._derive(key, None)

    def _derive(self, key: str, value: Optional[str]) -> None:
        for prefix, fn, deletes in self._derived:
            if key.startswith(prefix) and (value is not None or deletes):
                for k, v in fn(key[len(prefix):], value).items():
                    if v is None:  # the function absorbed the key (or an old one): gone
                        old = self.data.pop(k, None)
                        if old is not None:
                            self.nbytes -= len(k) + len(old)
                            self._notify(k)
                    elif self.data.get(k) != v:
                        self._store(k, v)
                        self._notify(k)

    def _notify(self, key: str) -> None:
        cond = self._changed.get(key)
        if cond is not None:
            cond.notify_all()

    def _wait_locked(self, key: str, known: Optional[str], wait_s: float) -> Optional[str]:
        """The key's value once it differs from ``known``, or after ``wait_s`` (lock held; released
        while waiting)."""
        cond = self._changed.get(key)
        if cond is None:
            cond = self._changed[key] = threading.Condition(self._lock)
        deadline = time.monotonic() + wait_s
        while self.data.get(key) == known:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cond.wait(left)
        return self.data.get(key)

    def derive(self, prefix: str, fn: Derive, deletes: bool = False) -> None:
        with self._lock:
            self._derived.append((prefix, fn, deletes))

    def closed(self, conn: wire.Connection) -> None:
        pass


class KVServer:
    """A store server on ``address`` (``(host, port)``: the node's own address, never a wildcard);
    ``secret``: the job's, which every connection must prove (None only where nothing but this process
    can connect, as in tests). ``start()`` serves on threads; ``close()`` stops."""

    def __init__(self, address: tuple[str, int], secret: Optional[bytes]):
        self._map = _Map()
        self._server = wire.Server(address, self._map, "store", secret=secret)
        self.address = self._server.address

    def start(self) -> "KVServer":
        self._server.start()
        return self

    def derive(self, prefix: str, fn: Derive, deletes: bool = False) -> None:
        """Call ``fn(key after prefix, value)`` under the map's lock with every ``set`` of a key under
        ``prefix`` (full key, the job's prefix included) and, with ``deletes``, every ``delete`` of one
        that existed (``value`` None); the keys it returns are set (None: deleted) in the same step (their
        watchers woken). ``fn`` must be quick and do no I/O: the map waits for it."""
        self._map.derive(prefix, fn, deletes)

    def local(self, prefix: str) -> "LocalKV":
        """A client of this server's map in this process (no wire; see :class:`LocalKV`)."""
        return LocalKV(self._map, prefix, f"{self.address[0]}:{self.address[1]}")

    def op_counts(self) -> dict[str, int]:
        """Requests this server has served: by op (``"set"``) and by op and key family (``"set agree"``,
        ``"watch agreed"``, ``"watch-timeout agreed"`` for a watch that ended unchanged). A copy."""
        with self._map._lock:
            return dict(self._map.ops)

    def close(self) -> None:
        self._server.close()


def _fenced(reply: dict, fence: Optional[str], where: str) -> dict:
    """``reply`` unless it says the write was fenced (then :class:`~.fencing.Fenced`)."""
    if "fenced" in reply:
        raise Fenced(fence or "", str(reply["fenced"]), where)
    return reply


def _writes(fence: Optional[str], prefix: str) -> dict:
    return {"fence": prefix + fence} if fence is not None else {}


class LocalKV:
    """The :class:`WireKV` interface on a server's map from the server's own process: each call applies
    the same validated request under the same lock (derived keys included) with no connection, counted
    as ``"local <op>"`` in :meth:`KVServer.op_counts`. A key or value beyond the limits, or a map that is
    full, is a :class:`StoreUnavailable` naming the server and the value, as through the wire. A
    ``watch`` blocks the calling thread only (the map's condition, not its lock, is waited on)."""

    def __init__(self, m: _Map, prefix: str, where: str):
        self._map, self.prefix, self.where = m, prefix, where

    def _request(self, op: str, **fields) -> dict:
        try:
            req = STORE_MESSAGES.parse({"op": op, **fields})
            return self._map.apply(req, "local ")
        except ValueError as e:
            raise StoreUnavailable(f"store at {self.where} (in process): {e}") from None

    def get(self, key: str) -> Optional[str]:
        with self._map._lock:  # the hot path (the root's monitor reads every heartbeat): no model built
            full = self.prefix + key
            self._map.ops["local get"] += 1
            self._map.ops[f"local get {full.split('/')[2] if full.count('/') >= 2 else full}"] += 1
            return self._map.data.get(full)

    def set(self, key: str, value: str, fence: Optional[str] = None) -> None:
        _fenced(self._request("set", key=self.prefix + key, value=value, **_writes(fence, self.prefix)), fence,
                self.where)

    def compare_set(self, key: str, expected: str, desired: str, fence: Optional[str] = None) -> str:
        return _fenced(self._request("compare_set", key=self.prefix + key, expected=expected, desired=desired,
                                     **_writes(fence, self.prefix)), fence, self.where)["value"]

    def delete(self, key: str, fence: Optional[str] = None) -> None:
        _fenced(self._request("delete", key=self.prefix + key, **_writes(fence, self.prefix)), fence, self.where)

    def watch(self, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
        return self._request("watch", key=self.prefix + key, value=value,
                             wait_s=float(min(wait_s, WATCH_MAX_S))).get("value")

    def close(self) -> None:
        pass


class WireKV:
    """A client of one store server (keys prefixed; thread-safe). It connects when made, so that a
    server that is not there (or refuses this process) shows at once; every failure afterwards - a
    broken connection included: it is not re-opened - is a :class:`StoreUnavailable` naming the
    server. Each operation is bounded by ``timeout_s``."""

    def __init__(self, host: str, port: int, prefix: str, timeout_s: float = 5.0, secret: Optional[bytes] = None):
        self.host, self.port, self.prefix = host, port, prefix
        # never re-opened behind the caller's back: a new server at this address (a replacement agent
        # taking a lost node's port) is not the store this client was connected to, and its caller
        # (EmbeddedStore, StoreClient) looks for the root again when a call fails
        self._client = wire.Client((host, port), timeout_s, secret=secret, reconnects=0)
        self._call(self._client.connect)

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except wire.AuthError:
            raise StoreUnavailable(f"store at {self.host}:{self.port}: the connection was refused before any "
                                   "operation (does this process hold the job's secret? security.secret_file)") from None
        except (OSError, wire.WireError, wire.RemoteError, ValueError) as e:
            raise StoreUnavailable(f"store at {self.host}:{self.port}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def _request(self, op: str, **fields) -> dict:
        return self._call(self._client.request, op, **fields)

    def get(self, key: str) -> Optional[str]:
        return self._request("get", key=self.prefix + key).get("value")

    def set(self, key: str, value: str, fence: Optional[str] = None) -> None:
        """``fence`` (here and in :meth:`compare_set`, :meth:`delete`): a key that must be absent for the
        write to apply, else :class:`~.fencing.Fenced` (:mod:`.fencing`)."""
        _fenced(self._request("set", key=self.prefix + key, value=value, **_writes(fence, self.prefix)), fence,
                f"{self.host}:{self.port}")

    def compare_set(self, key: str, expected: str, desired: str, fence: Optional[str] = None) -> str:
        return _fenced(self._request("compare_set", key=self.prefix + key, expected=expected, desired=desired,
                                     **_writes(fence, self.prefix)), fence, f"{self.host}:{self.port}")["value"]

    def delete(self, key: str, fence: Optional[str] = None) -> None:
        _fenced(self._request("delete", key=self.prefix + key, **_writes(fence, self.prefix)), fence,
                f"{self.host}:{self.port}")

    def watch(self, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
        """The key's value once it differs from ``value``, or after ``wait_s`` (at most
        :data:`WATCH_MAX_S`) unchanged. Blocks this client's connection meanwhile: use one of its own."""
        return self._request("watch", key=self.prefix + key, value=value, wait_s=float(min(wait_s, WATCH_MAX_S))
                             ).get("value")

    def close(self) -> None:
        self._client.close()
