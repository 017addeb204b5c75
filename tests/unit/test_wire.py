"""The wire layer every connection uses (trainer <-> agent over Unix sockets, agent <-> agent over
TCP): frames and versions, refusals, payloads, the retry and timeout policy, in one process."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from megatron_ft.transport import wire


class Echo:
    """A handler: echoes fields, stores put payloads, serves get ranges, refuses on demand."""

    def __init__(self):
        self.blob = bytearray(range(256)) * 64
        self.closed_with: list[bool] = []
        self.greeted = 0
        self.release = threading.Event()
        self.slow_calls = 0

    def handle(self, conn, msg):
        op = msg["op"]
        if op == "hello":
            self.greeted += 1
            conn.state["who"] = msg["who"]
            return {"hi": msg["who"]}
        if op == "echo":
            return {"x": msg["x"], "who": conn.state.get("who")}
        if op == "put":
            conn.read_into(memoryview(self.blob)[msg["at"]: msg["at"] + msg["nbytes"]])
            return {}
        if op == "put_ignored":
            return {"ignored": True}  # the server skips the unread payload
        if op == "get":
            return wire.Reply(payload=memoryview(self.blob)[msg["lo"]: msg["hi"]])
        if op == "busy":
            e = RuntimeError("no free slot")
            e.busy = True
            raise e
        if op == "fail":
            raise KeyError("nothing here")
        if op == "slow":
            self.slow_calls += 1
            self.release.wait(5)
            return {}
        if op == "bye":
            return wire.Reply(close=True, orderly=True)
        raise ValueError(op)

    def closed(self, conn):
        self.closed_with.append(conn.orderly)


@pytest.fixture(params=["unix", "tcp"])
def served(request, tmp_path):
    handler = Echo()
    address = str(tmp_path / "s.sock") if request.param == "unix" else ("127.0.0.1", 0)
    server = wire.Server(address, handler, name="test").start()
    yield server, handler
    server.close()


def test_requests_payloads_and_refusals_keep_the_stream_in_step(served):
    server, h = served
    c = wire.Client(server.address, timeout=5, greeting={"op": "hello", "who": "r0"})
    assert c.connect() == {"v": wire.WIRE_VERSION, "ok": True, "hi": "r0"}
    assert c.request("echo", x=[1, 2])["x"] == [1, 2]
    assert c.request("echo", x=0)["who"] == "r0"  # per-connection state
    data = bytes(range(100, 200)) * 10
    c.request("put", at=1000, payload=memoryview(data))
    assert bytes(h.blob[1000:2000]) == data
    c.request("put_ignored", payload=memoryview(b"z" * 70000))  # skipped by the server
    got = bytearray(1000)
    c.request("get", lo=1000, hi=2000, into=memoryview(got))
    assert bytes(got) == data
    with pytest.raises(wire.RemoteError) as e:
        c.request("busy")
    assert e.value.busy and e.value.kind == "RuntimeError" and "no free slot" in str(e.value)
    with pytest.raises(wire.RemoteError) as e:
        c.request("fail")
    assert e.value.kind == "KeyError" and not e.value.busy
    with pytest.raises(wire.WireError, match="1000 payload bytes sent back, 10 expected"):
        c.request("get", lo=0, hi=1000, into=memoryview(bytearray(10)))
    assert c.request("echo", x=3)["x"] == 3  # re-opened (greeting sent again) after the bad payload
    assert h.greeted == 2
    c.close("bye")
    deadline = time.time() + 5
    while len(h.closed_with) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert h.closed_with == [False, True]  # the dropped connection, then the goodbye


def test_frames_of_another_version_or_too_large_are_refused(tmp_path):
    a, b = socket.socketpair()
    wire.send_frame(a, {"op": "x"})
    assert wire.recv_frame(b)["op"] == "x"
    for raw, why in ((b'{"v":99,"op":"x"}', "wire version 1 expected"), (b"[1, 2]", "wire version 1 expected"),
                     (b"\x80 not json", "not JSON")):
        a.sendall(len(raw).to_bytes(4, "big") + raw)
        with pytest.raises(wire.WireError, match=why):
            wire.recv_frame(b)
    a.sendall((wire.MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.recv_frame(b)


def test_a_broken_connection_is_reopened_once_with_the_greeting(tmp_path):
    h = Echo()
    path = str(tmp_path / "s.sock")
    server = wire.Server(path, h, name="test").start()
    c = wire.Client(path, timeout=5, greeting={"op": "hello", "who": "r1"})
    assert c.request("echo", x=1)["who"] == "r1"
    server.close()  # the server restarts: same address, new process state
    h2 = Echo()
    server = wire.Server(path, h2, name="test").start()
    try:
        c._sock.shutdown(socket.SHUT_RDWR)  # the old connection is gone
        assert c.request("echo", x=2) == {"v": 1, "ok": True, "x": 2, "who": "r1"}
        assert h2.greeted == 1
    finally:
        server.close()
    with pytest.raises(OSError):  # nobody listens: one retry, then the error
        c._sock.shutdown(socket.SHUT_RDWR)
        c.request("echo", x=3)


def test_a_timeout_names_the_operation_and_is_not_retried(served):
    server, h = served
    c = wire.Client(server.address, timeout=0.3)
    with pytest.raises(TimeoutError, match=r"slow to .*no answer within 0.3 s"):
        c.request("slow")
    h.release.set()
    time.sleep(0.1)
    assert c.request("echo", x=5)["x"] == 5  # a fresh connection: the late reply is not read as this one's
    assert h.slow_calls == 1  # sent once: a timeout is not retried


def test_wait_s_extends_the_bound_of_one_call(served):
    server, h = served
    c = wire.Client(server.address, timeout=0.2)
    threading.Timer(0.5, h.release.set).start()
    assert c.request("slow", wait_s=2)["ok"]
    assert c.request("echo", x=1)["x"] == 1


def test_a_client_needs_a_positive_timeout():
    with pytest.raises(ValueError, match="timeout=0"):
        wire.Client("/nowhere", timeout=0)


def test_connect_waits_for_a_server_that_is_not_listening_yet(tmp_path):
    """A trainer started while its node's agent restarts: the socket file appears later."""
    path = str(tmp_path / "s.sock")
    h = Echo()
    servers = []
    c = wire.Client(path, timeout=5)
    with pytest.raises(FileNotFoundError):  # no wait: the error at once
        c.connect({"op": "hello", "who": "r0"})
    starter = threading.Timer(0.3, lambda: servers.append(wire.Server(path, h, name="test").start()))
    starter.start()
    try:
        assert c.connect({"op": "hello", "who": "r0"}, wait_s=10) == {"v": 1, "ok": True, "hi": "r0"}
        assert h.greeted == 1
    finally:
        starter.join()
        for s in servers:
            s.close()
    with pytest.raises(OSError):  # nobody listens within the wait: the last error
        wire.Client(path, timeout=5).connect({"op": "hello", "who": "r1"}, wait_s=0.2)


