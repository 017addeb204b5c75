"""Control messages between trainers and their node's agent.

Frames, versions, errors, timeouts and retries are the wire layer's
(:mod:`megatron_ft.transport.wire`); this module names the operations and types their requests
(:data:`MESSAGES`, validated by the agent before it acts: a malformed request is refused naming
the operation, the field and the value). Only small control data
travels here; snapshot bytes go through shared memory.

Operations (request fields -> reply fields):

==============  ==========================================  =================================
op              request                                     reply
==============  ==========================================  =================================
hello           rank, local_rank, pid, run_id[, role]       node, agent_pid, settings
register        rank, layout                                slots: [path, ...], adopted
begin           rank, step                                  slot (index) | refused, busy
commit          rank, slot, step[, loss] (step's loss)      agreed (the job's agreed step, as
                                                            this agent knows it; agents mode)
decide          rank, key, how (min, max, intersect),       values (the job's result)
                values, wait_s (a job-wide decision of a
                restore: the agents combine it, no world
                collective)
judged          rank, iteration, anomalous (its loss          certified (the newest certified step
                judged: recovery.prefer: certified)         as this agent knows it)
agreed          rank                                        agreed (the job's agreed step, as
                                                            this agent knows it; -1: none)
skip            rank, step (no snapshot of it: the job's    agreed
                agreement must not wait for this rank)
abort           rank, slot                                  -
global          rank, step (consistent on every rank)       -
rewind          rank, step (the job resumes from it)        -
invalidate      rank, step (found corrupt at restore)       invalidated (bool)
refuse          rank, step (the guard refused it: it and    rollbacks (this rank's, counted)
                every newer version dropped)
losses          rank                                        losses: {step: loss}, rollbacks
certify         rank, step (trained past, no anomaly)       certified: [step, ...], held (its
                                                            slot kept; rollbacks forgiven)
watch           rank, step (its next iterations judged)     held (its slot kept meanwhile)
list            rank                                        versions: [{slot, step, state, path,
                                                            certified}]
peer_list       rank, wait_s (for the group's answers)      versions rebuildable from peers,
                                                            unanswered: {node: why}
recover         rank, step, wait_s                          source (the tier it came from)
sched_*         the scheduled transport's pins and receives
status          -                                           every rank's versions, persists
persist         step                                        queued (bool), step
wait_persisted  wait_s                                      persisted: [step, ...]
adopt           launcher_pid (a restarted launcher)         node, agent_pid
bye             -                                           - (orderly trainer exit)
shutdown        -                                           - (agent removes its segments and exits)
==============  ==========================================  =================================
"""
from __future__ import annotations

import os
import socket

from typing import Annotated, Literal, Optional

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..transport.messages import Bytes, Messages, Rank, Request, Step
from ..transport.wire import Client, RemoteError, unlink_if_unheard

AnyRank = Annotated[StrictInt, Field(ge=-1)]  # -1: a launcher or the command line, no trainer


class Hello(Request):
    rank: AnyRank
    local_rank: AnyRank
    pid: StrictInt
    # a trainer's second connection: its scheduled transport's, or its restore's job-wide decisions'
    # (closed under a round's abort: not a trainer lost)
    role: Optional[Literal["transport", "coordination"]] = None


class Register(Request):
    rank: Rank
    layout: StrictStr  # the layout record (JSON, megatron_ft.capture.layout)


class RankOnly(Request):  # list, peer_list, losses, agreed, sched_unpin
    rank: Rank


class RankStep(Request):  # begin, skip, global, rewind, invalidate, refuse, certify, watch, recover, sched_pin
    rank: Rank
    step: Step


class Judged(Request):
    rank: Rank
    iteration: Step
    anomalous: StrictBool


class Decide(Request):
    rank: Rank
    key: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._/-]{1,200}$")]
    how: Literal["min", "max", "intersect"]
    values: Annotated[list[StrictInt], Field(max_length=64)]
    wait_s: Annotated[float, Field(gt=0, le=3600, strict=False)]


class Commit(Request):
    rank: Rank
    slot: Annotated[StrictInt, Field(ge=0)]
    step: Step
    loss: Optional[Annotated[StrictFloat, Field(allow_inf_nan=False)]] = None  # the step's training loss


class Abort(Request):
    rank: Rank
    slot: Annotated[StrictInt, Field(ge=0)]


class SchedRecvBegin(Request):
    src_rank: Rank
    step: Step
    length: Bytes


