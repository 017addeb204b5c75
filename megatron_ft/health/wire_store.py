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
==============  ==========================  =====================================================

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

import logging
import threading
from typing import Annotated, Optional

from pydantic import Field, StrictStr

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


#: the coordination store's protocol
STORE_MESSAGES = Messages("store", {"get": Get, "set": Set, "compare_set": CompareSet, "delete": Delete})


class _Map:
    """The store's map and its rules (a :class:`~megatron_ft.transport.wire.Handler`); one lock, held
    only while the map is read or changed."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self._lock = threading.Lock()

    def handle(self, conn: wire.Connection, msg: dict) -> dict:
        req = STORE_MESSAGES.parse(msg)
        with self._lock:
            if isinstance(req, Get):
                return {"value": self.data.get(req.key)}
            if isinstance(req, Delete):
                self.data.pop(req.key, None)
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

    def close(self) -> None:
        self._client.close()