def test_a_tcp_server_with_the_jobs_secret_serves_only_clients_that_prove_it(caplog):
    """The challenge and response run both ways before the first request: a client without the secret,
    with a wrong one, or one that sends a huge or malformed first frame is refused before the handler
    sees anything (and logged); a client expecting a secret refuses a server that asks for none."""
    import socket as _socket
    import struct as _struct

    seen = []

    class H:
        def handle(self, conn, msg):
            seen.append(msg["op"])
            return {"pong": True}

        def closed(self, conn):
            pass

    secret = b"0123456789abcdef-the-job"
    server = wire.Server(("127.0.0.1", 0), H(), name="peers-test", secret=secret).start()
    try:
        assert wire.Client(server.address, timeout=5, secret=secret).request("holds")["pong"] is True
        assert seen == ["holds"]
        for wrong in (None, b"0123456789abcdef-another"):
            with pytest.raises((wire.WireError, OSError, wire.RemoteError)):
                wire.Client(server.address, timeout=2, secret=wrong, reconnects=0).request("get")
        raw = _socket.create_connection(server.address, timeout=5)  # a stranger's huge first frame
        wire.recv_frame(raw)  # the challenge
        raw.sendall(_struct.pack(">I", 16 << 20))
        assert raw.recv(10) == b""  # closed, nothing allocated for it
        assert seen == ["holds"]  # nothing of theirs was served
        assert "refused a connection from 127.0.0.1" in caplog.text
    finally:
        server.close()
    plain = wire.Server(("127.0.0.1", 0), H(), name="plain").start()
    try:
        with pytest.raises((wire.AuthError, OSError)):
            wire.Client(plain.address, timeout=1, secret=secret, reconnects=0).request("holds")
    finally:
        plain.close()