class SchedRecvDone(Request):
    src_rank: Rank
    step: Step


class Adopt(Request):
    launcher_pid: Annotated[StrictInt, Field(gt=0)]


class Persist(Request):
    rank: Optional[Rank] = None
    step: Optional[Step] = None  # None: the newest consistent step


class NoFields(Request):  # status, wait_persisted, bye, shutdown
    pass


MESSAGES = Messages("agent", {
    "hello": Hello, "register": Register, "begin": RankStep, "skip": RankStep, "agreed": RankOnly, "decide": Decide, "judged": Judged,
    "commit": Commit, "abort": Abort,
    "global": RankStep, "rewind": RankStep, "invalidate": RankStep, "refuse": RankStep, "losses": RankOnly,
    "certify": RankStep, "watch": RankStep,
    "list": RankOnly, "peer_list": RankOnly,
    "recover": RankStep, "sched_pin": RankStep, "sched_unpin": RankOnly, "sched_recv_begin": SchedRecvBegin,
    "sched_recv_done": SchedRecvDone, "status": NoFields, "adopt": Adopt, "persist": Persist,
    "wait_persisted": NoFields, "bye": NoFields, "shutdown": NoFields,
})


class AgentError(RemoteError):
    """The agent refused a request; ``kind`` names the agent-side error class (e.g. SharedMemoryError)."""


class AgentClient(Client):
    """A connection to the node's agent over :mod:`megatron_ft.transport.wire` (thread-safe: one
    request at a time). ``timeout`` bounds every call: ``agent.request_timeout_s``. After an agent
    restart the connection is re-opened once and ``hello`` sent again (the wire's retry policy)."""

    def __init__(self, socket_path: str, timeout: float):
        super().__init__(socket_path, timeout, error=AgentError)
        self.socket_path = socket_path

    def connect(self, hello: dict, wait_s: float = 0.0) -> dict:  # type: ignore[override]
        """Open the connection and say ``hello`` (rank, local_rank, pid, run_id[, role]); ``wait_s``: how
        long to wait for an agent that is not listening yet (see :meth:`Client.connect`)."""
        reply = super().connect({"op": "hello", **hello}, wait_s)
        assert reply is not None
        return reply

    def close(self, orderly: bool = True) -> None:  # type: ignore[override]
        """``orderly``: say ``bye`` first (the agent then does not treat the trainer as lost)."""
        super().close("bye" if orderly else None)


def agent_status(cfg, node: int) -> dict:
    """Node ``node``'s agent's ``status`` (its version table, agreement, memory; ``megatron-ft status``):
    one connection as no rank, closed with ``bye``. An ``OSError`` where no agent answers on the node's
    socket, an :class:`AgentError` where it refuses."""
    c = AgentClient(socket_path(cfg.agent.socket_dir, cfg.run_id, node), cfg.agent.request_timeout_s)
    c.connect({"rank": -1, "local_rank": -1, "pid": os.getpid(), "run_id": cfg.run_id})
    try:
        return c.request("status")["status"]
    finally:
        c.close(orderly=True)


MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path on Linux, minus the terminating NUL


def spares_socket_path(socket_dir: str, run_id: str, node: int) -> str:
    """Where node ``node``'s spare pool listens (``megatron_ft/spares/pool.py``): its agent removes it when
    the job ends and nothing listens there (the pool died with a SIGKILLed launcher)."""
    return f"{socket_dir.rstrip('/')}/{run_id}.node{node}.spares.sock"


def remove_node_sockets(socket_dir: str, run_id: str, node: int) -> None:
    """At the agent's shutdown (the node's last process): its own socket, and the node's spare pool's if
    nothing listens there (the pool dies with a SIGKILLed launcher and cannot unlink it)."""
    try:
        os.unlink(socket_path(socket_dir, run_id, node))
    except FileNotFoundError:
        pass
    unlink_if_unheard(spares_socket_path(socket_dir, run_id, node), socket.SOCK_SEQPACKET)


def socket_path(socket_dir: str, run_id: str, node: int) -> str:
    path = f"{socket_dir.rstrip('/')}/{run_id}.node{node}.sock"
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"agent.socket_dir={socket_dir!r} is too long: the agent socket path {path!r} has "
                         f"{len(path.encode())} bytes, Unix sockets allow {MAX_SOCKET_PATH}; use a shorter directory")
    return path
