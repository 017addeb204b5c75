"""``health.store: etcd://HOST:PORT``: the agents' coordination store is an external etcd cluster.

etcd is replicated, so unlike the embedded store (:mod:`.store`) no agent hosts the store and
nothing fails over. Liveness and the root are etcd's own mechanisms, not heartbeats read by everyone:

* **a lease per agent.** :meth:`EtcdStore.connect` grants a lease of ``ttl_s`` = ``health.timeout_s``
  rounded up to whole seconds (at least 2) and a thread (``etcd-lease``) keeps it alive every
  ``ttl_s / 3``. The agent's liveness key ``alive/<node:06d>`` (``{"pid", "lease"}``) is attached to
  it: when the agent stops refreshing (killed, its host down, cut off from etcd) etcd deletes the key
  ``ttl_s`` later. A refresh that finds the lease expired (the agent did not run for longer: a paused
  process) grants a new one, puts ``alive/`` again and calls the :meth:`EtcdStore.on_new_lease`
  callbacks (the liveness monitor then asks whether this agent was judged lost meanwhile);
* **the root is a lease-bound key.** ``root`` is put-if-absent (one transaction on the key's create
  revision) with the agent's lease, so it vanishes with its holder's lease. Every agent follows
  ``root`` with an etcd watch (thread ``etcd-root``) and keeps its value in memory: :attr:`is_root`
  and :attr:`root` read no store. When ``root`` is deleted the lowest-numbered live agent (the one
  with no ``alive/`` key below its own: one count-only range read) puts it; the others wait for
  that put on the watch, and any agent puts it if it stays vacant for ``ttl_s + 1`` s (the lowest one
  was lost too). An agent whose lease was not confirmed within ``ttl_s`` is not root
  (:attr:`is_root` is False) whatever ``root`` said: its key may already be gone;
* **watches, not polls.** :meth:`EtcdStore.watch` waits for a key's change on an etcd watch stream
  (one range read, one stream), bounded by its ``wait_s``.

The failure verdicts themselves (the root's watch on ``alive/``) are
:class:`~megatron_ft.health.etcd_liveness.EtcdLiveness`.

The client is `etcd3gw <https://opendev.org/openstack/etcd3gw>`_ (etcd's v3 gRPC-gateway HTTP API;
``pip install 'megatron-ft[etcd]'``) for the unary calls (range, put, transactions, leases); the watch
streams are read here (:meth:`EtcdKV.events`) on the same gateway, because etcd3gw's watch has no
read timeout and drops a broken stream silently in a pool thread. Keys are UTF-8 strings under
``mft/<run_id>/``. With ``health.etcd_ca_file`` it speaks HTTPS, checking etcd's certificate against
that CA, and with ``etcd_cert_file``/``etcd_key_file`` presents a client certificate
(:class:`EtcdTLS`); the watch streams use the same settings.
"""
from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import threading
import time
from typing import Callable, Iterator, NamedTuple, Optional

from ..clock import Deadline
from .fencing import Fence, Fenced, fence_of_claim
from .kv import StoreUnavailable

log = logging.getLogger("megatron_ft.health")


def parse_endpoint(url: str) -> tuple[str, int]:
    """``etcd://host:port`` -> (host, port)."""
    m = re.fullmatch(r"etcd://([A-Za-z0-9_.-]+):(\d{1,5})", url or "")
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"etcd endpoint {url!r} is invalid: must be 'etcd://HOST:PORT' (port 1-65535)")
    return m.group(1), int(m.group(2))


def _b64(s: str) -> str:
    return base64.b64encode(s.encode("utf-8")).decode("ascii")


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode("utf-8")


def _range_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix`` (ASCII prefixes)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def lease_ttl(timeout_s: float) -> int:
    """An agent's lease TTL: ``health.timeout_s`` rounded up to whole seconds, at least 2."""
    return max(2, math.ceil(timeout_s))


def alive_key(node: int) -> str:
    """Node ``node``'s liveness key; zero-padded so that etcd's key order is the nodes' order (the
    election counts the live nodes below one with a single range read)."""
    return f"alive/{node:06d}"


