"""Where torchrun's rendezvous lives, what a standby waits for, and how a launcher learns that another
node ended the job - all read from the job record (:mod:`megatron_ft.health.job_record`), not from
every node's keys.

* :class:`Rendezvous`: a launcher's generations (docs/health.md, "The rendezvous: no node is special");
* :func:`claim_failed_node`: a standby's wait for a verdict and its claim;
* :class:`FatalWatch`: a launcher's thread that waits on the record for another node's fatal record.

Messages per launcher (N nodes): at its start, the record's owners once (ceil(N / 512) parts) and the
``rdzv`` key; per generation, a long poll on ``job/owners`` until every node has an agent and a
launcher (usually at once; woken by its change), then the owners parts that changed; after a failed torchrun, one long poll
and two index reads per 0.5 s while it waits for the evidence and the next host; while torchrun runs,
the ``rdzv`` key every 2 s and :class:`FatalWatch`'s long poll (one per 10 s or per change of the
events). A standby: one long poll per 10 s or per change of the events, and a compare-and-set per new
verdict. None of it grows with N except the first read of the owners.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, replace
from typing import Optional

from . import config as ftconfig
from . import fatal, network
from .clock import Deadline
from .health.job_record import JobRecord
from .health.store import job_view
from .health.monitor import claim_key

#: the longest one long poll on the record waits before it is asked again
WAIT_S = 10.0


@dataclass(frozen=True)
class RdzvGeneration:
    """One torchrun rendezvous: generation ``gen`` hosted by node ``node`` at ``addr:port``;
    ``host_agent``, ``host_launcher``: the host node's agent and launcher when it published it (0: not
    known), so that a launcher can tell a generation whose host is gone from a live one."""
    gen: int
    node: int
    addr: str
    port: int
    host_agent: int = 0
    host_launcher: int = 0

    def to_json(self) -> str:
        return json.dumps({"format": "megatron-ft-rdzv/2", "gen": self.gen, "node": self.node, "addr": self.addr,
                           "port": self.port, "host_agent": self.host_agent, "host_launcher": self.host_launcher})


@dataclass(frozen=True)
class NodeOwners:
    """The processes that make a node what it was when a rendezvous generation began: its agent
    (its memory) and the launcher owning it (its torchrun; 0 while the agent has none)."""
    agent: int
    launcher: int


def owners_in(rec: JobRecord, node: int) -> Optional[NodeOwners]:
    """Node ``node``'s agent and launcher in the record (None: no heartbeat of it yet)."""
    o = rec.owners.get(node)
    return NodeOwners(o.agent, o.launcher) if o is not None else None


