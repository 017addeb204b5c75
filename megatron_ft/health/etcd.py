"""``health.store: etcd://HOST:PORT``: the agents' coordination store is an external etcd cluster.

etcd is replicated, so unlike the embedded store (:mod:`.store`) no agent hosts the store and
nothing fails over: only the *root agent* (the one that watches heartbeats and writes failure
verdicts) is elected, inside etcd:

* at start every agent does a put-if-absent of ``root`` (an etcd transaction comparing the key's
  create revision with 0): the first agent to arrive is root, the others follow it;
* a non-root agent whose view of the root's heartbeat has not changed for ``health.timeout_s``
  (see :class:`~megatron_ft.health.monitor.Monitor`) and that is the lowest-numbered node whose
  heartbeat it sees fresh moves ``root`` from the old root to itself with a compare-and-swap
  (:meth:`EtcdStore.take_root`). Two agents racing for it swap from the same old value: one wins;
* :attr:`EtcdStore.is_root` reads ``root`` from etcd each time, so an agent that lost the root
  (it was only slow) stops acting as root at its next heartbeat.

The client is `etcd3gw <https://opendev.org/openstack/etcd3gw>`_ (etcd's v3 gRPC-gateway HTTP API;
``pip install 'megatron-ft[etcd]'``). Keys are UTF-8 strings under ``mft/<run_id>/``. With
``health.etcd_ca_file`` it speaks HTTPS, checking etcd's certificate against that CA, and with
``etcd_cert_file``/``etcd_key_file`` presents a client certificate (:class:`EtcdTLS`).
"""
from __future__ import annotations

