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

An owner of a server may *derive* keys (:meth:`KVServer.derive`): a function called, under the map's
lock, with every ``set`` of a key under a given prefix, whose returned keys are set in the same step
(the root agent's job-wide agreement is computed this way, in process, as the nodes' reports arrive).

A key is at most :data:`KEY_MAX` bytes, a value :data:`VALUE_MAX`; a server holds at most
:data:`KEYS_MAX` keys (a ``set`` of a new key beyond that is refused). The map lives in the agent's
memory only: a new root is re-filled by the agents' re-publishing (:class:`~.store.EmbeddedStore`).

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
from .kv import StoreUnavailable

log = logging.getLogger("megatron_ft.health")

KEY_MAX = 512
VALUE_MAX = 64 << 10
KEYS_MAX = 1 << 16

Key = Annotated[StrictStr, Field(min_length=1, max_length=KEY_MAX)]
Value = Annotated[StrictStr, Field(max_length=VALUE_MAX)]


class Get(Request):
    key: Key


class Set(Request):
    key: Key
    value: Value


class CompareSet(Request):
    key: Key
    expected: Value
    desired: Value


class Delete(Request):
    key: Key


#: the longest a ``watch`` may wait (the client's bound is its timeout plus this)
WATCH_MAX_S = 60.0


class Watch(Request):
    key: Key
    value: Optional[Value] = None  # the value the waiter knows (None: absent)
    wait_s: Annotated[StrictFloat, Field(ge=0.0, le=WATCH_MAX_S)]


#: the coordination store's protocol
STORE_MESSAGES = Messages("store", {"get": Get, "set": Set, "compare_set": CompareSet, "delete": Delete,
                                    "watch": Watch})

#: a derived key's function: (key under the prefix, new value) -> keys to set with it (full keys; a
#: value None deletes the key, e.g. the one just set once the function has absorbed it)
Derive = Callable[[str, str], dict[str, Optional[str]]]


class _Map:
    """The store's map and its rules (a :class:`~megatron_ft.transport.wire.Handler`); one lock, held
    only while the map is read or changed."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self._lock = threading.Lock()
        self._changed: dict[str, threading.Condition] = {}  # key -> its waiters (only keys watched)
        self._derived: list[tuple[str, Derive]] = []
        # requests served, by op and by "op family" (the key's first part under the job's prefix, e.g.
        # "set agree", "watch agreed"; a watch that ended unchanged also as "watch-timeout <family>"):
        # the scale benchmark counts the store's messages with it (benchmarks/scale.py)
        self.ops: collections.Counter = collections.Counter()

    def handle(self, conn: wire.Connection, msg: dict) -> dict:
        req = STORE_MESSAGES.parse(msg)
        family = req.key.split("/")[2] if req.key.count("/") >= 2 else req.key
        with self._lock:
            self.ops[req.op] += 1
            self.ops[f"{req.op} {family}"] += 1
            if isinstance(req, Watch):
                value = self._wait_locked(req.key, req.value, req.wait_s)
                if value == req.value:
                    self.ops[f"watch-timeout {family}"] += 1
                return {"value": value}
            if isinstance(req, Get):
                return {"value": self.data.get(req.key)}
            if isinstance(req, Delete):
                self.data.pop(req.key, None)
                self._notify(req.key)
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

    def _put(self, key: str, value: str) -> None:
        if key not in self.data and len(self.data) >= KEYS_MAX:
            raise ValueError(f"store holds {KEYS_MAX} keys already (KEYS_MAX): {key!r} refused")
        self.data[key] = value
        self._notify(key)
        for prefix, fn in self._derived:
            if key.startswith(prefix):
                for k, v in fn(key[len(prefix):], value).items():
                    if v is None:  # the function absorbed the key (or an old one): gone
                        if self.data.pop(k, None) is not None:
                            self._notify(k)
                    elif self.data.get(k) != v:
                        self.data[k] = v
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

    def derive(self, prefix: str, fn: Derive) -> None:
        with self._lock:
            self._derived.append((prefix, fn))

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

    def derive(self, prefix: str, fn: Derive) -> None:
        """Call ``fn(key after prefix, value)`` under the map's lock with every ``set`` of a key under
        ``prefix`` (full key, the job's prefix included); the keys it returns are set (None: deleted) in
        the same step (their watchers woken). ``fn`` must be quick and do no I/O: the map waits for it."""
        self._map.derive(prefix, fn)

    def op_counts(self) -> dict[str, int]:
        """Requests this server has served: by op (``"set"``) and by op and key family (``"set agree"``,
        ``"watch agreed"``, ``"watch-timeout agreed"`` for a watch that ended unchanged). A copy."""
        with self._map._lock:
            return dict(self._map.ops)

    def close(self) -> None:
        self._server.close()


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

    def set(self, key: str, value: str) -> None:
        self._request("set", key=self.prefix + key, value=value)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self._request("compare_set", key=self.prefix + key, expected=expected, desired=desired)["value"]

    def delete(self, key: str) -> None:
        self._request("delete", key=self.prefix + key)

    def watch(self, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
        """The key's value once it differs from ``value``, or after ``wait_s`` (at most
        :data:`WATCH_MAX_S`) unchanged. Blocks this client's connection meanwhile: use one of its own."""
        return self._request("watch", key=self.prefix + key, value=value, wait_s=float(min(wait_s, WATCH_MAX_S))
                             ).get("value")

    def close(self) -> None:
        self._client.close()