class Rendezvous:
    """Where torchrun's c10d rendezvous lives, so that no node is special.

    Generation 0 is hosted by node 0 at ``launch.master_addr:launch.rdzv_port``; the hosting node's
    launcher publishes the generation under ``rdzv`` in the agents' store. When a torchrun ends in
    failure, the launcher asks whether the host node was lost: the root agent's verdict on the host's
    agent, or another agent or launcher of the host in the job record (a replacement, a restarted
    launcher, or none while the host's agent waits for a new launcher). If so, generation g+1 is hosted
    by the lowest-numbered *survivor* (a node whose agent and launcher are the ones it had when
    generation g began) at its listening address, on the first port of
    :func:`megatron_ft.network.rendezvous_ports` free there (:meth:`_hosted_here`): that launcher
    publishes it (compare-and-set), the others wait for it (``launch.start_timeout_s``), woken by the
    record. A launcher starting on the node that hosts the published generation is a replacement of the
    lost host: it waits for the survivors' next generation instead of hosting the old one. The agents
    run the store for every job of more than one node, whatever ``redundancy.scheme`` says
    (:func:`megatron_ft.health.store.store_needed`), so no node is special under any scheme. Its calls
    are one thread's (the launcher's)."""

    def __init__(self, cfg: ftconfig.FTConfig, node: int):
        self.cfg, self.node = cfg, node
        self.store = None
        self._view = None
        self.owners: dict[int, Optional[NodeOwners]] = {}  # every node's agent and launcher when the generation began
        from .health.store import StoreClient, store_needed

        if store_needed(cfg):
            self.store = StoreClient(cfg)

    @property
    def view(self):
        """The job record as this launcher reads it (made at first use, on :attr:`store`)."""
        if self._view is None:
            self._view = job_view(self.store, self.cfg.cluster.nodes)
        return self._view

    def initial(self) -> RdzvGeneration:
        lc = self.cfg.launch
        return RdzvGeneration(0, 0, lc.master_addr, lc.rdzv_port)

    def _hosted_here(self, gen: int) -> RdzvGeneration:
        """Generation ``gen`` hosted by this node, on the first port of its range free here now (a
        :class:`RuntimeError` naming the range when none is)."""
        addr = network.listen_address(self.cfg, self.node)
        ports = network.rendezvous_ports(self.cfg, gen)
        for port in ports:
            if network.port_free(addr, port):  # torchrun's store binds it with SO_REUSEADDR: so does the check
                return RdzvGeneration(gen, self.node, addr, port)
        raise RuntimeError(f"node {self.node} cannot host rendezvous generation {gen}: every port of "
                           f"launch.rdzv_port={self.cfg.launch.rdzv_port} .. +{self.cfg.launch.rdzv_ports - 1} is in use "
                           f"on {addr}; free one or widen launch.rdzv_ports")

    def _published(self) -> tuple[str, Optional[RdzvGeneration]]:
        raw = self.store.get("rdzv") or ""
        try:
            rec = json.loads(raw) if raw else None
            if rec is None or rec.get("format") not in ("megatron-ft-rdzv/1", "megatron-ft-rdzv/2"):
                return raw, None
            return raw, RdzvGeneration(int(rec["gen"]), int(rec["node"]), str(rec["addr"]), int(rec["port"]),
                                       int(rec.get("host_agent", 0)), int(rec.get("host_launcher", 0)))
        except (ValueError, KeyError, TypeError):
            return raw, None

    def _host_gone(self, pub: RdzvGeneration) -> bool:
        """Whether the node hosting ``pub`` is no longer what published it: the root's verdict on its agent,
        or another agent or launcher in the record (a replacement, a restarted launcher). False where the
        record of ``rdzv`` does not say who published it."""
        if not pub.host_agent:
            return False
        rec = self.view.refresh(owners=True)
        verdict = rec.failed.get(pub.node)
        if verdict is not None and verdict.pid == pub.host_agent:
            return True
        now = owners_in(rec, pub.node)
        return now is not None and now != NodeOwners(pub.host_agent, pub.host_launcher or now.launcher)

    def _here(self, gen: RdzvGeneration) -> RdzvGeneration:
        """``gen`` as this node publishes it: with its agent and launcher (from the record)."""
        o = self.owners.get(self.node) or self._owners(self.node)
        return replace(gen, host_agent=o.agent, host_launcher=o.launcher) if o is not None else gen

    def _owners(self, node: int) -> Optional[NodeOwners]:
        """Node ``node``'s agent and launcher pids now (None: no heartbeat of it yet)."""
        return owners_in(self.view.refresh(owners=True), node)

    def _job_running(self) -> bool:
        """Whether another node's agent has had a trainer (``trained`` in the record): this launcher
        joins a running job (a replacement). While a job starts no agent has one - trainers start only
        once every node's torchrun joined the rendezvous, i.e. after every launcher asked this - however
        long the agents have been up (warming spare pools, slow imports)."""
        rec = self.view.refresh(owners=True)
        return any(o.trained for n, o in rec.owners.items() if n != self.node)

    def current(self, log) -> RdzvGeneration:
        """The generation to join at start: the published one, or 0 when the job is starting. A
        launcher joining a running job waits for the record (the survivors re-publish it into a
        store that lost it with its root); on the node hosting the published generation (a
        replacement for the lost host) it waits for the survivors' next generation. Its waits are long
        polls on the record (``rdzv`` is in its events), at most 1 s each."""
        if self.store is None:
            return self.initial()
        from .health.store import StoreUnavailable

        deadline = Deadline(self.cfg.launch.start_timeout_s, "the running job's rendezvous record")
        try:
            self.store.connect(3.0)
            raw, pub = self._published()
            if pub is None and self._job_running():
                log(f"[launch n{self.node}] joining a running job: waiting up to "
                    f"{self.cfg.launch.start_timeout_s:g} s for its rendezvous record")
            while pub is None and self._job_running() and not deadline.expired():
                self.view.wait(self.view.version, min(1.0, deadline.left()))
                raw, pub = self._published()
        except StoreUnavailable:
            return self.initial()  # no agent store yet: the job is starting
        if pub is None:
            return self.initial()
        if pub.node != self.node and not self._host_gone(pub):
            return pub
        if pub.node == self.node and not self._job_running():
            # the job is starting (no trainer anywhere yet) and another launcher, started first, put the
            # record of this node's generation back already (keep_published): host it, no replacement
            return pub
        log(f"[launch n{self.node}] " + (f"this node hosted rendezvous generation {pub.gen} and starts again"
                                         if pub.node == self.node else
                                         f"rendezvous generation {pub.gen}'s host, node {pub.node}, is gone") +
            ": waiting for the survivors' next generation")
        while not deadline.expired():
            try:
                self.view.wait(self.view.version, min(1.0, deadline.left()))
                _, nxt = self._published()
            except StoreUnavailable:
                deadline.pause(0.5)
                continue
            if nxt is not None and nxt.gen > pub.gen:
                return nxt
        return pub  # nobody moved on: host it again

    def keep_published(self, cur: RdzvGeneration) -> None:
        """While ``cur`` runs: put its record back if the store lost it (a new root's store starts
        empty). Every launcher does it, so the record survives the loss of any node."""
        if self.store is None:
            return
        from .health.store import StoreUnavailable

        try:
            raw, pub = self._published()
            if pub is None:
                o = self.owners.get(cur.node)  # who hosted it when it began, if the record did not say
                if not cur.host_agent and o is not None:
                    cur = replace(cur, host_agent=o.agent, host_launcher=o.launcher)
                self.store.compare_set("rdzv", raw, cur.to_json())
        except StoreUnavailable:
            pass

    def begin(self, cur: RdzvGeneration) -> None:
        """Before torchrun runs generation ``cur``: remember every node's agent and launcher; the
        host publishes the generation (so a replacement of this node knows it hosted it). Long-polls
        ``job/owners`` (at most 15 s) until every node has both, then reads its changed parts."""
        if self.store is None:
            return
        from .health.store import StoreUnavailable

        nodes = self.cfg.cluster.nodes
        try:
            # every node's agent heartbeats within moments of its start, naming its launcher within a
            # heartbeat of an adoption
            self.view.wait_complete(nodes, 15.0)
            rec = self.view.refresh(owners=True)
            self.owners = {n: owners_in(rec, n) for n in range(nodes)}
            if cur.node == self.node:
                raw, pub = self._published()
                if pub is None or pub.gen <= cur.gen:
                    self.store.compare_set("rdzv", raw, self._here(cur).to_json())
        except StoreUnavailable:
            pass

    def record_end(self, rc: Optional[int]) -> None:
        """This launcher is done with the job (exit ``rc``): say so in the store (``ended``), so that an
        agent whose launcher died and will not come back learns that the job is over
        (:class:`megatron_ft.agent.launcher_watch.JobEndWatch`). Best effort, on the connection it has (no new
        root is looked for: bounded by ``health.timeout_s``)."""
        kv = self.store.kv if self.store is not None else None
        if kv is None:
            return
        try:
            kv.set("ended", json.dumps({"node": self.node, "rc": rc, "time": time.time()}))
        except Exception:  # the store went first: the agents' heartbeats tell the rest
            pass

    def record_fatal(self, message: str, code: int) -> None:
        """This node ends the job (``message``, exit ``code``): ``fatal/<node>`` in the store, which the
        record carries to every launcher's :class:`FatalWatch`. Best effort, bounded by a 3 s search for the
        root where this launcher has not found it yet (a node that fails before its agent starts): the
        other torchruns end when this node's trainers stop, and each launcher then reads the run
        directory's records once."""
        from .health.store import StoreUnavailable

        if self.store is None:
            return
        try:
            if self.store.kv is None:
                self.store.connect(3.0)
            self.store.kv.set(f"fatal/{self.node}", fatal.store_value(self.node, message, code))
        except StoreUnavailable:
            pass

    def _lost_as_host(self, cur: RdzvGeneration) -> bool:
        """One look at the record: the root's verdict on the host's agent, or other owners there."""
        was = self.owners.get(cur.node)
        rec = self.view.refresh(owners=True)
        verdict = rec.failed.get(cur.node)
        if verdict is not None and (was is None or verdict.pid == was.agent):
            return True
        now = owners_in(rec, cur.node)
        return now is not None and was is not None and now != was

    def _host_lost(self, cur: RdzvGeneration) -> bool:
        """Whether the node hosting ``cur`` was lost as a host: the root's verdict on its agent,
        another agent there, or another launcher (none while its agent waits for one: the launcher,
        and with it the torchrun hosting the rendezvous, died). Waits up to three health timeouts
        for the evidence (failure path only): a long poll of at most 0.5 s on the record's events, then
        its owners."""
        from .health.store import StoreUnavailable

        deadline = Deadline(3 * self.cfg.health.timeout_s + 5, f"the evidence on node {cur.node}")
        while not deadline.expired():
            try:
                if self._lost_as_host(cur):
                    return True
                self.view.wait(self.view.version, 0.5)
            except StoreUnavailable:
                deadline.pause(0.5)
        return False

    def after_failure(self, cur: RdzvGeneration, log) -> Optional[RdzvGeneration]:
        """The generation to join after torchrun failed, or None (end: the host node was not lost,
        there is no store to agree on a new one, or one generation per node was used up)."""
        from .health.store import StoreUnavailable

        if self.store is None or cur.gen >= self.cfg.cluster.nodes:
            return None
        try:  # the survivors moved on already (this launcher joined a generation whose host was lost)
            _, pub = self._published()
            if pub is not None and pub.gen > cur.gen:
                return pub
        except StoreUnavailable:
            pass
        if not self._host_lost(cur):
            return None
        deadline = Deadline(self.cfg.launch.start_timeout_s, "the next rendezvous host")
        while not deadline.expired():
            try:
                raw, pub = self._published()
                if pub is not None and pub.gen > cur.gen:
                    return pub
                rec = self.view.refresh(owners=True)
                survivors = [n for n in range(self.cfg.cluster.nodes)
                             if n != cur.node and self.owners.get(n) is not None and owners_in(rec, n) == self.owners[n]]
                if survivors and survivors[0] == self.node:  # this node hosts the next generation
                    nxt = self._here(self._hosted_here(max(cur.gen, pub.gen if pub else 0) + 1))
                    if self.store.compare_set("rdzv", raw, nxt.to_json()) == nxt.to_json():
                        return nxt
                self.view.wait(self.view.version, 0.5)  # the next host's record wakes it
            except StoreUnavailable as e:
                log(f"[launch n{self.node}] store not answering while choosing a new rendezvous host: {e}")
                deadline.pause(0.5)
            except RuntimeError as e:  # no port of the range free here
                log(f"[launch n{self.node}] {e}")
                return None
        log(f"[launch n{self.node}] no new rendezvous host within launch.start_timeout_s="
            f"{self.cfg.launch.start_timeout_s:g} s")
        return None


