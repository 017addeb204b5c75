"""Typed requests (megatron_ft.transport.messages): the agent's and the peers' operations as the
project's senders build them validate; malformed ones are refused naming the operation, the field,
the value and what is allowed."""
import pytest

from megatron_ft.agent.peer_protocol import PEER_MESSAGES, Get, PutMeta
from megatron_ft.transport.messages import validated
from megatron_ft.transport.wire_bytes import PutBytes
from megatron_ft.agent.protocol import MESSAGES

SENT = [  # every agent operation, with the fields its senders use (trainer, launcher, CLI, transport)
    {"op": "hello", "rank": 3, "local_rank": 1, "pid": 99, "run_id": "r"},
    {"op": "hello", "rank": -1, "local_rank": -1, "pid": 0, "run_id": "r"},
    {"op": "hello", "rank": 3, "local_rank": 1, "pid": 99, "run_id": "r", "role": "transport"},
    {"op": "register", "rank": 0, "layout": "{}"},
    {"op": "begin", "rank": 0, "step": 4}, {"op": "skip", "rank": 0, "step": 4}, {"op": "agreed", "rank": 0}, {"op": "judged", "rank": 0, "iteration": 7, "anomalous": False},
    {"op": "decide", "rank": 0, "key": "r1a2/0", "how": "intersect", "values": [4, 3], "wait_s": 600.0}, {"op": "commit", "rank": 0, "slot": 1, "step": 4},
    {"op": "commit", "rank": 0, "slot": 1, "step": 4, "loss": 2.5}, {"op": "refuse", "rank": 0, "step": 4},
    {"op": "losses", "rank": 0}, {"op": "certify", "rank": 0, "step": 4}, {"op": "watch", "rank": 0, "step": 4},
    {"op": "abort", "rank": 0, "slot": 1}, {"op": "global", "rank": 0, "step": 4},
    {"op": "rewind", "rank": 0, "step": -1}, {"op": "invalidate", "rank": 0, "step": 4},
    {"op": "list", "rank": 0}, {"op": "peer_list", "rank": 0}, {"op": "recover", "rank": 0, "step": 4},
    {"op": "sched_pin", "rank": 0, "step": 4}, {"op": "sched_unpin", "rank": 0},
    {"op": "sched_recv_begin", "src_rank": 1, "step": 4, "length": 4096},
    {"op": "sched_recv_done", "src_rank": 1, "step": 4}, {"op": "status"}, {"op": "adopt", "launcher_pid": 7},
    {"op": "persist", "rank": 0, "step": 4}, {"op": "persist"}, {"op": "wait_persisted", "wait_s": 30},
    {"op": "bye"}, {"op": "shutdown"},
]


@pytest.mark.parametrize("msg", SENT, ids=lambda m: m["op"])
def test_every_agent_operation_as_sent_validates(msg):
    req = MESSAGES.parse({"v": 1, **msg})
    assert req.op == msg["op"] and {k: getattr(req, k) for k in msg} == msg


def test_every_agent_operation_has_a_type():
    assert {m["op"] for m in SENT} == set(MESSAGES.ops)


@pytest.mark.parametrize("msg,error", [
    ({"op": "begin", "rank": 0, "step": 2.0}, "agent op 'begin': step=2.0 is invalid: Input should be a valid integer"),
    ({"op": "begin", "rank": True, "step": 2}, "agent op 'begin': rank=True is invalid"),
    ({"op": "hello", "rank": 0, "local_rank": 0, "pid": 1, "run_id": "r", "role": "spy"},
     "agent op 'hello': role='spy' is invalid: Input should be 'transport' or 'coordination'"),
    ({"op": "adopt", "launcher_pid": 0}, "agent op 'adopt': launcher_pid=0 is invalid: Input should be greater than 0"),
    ({"op": "abort", "rank": 0}, "agent op 'abort': field 'slot' is missing"),
    ({"op": "commit", "rank": 0, "slot": 1, "step": 4, "loss": float("nan")}, "agent op 'commit': loss=nan is invalid"),
    ({"op": None}, "agent op None is unknown; allowed: ['abort', "),
])
def test_malformed_agent_requests_are_refused_with_the_field(msg, error):
    with pytest.raises(ValueError) as e:
        MESSAGES.parse({"v": 1, **msg})
    assert str(e.value).startswith(error)


def test_peer_requests_round_trip_and_refuse_what_they_do_not_allow():
    put = PutBytes(op="put", key="copy.r1", step=3, src=1, meta={"kind": "copy", "length": 64, "expect": 1})
    assert PEER_MESSAGES.parse({"v": 1, **put.fields(), "nbytes": 64}) == put.model_copy(update={"nbytes": 64})
    assert validated(PutMeta, put.meta, "put meta").length == 64
    get = Get(op="get", what="block", step=3, lo=0, hi=64, key="copy.r1")
    assert PEER_MESSAGES.parse({"v": 1, **get.fields()}) == get
    assert PEER_MESSAGES.parse({"v": 1, "op": "holds"}).op == "holds"
    with pytest.raises(ValueError, match=r"put meta: kind='parity' is invalid: Input should be 'copy', 'xor' or 'rs'"):
        validated(PutMeta, {**put.meta, "kind": "parity"}, "put meta")
    with pytest.raises(ValueError, match=r"peer op 'put': field 'kind' is not one of"):
        PEER_MESSAGES.parse({"v": 1, **put.fields(), "kind": "copy"})
    with pytest.raises(ValueError, match=r"peer op 'get': lo=-1 is invalid"):
        PEER_MESSAGES.parse({"v": 1, **get.fields(), "lo": -1})
    with pytest.raises(ValueError, match=r"peer op 'announce': field 'node' is missing"):
        PEER_MESSAGES.parse({"v": 1, "op": "announce", "step": 3})
