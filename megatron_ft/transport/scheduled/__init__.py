"""The scheduled transport: trainers send their latest clean snapshot to the peers
that hold its copies, in the chunks and at the times of a :class:`~megatron_ft.schedule.modes.SendSchedule`;
the receiving trainer lands each chunk in its agent's shared memory and tells its agent when every
chunk is there.

In parts: :mod:`.transport` (:class:`ScheduledTransport`: the sending side and the driver's jobs),
:mod:`.receiving` (the receiver threads), :mod:`.groups` (who exchanges with whom, the groups and the
planning collectives), :mod:`.p2p` (the p2p driver, the batches, the link gate), :mod:`.transfers` (the
wire format on ``ctrl`` and the transfer records).

In parts: :mod:`.transport` (:class:`ScheduledTransport`: the sending side and the driver's jobs),
:mod:`.receiving` (the receiver threads), :mod:`.groups` (who exchanges with whom, the groups and the
planning collectives), :mod:`.p2p` (the p2p driver, the batches, the link gate), :mod:`.transfers` (the
wire format on ``ctrl`` and the transfer records).

Byte path of one transfer of version ``S`` from rank ``r`` (node A) to rank ``r'`` (same local
index on node B, which holds ``copy.r{r}``)::

    A: agent slot of S (pinned: sched_pin) --(GPU: H2D, side stream)--> staging buffer --send--> B
    B: --recv--> staging buffer --(GPU: D2H, side stream)--> agent block copy.r{r}, version S (sched_recv_begin)
    (on CPU gloo sends from a window of the slot and receives into a window of the block: no copies)
    B: after the last chunk: sched_recv_done -> B's agent marks the block complete, announces S

``S`` is the step every rank agreed on (the snapshot engine's ``last_agreed``, read where the engine is
idle), so all ranks send the same version and the group holds a consistent cut. A transfer starts
every ``interval_iterations`` iterations, at the same iteration on every rank; a failure midway
leaves the block incomplete and the previous complete version in use.

**Process groups, threads, timeouts.** The transport makes its own groups, each spanning only the
ranks that exchange copies with this one (:func:`exchange_ranks`: this rank's local index on the nodes
of its redundancy group that send or receive a copy; a pair of ranks for two-node replica groups,
never the world unless the plan's group is the world), created by those ranks alone
(:func:`member_group`: ``use_local_synchronization``, where torch has it; a rank that belongs to fewer
groups than others first makes groups of itself alone until the counts agree, since torch names a
locally made group by the process's group count; without that argument, or for NCCL on a bound default
group, every rank makes every such group, in one order); a rank that exchanges with nobody makes none:

* ``ctl`` (gloo, torch's default timeout): the planning exchange of bubbles
  (:meth:`TransportGroups.exchange_bubbles <.groups.TransportGroups.exchange_bubbles>`), on the training
  thread. The two planning steps that must be the same on every rank (:meth:`TransportGroups.agree
  <.groups.TransportGroups.agree>`, :meth:`TransportGroups.ranks_on_my_host <.groups.TransportGroups.ranks_on_my_host>`)
  run on the job's default group, which already exists: no group of the world is made.
* ``ctrl`` (gloo, :data:`CTRL_TIMEOUT` = 24 h): each transfer's header and chunk table, and the bye.
  The training thread sends them; one receiver thread per source rank (``mft-sched-recv-r{R}-from{S}``)
  receives them, and waits in that receive from one checkpoint to the next for as long as training
  runs (an ``off`` segment, an evaluation or a long interval included), hence the day.
* the data group (the job's backend: NCCL on GPUs, gloo on CPU), one per timeout in use, with a
  timeout of :func:`~megatron_ft.transport.p2p_batch.data_timeout_s` of the agreed schedules (60 s
  unless a chunk needs more than 6 s at the planned rate; :func:`schedule_timeout_s`). Created by
  :meth:`TransportGroups.agree <.groups.TransportGroups.agree>` (collective) with an eager barrier, so the communicator is built
  with every rank of the group taking part (``batch_isend_irecv`` requires that of the first collective call on
  an NCCL group); from then on **only the p2p driver thread** (``mft-sched-p2p-r{R}``) touches it: NCCL
  communicators are not thread-safe, and one communicator's operations run on one stream in issue
  order. The driver executes every chunk in the order of :mod:`megatron_ft.transport.p2p_batch`
  (keys both ends compute; one ``batch_isend_irecv`` per key, a send and a receive of the same key
  together), waits for each batch on the host, and resolves its operations. The same timeout bounds
  its wait for the sources' headers when a transfer starts. A batch that fails or times out stops
  the transport (on NCCL, PyTorch's watchdog also acts on the timed-out communicator as
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says: by default it ends the process).

The training thread only releases work to the driver (the chunks of an iteration, with their due
times) and waits for it in ``blocking`` / ``end`` modes and when a transfer is finished; the
receiver threads hand each announced transfer (its table and the agent's block) to the driver and
wait until the driver has received every chunk of it.

**The link gate** (:class:`GateClock`, a :class:`~megatron_ft.schedule.link_gate.LinkGate` on the
clock, made by :meth:`ScheduledTransport.use_link`). A schedule with ``gate_window_s`` > 0 ignores
its chunks' planned offsets: the training thread reports each of its own network calls to the gate
(begin / end, from the pipeline hooks), and the driver sends a chunk only once the gate lets it onto
the link (:func:`exchange_gated` on gloo: every receive of the release posted at once, each send
after the gate; on NCCL each batch with a send waits for the gate, still in key order). A chunk
waits at most ``2 x quiet_s`` (then goes, counted in ``GateClock.forced``). Lock order: the gate's
lock is a leaf - taken by the training thread's hooks and the driver, never held while waiting on
anything else.

Wire format on ``ctrl``, no pickle: a header of 8 int64 ``[MAGIC, VERSION, kind, start, step,
length, nchunks, columns]`` (kind 1 = transfer, 2 = bye, 3 = no transfer this time; ``start``: the
iteration step after which the transfer started, the same on every rank), then for a transfer an
int64 table of ``nchunks x (offset, size, iteration, at_ms, seq)`` (the chunk's key). The chunks
travel on the data group.

**Checks only a GPU machine can make** (``tests/gpu/test_scheduled_nccl.py``, two or more GPUs):
that two ranks exchanging large chunks both ways complete on NCCL (the ungrouped sends this
transport used to issue from two threads can deadlock there; gloo does not serialise them); that the first
batch after the eager barrier needs no other rank; the side-stream staging (host -> device before
the wire, device -> host before a block is released); and the driver thread's device (a new thread
starts on device 0 unless told).
"""
from __future__ import annotations

from .groups import (LOCAL_SYNCHRONIZATION, TransportGroups, all_exchange_ranks, exchange_ranks, groups_belonged_to,
                     member_group, peers_of, schedule_timeout_s)
from .p2p import GateClock, exchange, exchange_gated
from .transfers import CTRL_TIMEOUT, MAGIC, WIRE_VERSION
from .transport import ScheduledTransport

__all__ = ["ScheduledTransport", "TransportGroups", "GateClock", "exchange", "exchange_gated", "exchange_ranks",
           "all_exchange_ranks", "peers_of", "member_group", "groups_belonged_to", "schedule_timeout_s",
           "LOCAL_SYNCHRONIZATION", "CTRL_TIMEOUT", "MAGIC", "WIRE_VERSION"]
