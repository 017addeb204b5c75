"""Local sockets are private: the agent's and the spare pool's Unix sockets live in a directory of
mode 0700 owned by the job's user, are 0600 themselves, and refuse a process of another user (its uid
from SO_PEERCRED) before reading anything from it - also where the permissions were loosened. The
stranger is a real process of uid 65534 (nobody), run with the system's Python."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
import time

import psutil
import pytest

from megatron_ft.spares import pool
from megatron_ft.transport import wire
from megatron_ft.testing.helpers import wait_for

NOBODY = 65534
STRANGER_PYTHON = "/usr/bin/python3"  # readable by every user (the project's venv may not be)


@pytest.fixture
def shared_tmp():
    """A directory under /tmp that uid 65534 may traverse (pytest's own tmp_path is root's alone)."""
    if os.geteuid() != 0 or not os.path.exists(STRANGER_PYTHON):
        why = "needs root (to run a process as another user) and /usr/bin/python3"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the private-socket tests: {why}")
        pytest.skip(why)
    d = tempfile.mkdtemp(prefix="mft-private-", dir="/tmp")
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_stranger(code: str) -> dict:
    """Run ``code`` (it prints one JSON line) as uid/gid 65534; its output."""
    out = subprocess.run([STRANGER_PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


CONNECT = """
import json, socket, struct
s = socket.socket(socket.AF_UNIX, socket.{kind})
try:
    s.connect({path!r})
except OSError as e:
    print(json.dumps({{"connected": False, "errno": e.errno}})); raise SystemExit
s.settimeout(10)
try:
    s.sendall({frame!r})
    got = s.recv(65536)
except OSError as e:
    got = repr(e).encode()
print(json.dumps({{"connected": True, "reply": got.decode(errors="replace")}}))
"""


def refused(reply: str) -> bool:
    """The server closed the connection without a word (before or after the stranger's frame)."""
    return reply == "" or reply.startswith(("ConnectionResetError", "BrokenPipeError"))


class Counter:
    def __init__(self):
        self.calls = 0

    def handle(self, conn, msg):
        self.calls += 1
        return {"pong": True}

    def closed(self, conn):
        pass


def test_the_agent_socket_is_private_and_refuses_another_users_process(shared_tmp):
    path = os.path.join(shared_tmp, "socks", "job.node0.sock")
    handler = Counter()
    srv = wire.Server(path, handler, name="t").start()
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert wire.Client(path, 5.0).request("ping")["pong"] is True  # the job's own user
        assert handler.calls == 1
        frame = wire._LEN.pack(len(b'{"v": 1, "op": "status"}')) + b'{"v": 1, "op": "status"}'
        probe = CONNECT.format(kind="SOCK_STREAM", path=path, frame=frame)
        assert as_stranger(probe) == {"connected": False, "errno": 13}  # the directory keeps it out
        os.chmod(os.path.dirname(path), 0o777)  # loosened by mistake: the uid check still refuses
        os.chmod(path, 0o666)
        got = as_stranger(probe)
        assert got["connected"] and refused(got["reply"]), got  # closed unanswered
        assert handler.calls == 1  # nothing of the stranger's reached the handler
    finally:
        srv.close()


def test_a_socket_directory_of_another_user_or_open_to_others_is_refused(shared_tmp):
    theirs = os.path.join(shared_tmp, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"belongs to uid {NOBODY}, not to this job's uid 0"):
        wire.private_directory(theirs)
    with pytest.raises(PermissionError, match=r"/tmp is open to other users \(mode 1777\).*chmod 700 /tmp"):
        wire.private_directory("/tmp")
    assert stat.S_IMODE(os.stat("/tmp").st_mode) == 0o1777  # never chmod-ed


def test_the_spare_pool_never_forks_for_another_users_process(shared_tmp):
    path = os.path.join(shared_tmp, "pool", "job.node0.spares.sock")
    log_path = os.path.join(shared_tmp, "spares.log")
    proc = pool.start(path, log_path, ("json",))
    try:
        assert pool.wait_warm(proc, path, 60) is None, open(log_path).read()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        os.chmod(os.path.dirname(path), 0o777)
        os.chmod(path, 0o666)
        request = json.dumps({"v": 1, "op": "spawn", "argv": ["-c", "open('/tmp/owned', 'w')"], "env": {},
                              "cwd": "/"}).encode()  # a well-formed request (megatron_ft/spares/messages.py)
        got = as_stranger(CONNECT.format(kind="SOCK_SEQPACKET", path=path, frame=request))
        assert got["connected"] and refused(got["reply"]), got
        wait_for("the pool to log the refusal", lambda: "refused a connection from pid" in open(log_path).read(), 10)
        time.sleep(0.5)
        assert psutil.Process(proc.pid).children() == []  # no keeper was forked
    finally:
        pool.stop(proc, path)
