"""One contract, both peer byte transports (``megatron_ft/transport/peer_bytes.py``): the agents' TCP wire
(:class:`WireBytes`) and a process group's point-to-point (:class:`GroupBytes`, gloo here). Each test runs
a sending and a receiving end as processes of their own (``tests/peer_bytes_ends.py``) and expects the
same outcome from both: the bytes land whole, a refusal and a decline are told apart, a peer that dies
mid-transfer is a lost peer (not a timeout), and a landing that never opens ends the send at its bound."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO

ENDS = os.path.join(REPO, "tests", "peer_bytes_ends.py")
TRANSPORTS = ["wire", "group"]
BOUND_S = 120  # the whole exchange of one test (both processes), far above what it needs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(transport: str, mode: str, buffers: str, timeout: float = 30.0, die_after_s: float = 0.0):
    """Both ends; the sender's result lines, the receiver's landed lines and its exit status."""
    rendezvous = f"127.0.0.1:{free_port()}"
    recv = subprocess.Popen([sys.executable, ENDS, "recv", "--transport", transport, "--mode", mode,
                             "--rendezvous", rendezvous], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        to = ""
        if transport == "wire":
            to = json.dumps(json.loads(recv.stdout.readline())["address"])
        sent = subprocess.run([sys.executable, ENDS, "send", "--transport", transport, "--rendezvous", rendezvous,
                               "--to", to, "--buffers", buffers, "--timeout", str(timeout),
                               "--die-after-s", str(die_after_s)],
                              capture_output=True, text=True, timeout=BOUND_S)
        assert sent.returncode == (-9 if die_after_s else 0), sent.stderr[-3000:]
        if mode in ("slow",):
            recv.kill()
        out, _ = recv.communicate("", timeout=BOUND_S)  # its stdin closed: the receiving end stops
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    results = [json.loads(line) for line in sent.stdout.splitlines() if line.startswith("{")]
    landed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return results, landed, recv.returncode


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_buffers_land_whole_and_in_order(transport):
    spec = "3:copy.r0:0,3:copy.r1:1,4:xor.g0.p0:65537,5:rs.g0.p1.row0:3145728"
    results, landed, rc = run_pair(transport, "keep", spec)
    assert [r["result"] for r in results] == ["landed"] * 4, results
    assert rc == 0
    assert [(x["step"], x["key"], x["sha256"], x["meta"]["spec"]) for x in landed] == \
        [(int(s.split(":")[0]), s.split(":")[1], r["sha256"], s) for s, r in zip(spec.split(","), results)]
    assert {x["src"] for x in landed} == {0}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_declined_buffer_and_a_refused_one_are_told_apart(transport):
    (declined,), landed, _ = run_pair(transport, "decline", "7:copy.r0:4096")
    assert (declined["result"], declined["declined"]) == ("PeerRefused", True), declined
    assert "declined copy.r0 of step 7" in declined["message"] and not landed
    (refused,), landed, _ = run_pair(transport, "refuse", "7:copy.r0:4096")
    assert (refused["result"], refused["declined"]) == ("PeerRefused", False), refused
    assert "no room for 4096 bytes here" in refused["message"] and not landed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_that_dies_mid_transfer_is_lost_not_timed_out(transport):
    (r,), landed, rc = run_pair(transport, "die", f"9:copy.r0:{512 << 20}", timeout=60.0)
    assert r["result"] == "PeerLost", r
    assert "copy.r0 of step 9" in r["message"] and not landed
    assert rc == -9  # the receiving end killed itself mid-transfer


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sender_that_dies_mid_transfer_leaves_the_buffer_abandoned_not_landed(transport):
    results, landed, rc = run_pair(transport, "keep", f"8:copy.r0:16,9:copy.r0:{1 << 30}", die_after_s=0.05)
    assert [r["result"] for r in results] == ["landed"] and rc == 0  # the receiving end ended by itself
    assert [x.get("step") for x in landed] == [8, None], landed
    assert landed[1] == {"abandoned": [0, 9, "copy.r0"]}, landed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_landing_that_never_opens_ends_the_send_at_its_bound(transport):
    (r,), landed, _ = run_pair(transport, "slow", "11:copy.r0:4096", timeout=1.0)
    assert r["result"] == "PeerTimeout", r
    assert "not landed within 1 s" in r["message"] and not landed


def test_the_payloads_are_a_function_of_the_name():
    sys.path.insert(0, os.path.dirname(ENDS))
    from peer_bytes_ends import payload
    assert payload(3, "a", 100) == payload(3, "a", 100) != payload(4, "a", 100)
    assert hashlib.sha256(payload(3, "a", 0)).hexdigest() == hashlib.sha256(b"").hexdigest()
