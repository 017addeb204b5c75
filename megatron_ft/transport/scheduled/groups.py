"""Which ranks a trainer's scheduled transport exchanges with, and the process groups it makes for them.

Each group spans only :func:`exchange_ranks` (this rank's local index on the nodes of its redundancy
group that send or receive a copy), made by those ranks alone (:func:`member_group`); the planning
collectives that must be the same on every rank run on the job's default group, which exists already
(:class:`TransportGroups`: no group of the world is made).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import socket
import zlib
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...redundancy.exchange import holders_of_whole
from ...redundancy.plan import plan_from_config
from ...schedule.modes import SendSchedule
from ..p2p_batch import data_timeout_s
from .transfers import CTRL_TIMEOUT

log = logging.getLogger("megatron_ft.transport")

def peers_of(cfg: Any, rank: int) -> tuple[list[int], list[int]]:
    """(ranks this rank sends its copies to, ranks whose copies it receives): the rank with the same
    local index on every node that holds a copy of this rank's container (GEMINI placement).

    Two nodes of two ranks, replica m = 2: rank 1 (node 0) sends to rank 3 (node 1) and receives
    from rank 3; rank 2 sends to and receives from rank 0."""
    plan = plan_from_config(cfg)
    topo = plan.topology
    rpn = cfg.cluster.ranks_per_node
    node, local = divmod(rank, rpn)
    dsts = [n * rpn + local for n in holders_of_whole(plan, rank)[1:]]
    srcs = [n * rpn + local for n in range(topo.nodes) if n != node
            and node in holders_of_whole(plan, n * rpn + local)[1:]]
    return dsts, srcs


def _exchanging(plan: Any, rpn: int, group: Any, local: int) -> tuple[int, ...]:
    """The ranks of local index ``local`` on the nodes of redundancy group ``group`` that send or
    receive a whole copy (sorted; empty when nobody in it does)."""
    nodes: set[int] = set()
    for n in group.members:
        holders = holders_of_whole(plan, n * rpn + local)
        if len(holders) > 1:
            nodes.update(holders)
    return tuple(sorted(n * rpn + local for n in nodes))


def exchange_ranks(cfg: Any, rank: int) -> tuple[int, ...]:
    """The ranks the scheduled transport's groups of ``rank`` span: every rank of ``rank``'s local
    index on the nodes of its redundancy group that sends or receives a copy (so every rank it sends
    to or receives from, :func:`peers_of`), sorted; ``(rank,)`` when it exchanges with nobody. Every
    rank of the result computes the same tuple.

    Four nodes of one rank, replica m = 2 (groups {0, 1} and {2, 3}): rank 2's groups span (2, 3)."""
    plan = plan_from_config(cfg)
    rpn = cfg.cluster.ranks_per_node
    node, local = divmod(rank, rpn)
    ranks = _exchanging(plan, rpn, plan.groups[plan.node_group[node]], local)
    return ranks if rank in ranks else (rank,)


def all_exchange_ranks(cfg: Any) -> list[tuple[int, ...]]:
    """Every :func:`exchange_ranks` of more than one rank in the job, in one order every rank computes
    (redundancy group, then local index): the groups a rank must take part in creating where torch
    cannot create a group among its members alone."""
    plan = plan_from_config(cfg)
    rpn = cfg.cluster.ranks_per_node
    out = []
    for group in plan.groups:
        for local in range(rpn):
            ranks = _exchanging(plan, rpn, group, local)
            if len(ranks) > 1:
                out.append(ranks)
    return out


#: whether this torch creates a group among its members alone (``new_group(use_local_synchronization=True)``)
LOCAL_SYNCHRONIZATION = "use_local_synchronization" in inspect.signature(dist.new_group).parameters


def groups_belonged_to() -> int:
    """How many process groups this process is a member of (the default group included), as torch
    counts them when it names a group made with ``use_local_synchronization``; -1 where this torch
    does not say (its registry, ``distributed_c10d._world.pg_names``, is private)."""
    try:
        return len(dist.distributed_c10d._world.pg_names)
    except Exception:
        return -1


