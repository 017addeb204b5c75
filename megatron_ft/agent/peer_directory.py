"""What one node's agent knows of the other members of its redundancy group: their peer transport
addresses and their ranks' container sizes (published in the coordination store), their answers to
"what do you hold" (shared for a moment by this node's ranks: a restore's ranks all ask at once, one
question per node, not per rank), and connections to them.

Lock: ``PeerDirectory._asking`` (one question to the group at a time), held across that question's
network I/O and nothing else's; it is taken with no other lock of the agent held. Store calls and
connections are made with no lock held otherwise. Not collective.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Optional

from ..clock import Deadline
from .peer_rebuild import GroupHoldings, PeerError
from ..health.kv import StoreUnavailable
from ..transport import wire

log = logging.getLogger("megatron_ft.agent")

#: how long the group's answers to "what do you hold" serve this node's other ranks (a restore's ranks
#: ask within milliseconds of each other; nothing is exchanged while they restore)
ANSWERS_FRESH_S = 2.0


class PeerDirectory:
    """One node's view of its group (see the module). ``own_holds``: this node's own ``holds`` reply
    (it counts like a survivor's); ``stop``: set when the agent shuts down (no more waiting)."""

    def __init__(self, cfg: Any, node: int, members: tuple, group_ranks: list[int], store: Any,
                 secret: Optional[bytes], own_holds: Callable[[], dict], stop: threading.Event):
        self.cfg, self.node, self.members, self.group_ranks = cfg, node, members, group_ranks
        self.store, self.secret, self._own_holds, self._stop = store, secret, own_holds, stop
        self._asking = threading.Lock()
        self._answers: Optional[tuple[float, dict[int, dict]]] = None
        self._own_sizes: dict[str, int] = {}  # this node's ranks' container sizes (publish_size)
        self._sizes_lock = threading.Lock()

    def forget(self) -> None:
        """The group's answers are out of date (the job rewound)."""
        self._answers = None

    def publish_size(self, rank: int, nbytes: int) -> None:
        """``rank``'s container size, published with the rest of this node's: one key per node
        (``size/<node>``, JSON rank -> bytes), not one per rank."""
        with self._sizes_lock:  # not _asking: that one is held across a question to the group
            self._own_sizes[str(rank)] = nbytes
            value = json.dumps(self._own_sizes, sort_keys=True)
        try:
            self.store.publish(f"size/{self.node}", value)
        except Exception as e:
            log.warning("agent node %d: could not publish the size of rank %d: %s", self.node, rank, e)

    def sizes(self, holds: Optional[dict] = None) -> dict[int, int]:
        """Container size of every rank of the group: from the store (one read per member node), else (a
        lost rank whose size went with a lost root store) from the sizes the survivors' blocks were
        built with."""
        out = {}
        known: dict[str, int] = {}
        for h in (holds or {}).values():
            known.update(h.get("sizes", {}))
        read: dict[int, dict] = {}
        rpn = self.cfg.cluster.ranks_per_node
        for r in self.group_ranks:
            v = known.get(str(r))
            if v is None:
                node = r // rpn
                if node not in read:
                    text = self.store.get(f"size/{node}")
                    read[node] = json.loads(text) if text else {}
                v = read[node].get(str(r))
            if v is None:
                raise RuntimeError(f"the container size of rank {r} is not known yet")
            out[r] = int(v)
        return out

    def wait_sizes(self, timeout: float = 30.0) -> dict[int, int]:
        """Every rank's container size, for sending. Every rank of a consistent step has registered,
        but its agent may publish a moment later (bounded by ``timeout``)."""
        deadline = Deadline(timeout, "every rank's container size")
        while True:
            try:
                return self.sizes()
            except RuntimeError:  # not published yet (or the store is moving: StoreUnavailable)
                if not deadline.pause(0.05, self._stop):
                    raise

    def group_holdings(self, wait_s: float) -> "GroupHoldings":
        """What every member of the group holds, this node included: its own ``holds``, and every other
        member asked (``holds``) until all have answered and every group rank's container size is known,
        for at most ``wait_s``. This node's own blocks count like a survivor's: an rs parity node keeps one
        staging slot for its rank, and once a newer snapshot overwrote it, the group's complete step of
        that rank is decoded from this node's own parity row and the data held elsewhere. A replacement's agent asks
        just after a failure: the store may be moving to a new root (its keys fill as the survivors'
        next heartbeats re-publish them) and a member's agent may be restarting, so a member that does
        not answer is asked again rather than taken for one that holds nothing. Not collective; no lock
        held; every ask (address lookup, connection, reply) is bounded by what is left of ``wait_s``."""
        with self._asking:  # this node's ranks restoring at once share the answers
            cached = self._answers
            if cached is not None and time.monotonic() - cached[0] < ANSWERS_FRESH_S:
                return self._holdings({self.node: self._own_holds(), **cached[1]}, {})
            got = self._ask_group(wait_s)
            if not got.unanswered:
                self._answers = (time.monotonic(), {n: h for n, h in got.holds.items() if n != self.node})
            return got

    def _holdings(self, holds: dict[int, dict], unanswered: dict[str, str]) -> "GroupHoldings":
        sizes: Optional[dict[int, int]] = None
        try:
            sizes = self.sizes(holds)
        except StoreUnavailable as e:
            unanswered["store"] = str(e).splitlines()[0]
        except RuntimeError:
            pass
        return GroupHoldings(holds, sizes, unanswered)

    def _ask_group(self, wait_s: float) -> "GroupHoldings":
        deadline = Deadline(wait_s, "what the group holds")
        ask_s = max(1.0, wait_s / 3)  # one silent member does not use up the others' time
        holds: dict[int, dict] = {self.node: self._own_holds()}
        unanswered: dict[str, str] = {}
        while True:
            for n in self.members:
                if n == self.node or n in holds:
                    continue
                try:
                    holds[n] = self._ask_holds(n, min(ask_s, max(deadline.left(), 0.5)))
                    unanswered.pop(f"node {n}", None)
                except (OSError, PeerError, StoreUnavailable, wire.WireError) as e:
                    unanswered[f"node {n}"] = str(e).splitlines()[0] if str(e) else type(e).__name__
            sizes: Optional[dict[int, int]] = None
            try:
                sizes = self.sizes(holds)
                unanswered.pop("store", None)
            except StoreUnavailable as e:  # a RuntimeError too: the store moving, not an unknown size
                unanswered["store"] = str(e).splitlines()[0]
            except RuntimeError:
                pass  # everyone answered and nobody knows a rank's size: nobody holds its data
            if not unanswered or deadline.expired() or self._stop.is_set():
                if unanswered:
                    log.warning("agent node %d: no answer within %.0f s about what the group holds from %s",
                                self.node, wait_s, unanswered)
                return GroupHoldings(holds, sizes, unanswered)
            deadline.pause(0.2, self._stop)

    def _ask_holds(self, node: int, within_s: float) -> dict:
        """Node ``node``'s ``holds`` reply; its address lookup, connection and reply each bounded by
        ``within_s``."""
        cl = self.client(node, within_s)
        try:
            return cl.request("holds")
        finally:
            cl.close()

    def addr(self, node: int, wait_s: Optional[float] = None) -> tuple[str, int]:
        """Node ``node``'s peer transport address from the store. After a root failover the new store
        fills as the agents' next heartbeats re-publish, and the failover itself takes up to the health
        timeout (longer on a loaded machine): waits for it up to ``wait_s`` (default: that long)."""
        h = self.cfg.health
        if wait_s is None:
            wait_s = h.timeout_s + 4 * h.heartbeat_s + 1.0
        deadline = Deadline(wait_s, f"node {node}'s peer address")
        why = "has not published its peer address"
        while True:
            try:
                v = self.store.get(f"addr/{node}")
            except StoreUnavailable as e:  # the store moving to a new root: ask again
                v, why = None, f"peer address unknown: {e}"
            if v is not None or deadline.expired():
                break
            deadline.pause(0.05)
        if v is None:
            raise PeerError(f"node {node} {why}")
        host, port = v.rsplit(":", 1)
        return host, int(port)

    def client(self, node: int, within_s: Optional[float] = None) -> wire.Client:
        """A connection to ``node``'s agent (its address looked up at each (re)connect: a restarted
        agent listens on a new port); bounded by ``agent.request_timeout_s``, and with ``within_s`` its
        address lookup and every call by that too. What this agent sends on it (the copies and parity it
        replicates, requests) carries ``network.replication_dscp``; what the peer answers does not."""
        secret, dscp = self.secret, self.cfg.network.replication_dscp
        if within_s is None:
            return wire.Client(lambda: self.addr(node), self.cfg.agent.request_timeout_s, error=PeerError, secret=secret,
                               dscp=dscp)
        return wire.Client(lambda: self.addr(node, wait_s=within_s), min(self.cfg.agent.request_timeout_s, within_s),
                           error=PeerError, secret=secret, dscp=dscp)
