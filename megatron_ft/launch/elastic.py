"""Going on at fewer data-parallel replicas, and growing back: the launchers' side (decision and handover).

One launcher decides, the *decider*: the launcher of the lowest node of the running generation that the
root's verdicts have not judged lost. Every :data:`LOOK_S` while its torchrun runs it feeds
:class:`~megatron_ft.policy.generations.ShrinkTrigger` with the job record (a verdict on a node's agent:
lost; another agent or launcher on that node since: claimed - a standby or a replacement took it) and with
the ``elastic/returned/<slot>`` keys of slots that came back; when the trigger says so it writes the next
generation (:class:`~megatron_ft.launch.generation.GenerationRecord`) into ``elastic/next`` with a
compare-and-set. Every launcher of the generation looks at that key at the same pace; on a new record
it stops its torchrun and takes part in the handover, with the old generation's agents still running:

1. *stopped*: each old node that goes on says which steps its agent holds clean for its ranks and its
   redundancy group's complete step (``elastic/stopped/<n>/<slot>``; every step's barrier is gathered by
   the decider into one key the others wait for, :meth:`Handover._barrier`);
2. *plan*: the decider picks the step (:func:`~megatron_ft.policy.generations.restore_step`: the newest
   every surviving rank holds, and the lost ranks' redundancy can rebuild), which old node holds each old
   rank's container, and which surviving node rebuilds each lost rank (the lowest surviving member of its
   node's redundancy group) - :func:`plan_handover`, pure - and writes ``elastic/plan/<n>``;
3. *rebuilt*: those nodes' agents rebuild the lost ranks from the group (the agents' ``recover``: a
   whole copy, or XOR / Reed-Solomon decoding), into a slot of their own;
4. *ready*: each node of the new generation gathers the old containers its ranks need
   (:func:`~megatron_ft.policy.generations.needed_by_node`) into files of its own memory: linked from its
   own agent's slot (no copy), else fetched whole from the holder's agent on the peer transport
   (``get`` of a clean primary, in pieces of :data:`FETCH_PIECE`, the job's secret proven both ways);
5. *go*: once every node is ready, each says so and stops its old agent - the launcher of the store's
   root last, after every go (the old generation's store goes with it) - and starts the new generation's
   agent and torchrun (:class:`~megatron_ft.launch.node.NodeLauncher`).

A slot that comes back (a replacement launcher started for it, or a host relaunched) finds the running
generation in the run directory's pointer, says so in that generation's store (``elastic/returned/<slot>``),
waits for the decider's grow-back and takes part from step 4, fetching everything it needs.

Every wait is bounded by ``launch.start_timeout_s``; a handover that cannot finish (no common step, a
rebuild refused, a holder gone) ends the job with a fatal record naming why, never a silent restart.

Messages (N' nodes of the new generation, N of the old): per tick of the decider one read of the record's
changed parts and of each slot out of the job; per tick of every launcher one read of ``elastic/next``;
per handover O(N) keys (each launcher writes its own per barrier; the decider reads them and writes one
that the others wait for), once per handover, never per step; and one ``holds`` plus ceil(size / piece)
``get`` requests per container a node fetches.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

from .. import config as ftconfig
from ..agent import shm
from ..agent.peer_protocol import Get
from ..agent.protocol import AgentClient
from ..capture import snapfile
from ..clock import Deadline
from ..health.store import StoreUnavailable
from ..policy.generations import ShrinkRefused, ShrinkTrigger, needed_by_node, restore_step
from ..redundancy.plan import plan_from_config
from ..rendezvous import owners_in
from ..transport import credential, wire
from .generation import GenerationRecord, generation_config, import_name

NEXT = "elastic/next"
#: how often a launcher looks at ``elastic/next`` (and the decider at the record) while its torchrun runs: as
#: often as it looks at the rendezvous record
LOOK_S = 2.0
#: how much of a container one ``get`` fetches
FETCH_PIECE = 64 << 20
#: how long a rebuild waits for the group's members to say what they hold: the lost node never answers, and
#: the survivors' agents are up (each reported what it holds in step 1)
RECOVER_WAIT_S = 2.0
#: the tier a lost rank's container comes from, by the redundancy scheme that rebuilds it
REBUILT_TIER = {"replica": "peer_memory", "xor": "decoded", "rs": "decoded"}


class HandoverError(RuntimeError):
    """The handover cannot finish: the message says which step and why."""


def plan_handover(rec: GenerationRecord, reports: dict[int, dict], cfg: ftconfig.FTConfig) -> GenerationRecord:
    """``rec`` with its step, holders, rebuilds and tiers, from the old nodes' reports (slot -> ``{"clean":
    {rank: [steps]}, "complete": step}``) and generation 0's configuration (the old generation's redundancy
    plan). Pure. :class:`HandoverError` when no step fits or a lost rank has no surviving group member.

    >>> from megatron_ft.config import from_dict
    >>> cfg = from_dict({"run_id": "j", "cluster": {"nodes": 3, "ranks_per_node": 2},
    ...                  "parallel": {"pipeline": 2}, "redundancy": {"scheme": "replica"}})
    >>> rec = GenerationRecord(1, "shrink", "j", (0, 2), (), 3, 2, 1, 2, 1, previous_slots=(0, 1, 2), lost=(1,))
    >>> reports = {0: {"clean": {"0": [6, 7], "1": [6, 7]}, "complete": 6},
    ...            2: {"clean": {"4": [6, 7], "5": [7, 6]}, "complete": 6}}
    >>> p = plan_handover(rec, reports, cfg)
    >>> p.step, p.holder, p.rebuilt, p.sources
    (6, {0: 0, 1: 0, 4: 2, 5: 2, 2: 0, 3: 0}, {0: [2, 3]}, {2: 'peer_memory', 3: 'peer_memory'})
    """
    old = rec.previous
    rpn = rec.ranks_per_node
    clean: dict[int, set[int]] = {}
    holder: dict[int, int] = {}
    lost_nodes = [n for n, s in enumerate(old.slots) if s in rec.lost]
    for node, slot in enumerate(old.slots):
        if slot in rec.lost:
            continue
        if slot not in reports:
            raise HandoverError(f"slot {slot} (node {node} of generation {old.number}) did not say what it holds")
        held = reports[slot].get("clean", {})
        for r in range(node * rpn, (node + 1) * rpn):
            clean[r] = {int(s) for s in held.get(str(r), [])}
            holder[r] = node
    rebuildable = None
    if lost_nodes:
        rebuildable = {int(rep["complete"]) for rep in reports.values() if int(rep.get("complete", -1)) >= 0}
    step = restore_step(clean, rebuildable)
    if step is None:
        raise HandoverError(f"no step is held clean by every surviving rank of generation {old.number}"
                            + (f" and rebuildable for the lost node(s) {lost_nodes} (their group's complete steps: "
                               f"{sorted(rebuildable or [])})" if lost_nodes else ""))
    rebuilt: dict[int, list[int]] = {}
    sources: dict[int, str] = {}
    if lost_nodes:
        gcfg = generation_config(cfg, _as_record(rec, old))
        plan = plan_from_config(gcfg)
        tier = REBUILT_TIER.get(plan.scheme)
        if tier is None:
            raise HandoverError(f"redundancy.scheme={plan.scheme!r}: nothing in memory holds the lost nodes' ranks")
        if not plan.survives(lost_nodes):
            raise HandoverError(f"the nodes {lost_nodes} of generation {old.number} were lost together, more than "
                                f"{plan.label} survives: their ranks cannot be rebuilt from memory")
        alive = [n for n in range(len(old.slots)) if n not in lost_nodes]
        for lost in lost_nodes:
            members = [n for n in alive if plan.node_group[n] == plan.node_group[lost]]
            if not members:
                raise HandoverError(f"node {lost} of generation {old.number} was lost with every member of its "
                                    f"redundancy group: its ranks cannot be rebuilt from memory")
            for r in range(lost * rpn, (lost + 1) * rpn):
                rebuilt.setdefault(members[0], []).append(r)
                holder[r] = members[0]
                sources[r] = tier
    return GenerationRecord(**{**rec.__dict__, "step": step, "holder": holder, "rebuilt": rebuilt, "sources": sources})


def _as_record(rec: GenerationRecord, old) -> GenerationRecord:
    """The old generation as a record (its configuration's node count and hosts)."""
    return GenerationRecord(old.number, "old", rec.base_run_id, old.slots, (), rec.full, rec.ranks_per_node,
                            rec.tensor, rec.pipeline, rec.expert)


def agent_report(client: AgentClient) -> dict:
    """What an old node's agent holds for the plan: its ranks' clean steps and its group's complete step (and
    which node's agent serves the store: the handover's last barrier keeps that one up until the end)."""
    st = client.request("status")["status"]
    clean_name = snapfile.STATE_NAMES[snapfile.CLEAN]
    clean = {r: [s["step"] for s in v["slots"] if s["state"] == clean_name] for r, v in st.get("ranks", {}).items()}
    red = st.get("redundancy") or {}
    return {"clean": clean, "complete": int(red.get("complete_step", -1)), "root": st.get("root")}


def fetch_primary(store, cfg: ftconfig.FTConfig, secret: Optional[bytes], node: int, rank: int, step: int,
                  dest: str) -> int:
    """Fetch old rank ``rank``'s clean container of ``step`` whole from node ``node``'s agent (``cfg``: the old
    generation's configuration; ``store``: its store, for the agent's address) into the new shared-memory
    file ``dest``; returns its size. Bounded by ``agent.request_timeout_s`` per request."""
    raw = store.get(f"addr/{node}")
    if raw is None:
        raise HandoverError(f"node {node} of run {cfg.run_id} has no peer address in the store")
    host, port = raw.rsplit(":", 1)
    cl = wire.Client(lambda: (host, int(port)), cfg.agent.request_timeout_s, error=HandoverError, secret=secret)
    try:
        size = cl.request("holds").get("sizes", {}).get(str(rank))
        if not size:
            raise HandoverError(f"node {node} of run {cfg.run_id} does not hold rank {rank}")
        seg = shm.create(dest, int(size))
        try:
            for lo in range(0, int(size), FETCH_PIECE):
                hi = min(int(size), lo + FETCH_PIECE)
                get = Get(op="get", what="primary", step=step, lo=lo, hi=hi, rank=rank)
                cl.request(**get.fields(), into=memoryview(seg.mm)[lo:hi])
        finally:
            seg.close()
        return int(size)
    finally:
        cl.close()


def link_own(client: AgentClient, rank: int, step: int, dest: str) -> None:
    """Link this node's clean slot of old rank ``rank`` at ``step`` to ``dest`` (the same memory, no copy:
    the old agent unlinks its name at shutdown, the file lives on under ``dest``)."""
    for v in client.request("list", rank=rank)["versions"]:
        if v["step"] == step:
            os.link(v["path"], dest)
            return
    raise HandoverError(f"this node's agent no longer holds rank {rank} step {step} clean")


class Handover:
    """One launcher's part in one handover to ``rec`` (see the module), on the old generation's ``store``.
    ``slot``: this launcher's slot; ``agent``: a client of its old agent (None: a returning slot, which
    has none); ``old_cfg``: the old generation's configuration; ``base``: generation 0's."""

    def __init__(self, rec: GenerationRecord, slot: int, store, old_cfg: ftconfig.FTConfig, base: ftconfig.FTConfig,
                 agent: Optional[AgentClient], log: Callable[[str], None]):
        self.rec, self.slot, self.store, self.old_cfg, self.base = rec, slot, store, old_cfg, base
        self.agent, self.log = agent, log
        self.n = rec.number
        self.deadline = Deadline(base.launch.start_timeout_s, f"the handover to generation {rec.number}")

    def _wait_key(self, key: str, store_may_go: bool = False) -> str:
        """``key``'s value once it is set (bounded by the handover's deadline). ``store_may_go``: the store
        not answering ends the wait (:class:`StoreUnavailable`) instead of being asked again."""
        while True:
            try:
                v = self.store.get(key)
            except StoreUnavailable:
                if store_may_go:
                    raise
                v = None
            if v is not None:
                return v
            if self.deadline.expired():
                raise HandoverError(f"waited launch.start_timeout_s={self.base.launch.start_timeout_s:g} s for "
                                    f"{key} in generation {self.n - 1}'s store")
            self.deadline.pause(0.1)

    def _members(self) -> list[int]:
        """The old generation's slots that take part (all but the lost)."""
        return [s for s in self.rec.previous_slots if s not in self.rec.lost]

    def _barrier(self, name: str, members: list[int], value: str = "1", store_may_go: bool = False) -> dict[int, str]:
        """Say ``value`` under ``elastic/<name>/<n>/<slot>`` (``members``' own take part; others only read)
        and return every member's once all said theirs: the decider reads the members' keys and writes them
        as one (``.../all``), which everyone else waits for - O(N) reads per barrier, not N per launcher."""
        key = f"elastic/{name}/{self.n}"
        if self.slot in members:
            self.store.set(f"{key}/{self.slot}", value)
        if self.rec.decider == self.slot:
            said = {s: self._wait_key(f"{key}/{s}", store_may_go) for s in members}
            self.store.set(f"{key}/all", json.dumps({str(s): v for s, v in said.items()}))
            return said
        return {int(s): v for s, v in json.loads(self._wait_key(f"{key}/all", store_may_go)).items()}

    def run(self) -> GenerationRecord:
        """Steps 1-5 of the module for this launcher; returns the planned record. The old agent still runs."""
        t0 = time.perf_counter()
        members = self._members()
        mine = agent_report(self.agent) if self.agent is not None else {}
        reports = self._barrier("stopped", members, json.dumps(mine))  # 1. stopped
        if self.rec.decider == self.slot:  # 2. plan
            try:
                planned = plan_handover(self.rec, {s: json.loads(v) for s, v in reports.items()}, self.base).to_json()
            except HandoverError as e:
                planned = json.dumps({"refused": str(e)})
            self.store.set(f"elastic/plan/{self.n}", planned)
        raw = self._wait_key(f"elastic/plan/{self.n}")
        if "refused" in json.loads(raw):
            raise HandoverError(json.loads(raw)["refused"])
        plan = GenerationRecord.from_json(raw)
        old_node = plan.previous_slots.index(self.slot) if self.slot in plan.previous_slots else None
        rebuilt: dict[str, str] = {}
        for r in plan.rebuilt.get(old_node, []) if old_node is not None else []:  # 3. rebuilt
            assert self.agent is not None
            got = self.agent.request("recover", rank=r, step=plan.step, wait_s=RECOVER_WAIT_S)
            rebuilt[str(r)] = str(got.get("source") or plan.sources.get(r, "peer_memory"))
            self.log(f"rebuilt old rank {r} step {plan.step} from the group ({rebuilt[str(r)]})")
        rebuilders = sorted(plan.previous_slots[node] for node in plan.rebuilt)
        said = self._barrier("rebuilt", rebuilders, json.dumps(rebuilt))
        tiers = dict(plan.sources)  # the tiers the rebuilds said (a whole copy, or decoded)
        tiers.update({int(r): t for v in said.values() for r, t in json.loads(v).items()})
        plan = GenerationRecord(**{**plan.__dict__, "sources": tiers})
        if self.slot in plan.slots:  # 4. ready
            self._gather(plan, old_node)
        everyone = sorted(set(plan.slots) | set(members))
        self._barrier("ready", everyone)
        # 5. go: each says it saw every node ready; the launcher of the store's root waits for every go before
        # its agent (and the store with it) stops, the others go on at once
        self.store.set(f"elastic/go/{self.n}/{self.slot}", "1")
        if old_node is not None and mine.get("root") == old_node:
            try:
                for s in everyone:
                    self._wait_key(f"elastic/go/{self.n}/{s}", store_may_go=True)
            except (StoreUnavailable, HandoverError) as e:  # every node was ready: what is left is theirs
                self.log(f"not every node said go ({e}); going on: every node was ready")
        self.log(f"handover to generation {self.n} ready in {time.perf_counter() - t0:.2f} s (step {plan.step})")
        return plan

    def _gather(self, plan: GenerationRecord, old_node: Optional[int]) -> None:
        """Step 4: the old containers this slot's node needs, as files of its own memory."""
        node = plan.node_of(self.slot)
        assert node is not None
        secret = credential.configured_secret(self.old_cfg, os.environ)
        for o in needed_by_node(plan.generation, plan.previous, node):
            dest = os.path.join(self.base.agent.shm_dir, import_name(plan.run_id, node, o))
            try:
                os.unlink(dest)  # an earlier attempt's
            except FileNotFoundError:
                pass
            h = plan.holder[o]
            if self.agent is not None and h == old_node:
                link_own(self.agent, o, plan.step, dest)
            else:
                fetch_primary(self.store, self.old_cfg, secret, h, o, plan.step, dest)


class ElasticWatch:
    """A launcher's look at the generations while its torchrun runs (see the module): :meth:`tick` every
    :data:`LOOK_S` returns the next generation's record once one concerns this launcher's slot."""

    def __init__(self, rec: GenerationRecord, slot: int, base: ftconfig.FTConfig, rendezvous, batch: tuple,
                 log: Callable[[str], None]):
        self.rec, self.slot, self.base, self.rendezvous, self.log = rec, slot, base, rendezvous, log
        self.global_batch, self.micro_batch = batch
        self.trigger = ShrinkTrigger(base.recovery.elastic_after_s)
        self.trigger.shrunk(set(range(rec.full)) - set(rec.slots) - set(rec.idle))  # out of the job: may return
        self._next_look = 0.0
        self._refused: Optional[str] = None
        self._began: dict = {}  # node -> its agent and launcher when the generation's first rendezvous began

    def tick(self) -> Optional[GenerationRecord]:
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + LOOK_S
        store = self.rendezvous.store
        try:
            raw = store.get(NEXT)
            if raw:
                nxt = GenerationRecord.from_json(raw)
                if nxt.number == self.rec.number + 1:
                    return nxt
            else:  # one read of the record's changed parts per look: who decides, and what was lost
                view = self.rendezvous.view.refresh(owners=True)
                lost, taken = self._lost_nodes(view)
                if self._decides(lost):
                    self._decide(store, now, lost, taken)
        except StoreUnavailable:
            pass
        return None

    def _lost_nodes(self, view) -> tuple[set[int], set[int]]:
        """(nodes judged lost since the generation began, of those the ones another agent took). The agents
        each node had when the generation's first rendezvous began are kept: a later rendezvous (its host was
        lost) begins after a root failover, whose store no longer knows the lost node's agent."""
        if not self._began and any(o is not None for o in self.rendezvous.owners.values()):
            self._began = dict(self.rendezvous.owners)
        lost, taken = set(), set()
        for node, f in view.failed.items():
            was = self._began.get(node)
            if was is not None and f.pid != was.agent:
                continue  # a verdict on an agent this node had before the generation began
            lost.add(node)
            now = owners_in(view, node)
            if now is not None and now.agent != f.pid:
                taken.add(node)
        return lost, taken

    def _decides(self, lost: set[int]) -> bool:
        alive = [n for n in range(len(self.rec.slots)) if n not in lost]
        return bool(alive) and self.rec.slots[alive[0]] == self.slot

    def _refuse(self, why: str) -> None:
        """Say once (per reason) why the job does not change its size: it waits for a replacement."""
        if why != self._refused:
            self._refused = why
            self.log(f"cannot go on at fewer data-parallel replicas: {why}; waiting for a replacement")

    def _decide(self, store, now: float, lost: set[int], taken: set[int]) -> None:
        for node in lost:
            slot = self.rec.slots[node]
            self.trigger.claimed(slot) if node in taken else self.trigger.lost(slot, now)
        for slot in set(range(self.rec.full)) - set(self.rec.slots):
            if store.get(f"elastic/returned/{slot}"):
                self.trigger.returned(slot)
        due = self.trigger.due(now)
        if due is None:
            return
        kind, slots = due
        g = self.rec.generation
        least = self.base.cluster.elastic.min_data_parallel
        try:
            new = (g.shrink(slots, self.global_batch, self.micro_batch, least) if kind == "shrink" else
                   g.grow(slots, self.global_batch, self.micro_batch, least))
        except ShrinkRefused as e:
            return self._refuse(str(e))
        if new.number == g.number:
            return  # a slot back, but no larger size fits yet
        if len(new.slots) < 2:  # no peer to hold its memory, no peer transport to grow back from
            return self._refuse(f"generation {new.number} would have one node (slot {new.slots[0]}): nothing would "
                                f"protect its memory and it could not grow back from it")
        rec = GenerationRecord(new.number, kind, self.rec.base_run_id, new.slots, new.idle, self.rec.full,
                               self.rec.ranks_per_node, self.rec.tensor, self.rec.pipeline, self.rec.expert,
                               previous_slots=g.slots, lost=tuple(slots) if kind == "shrink" else (),
                               decided_at=time.time(), decider=self.slot)
        if store.compare_set(NEXT, "", rec.to_json()) == rec.to_json():
            self.log(f"generation {rec.number}: {kind} to DP {rec.data_parallel} on slots {list(rec.slots)} "
                     f"(from DP {g.data_parallel}; slots {list(slots)} {'lost' if kind == 'shrink' else 'back'})")