class Event(NamedTuple):
    """One change seen on a watch stream: ``kind`` ``PUT`` or ``DELETE``; ``key`` without the run's
    prefix; ``value`` the new value (None for a DELETE); ``prev`` the value before (when asked for);
    ``rev`` the revision of the change."""
    kind: str
    key: str
    value: Optional[str]
    prev: Optional[str]
    rev: int


class EtcdTLS(NamedTuple):
    """etcd over TLS: the CA that signed etcd's server certificate, and optionally this client's
    certificate and key (all PEM file paths; empty: not used)."""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def of(cls, health) -> Optional["EtcdTLS"]:
        """From ``cfg.health`` (None: plain HTTP)."""
        return cls(health.etcd_ca_file, health.etcd_cert_file, health.etcd_key_file) if health.etcd_ca_file else None


class EtcdKV:
    """A client of an etcd cluster: keys prefixed with ``prefix``, values UTF-8 strings. Every
    error (unreachable, timeout, server error, a certificate refused) is a :class:`StoreUnavailable`
    naming the endpoint. ``tls``: HTTPS (:class:`EtcdTLS`); None: HTTP. Thread-safe: the unary calls
    share one session under a lock; each watch stream (:meth:`events`) has a session of its own.
    :attr:`requests` counts the requests sent (unary calls and streams opened)."""

    def __init__(self, url: str, prefix: str, timeout_s: float = 5.0, tls: Optional[EtcdTLS] = None):
        try:
            import etcd3gw
        except ImportError:
            raise StoreUnavailable(f"health.store={url!r} needs the etcd3gw package: "
                                   "pip install 'megatron-ft[etcd]'") from None
        self.url = url
        self.host, self.port = parse_endpoint(url)
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.tls = tls
        self.requests = 0
        self._open: set = set()  # the responses of the watch streams open now (close() shuts them)
        if tls is not None:
            for name, path in zip(("health.etcd_ca_file", "health.etcd_cert_file", "health.etcd_key_file"), tls):
                if path and not os.path.isfile(path):
                    raise StoreUnavailable(f"{name}={path!r}: no such file (etcd at {self.host}:{self.port} over TLS)")
        self._client = etcd3gw.Etcd3Client(self.host, self.port, protocol="https" if tls else "http",
                                           timeout=timeout_s, session=self._session())
        self.scheme = "https" if tls else "http"
        self._errors = (etcd3gw.exceptions.Etcd3Exception, OSError, ValueError, KeyError)
        self._lock = threading.Lock()  # one requests.Session, used by several agent threads

    def _session(self):
        """A requests session for etcd: with TLS, a session of its own that ignores the environment:
        with REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE set (common on clusters), requests checks etcd's
        certificate against that bundle instead of the session's CA (the environment's bundle wins over
        Session.verify), and a proxy from the environment has no business between the agents and the
        job's etcd."""
        import requests

        session = requests.Session()
        if self.tls is not None:
            session.trust_env = False
            session.verify = self.tls.ca_file
            if self.tls.cert_file:
                session.cert = (self.tls.cert_file, self.tls.key_file)
        return session

    def _fail(self, e: BaseException) -> StoreUnavailable:
        detail = getattr(e, "detail_text", None) or str(e) or type(e).__name__
        return StoreUnavailable(f"etcd at {self.host}:{self.port} ({self.url}): {type(e).__name__}: "
                                f"{str(detail).splitlines()[0][:300]}")

    def _call(self, fn, *args, **kw):
        with self._lock:
            self.requests += 1
            try:
                return fn(*args, **kw)
            except self._errors as e:
                raise self._fail(e) from None

    def _post(self, path: str, body: dict) -> dict:
        """One call of etcd's gateway (``/v3/<path>``), its JSON answer."""
        return self._call(lambda: self._client.post(self._client.get_url(path), json=body))

    def wait_ready(self, deadline_s: float) -> None:
        """Wait until the endpoint answers (its status call), at most ``deadline_s``."""
        deadline = Deadline(deadline_s, "etcd's status")
        while True:
            try:
                self._call(self._client.status)
                return
            except StoreUnavailable as e:
                if not deadline.pause(0.2):
                    raise StoreUnavailable(f"{e} (still unreachable after {deadline_s:g} s; is etcd running "
                                           f"and is health.store right?)") from None

    def set(self, key: str, value: str, lease: int = 0, fence: Optional[str] = None) -> None:
        """Put ``key``; ``lease``: attached to that lease (etcd deletes the key when it expires);
        ``fence``: only while that key is absent (one transaction; else :class:`~.fencing.Fenced`)."""
        body = {"key": _b64(self.prefix + key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        if fence is None:
            self._post("/kv/put", body)
        else:
            self._fenced_txn([], [{"request_put": body}], fence)

    def _fenced_txn(self, compare: list, success: list, fence: str, failure: tuple = ()) -> dict:
        """One transaction: ``success`` if ``compare`` holds and ``fence`` is absent; else ``failure`` (and
        a read of ``fence``, last). A present fence raises :class:`~.fencing.Fenced` naming its value."""
        f = _b64(self.prefix + fence)
        r = self._post("/kv/txn", {"compare": [*compare, {"key": f, "result": "EQUAL", "target": "CREATE",
                                                          "create_revision": 0}],
                                   "success": success,
                                   "failure": [*failure, {"request_range": {"key": f}}]})
        if not r.get("succeeded"):
            kvs = r["responses"][-1]["response_range"].get("kvs", [])
            if kvs:
                raise Fenced(fence, _unb64(kvs[0].get("value", "")), f"{self.host}:{self.port}")
        return r

    def get(self, key: str) -> Optional[str]:
        return self.read(key)[1]

    def read(self, key: str) -> tuple[int, Optional[str]]:
        """The store's revision and ``key``'s value (None if absent), in one range read."""
        r = self._post("/kv/range", {"key": _b64(self.prefix + key)})
        kvs = r.get("kvs", [])
        return int(r["header"]["revision"]), (_unb64(kvs[0].get("value", "")) if kvs else None)

    def read_prefix(self, prefix: str) -> tuple[int, dict[str, str]]:
        """The store's revision and every key starting with ``prefix`` (without the run's prefix) with
        its value, in one range read."""
        full = self.prefix + prefix
        r = self._post("/kv/range", {"key": _b64(full), "range_end": _b64(_range_end(full))})
        n = len(self.prefix)
        keys = {_unb64(kv["key"])[n:]: _unb64(kv.get("value", "")) for kv in r.get("kvs", [])}
        return int(r["header"]["revision"]), keys

    def read_range(self, first: str, end: str) -> tuple[int, dict[str, str]]:
        """The store's revision and every key in ``[first, end)`` (without the run's prefix) with its
        value, in one range read."""
        r = self._post("/kv/range", {"key": _b64(self.prefix + first), "range_end": _b64(self.prefix + end)})
        n = len(self.prefix)
        return int(r["header"]["revision"]), {_unb64(kv["key"])[n:]: _unb64(kv.get("value", ""))
                                              for kv in r.get("kvs", [])}

    def count(self, first: str, end: str) -> int:
        """How many keys lie in ``[first, end)`` (count only: no values travel)."""
        r = self._post("/kv/range", {"key": _b64(self.prefix + first), "range_end": _b64(self.prefix + end),
                                     "count_only": True})
        return int(r.get("count", 0))

    def delete(self, key: str, fence: Optional[str] = None) -> None:
        body = {"key": _b64(self.prefix + key)}
        if fence is None:
            self._post("/kv/deleterange", body)
        else:
            self._fenced_txn([], [{"request_delete_range": body}], fence)

    def compare_set(self, key: str, expected: str, desired: str, lease: int = 0, fence: Optional[str] = None,
                    also: Optional[dict[str, str]] = None) -> str:
        """Set ``key`` to ``desired`` if its value is ``expected`` (``""``: if it does not exist), in
        one etcd transaction (``lease``: the put attached to that lease; ``fence``: only while that key is
        absent, else :class:`~.fencing.Fenced`; ``also``: more keys put in the same transaction when it
        succeeds; a standby's claim of a verdict puts the claimed agent's fence with it,
        :func:`~.fencing.fence_of_claim`); returns the value the key has afterwards (``""`` if absent)."""
        if (fenced := fence_of_claim(key, desired)) is not None:
            also = {**(also or {}), fenced[0]: fenced[1]}
        k = _b64(self.prefix + key)
        cmp = ({"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0} if expected == ""
               else {"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(expected)})
        put = {"key": k, "value": _b64(desired)}
        if lease:
            put["lease"] = lease
        success = [{"request_put": put}] + [{"request_put": {"key": _b64(self.prefix + ak), "value": _b64(av)}}
                                            for ak, av in (also or {}).items()]
        failure = ({"request_range": {"key": k}},)
        if fence is None:
            r = self._post("/kv/txn", {"compare": [cmp], "success": success, "failure": list(failure)})
        else:
            r = self._fenced_txn([cmp], success, fence, failure)
        if r.get("succeeded"):
            return desired
        kvs = r["responses"][0]["response_range"].get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else ""

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        return int(self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its TTL from now, -1 when it has expired (its keys are gone)."""
        r = self._post("/lease/keepalive", {"ID": lease})
        return int(r.get("result", {}).get("TTL", -1))

    def events(self, key: str, start_rev: int, wait_s: float, prefix: bool = False, prev: bool = False,
               stop: Optional[threading.Event] = None, end: Optional[str] = None) -> Iterator[Event]:
        """The changes of ``key`` (``prefix``: of every key under it; ``end``: of every key in ``[key, end)``)
        from revision ``start_rev`` on,
        on an etcd watch stream (a session of its own), until nothing arrived for ``wait_s`` (then
        the iterator ends) or ``stop`` is set (checked at each event). ``prev``: each event carries the
        value before it. Bounded: the connection by the client's timeout, each read by ``wait_s``. A
        broken stream, or history etcd compacted away, is a :class:`StoreUnavailable`."""
        import requests
        import urllib3

        full = self.prefix + key
        create = {"key": _b64(full), "start_revision": start_rev}
        if prefix:
            create["range_end"] = _b64(_range_end(full))
        elif end is not None:
            create["range_end"] = _b64(self.prefix + end)
        if prev:
            create["prev_kv"] = True
        url = self._call(lambda: self._client.get_url("/watch"))  # counted: the stream's request
        n = len(self.prefix)
        session, resp = self._session(), None
        try:
            resp = session.post(url, json={"create_request": create}, stream=True,
                                timeout=(self.timeout_s, max(0.05, wait_s)))
            with self._lock:
                self._open.add(resp)
            if resp.status_code != 200:
                raise StoreUnavailable(f"etcd at {self.host}:{self.port} ({self.url}): watch of {full!r} refused: "
                                       f"HTTP {resp.status_code} {resp.text[:200]}")
            for line in resp.iter_lines(chunk_size=None):
                if not line.strip():
                    continue
                msg = json.loads(line)
                if "error" in msg:
                    raise StoreUnavailable(f"etcd at {self.host}:{self.port} ({self.url}): watch of {full!r}: "
                                           f"{str(msg['error'])[:300]}")
                res = msg.get("result", {})
                if res.get("canceled") or int(res.get("compact_revision", 0) or 0):
                    raise StoreUnavailable(f"etcd at {self.host}:{self.port} ({self.url}): watch of {full!r} from "
                                           f"revision {start_rev} canceled ({res.get('cancel_reason') or 'compacted'})")
                for ev in res.get("events", []):
                    kv, pkv = ev["kv"], ev.get("prev_kv")
                    kind = ev.get("type", "PUT")
                    yield Event(kind, _unb64(kv["key"])[n:],
                                _unb64(kv.get("value", "")) if kind == "PUT" else None,
                                _unb64(pkv.get("value", "")) if pkv else None, int(kv.get("mod_revision", 0)))
                    if stop is not None and stop.is_set():
                        return
        except requests.exceptions.ConnectionError as e:
            if e.args and isinstance(e.args[0], urllib3.exceptions.ReadTimeoutError):
                return  # nothing for wait_s: the caller looks around and watches again
            raise self._fail(e) from None
        except requests.exceptions.Timeout:
            return
        except (requests.exceptions.RequestException, OSError, ValueError) as e:
            raise self._fail(e) from None
        finally:
            with self._lock:
                self._open.discard(resp)
            session.close()

    def close(self) -> None:
        """End the watch streams open now (their readers end with a :class:`StoreUnavailable` at once)."""
        import socket

        with self._lock:
            open_now, self._open = list(self._open), set()
        for resp in open_now:
            try:
                resp.raw.connection.sock.shutdown(socket.SHUT_RDWR)
            except (AttributeError, OSError):
                pass  # already closed


class EtcdStore:
    """The store interface the agents use (:class:`~megatron_ft.health.store.EmbeddedStore`'s:
    connect, publish, set, get, compare_set, delete, watch, root, is_root, close) on an etcd cluster,
    with this agent's lease and the lease-bound ``root`` (see the module). Threads: ``etcd-lease``
    (keepalive every :attr:`refresh_s`) and ``etcd-root`` (the watch on ``root``), both started by
    :meth:`connect` and ended by :meth:`close` (within :attr:`refresh_s` and the watch's read
    timeout); nothing else blocks on them. ``timeout_s``: each request's limit, and the lease TTL's
    source (:func:`lease_ttl`)."""

    #: how long one watch of ``root`` waits before it is opened again (bounds :meth:`close`)
    ROOT_WATCH_S = 10.0

    def __init__(self, url: str, run_id: str, node: int, nodes: int, timeout_s: float = 5.0,
                 tls: Optional[EtcdTLS] = None):
        self.node, self.nodes, self.timeout_s = node, nodes, timeout_s
        self.prefix = f"mft/{run_id}/"
        self.kv = EtcdKV(url, self.prefix, timeout_s, tls)
        self.url = url
        self.ttl_s = lease_ttl(timeout_s)
        self.refresh_s = self.ttl_s / 3
        self.lease = 0
        self._root = -1
        self._valid_until = 0.0  # monotonic time until which our lease is known to live
        #: the revision at which ``root`` was last seen deleted (0: never): the old root's lease expired
        #: there, so a new root's watch of ``alive/`` starts there and sees that node's loss too
        self.vacated_rev = 0
        self._callbacks: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self.fence = Fence()  # armed by the agent (:meth:`fence_as`)
        self._lock = threading.Lock()  # lease, _valid_until, _root

    # ------------------------------------------------------------------ lease and election

    def connect(self, deadline_s: float = 60.0) -> int:
        """Wait for etcd (at most ``deadline_s``), grant this agent's lease, put its ``alive/`` key,
        claim ``root`` if nobody holds it, start the lease and root threads; returns the root node id."""
        self.kv.wait_ready(deadline_s)
        self._new_lease()
        self._root = root = self._claim()
        if root == self.node:
            log.warning("node %d: this agent is the root (etcd at %s)", self.node, self.url)
        else:
            log.info("node %d: root agent is node %d (etcd at %s)", self.node, root, self.url)
        threading.Thread(target=self._keepalive_loop, name="etcd-lease", daemon=True).start()
        threading.Thread(target=self._root_loop, name="etcd-root", daemon=True).start()
        return root

    def on_new_lease(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the lease thread, no lock held) after this agent's lease expired and a new
        one was granted: it did not run, or reach etcd, for ``ttl_s``, and may have been judged lost."""
        self._callbacks.append(fn)

    def _new_lease(self) -> None:
        t0 = time.monotonic()
        lease = self.kv.grant(self.ttl_s)
        # fenced: an agent judged lost whose node was claimed meanwhile takes no new liveness
        self._write(lambda: self.kv.set(alive_key(self.node), json.dumps({"pid": os.getpid(), "lease": lease}),
                                        lease=lease, fence=self.fence.key))
        with self._lock:
            self.lease, self._valid_until = lease, t0 + self.ttl_s

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                t0 = time.monotonic()
                ttl = self.kv.keepalive(self.lease)
                if ttl > 0:
                    with self._lock:
                        self._valid_until = t0 + ttl
                    continue
                log.warning("node %d: this agent's etcd lease expired (no refresh for %d s: it did not run, or "
                            "could not reach etcd); taking a new one", self.node, self.ttl_s)
                self._new_lease()
            except StoreUnavailable as e:
                log.warning("node %d: etcd lease refresh failed: %s", self.node, e)
                continue
            for fn in self._callbacks:
                try:
                    fn()
                except Exception as e:
                    log.warning("node %d: after a new etcd lease: %s", self.node, e)

    def _claim(self) -> int:
        """Put ``root`` = this node with our lease if it is absent; the holder afterwards (-1: none)."""
        cur = self.kv.compare_set("root", "", str(self.node), lease=self.lease)
        return int(cur) if cur else -1

    def _set_root(self, root: int) -> None:
        with self._lock:
            old, self._root = self._root, root
        if old == root or root < 0:
            return
        if root == self.node:
            log.warning("node %d: this agent is the root now (etcd; it was node %d)", self.node, old)
        else:
            log.info("node %d: root agent is node %d (was %d)", self.node, root, old)

    def _root_loop(self) -> None:
        """Follow ``root`` on a watch; when it is vacant, the lowest live node takes it (see the module)."""
        vacant_since: Optional[float] = None
        while not self._stop.is_set():
            try:
                rev, v = self.kv.read("root")
                if v is None:
                    now = time.monotonic()
                    vacant_since = vacant_since if vacant_since is not None else now
                    lowest = self.kv.count(alive_key(0), alive_key(self.node)) == 0
                    if lowest or now - vacant_since > self.ttl_s + 1:
                        won = self._claim()
                        if won >= 0:
                            self._set_root(won)
                            vacant_since = None
                            continue
                    self._set_root(-1)
                    wait = max(0.1, vacant_since + self.ttl_s + 1 - now)
                else:
                    vacant_since = None
                    self._set_root(int(v))
                    wait = self.ROOT_WATCH_S
                for ev in self.kv.events("root", rev + 1, wait, stop=self._stop):
                    if ev.kind == "DELETE":
                        self.vacated_rev = ev.rev
                        break  # vacant: read it again and elect
                    self._set_root(int(ev.value or -1))
            except StoreUnavailable as e:
                if self._stop.is_set():
                    return
                log.warning("node %d: following the etcd root key: %s", self.node, e)
                self._stop.wait(self.refresh_s)

    @property
    def root(self) -> int:
        """The root node as last seen on the watch (-1: vacant). No store read."""
        return self._root

    @property
    def is_root(self) -> bool:
        """This agent holds ``root`` and its lease was confirmed within ``ttl_s``. No store read."""
        with self._lock:
            return self._root == self.node and time.monotonic() < self._valid_until

    def close(self) -> None:
        """Stop the lease and root threads (the lease is not revoked: it lapses ``ttl_s`` later, as a
        lost agent's does, and the root judges the node as it would any silent one)."""
        self._stop.set()
        self.kv.close()

    # ------------------------------------------------------------------ the key-value interface

    def fence_as(self, pid: int, on_fenced: Callable[[str], None]) -> None:
        """Every write from now on is agent ``pid``'s of this node (:mod:`.fencing`), its liveness key at a
        new lease included; ``on_fenced(why)`` once at the first refusal."""
        self.fence.arm(self.node, pid, on_fenced)

    def _write(self, fn):
        try:
            return fn()
        except Fenced as e:
            self.fence.refused(e)

    def publish(self, key: str, value: str) -> None:
        """A key this node owns (etcd keeps it; nothing to re-publish)."""
        self._write(lambda: self.kv.set(key, value, fence=self.fence.key))

    def set(self, key: str, value: str) -> None:
        self._write(lambda: self.kv.set(key, value, fence=self.fence.key))

    def get(self, key: str) -> Optional[str]:
        return self.kv.get(key)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self._write(lambda: self.kv.compare_set(key, expected, desired, fence=self.fence.key))

    def delete(self, key: str) -> None:
        self._write(lambda: self.kv.delete(key, fence=self.fence.key))

    def watch(self, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
        """The key's value once it differs from ``value`` (None: absent), or after ``wait_s``
        unchanged (:func:`watch_key`)."""
        return watch_key(self.kv, key, value, wait_s, self._stop)


def watch_key(kv: EtcdKV, key: str, value: Optional[str], wait_s: float,
              stop: Optional[threading.Event] = None) -> Optional[str]:
    """``key``'s value once it differs from ``value`` (None: absent), or after ``wait_s`` unchanged:
    one range read, then an etcd watch from that read's revision (so no change between the two is
    missed), at most ``wait_s`` (plus one request's connect timeout)."""
    deadline = time.monotonic() + wait_s
    rev, cur = kv.read(key)
    while cur == value:
        left = deadline - time.monotonic()
        if left <= 0.01:
            break
        for ev in kv.events(key, rev + 1, left, stop=stop):
            rev, cur = ev.rev, ev.value
            if cur != value or time.monotonic() >= deadline:
                break
        else:
            break  # nothing more within wait_s
    return cur