def test_a_client_marks_its_tcp_connection_with_the_dscp_it_was_given():
    """The DSCP goes into the IP header's TOS byte (``dscp << 2``) of what the client sends; unmarked by
    default; a value outside 0-63 is refused naming it."""
    server = wire.Server(("127.0.0.1", 0), Echo(), name="dscp-test").start()
    clients = [wire.Client(server.address, timeout=5, dscp=d) for d in (8, 0)]
    try:
        for d, c in zip((8, 0), clients):
            assert c.request("echo", x=d)["x"] == d
        assert [c._sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) for c in clients] == [0x20, 0]
        with pytest.raises(ValueError, match="dscp 64: must be an integer from 0 to 63"):
            wire.mark(clients[0]._sock, 64)
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_packet_socket_carries_typed_versioned_messages_and_refuses_others():
    """The spares' packet form: a message with its standard streams passed along; a packet that is not
    the wire's, of another version, or refused by the table is a WireError and its descriptors closed."""
    import os

    from megatron_ft.spares.messages import POOL

    before = _pipes()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        wire.send_packet(a, {"op": "spawn", "argv": ["x.py"], "env": {"A": "1"}, "cwd": "/"}, (r,))
        req, fds = wire.recv_packet(b, POOL, max_fds=3)
        assert (req.argv, req.env, len(fds)) == (["x.py"], {"A": "1"}, 1)
        os.close(fds[0])
        for bad, why in ((b"not json", "not JSON"), (b'{"v": 2, "op": "spawn"}', "wire version 1 expected"),
                         (b'{"v": 1, "op": "spawn", "argv": [], "env": {}, "cwd": "/"}', "argv=.* is invalid")):
            socket.send_fds(a, [bad], [r])
            with pytest.raises(wire.WireError, match=why):
                wire.recv_packet(b, POOL, max_fds=3)
        with pytest.raises(wire.WireError, match="exceeds the 1048576-byte packet limit"):
            wire.send_packet(a, {"op": "spawn", "argv": ["x" * (1 << 20)], "env": {}, "cwd": "/"})
        a.close()
        with pytest.raises(ConnectionError):
            wire.recv_packet(b, POOL)
        # every descriptor that came with a refused packet was closed: only ours remain
        assert _pipes() == before | {r, w}
    finally:
        b.close()
        os.close(r)
        os.close(w)


def _pipes() -> set[int]:
    """This process's open pipe descriptors."""
    import os

    out = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{f}").startswith("pipe:"):
                out.add(int(f))
        except FileNotFoundError:  # the listing's own descriptor
            pass
    return out


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_SEQPACKET])
def test_a_socket_nobody_listens_on_is_removed_and_a_live_one_kept(tmp_path, kind):
    d = tmp_path / "socks"
    path = str(d / "pool.sock")
    srv = socket.socket(socket.AF_UNIX, kind)
    wire.bind_private(srv, path, backlog=4)
    assert not wire.unlink_if_unheard(path, kind) and os.path.exists(path)  # a live server keeps its file
    srv.close()  # as a SIGKILLed server: the file stays, nothing listens
    assert os.path.exists(path)
    assert wire.unlink_if_unheard(path, kind) and not os.path.exists(path)
    assert not wire.unlink_if_unheard(path, kind)  # nothing there any more