import base64
import logging
import os
import re
import threading
import time
from typing import NamedTuple, Optional

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
    naming the endpoint. ``tls``: HTTPS (:class:`EtcdTLS`); None: HTTP."""

    def __init__(self, url: str, prefix: str, timeout_s: float = 5.0, tls: Optional[EtcdTLS] = None):
        try:
            import etcd3gw
        except ImportError:
            raise StoreUnavailable(f"health.store={url!r} needs the etcd3gw package: "
                                   "pip install 'megatron-ft[etcd]'") from None
        self.url = url
        self.host, self.port = parse_endpoint(url)
        self.prefix = prefix
        if tls is None:
            self._client = etcd3gw.Etcd3Client(self.host, self.port, timeout=timeout_s)
        else:
            for name, path in zip(("health.etcd_ca_file", "health.etcd_cert_file", "health.etcd_key_file"), tls):
                if path and not os.path.isfile(path):
                    raise StoreUnavailable(f"{name}={path!r}: no such file (etcd at {self.host}:{self.port} over TLS)")
            import requests

            # a session of its own that ignores the environment: with REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE
            # set (common on clusters), requests checks etcd's certificate against that bundle instead of
            # the session's CA (the environment's bundle wins over Session.verify), and a proxy from the
            # environment has no business between the agents and the job's etcd
            session = requests.Session()
            session.trust_env = False
            session.verify = tls.ca_file
            if tls.cert_file:
                session.cert = (tls.cert_file, tls.key_file)
            self._client = etcd3gw.Etcd3Client(self.host, self.port, protocol="https", timeout=timeout_s,
                                               session=session)
        self.scheme = "https" if tls else "http"
        self._errors = (etcd3gw.exceptions.Etcd3Exception, OSError, ValueError, KeyError)
        self._lock = threading.Lock()  # one requests.Session, used by several agent threads

    def _call(self, fn, *args, **kw):
        with self._lock:
            try:
                return fn(*args, **kw)
            except self._errors as e:
                detail = getattr(e, "detail_text", None) or str(e) or type(e).__name__
                raise StoreUnavailable(f"etcd at {self.host}:{self.port} ({self.url}): {type(e).__name__}: "
                                       f"{str(detail).splitlines()[0][:300]}") from None

    def wait_ready(self, deadline_s: float) -> None:
        """Wait until the endpoint answers (its status call), at most ``deadline_s``."""
        deadline = time.time() + deadline_s
        while True:
            try:
                self._call(self._client.status)
                return
            except StoreUnavailable as e:
                if time.time() > deadline:
                    raise StoreUnavailable(f"{e} (still unreachable after {deadline_s:g} s; is etcd running "
                                           f"and is health.store right?)") from None
            time.sleep(0.2)

    def set(self, key: str, value: str) -> None:
        self._call(self._client.put, (self.prefix + key).encode(), value.encode())

    def get(self, key: str) -> Optional[str]:
        got = self._call(self._client.get, (self.prefix + key).encode())
        return got[0].decode() if got else None

    def delete(self, key: str) -> None:
        self._call(self._client.delete, (self.prefix + key).encode())

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if its value is ``expected`` (``""``: if it does not exist), in
        one etcd transaction; returns the value the key has afterwards (``""`` if absent)."""
        k = _b64(self.prefix + key)
        cmp = ({"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0} if expected == ""
               else {"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(expected)})
        r = self._call(self._client.transaction, {
            "compare": [cmp], "success": [{"request_put": {"key": k, "value": _b64(desired)}}],
            "failure": [{"request_range": {"key": k}}]})
        if r.get("succeeded"):
            return desired
        kvs = r["responses"][0]["response_range"].get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else ""


class EtcdStore:
    """The store interface the agents use (:class:`~megatron_ft.health.store.EmbeddedStore`'s:
    connect, publish, set, get, compare_set, delete, root, is_root) on an etcd cluster."""

    elects_root_by_heartbeat = True  # the Monitor moves ``root`` when the root's heartbeat is stale

    def __init__(self, url: str, run_id: str, node: int, nodes: int, timeout_s: float = 5.0,
                 tls: Optional[EtcdTLS] = None):
        self.node, self.nodes, self.timeout_s = node, nodes, timeout_s
        self.prefix = f"mft/{run_id}/"
        self.kv = EtcdKV(url, self.prefix, timeout_s, tls)
        self.url = url
        self._root = -1

    def connect(self, deadline_s: float = 60.0) -> int:
        """Wait for etcd, claim ``root`` if nobody holds it; returns the root node id."""
        self.kv.wait_ready(deadline_s)
        cur = self.kv.compare_set("root", "", str(self.node))
        self._root = int(cur)
        if self._root == self.node:
            log.warning("node %d: this agent is the root (etcd at %s)", self.node, self.url)
        else:
            log.info("node %d: root agent is node %d (etcd at %s)", self.node, self._root, self.url)
        return self._root

    def take_root(self, old: int) -> bool:
        """Compare-and-swap ``root`` from ``old`` to this node; True if this agent is now root."""
        cur = int(self.kv.compare_set("root", str(old), str(self.node)) or -1)
        self._root = cur
        if cur == self.node:
            log.warning("node %d: root agent node %d went silent; this agent is the root now", self.node, old)
        return cur == self.node

    @property
    def root(self) -> int:
        return self._root

    @property
    def is_root(self) -> bool:
        v = self.kv.get("root")
        self._root = int(v) if v is not None else -1
        return self._root == self.node

    def publish(self, key: str, value: str) -> None:
        """A key this node owns (etcd keeps it; nothing to re-publish)."""
        self.kv.set(key, value)

    def set(self, key: str, value: str) -> None:
        self.kv.set(key, value)

    def get(self, key: str) -> Optional[str]:
        return self.kv.get(key)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self.kv.compare_set(key, expected, desired)

    def delete(self, key: str) -> None:
        self.kv.delete(key)

    #: how often :meth:`watch` reads the key (etcd3gw's watches are not used yet)
    WATCH_POLL_S = 0.05

    def watch(self, key: str, value: Optional[str], wait_s: float) -> Optional[str]:
        """The key's value once it differs from ``value``, or after ``wait_s`` unchanged (read every
        :data:`WATCH_POLL_S`)."""
        deadline = time.monotonic() + wait_s
        while True:
            cur = self.kv.get(key)
            if cur != value or time.monotonic() >= deadline:
                return cur
            time.sleep(min(self.WATCH_POLL_S, max(0.0, deadline - time.monotonic())))
