"""The agent's operations as a table: each op of :data:`.protocol.MESSAGES` -> its handler, called
with the agent service (:class:`.server.Agent`) and the op's typed request, returning the reply.

Handlers run on the connection's thread of the wire server, with no lock held; each takes only the
locks of the part it calls (the slot store's, the persister's, ...). ``bye`` and ``shutdown`` answer
empty here: the service closes the connection (and shuts down) after replying.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from .. import config as ftconfig
from ..transport.messages import Request

Handler = Callable[[Any, Request], dict]


def _hello(a, r) -> dict:
    if r.run_id != a.run_id:
        raise ValueError(f"run_id {r.run_id!r} does not match this agent's {a.run_id!r}")
    return {"node": a.node, "agent_pid": os.getpid(), "settings": ftconfig.shared_settings(a.cfg),
            "decides": a.agreement is not None and a.agreement.decides}


def _agreed(a) -> dict:
    """The reply of commit and skip: the job's agreed step as this agent knows it (agents mode)."""
    return {"agreed": a.agreement.verdict.agreed} if a.agreement is not None else {}


def _commit(a, r) -> dict:
    a.commit(r.rank, r.slot, r.step, r.loss)
    return _agreed(a)


def _skip(a, r) -> dict:
    a.slots.skip(r.rank, r.step)
    return _agreed(a)


def _group_wait_s(a, r) -> float:
    """How long a restore's request may wait for the group's members to answer: what the trainer
    asked for (it waits that long plus its request timeout), else the health settings' default."""
    return r.wait_s if r.wait_s is not None else a.cfg.health.group_answer_s


def _peer_list(a, r) -> dict:
    if a.redundancy is None:
        return {"versions": [], "unanswered": {}}
    return a.redundancy.rebuild.candidates(r.rank, _group_wait_s(a, r))


def _recover(a, r) -> dict:
    if a.redundancy is None:
        raise RuntimeError("redundancy.scheme is none: nothing to recover from peers")
    out = a.redundancy.rebuild.recover(r.rank, r.step, _group_wait_s(a, r))
    a.redundancy.rebuilt(r.step)
    return out


def _scheduled(handler: Handler) -> Handler:
    """A scheduled transport's op: refused unless ``redundancy.transport`` is ``scheduled`` here."""
    def run(a, r) -> dict:
        if a.redundancy is None or not a.redundancy.scheduled:
            raise RuntimeError(f"{r.op}: redundancy.transport is not 'scheduled' on node {a.node}")
        return handler(a, r)
    return run


def _sched_unpin(a, r) -> dict:
    a.slots.transport.unpin(r.rank)
    return {}


def _abort(a, r) -> dict:
    a.slots.abort(r.rank, r.slot)
    return {}


def _global(a, r) -> dict:
    a.mark_global(r.rank, r.step)
    return {}


def _persist(a, r) -> dict:
    step = r.step if r.step is not None else a.slots.newest_consistent_step()
    return {"queued": a.persister.request(step, "requested"), "step": step}


HANDLERS: dict[str, Handler] = {
    "hello": _hello,
    "register": lambda a, r: a.register(r.rank, r.layout),
    "begin": lambda a, r: {"slot": a.begin(r.rank, r.step)},
    "commit": _commit,
    "decide": lambda a, r: {"values": a.decisions.decide(a.agreement, r.rank, r.key, r.how, list(r.values),
                                                         float(r.wait_s))},
    "judged": lambda a, r: a.judge(r.rank, r.iteration, r.anomalous),
    "agreed": lambda a, r: {"agreed": a.agreement.verdict.agreed if a.agreement is not None else -1},
    "skip": _skip,
    "abort": _abort,
    "invalidate": lambda a, r: {"invalidated": a.slots.invalidate(r.rank, r.step)},
    "refuse": lambda a, r: a.refuse(r.rank, r.step),
    "losses": lambda a, r: a.guard.history(r.rank),
    "certify": lambda a, r: a.certify(r.rank, r.step),
    "watch": lambda a, r: a.watch(r.rank, r.step),
    "global": _global,
    "rewind": lambda a, r: a.rewind(r.rank, r.step),
    "list": lambda a, r: {"versions": a.slots.list_versions(r.rank)},
    "peer_list": _peer_list,
    "recover": _recover,
    "sched_pin": _scheduled(lambda a, r: a.redundancy.sched_pin(r.rank, r.step)),
    "sched_unpin": _scheduled(_sched_unpin),
    "sched_recv_begin": _scheduled(lambda a, r: a.redundancy.sched_recv_begin(r.src_rank, r.step, r.length)),
    "sched_recv_done": _scheduled(lambda a, r: a.redundancy.sched_recv_done(r.src_rank, r.step)),
    "status": lambda a, r: {"status": a.status()},
    "adopt": lambda a, r: a.launcher.adopt(r.launcher_pid),
    "persist": _persist,
    "wait_persisted": lambda a, r: {"persisted": a.persister.wait(60.0 if r.wait_s is None else r.wait_s)},
    "bye": lambda a, r: {},
    "shutdown": lambda a, r: {},
}