class FatalWatch:
    """A launcher's thread (``fatal-watch``) that waits on the job record, on a store client of its own,
    for a node's fatal record: :attr:`seen` is then ``(node, message, code)`` (read without a lock: one
    attribute). One long poll per :data:`WAIT_S` or per change of the record's events; a store that does
    not answer is asked again after 1 s. :meth:`stop` ends it within :data:`WAIT_S`."""

    def __init__(self, cfg: ftconfig.FTConfig):
        from .health.store import StoreClient

        self.cfg = cfg
        self.seen: Optional[tuple[int, str, int]] = None
        self._stop = threading.Event()
        self._client = StoreClient(cfg)
        self._view = None
        self._thread = threading.Thread(target=self._run, name="fatal-watch", daemon=True)

    def start(self) -> "FatalWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        from .health.store import StoreUnavailable

        view = self._view = job_view(self._client, self.cfg.cluster.nodes)
        version = -1
        while not self._stop.is_set():
            try:
                rec = view.wait(version, WAIT_S) if version >= 0 else view.refresh()
                version = view.version
                f = rec.first_fatal()
                if f is not None:
                    self.seen = (f.node, f.message, f.code)
                    return
            except StoreUnavailable:
                self._stop.wait(1.0)
            except Exception:  # noqa: BLE001 - a reader's bug must not end the launcher; said, then asked again
                import logging

                logging.getLogger("megatron_ft").exception("fatal watch")
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        try:
            if self._view is not None:
                self._view.close()  # etcd: its stream's thread
            self._client.close()  # a long poll in progress ends with it
        except Exception:  # noqa: BLE001 - closing at the end, nothing to tell
            pass