def member_group(ranks: Sequence[int], every: Callable[[], Sequence[Sequence[int]]], backend: str,
                 timeout: Optional[timedelta] = None, local: bool = True) -> Any:
    """A process group of ``ranks`` (this rank among them, more than one). With ``local`` (the caller
    established that every rank belongs to equally many groups: :func:`groups_belonged_to`) it is
    made by its members alone: ``use_local_synchronization=True``, the ranks outside it never call
    ``new_group`` for it, and only its members meet in the store. torch 2.13 names such a group
    after its ranks and the number of groups the calling process belongs to, so members whose
    counts differ (Megatron puts only some pipeline stages in its embedding groups) would wait in
    different places for ever. Otherwise, without that argument (an older torch), or for an NCCL
    group when the default group is bound to a device (torch then splits the default group's
    communicator, which every rank of the default group must join), every rank calls ``new_group``
    for each of ``every()`` in that order, as torch requires, and gets the one it is in: each rank is
    a member of one, the calls for the others only count them. Every rank must pass the same
    ``local`` and make the transport's groups in the same order."""
    kw = {"backend": backend} if timeout is None else {"backend": backend, "timeout": timeout}
    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    if local and LOCAL_SYNCHRONIZATION and not (bound and backend == "nccl"):
        return dist.new_group(ranks=list(ranks), use_local_synchronization=True, **kw)
    mine = None
    for group_ranks in every():
        group = dist.new_group(ranks=list(group_ranks), **kw)
        if tuple(group_ranks) == tuple(ranks):
            mine = group
    if mine is None:
        raise ValueError(f"ranks {list(ranks)} are not among the groups every rank makes")
    return mine


def schedule_timeout_s(schedule: SendSchedule) -> int:
    """The data group's timeout for ``schedule``: :func:`~.p2p_batch.data_timeout_s` of its largest
    chunk at its planned rate (its bytes over its planned seconds, start-up times included, so never
    faster than the link model it was planned with)."""
    sizes = [s.size for s in schedule.sends]
    rate = sum(sizes) / schedule.planned_transfer_s if schedule.planned_transfer_s > 0 else math.inf
    return data_timeout_s(max(sizes, default=0), rate)


