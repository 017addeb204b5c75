"""Fencing: an agent judged lost whose node a standby claimed cannot act on the job's state again.

A node's agent can be judged lost while it still lives - a paused process or VM, a host starved for
``health.timeout_s``, a healed network partition - and a standby can claim its node meanwhile
(:func:`~megatron_ft.health.monitor.claim_key`, a compare-and-set per verdict). From that claim on,
the old agent is an old generation of the node: whatever it writes (a heartbeat, an agreement report,
a stall report, a size, a verdict if it was the root) would compete with the new agent's.

The claim itself is the fence. Claiming verdict ``claim/<node>/<pid>/<time>`` for a standby also sets
``fenced/<node>/<pid>`` to the claimer, in the same step: on the embedded store the root derives it
under its map's lock (:func:`derive_fences`, installed on every node's server by
:class:`~megatron_ft.health.store.EmbeddedStore`); on etcd the claim's transaction puts both
(:meth:`~megatron_ft.health.etcd.EtcdStore.compare_set`). A withdrawn verdict (the tombstone
``withdrawn-by-...``) fences nothing.

Every write an agent makes to the store - ``set``, ``compare_set``, ``delete``, the publishing of its
keys, on etcd its liveness key at a new lease - names its own fence key (``fence=``); the store
applies the write only while that key is absent, else answers *fenced* with the claimer, and the
agent's store calls its stand-down once (:class:`Fenced` to the caller): the agent ends with
:data:`~megatron_ft.fatal.EXIT_STOOD_DOWN`, its launcher ends the node's trainers, saying who took the
node. So a returning agent acts at most once more - the write that is refused - whatever thread writes
first: one key lookup per write at the store, nothing per heartbeat period added. It never rejoins
under its old identity; the node goes on as the claimer's.

Scope: the store's state. Reads are not fenced (they change nothing). A returning agent's peer
transfers and a trainer's collectives are not checked here: the agent ends at its first store write -
its heartbeat thread writes within ``health.heartbeat_s`` of running again - and the trainers of the
old generation belong to a torchrun rendezvous generation the job left. On the embedded store the
fence keys live in the root's map like the verdicts and claims they come from: a root failover loses
them with those (docs/health.md, "A paused agent").

    >>> fence_key(3, 4242)
    'fenced/3/4242'
    >>> derive_fences("3/4242/1700000000.5", "spare-host:77")
    {'fenced/3/4242': 'spare-host:77'}
    >>> derive_fences("3/4242/1700000000.5", "withdrawn-by-root0")
    {}
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, NoReturn, Optional

log = logging.getLogger("megatron_ft.health")

#: under the job's prefix: ``fenced/<node>/<agent pid>`` = who claimed that agent's node
PREFIX = "fenced/"
#: the claims' keys (``claim/<node>/<pid>/<verdict time>``, :func:`~megatron_ft.health.monitor.claim_key`)
CLAIM_PREFIX = "claim/"
#: a claim value that withdraws a verdict instead of taking the node (same as ``monitor.WITHDRAWN``)
WITHDRAWN = "withdrawn-by-"


class Fenced(Exception):
    """A write refused because the writer's node was claimed by another (``claimer``) after the root
    judged this agent lost. Not a :class:`~megatron_ft.health.kv.StoreUnavailable`: asking again, or
    another root, changes nothing."""

    def __init__(self, key: str, claimer: str, where: str = ""):
        self.key, self.claimer = key, claimer
        super().__init__(f"store{(' at ' + where) if where else ''}: write refused - {key!r} says this agent's node "
                         f"was claimed by {claimer} after the root judged the agent lost")


def fence_key(node: int, pid: int) -> str:
    """The key that fences agent ``pid`` of ``node`` (under the job's prefix)."""
    return f"{PREFIX}{node}/{pid}"


def fence_of_claim(key: str, value: str) -> Optional[tuple[str, str]]:
    """(fence key, claimer) that a claim ``claim/<node>/<pid>/<time>`` = ``value`` sets, or None: a
    withdrawal, or not a claim key. ``key`` under the job's prefix."""
    if not key.startswith(CLAIM_PREFIX) or not value or value.startswith(WITHDRAWN):
        return None
    parts = key[len(CLAIM_PREFIX):].split("/")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return fence_key(int(parts[0]), int(parts[1])), value


def derive_fences(claim: str, value: Optional[str]) -> dict[str, Optional[str]]:
    """The embedded store's derived keys for a ``set`` of ``claim/<claim>`` (``claim``: the key after
    ``claim/``): the fence of the claimed agent, or nothing. Pure, called under the map's lock."""
    got = fence_of_claim(CLAIM_PREFIX + claim, value or "")
    return {got[0]: got[1]} if got is not None else {}


class Fence:
    """One agent's fence on its store client: the key its writes name (None until :meth:`arm`: a
    launcher's or a standby's client writes unfenced) and the stand-down called, once, at the first
    refusal. Thread-safe: any thread of the agent may write first."""

    def __init__(self) -> None:
        self.key: Optional[str] = None
        self._on_fenced: Callable[[str], None] = lambda why: None
        self._told = False
        self._lock = threading.Lock()

    def arm(self, node: int, pid: int, on_fenced: Callable[[str], None]) -> None:
        """From now on every write names ``fenced/<node>/<pid>``; ``on_fenced(why)`` at the first refusal
        (called on the refused writer's thread, no lock held; it must not block: the agent's stand-down
        starts its shutdown on a thread of its own)."""
        with self._lock:
            self.key, self._on_fenced = fence_key(node, pid), on_fenced

    def refused(self, e: Fenced) -> NoReturn:
        """A write was fenced: tell the agent (once), then raise ``e`` to the writer."""
        with self._lock:
            first, self._told = not self._told, True
            on = self._on_fenced
        if first:
            log.error("%s", e)
            on(f"node's store refused this agent's write: it was judged lost and {e.claimer} claimed the node")
        raise e
