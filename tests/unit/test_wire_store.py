"""The embedded coordination store's server on the wire: its rules (compare-and-set as etcd's), its
bounds, the job's secret proven before any operation, and only the address it was given."""
from __future__ import annotations

import logging
import socket

import psutil
import pytest

from megatron_ft.health import wire_store
from megatron_ft.health.kv import StoreUnavailable
from megatron_ft.health.wire_store import KVServer, WireKV
from megatron_ft.transport import wire

SECRET = b"k" * 32


@pytest.fixture
def server():
    s = KVServer(("127.0.0.1", 0), SECRET).start()
    yield s
    s.close()


def test_compare_set_follows_the_kv_rules(server):
    kv = WireKV(*server.address, "p/", 2.0, SECRET)
    assert kv.get("a") is None
    assert kv.compare_set("a", "x", "y") == ""  # absent and something else expected: nothing set
    assert kv.get("a") is None
    assert kv.compare_set("a", "", "1") == "1"  # "" expects absence
    assert kv.compare_set("a", "", "2") == "1"
    assert kv.compare_set("a", "1", "3") == "3"
    kv.set("b", "v")
    kv.delete("a")
    assert (kv.get("a"), kv.get("b")) == (None, "v")
    assert WireKV(*server.address, "q/", 2.0, SECRET).get("b") is None  # prefixes keep runs apart
    kv.close()


def test_oversized_keys_and_values_and_too_many_keys_are_refused(server, monkeypatch):
    kv = WireKV(*server.address, "", 2.0, SECRET)
    with pytest.raises(StoreUnavailable, match=r"key=.* is invalid: String should have at most 512 characters"):
        kv.set("k" * 513, "v")
    with pytest.raises(StoreUnavailable, match=r"value=.* is invalid: String should have at most 65536"):
        kv.set("k", "v" * (64 << 10 | 1))
    monkeypatch.setattr(wire_store, "KEYS_MAX", 3)
    for i in range(3):
        kv.set(f"k{i}", "v")
    kv.set("k0", "again")  # an existing key may change
    with pytest.raises(StoreUnavailable, match=r"store holds 3 keys already"):
        kv.set("k3", "v")
    assert kv.get("k0") == "again" and kv.get("k3") is None  # the connection keeps serving
    kv.close()


@pytest.mark.parametrize("secret", [None, b"w" * 32], ids=["no-secret", "wrong-secret"])
def test_a_client_without_the_secret_is_refused_before_any_operation(server, secret, caplog):
    """With no answer to the challenge, or a wrong one: nothing read, nothing written, the refusal logged."""
    owner = WireKV(*server.address, "", 2.0, SECRET)
    owner.set("root", "0")
    with caplog.at_level(logging.WARNING, logger="megatron_ft"):
        if secret is None:  # a stranger speaking the protocol without answering the challenge
            with socket.create_connection(server.address, timeout=2) as s:
                assert wire.recv_frame(s)["op"] == "challenge"
                wire.send_frame(s, {"op": "set", "key": "root", "value": "9"})
                with pytest.raises((ConnectionError, OSError, wire.WireError)):
                    wire.recv_frame(s)
        else:
            with pytest.raises(StoreUnavailable, match="refused before any operation"):
                WireKV(*server.address, "", 2.0, secret)
    assert owner.get("root") == "0"
    assert "store: refused a connection from 127.0.0.1:" in caplog.text
    owner.close()


def test_the_server_listens_on_its_address_only():
    """Bound to the address given (a node's own), never a wildcard."""
    s = KVServer(("127.0.0.1", 0), SECRET).start()
    try:
        mine = [c for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
                and c.laddr.port == s.address[1]]
        assert [c.laddr.ip for c in mine] == ["127.0.0.1"]
    finally:
        s.close()


def test_the_byte_bound_refuses_a_set_and_deletes_reach_only_derivers_that_ask(server, monkeypatch):
    kv = WireKV(*server.address, "", 2.0, SECRET)
    seen = {"all": [], "sets": []}
    server.derive("d/", lambda k, v: seen["all"].append((k, v)) or {}, deletes=True)
    server.derive("d/", lambda k, v: seen["sets"].append((k, v)) or {})
    kv.set("d/1", "x")
    kv.delete("d/1")
    kv.delete("d/2")  # absent: nothing to tell
    assert seen == {"all": [("1", "x"), ("1", None)], "sets": [("1", "x")]}
    monkeypatch.setattr(wire_store, "BYTES_MAX", 100)
    kv.set("small", "v" * 20)
    with pytest.raises(StoreUnavailable, match=r"BYTES_MAX 100\): 'big' of 200 bytes refused"):
        kv.set("big", "v" * 200)
    kv.set("small", "w")  # shrinking is always allowed
    assert kv.get("big") is None and kv.get("small") == "w"
    kv.close()
