"""Malformed input at the receiving edge (hypothesis, 3,200 examples): random bytes as a frame, as a
first frame before authentication, and random JSON objects as the agents', the peers', the store's and the spares' requests.
Never a crash other than the documented refusals, never a hang: every read has a bound (a closed
peer, a socket timeout), every refusal names what was wrong."""
from __future__ import annotations

import socket
import struct
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ft.agent.peer_protocol import PEER_MESSAGES
from megatron_ft.agent.protocol import MESSAGES as AGENT_MESSAGES
from megatron_ft.health.wire_store import STORE_MESSAGES
from megatron_ft.spares.messages import FROM_TRAINER, FROM_WORKER, POOL, TO_TRAINER
from megatron_ft.transport import wire

FAST = settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)




def _typed_or_refused(table, op: str, fields: dict):
    """``table``'s request for ``{"v": 1, "op": op, **fields}``, asserted to be of the type ``op``
    names; None when refused, asserting that the refusal names the operation (and the field)."""
    try:
        req = table.parse({"v": 1, "op": op, **fields})
    except ValueError as e:
        assert str(e).startswith(f"{table.name} op"), e
        return None
    assert type(req) is table.ops[op]
    return req


def _feed(data: bytes) -> socket.socket:
    """A socket whose peer sent ``data`` and closed."""
    a, b = socket.socketpair()
    a.settimeout(2.0)
    b.sendall(data)
    b.close()
    return a


@FAST
@given(st.binary(max_size=512) | st.builds(lambda n, body: struct.pack(">I", n) + body,
                                          st.integers(0, 2**32 - 1), st.binary(max_size=256)))
def test_random_bytes_as_a_frame_are_read_or_refused(data):
    sock = _feed(data)
    try:
        msg = wire.recv_frame(sock)
    except (wire.WireError, ConnectionError, UnicodeDecodeError):
        return
    finally:
        sock.close()
    assert isinstance(msg, dict) and msg.get("v") == wire.WIRE_VERSION


@FAST
@given(st.binary(max_size=256))
def test_random_bytes_before_authentication_are_refused(data):
    """The server's side of the challenge against a client that sends anything: refused, bounded."""
    a, b = socket.socketpair()
    a.settimeout(2.0)
    errors = []

    def client() -> None:
        try:
            wire.recv_frame(b)  # the challenge
            b.sendall(data)
        except OSError:
            pass
        finally:
            b.close()

    t = threading.Thread(target=client)
    t.start()
    try:
        wire.check_client(a, b"0123456789abcdef")
    except (wire.AuthError, wire.WireError, ConnectionError, OSError, struct.error) as e:
        errors.append(e)
    finally:
        t.join(5)
        a.close()
    assert errors and not t.is_alive()  # no random bytes prove the secret


@FAST
@given(st.sampled_from(sorted(PEER_MESSAGES.ops) + ["", "shutdown"]),
       st.dictionaries(st.sampled_from(["key", "kind", "step", "length", "src", "expect", "meta", "node", "what",
                                        "lo", "hi", "rank", "run_id", "nbytes", "x"]), json_values, max_size=8))
def test_random_peer_requests_are_typed_or_refused_naming_the_problem(op, fields):
    _typed_or_refused(PEER_MESSAGES, op, fields)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(AGENT_MESSAGES.ops) + ["nope"]),
       st.dictionaries(st.text(max_size=10), json_values, max_size=6))
def test_random_agent_requests_are_typed_or_refused_naming_the_problem(op, fields):
    _typed_or_refused(AGENT_MESSAGES, op, fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(STORE_MESSAGES.ops) + ["keys"]),
       st.dictionaries(st.sampled_from(["key", "value", "expected", "desired", "x"]),
                       json_values | st.text(min_size=500, max_size=600), max_size=4))
def test_random_store_requests_are_typed_or_refused_naming_the_problem(op, fields):
    req = _typed_or_refused(STORE_MESSAGES, op, fields)
    assert req is None or 0 < len(req.key) <= 512


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([POOL, FROM_WORKER, FROM_TRAINER, TO_TRAINER]),
       st.sampled_from(["spawn", "signal", "rejoinable", "restarting", "failed", "round", "exit", "x"]),
       st.dictionaries(st.sampled_from(["argv", "env", "cwd", "signal", "pid", "round", "port", "reason", "x"]),
                       json_values, max_size=5))
def test_random_spares_messages_are_typed_or_refused_naming_the_problem(table, op, fields):
    _typed_or_refused(table, op, fields)