class JobEnded(Exception):
    """The job a standby waits on ended (a launcher recorded ``ended``) before any node failed."""


def claim_failed_node(client, nodes: int, who: str, poll_s: float = 0.2, timeout_s: float = 0.0,
                      log=print, since: Optional[float] = None) -> tuple[int, dict]:
    """A standby's wait: on the job record of the store (a :class:`~megatron_ft.health.store.StoreClient`),
    woken by its changes (a long poll, at most :data:`WAIT_S`), for a root verdict on some node, claimed
    with a compare-and-set of ``claim/<node>/<failed agent pid>/<verdict time>`` from absent to ``who``; a
    verdict another standby claimed first (or withdrawn) is skipped and not asked about again. Returns
    (node, verdict: ``failed/<node>``'s record). ``timeout_s`` 0: wait for ever. ``since``: raise
    :class:`JobEnded` once a launcher records the job's end (``ended``) no earlier than this time (an
    older record is an earlier job's on a store that outlives jobs). ``poll_s``: the pause after a store
    that did not answer."""
    from .health.store import StoreUnavailable

    deadline = Deadline(timeout_s if timeout_s > 0 else float("inf"), f"standby {who}: a failed node to take over")
    view = job_view(client, nodes)
    warned, version = False, -1
    lost: set[str] = set()  # claim keys another standby holds (or a tombstone)
    try:
        while True:
            try:
                rec = view.wait(version, min(WAIT_S, deadline.left())) if version >= 0 else view.refresh()
                version = view.version
                if since is not None and rec.ended is not None and rec.ended.time >= since:
                    raise JobEnded(f"node {rec.ended.node}'s launcher ended the job (exit {rec.ended.rc})")
                for n, f in sorted(rec.failed.items()):
                    key = claim_key(n, f.claim_fields())
                    if key in lost:
                        continue
                    owner = client.compare_set(key, "", who)
                    if owner == who:
                        return n, _verdict(client, n, f)
                    lost.add(key)
                    log(f"[standby {who}] node {n} (agent pid {f.pid}) already claimed by {owner}")
                warned = False
            except StoreUnavailable as e:
                if not warned:
                    log(f"[standby {who}] store not answering yet, retrying: {e}")
                    warned = True
                deadline.pause(poll_s)
            if deadline.expired():
                raise TimeoutError(f"standby {who}: no failed node to take over within {timeout_s:g} s")
    finally:
        view.close()


def _verdict(client, node: int, f) -> dict:
    """The full verdict ``f`` stands for (``failed/<node>``), or its fields where the key says otherwise."""
    try:
        v = json.loads(client.get(f"failed/{node}") or "{}")
    except ValueError:
        v = {}
    if v.get("pid") == f.pid and v.get("time") == f.time:
        return v
    return {"node": node, "kind": "hardware", **f.claim_fields()}
