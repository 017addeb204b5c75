"""The spares' control messages: typed requests of the wire's packet form
(:func:`megatron_ft.transport.wire.send_packet` / :func:`~megatron_ft.transport.wire.recv_packet`: one
versioned JSON object per ``SOCK_SEQPACKET`` packet, at most ``PACKET_MAX`` bytes, standard streams
passed along with ``SCM_RIGHTS``), on private Unix sockets whose callers' uid is checked.

=======================  =========  ==========================================================
socket                   op         fields
=======================  =========  ==========================================================
worker -> pool           spawn      argv, env, cwd (+ the worker's stdin, stdout, stderr)
keeper -> worker         started    pid (the trainer runs)
keeper -> worker         exited     code (a signal as ``-N``)
worker -> keeper         signal     signal (torchrun's, forwarded)
trainer -> keeper        rejoinable pid (it can rejoin a fast-restart round in place)
trainer -> keeper        restarting round
trainer -> keeper        failed     reason (a peer's death reached it first)
keeper -> trainer        round      round, port (rejoin round ``round``; its store's port)
keeper -> trainer        exit       - (no round: end as before)
pool -> watcher          keeper     - (+ one end of a new keeper's socket to the node's watcher)
keeper -> watcher        rounds     addr, port, attempt, limit (follow this attempt's rounds)
keeper -> watcher        open       round (open it in the job's store; once per node)
keeper -> watcher        publish    round, port (torchrun's rank 0: the round's store listens)
keeper -> watcher        verdicts   config, settle_s (the root's verdicts for that long from now)
watcher -> keeper        opened     round (the newest round opened)
watcher -> keeper        port       round, port (that round's store listens there)
watcher -> keeper        gone       reason (the job's store is gone: no more rounds)
watcher -> keeper        verdict    value (the root's ``last_verdict``, as it changed)
=======================  =========  ==========================================================

The worker checks the two replies it reads without pydantic (it must start in milliseconds:
:data:`WORKER_REPLIES`); every other side validates with these models.

    >>> POOL.parse({"v": 1, "op": "spawn", "argv": ["train.py"], "env": {"RANK": "0"}, "cwd": "/"}).argv
    ['train.py']
    >>> FROM_TRAINER.parse({"v": 1, "op": "restarting", "round": "2"})
    Traceback (most recent call last):
    ...
    ValueError: keeper control op 'restarting': round='2' is invalid: Input should be a valid integer
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt, StrictStr

from ..transport.messages import Messages, Request

Pid = Annotated[StrictInt, Field(ge=1)]
Round = Annotated[StrictInt, Field(ge=0)]


class Spawn(Request):
    """A trainer with the worker's arguments, environment and working directory."""
    argv: Annotated[list[StrictStr], Field(min_length=1)]
    env: dict[StrictStr, StrictStr]
    cwd: StrictStr


class Started(Request):
    pid: Pid


class Exited(Request):
    code: StrictInt


class Forward(Request):
    signal: Annotated[StrictInt, Field(ge=1, le=64)]


class Rejoinable(Request):
    pid: Pid


class Restarting(Request):
    round: Round


class Failed(Request):
    reason: Annotated[StrictStr, Field(max_length=300)]


class RoundOpened(Request):
    round: Round
    port: Annotated[StrictInt, Field(ge=1, le=65535)]


class Rounds(Request):
    addr: Annotated[StrictStr, Field(min_length=1, max_length=255)]
    port: Annotated[StrictInt, Field(ge=1, le=65535)]
    attempt: Annotated[StrictStr, Field(max_length=300)]
    limit: Round


class Open(Request):
    round: Annotated[StrictInt, Field(ge=1)]


class Verdicts(Request):
    config: Annotated[StrictStr, Field(max_length=4096)]
    settle_s: Annotated[float, Field(ge=0, le=3600, strict=False)]


class Opened(Request):
    round: Round


class Gone(Request):
    reason: Annotated[StrictStr, Field(max_length=500)]


class Verdict(Request):
    value: Annotated[StrictStr, Field(max_length=1000)]


#: what the pool accepts
POOL = Messages("pool", {"spawn": Spawn})
#: what a keeper reads from its worker
FROM_WORKER = Messages("keeper", {"signal": Forward})
#: what a keeper reads from its trainer's control socket (in-process restart)
FROM_TRAINER = Messages("keeper control", {"rejoinable": Rejoinable, "restarting": Restarting, "failed": Failed})
#: what a trainer reads from its keeper
TO_TRAINER = Messages("trainer control", {"round": RoundOpened, "exit": Request})
#: what the node's watcher reads: from the pool, then from each keeper (:mod:`.node_watch`)
TO_WATCHER = Messages("node watcher", {"keeper": Request, "rounds": Rounds, "open": Open, "publish": RoundOpened,
                                       "verdicts": Verdicts})
#: what a keeper reads from the node's watcher
FROM_WATCHER = Messages("keeper watch", {"opened": Opened, "port": RoundOpened, "gone": Gone, "verdict": Verdict})