class TransportGroups:
    """One trainer's groups for its scheduled transport, and its planning collectives (training thread).
    Made collectively over :attr:`members` (:func:`exchange_ranks`): ``ctl`` (gloo, torch's default
    timeout: the bubble exchange), ``ctrl`` (gloo, :data:`CTRL_TIMEOUT`: headers, tables, byes) and, per
    data timeout an agreed schedule needs, a data group on the job's backend (:meth:`data_group`). Every
    one is None when this rank exchanges with nobody."""

    def __init__(self, cfg: Any, rank: int, backend: str, device: torch.device):
        self.cfg, self.rank, self.backend, self.device = cfg, rank, backend, device
        self.members = exchange_ranks(cfg, rank)  # every group made here spans these
        self.local = self.counts_agree([])[1]  # whether members may make their groups alone
        self.ctl = self.make("gloo")  # the bubble exchange (training thread)
        self.ctrl = self.make("gloo", CTRL_TIMEOUT)  # headers, tables, byes
        self.data: dict[int, Any] = {}  # timeout (s) -> data group
        self.agreed: dict[SendSchedule, int] = {}  # schedule agree() returned -> its data group's timeout

    def make(self, backend: str, timeout: Optional[timedelta] = None) -> Any:
        """A new group of :attr:`members` (:func:`member_group`); None when this rank exchanges with nobody."""
        if len(self.members) < 2:
            return None
        return member_group(self.members, lambda: all_exchange_ranks(self.cfg), backend, timeout, self.local)

    def counts_agree(self, values: list[int]) -> tuple[list[int], bool]:
        """Collective over the job's default group (every rank, no group made for it): the maximum of
        each of ``values`` over the ranks, and whether every rank belongs to equally many process
        groups now (:func:`groups_belonged_to`), so that the members of a group can make it alone.
        Where the counts differ (Megatron puts only some pipeline stages in its embedding groups), each
        rank below the largest makes groups of itself alone (local, no other rank takes part) until it
        belongs to as many: then they agree - rather than every rank making every pair's group, O(R)
        ``new_group`` calls per rank."""
        n = groups_belonged_to()
        t = torch.tensor([*values, n, -n, -1 if n < 0 else 0], dtype=torch.int64).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the default group's backend: NCCL on GPUs
        *out, most, least, unknown = (int(x) for x in t.tolist())
        if unknown == 0 and most != -least and LOCAL_SYNCHRONIZATION:
            for _ in range(most - n):
                dist.new_group(ranks=[self.rank], use_local_synchronization=True, backend="gloo")
            return out, self.counts_agree([])[1]  # every rank the same answer (one all-reduce more)
        return out, unknown == 0 and most == -least

    # ------------------------------------------------------------------ planning (training thread)
    def agree(self, schedule: Optional[SendSchedule]) -> Optional[SendSchedule]:
        """Collective over the job's default group (every rank, no group made for it): every rank
        passes its own schedule; all take the largest interval, so transfers start at the same steps
        everywhere (a ``compare_modes`` rotation switches modes at the same step on every rank), and
        the largest data timeout (:func:`schedule_timeout_s`), whose data group is made here if it is
        new. If one rank has none (it could not plan), nobody sends: None everywhere."""
        (n, missing, timeout_s), self.local = self.counts_agree(
            [schedule.interval_iterations if schedule else 0, 0 if schedule else 1,
             schedule_timeout_s(schedule) if schedule else 0])
        if missing or schedule is None:
            log.error("rank %d: a rank could not plan its checkpoint traffic: no scheduled transfers", self.rank)
            return None
        out = schedule if n == schedule.interval_iterations else dataclasses.replace(schedule, interval_iterations=n)
        self.data_group(timeout_s)
        self.agreed[out] = timeout_s
        return out

    def data_group(self, timeout_s: int) -> Any:
        """The data group with ``timeout_s``; a new one is made (collective over :attr:`members`) with
        an eager barrier: its communicator is built with every member taking part, before the driver's
        first batch. None when this rank exchanges with nobody."""
        if timeout_s not in self.data:
            group = self.make(self.backend, timedelta(seconds=timeout_s))
            if group is not None and self.device.type == "cuda":
                dist.barrier(group=group, device_ids=[self.device.index])
            elif group is not None:
                dist.barrier(group=group)
            self.data[timeout_s] = group
            log.info("rank %d: scheduled transport data group, timeout %d s", self.rank, timeout_s)
        return self.data[timeout_s]

    def exchange_bubbles(self, bubbles: list) -> dict[int, list]:
        """Collective over :attr:`members`: their reserved bubbles ``[(start, end), ...]``, by global
        rank (this rank's own, and those of every rank it sends to; a fixed-size float tensor, no pickle)."""
        cap = 64
        mine = torch.full((cap, 2), -1.0, dtype=torch.float64)
        for i, (a, b) in enumerate(bubbles[:cap]):
            mine[i, 0], mine[i, 1] = a, b
        out = [mine]
        if self.ctl is not None:
            out = [torch.empty_like(mine) for _ in self.members]
            dist.all_gather(out, mine, group=self.ctl)
        return {r: [(float(a), float(b)) for a, b in t.tolist() if a >= 0] for r, t in zip(self.members, out)}

    def ranks_on_my_host(self) -> int:
        """Collective over the job's default group (CPU only: every rank): how many training ranks
        share this rank's host (by host name, exchanged as a 64-bit hash: several simulated nodes on
        one machine share its cores)."""
        mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64).to(self.device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine)
        return sum(1 for t in out if int(t.item()) == int(mine.item()))
