"""The per-node snapshot agent (REFT's snapshot management process).

One long-lived process per node, started by ``megatron-ft launch`` before the trainers and not
a child of any of them. It

* owns the node's shared-memory slots: two per local rank (REFT's clean/dirty double buffer),
  created and pre-faulted on first registration, re-adopted after an agent restart;
* hands a trainer the slot to write next (``begin``) and never the one holding the newest
  globally consistent version; flips a slot to CLEAN only when the trainer ``commit``s a
  complete, well-formed snapshot;
* persists the newest globally consistent version to disk every ``persist.interval`` steps,
  and at once when a trainer's connection drops without ``bye`` ("save at breakpoint");
* serves restarted trainers the list of clean versions it holds (they map the slot and read);
* removes its segments on clean shutdown (``shutdown`` op, SIGTERM or SIGINT).
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .. import config as ftconfig
from .. import shm, snapfile
from ..layout import Layout
from ..protocol import recv_msg, send_msg, socket_path
from . import persist

log = logging.getLogger("megatron_ft.agent")

SLOTS_PER_RANK = 2


@dataclass
class Slot:
    index: int
    segment: shm.Segment
    state: int = snapfile.EMPTY
    step: int = -1
    pins: int = 0  # >0 while the agent reads it (persisting)


@dataclass
class RankRecord:
    rank: int
    slots: list[Slot] = field(default_factory=list)
    fingerprint: str = ""
    global_step: int = -1

    def clean(self) -> list[Slot]:
        return sorted((s for s in self.slots if s.state == snapfile.CLEAN), key=lambda s: -s.step)

    def slot_with(self, step: int) -> Optional[Slot]:
        for s in self.slots:
            if s.state == snapfile.CLEAN and s.step == step:
                return s
        return None


class Agent:
    def __init__(self, cfg: ftconfig.FTConfig, node: int):
        self.cfg = cfg
        self.node = node
        self.run_id = cfg.run_id
        self.lock = threading.RLock()
        self.ranks: dict[int, RankRecord] = {}
        self.connected: dict[int, int] = {}  # rank -> open trainer connections
        self.persisted: list[int] = []
        self.persist_errors: list[str] = []
        self._persist_q: "queue.Queue[Optional[tuple[int, str]]]" = queue.Queue()
        self._queued_steps: set[int] = set()
        self._persist_due = 0  # the next step at which an interval persist is due
        self._stop = threading.Event()
        self._done = threading.Event()  # set when shutdown() has finished
        self.socket_path = socket_path(cfg.agent.socket_dir, self.run_id, node)
        self._server: Optional[socketserver.ThreadingUnixStreamServer] = None
        self._persist_thread: Optional[threading.Thread] = None
        self.started = time.time()
        self._sched_pins: dict[int, Slot] = {}  # rank -> the slot its scheduled transport reads
        self.redundancy = None  # agent.redundancy.Redundancy when redundancy.scheme != none (start_peers)
        self.store = None
        self.monitor = None

    def start_peers(self) -> None:
        """Join the group's coordination store and peer transport (issue 3)."""
        if self.cfg.redundancy.scheme == "none":
            return
        from ..health.monitor import Monitor
        from ..health.store import make_store
        from .redundancy import Redundancy

        h = self.cfg.health
        self.store = make_store(self.cfg, self.node)
        self.store.connect(self.cfg.agent.connect_timeout_s)
        host = h.host_of(self.node)
        self.redundancy = Redundancy(self, self.store, host)
        self.monitor = Monitor(self.store, self.node, self.cfg.cluster.nodes, h.heartbeat_s, h.timeout_s).start()
        with self.lock:
            for rec in self.ranks.values():
                if rec.slots:
                    self.redundancy.publish_size(rec.rank, rec.slots[0].segment.size)

    # ------------------------------------------------------------------ segments
    def adopt_existing(self) -> int:
        """Re-adopt slots left in shared memory by a previous agent of this node (agent restart)."""
        n = 0
        for rank, slot_idx, path in shm.list_segments(self.cfg.agent.shm_dir, self.run_id, self.node):
            try:
                seg = shm.open_segment(path)
                hdr = snapfile.read_header(seg.mm)
                state = hdr.state
                if state == snapfile.WRITING:  # torn by a crash mid-snapshot
                    snapfile.set_state(seg.mm, snapfile.EMPTY)
                    state = snapfile.EMPTY
                if state == snapfile.CLEAN:
                    snapfile.read_version(seg.mm, hdr)  # well-formed record or not adopted as clean
                fp = snapfile.read_layout(seg.mm, hdr).fingerprint()
            except (snapfile.SnapshotFormatError, OSError, ValueError) as e:
                log.warning("agent node %d: discarding unreadable segment %s: %s", self.node, path, e)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                continue
            rec = self.ranks.setdefault(rank, RankRecord(rank))
            rec.fingerprint = fp
            rec.slots.append(Slot(slot_idx, seg, state, hdr.step if state == snapfile.CLEAN else -1))
            rec.slots.sort(key=lambda s: s.index)
            n += 1
        if n:
            log.info("agent node %d: adopted %d existing slots: %s", self.node, n, self.describe())
        return n

    def register(self, rank: int, layout_json: str) -> dict:
        layout = Layout.from_json(layout_json.encode())
        fp = layout.fingerprint()
        geom = snapfile.geometry_for(layout, layout_json.encode())
        with self.lock:
            rec = self.ranks.get(rank)
            nslots = self.slots_per_rank()
            if rec and rec.fingerprint == fp and len(rec.slots) == nslots and all(
                    s.segment.size >= geom.total for s in rec.slots):
                if self.redundancy is not None:
                    self.redundancy.publish_size(rank, rec.slots[0].segment.size)
                return {"slots": [s.segment.path for s in rec.slots], "adopted": True}
            if rec and any(s.pins for s in rec.slots):
                raise RuntimeError(f"rank {rank}: slots are busy (being persisted); retry")
            if rec:
                log.info("agent node %d: rank %d changed layout; dropping its old slots", self.node, rank)
                self._drop_rank(rec)
            rec = RankRecord(rank, fingerprint=fp)
            limit = self.cfg.agent.shm_limit_mib << 20
            for i in range(nslots):
                path = os.path.join(self.cfg.agent.shm_dir, shm.segment_name(self.run_id, self.node, rank, i))
                budget = None
                if limit:
                    used = sum(s.segment.size for r in self.ranks.values() for s in r.slots)
                    used += sum(s.segment.size for s in rec.slots)
                    budget = max(0, limit - used)
                try:
                    seg = shm.create(path, geom.total, budget)
                except shm.SharedMemoryError as e:
                    for s in rec.slots:  # do not keep half a rank
                        s.segment.close()
                        os.unlink(s.segment.path)
                    if limit:
                        raise shm.SharedMemoryError(f"{e} (agent.shm_limit_mib={self.cfg.agent.shm_limit_mib})") from None
                    raise
                snapfile.init_container(seg.mm, layout_json.encode(), geom)
                rec.slots.append(Slot(i, seg))
            self.ranks[rank] = rec
            if self.redundancy is not None:
                self.redundancy.publish_size(rank, geom.total)
            log.info("agent node %d: rank %d registered, %d x %.1f MiB slots", self.node, rank, nslots,
                     geom.total / 2**20)
            return {"slots": [s.segment.path for s in rec.slots], "adopted": False}

    def slots_per_rank(self) -> int:
        """Two (REFT's clean/dirty double buffer), or one on an rs parity node: every packet it
        owns is also held whole by a data node of its group (ECHECK), so its own clean copy is only
        a cache and the slot is the staging buffer; its trainers' software failures are then served
        from the data node's copy when the slot is mid-write."""
        if self.redundancy is not None and self.redundancy.own_copy_is_redundant:
            return 1
        if self.cfg.redundancy.transport == "scheduled":
            # + the version its trainer is still sending, while the group's complete one, the newest
            # clean one and the one being written stay: snapshots go on during a transfer
            return SLOTS_PER_RANK + 2
        return SLOTS_PER_RANK

    def _drop_rank(self, rec: RankRecord) -> None:
        for s in rec.slots:
            s.segment.close()
            try:
                os.unlink(s.segment.path)
            except FileNotFoundError:
                pass
        self.ranks.pop(rec.rank, None)

    # ------------------------------------------------------------------ versions
    def begin(self, rank: int, step: int) -> int:
        with self.lock:
            rec = self._rec(rank)
            protected = rec.slot_with(rec.global_step) if rec.global_step >= 0 else None
            if protected is None and rec.clean():
                protected = rec.clean()[0]
            keep = {id(protected)}
            if self.redundancy is not None:  # the newest version the group holds, and the one being exchanged
                keep |= {id(rec.slot_with(st)) for st in self.redundancy.protected_steps()}
            if len(rec.slots) == 1:  # staging only: busy just while the exchange still reads it
                keep = {id(rec.slot_with(st)) for st in self.redundancy.sending_steps()} if self.redundancy else set()
            candidates = [s for s in rec.slots if id(s) not in keep and s.pins == 0]
            if not candidates:
                held = ", ".join(f"step {s.step} {snapfile.STATE_NAMES[s.state]}" + (" (pinned: persisting or sending)"
                                 if s.pins else " (protected)") for s in rec.slots)
                raise BusyError(f"rank {rank}: no free slot for step {step}: {held}")
            slot = min(candidates, key=lambda s: (s.state != snapfile.EMPTY, s.step))
            snapfile.set_state(slot.segment.mm, snapfile.WRITING)
            slot.state, slot.step = snapfile.WRITING, step
            return slot.index

    def commit(self, rank: int, slot_idx: int, step: int) -> None:
        with self.lock:
            slot = self._slot(rank, slot_idx)
            if slot.state != snapfile.WRITING or slot.step != step:
                raise RuntimeError(f"rank {rank} slot {slot_idx}: commit of step {step} but the slot is "
                                   f"{snapfile.STATE_NAMES[slot.state]} for step {slot.step}")
            hdr = snapfile.read_header(slot.segment.mm)
            snapfile.read_version(slot.segment.mm, hdr)
            if hdr.step != step:
                raise RuntimeError(f"rank {rank} slot {slot_idx}: header step {hdr.step} != committed {step}")
            snapfile.set_state(slot.segment.mm, snapfile.CLEAN)
            slot.state = snapfile.CLEAN

    def abort(self, rank: int, slot_idx: int) -> None:
        with self.lock:
            slot = self._slot(rank, slot_idx)
            if slot.state == snapfile.WRITING:
                snapfile.set_state(slot.segment.mm, snapfile.EMPTY)
                slot.state, slot.step = snapfile.EMPTY, -1

    def invalidate(self, rank: int, step: int) -> bool:
        """A trainer found this version corrupt: never offer it again."""
        with self.lock:
            slot = self._rec(rank).slot_with(step)
            if slot is None:
                return False
            snapfile.set_state(slot.segment.mm, snapfile.EMPTY)
            slot.state, slot.step = snapfile.EMPTY, -1
            log.warning("agent node %d: rank %d step %d invalidated (corrupt)", self.node, rank, step)
            return True

    def mark_global(self, rank: int, step: int) -> None:
        """``step`` is clean on every rank of the job (the trainers agreed on it)."""
        with self.lock:
            rec = self._rec(rank)
            rec.global_step = max(rec.global_step, step)
            if self.redundancy is not None and self.ranks:
                low = min(r.global_step for r in self.ranks.values())
                if low >= 0 and len(self.ranks) == self.cfg.cluster.ranks_per_node:
                    self.redundancy.version_global(low)
            interval = self.cfg.persist.interval
            if interval <= 0 or not self.ranks:
                return
            low = min(r.global_step for r in self.ranks.values())
            # due at the next multiple of the interval; if that step was skipped (its snapshot
            # found both slots busy, e.g. during a persist) the next consistent step catches up
            if low >= max(self._persist_due, interval):
                self._persist_due = (low // interval + 1) * interval
                self.request_persist(low, "interval")

    def newest_consistent_step(self) -> int:
        """Newest step that every local rank holds clean (preferring globally agreed steps)."""
        with self.lock:
            if not self.ranks:
                return -1
            common: Optional[set[int]] = None
            for rec in self.ranks.values():
                steps = {s.step for s in rec.clean()}
                common = steps if common is None else common & steps
            if not common:
                return -1
            glob = [r.global_step for r in self.ranks.values() if r.global_step >= 0]
            g = min(glob) if len(glob) == len(self.ranks) else -1
            return g if g in common else max(common)

    def list_versions(self, rank: int) -> list[dict]:
        with self.lock:
            rec = self.ranks.get(rank)
            if rec is None:
                return []
            return [{"slot": s.index, "step": s.step, "state": snapfile.STATE_NAMES[s.state],
                     "path": s.segment.path} for s in rec.clean()]

    def status(self) -> dict:
        with self.lock:
            return {
                "node": self.node, "run_id": self.run_id, "pid": os.getpid(),
                "connected": {str(r): n for r, n in sorted(self.connected.items())},
                "ranks": {str(r): {"global_step": rec.global_step,
                                   "slots": [{"slot": s.index, "state": snapfile.STATE_NAMES[s.state],
                                              "step": s.step, "pins": s.pins, "bytes": s.segment.size}
                                             for s in rec.slots]}
                          for r, rec in sorted(self.ranks.items())},
                "persisted": list(self.persisted),
                "persist_errors": list(self.persist_errors[-5:]),
                "pending_persists": self._persist_q.qsize(),
                "redundancy": self.redundancy.status() if self.redundancy is not None else None,
                "root": self.store.root if self.store is not None else None,
            }

    def describe(self) -> str:
        with self.lock:
            return ", ".join(f"r{r}:" + "/".join(f"{snapfile.STATE_NAMES[s.state]}@{s.step}" for s in rec.slots)
                             for r, rec in sorted(self.ranks.items()))

    # ------------------------------------------------------------------ for the peer redundancy
    def pin_step(self, step: int) -> dict[int, Slot]:
        """Pin every local rank's clean slot of ``step`` (KeyError if one does not hold it)."""
        with self.lock:
            out = {}
            for rec in self.ranks.values():
                s = rec.slot_with(step)
                if s is None:
                    raise KeyError(f"rank {rec.rank} does not hold step {step} clean")
                out[rec.rank] = s
            for s in out.values():
                s.pins += 1
            return out

    def pin_rank_step(self, rank: int, step: int) -> Slot:
        """Pin one rank's clean slot of ``step`` for its trainer's scheduled transport: one pin per
        rank at a time (pinning again moves it; repeating a request is harmless), released by
        :meth:`unpin_rank` or when the trainer is lost or says hello again."""
        with self.lock:
            old = self._sched_pins.get(rank)
            if old is not None and old.step == step and old.state == snapfile.CLEAN:
                return old
            s = self._rec(rank).slot_with(step)
            if s is None:
                raise KeyError(f"rank {rank} does not hold step {step} clean on node {self.node}")
            self.unpin_rank(rank)
            s.pins += 1
            self._sched_pins[rank] = s
            return s

    def unpin_rank(self, rank: int) -> None:
        with self.lock:
            s = self._sched_pins.pop(rank, None)
            if s is not None:
                s.pins = max(0, s.pins - 1)

    def unpin(self, slots: dict[int, Slot]) -> None:
        with self.lock:
            for s in slots.values():
                s.pins -= 1

    def clean_steps(self) -> dict[int, list[int]]:
        with self.lock:
            return {r: [s.step for s in rec.clean()] for r, rec in self.ranks.items()}

    def clean_segment(self, rank: int, step: int) -> shm.Segment:
        with self.lock:
            s = self._rec(rank).slot_with(step)
            if s is None:
                raise KeyError(f"rank {rank} step {step} is not held clean on node {self.node}")
            return s.segment

    def install_recovered(self, rank: int, step: int, data) -> None:
        """Write a container rebuilt from peers into one of ``rank``'s slots and mark it clean
        (the slots are created from the container's own layout when the rank has none)."""
        data = memoryview(data).cast("B")
        hdr = snapfile.read_header(data)
        g = hdr.geometry
        layout_json = bytes(data[g.layout_off: g.layout_off + g.layout_len])
        with self.lock:
            rec = self.ranks.get(rank)
            if rec is None or any(s.segment.size < len(data) for s in rec.slots):
                self.register(rank, layout_json.decode())
                rec = self.ranks[rank]
            slot = next((s for s in rec.slots if s.state != snapfile.CLEAN and s.pins == 0), None) or \
                min((s for s in rec.slots if s.pins == 0), key=lambda s: s.step)
            slot.segment.mm[: len(data)] = data
            snapfile.set_state(slot.segment.mm, snapfile.CLEAN)
            snapfile.read_version(slot.segment.mm, snapfile.read_header(slot.segment.mm))
            slot.state, slot.step = snapfile.CLEAN, step

    def _rec(self, rank: int) -> RankRecord:
        rec = self.ranks.get(rank)
        if rec is None:
            raise KeyError(f"rank {rank} is not registered with the agent of node {self.node}")
        return rec

    def _slot(self, rank: int, idx: int) -> Slot:
        rec = self._rec(rank)
        if not 0 <= idx < len(rec.slots):
            raise KeyError(f"rank {rank} has no slot {idx}")
        return rec.slots[idx]

    # ------------------------------------------------------------------ persistence
    def request_persist(self, step: int, reason: str) -> bool:
        with self.lock:
            if step < 0 or step in self.persisted or step in self._queued_steps:
                return False
            self._queued_steps.add(step)
        self._persist_q.put((step, reason))
        return True

    def trainer_lost(self, rank: int) -> None:
        self.unpin_rank(rank)  # its scheduled transfer died with it
        log.warning("agent node %d: trainer rank %d disconnected without bye (crashed?)", self.node, rank)
        if self.monitor is not None:
            self.monitor.report_software(rank)
        if self.cfg.persist.on_failure:
            step = self.newest_consistent_step()
            if step >= 0 and self.request_persist(step, f"breakpoint (rank {rank} lost)"):
                log.warning("agent node %d: saving step %d at breakpoint", self.node, step)

    def _persist_loop(self) -> None:
        while not self._stop.is_set():
            item = self._persist_q.get()
            if item is None:
                return
            step, reason = item
            try:
                self._persist(step, reason)
            except Exception as e:  # a failed persist never stops the agent
                msg = f"persist of step {step} ({reason}) failed: {e}"
                log.error("agent node %d: %s", self.node, msg)
                with self.lock:
                    self.persist_errors.append(msg)
            finally:
                with self.lock:
                    self._queued_steps.discard(step)

    def _persist(self, step: int, reason: str) -> None:
        base = self.cfg.persist.dir
        with self.lock:
            slots = []
            for rec in self.ranks.values():
                s = rec.slot_with(step)
                if s is None:
                    raise RuntimeError(f"rank {rec.rank} no longer holds step {step} clean")
                s.pins += 1
                slots.append((rec.rank, s))
        t0 = time.perf_counter()
        nbytes = 0
        try:
            for rank, s in slots:
                nbytes += persist.write_container(s.segment.mm, persist.rank_file(base, self.run_id, step, rank))
        finally:
            with self.lock:
                for _, s in slots:
                    s.pins -= 1
        dt = time.perf_counter() - t0
        with self.lock:
            self.persisted.append(step)
            ranks = list(self.ranks)
        persist.prune(base, self.run_id, ranks, self.cfg.persist.keep, protect=step)
        log.info("agent node %d: persisted step %d (%s): %.1f MiB in %.2f s", self.node, step, reason,
                 nbytes / 2**20, dt)

    # ------------------------------------------------------------------ serving
    def serve_forever(self) -> None:
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        agent = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                agent._handle_connection(self.request)

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        self._server = Server(self.socket_path, Handler)
        self._persist_thread = threading.Thread(target=self._persist_loop, name="persist", daemon=True)
        self._persist_thread.start()
        backing = shm.page_backing(self.cfg.agent.shm_dir)
        log.info("agent node %d (pid %d) serving on %s; shared memory in %s (%s pages)", self.node, os.getpid(),
                 self.socket_path, self.cfg.agent.shm_dir, "2 MiB" if backing == shm.HUGE else "4 KiB")
        if backing != shm.HUGE:
            log.info("agent node %d: %s has 4 KiB pages; a huge-page tmpfs restores ~2x faster: "
                     "`megatron-ft shm-mount DIR --size S` (root), then agent.shm_dir: DIR", self.node,
                     self.cfg.agent.shm_dir)
        try:
            self._server.serve_forever(poll_interval=0.2)
        finally:
            self._server.server_close()

    def _handle_connection(self, sock: socket.socket) -> None:
        rank: Optional[int] = None
        orderly = False
        try:
            while True:
                try:
                    msg = recv_msg(sock)
                except ConnectionError:
                    break
                op = msg.get("op")
                try:
                    reply = self._dispatch(op, msg)
                    if op == "hello" and msg.get("role") != "transport":  # a trainer (not its transport's threads)
                        rank = int(msg["rank"])
                        with self.lock:
                            if not self.connected.get(rank):  # a restarted trainer: no transfer of the old one
                                self.unpin_rank(rank)
                            self.connected[rank] = self.connected.get(rank, 0) + 1
                    if op == "bye":
                        orderly = True
                    send_msg(sock, {"ok": True, **reply})
                except BusyError as e:
                    send_msg(sock, {"ok": False, "error": str(e), "busy": True})
                except Exception as e:  # report to the trainer, keep serving
                    send_msg(sock, {"ok": False, "error": f"{type(e).__name__}: {e}"})
                if op == "shutdown":
                    threading.Thread(target=self.shutdown, daemon=True).start()
                    return
                if op == "bye":
                    return
        finally:
            if rank is not None:
                with self.lock:
                    self.connected[rank] = max(0, self.connected.get(rank, 1) - 1)
                if not orderly and not self._stop.is_set():
                    self.trainer_lost(rank)

    def _dispatch(self, op: Optional[str], msg: dict) -> dict:
        if op == "hello":
            if msg.get("run_id") != self.run_id:
                raise ValueError(f"run_id {msg.get('run_id')!r} does not match this agent's {self.run_id!r}")
            return {"node": self.node, "agent_pid": os.getpid()}
        if op == "register":
            return self.register(int(msg["rank"]), msg["layout"])
        if op == "begin":
            return {"slot": self.begin(int(msg["rank"]), int(msg["step"]))}
        if op == "commit":
            self.commit(int(msg["rank"]), int(msg["slot"]), int(msg["step"]))
            return {}
        if op == "abort":
            self.abort(int(msg["rank"]), int(msg["slot"]))
            return {}
        if op == "invalidate":
            return {"invalidated": self.invalidate(int(msg["rank"]), int(msg["step"]))}
        if op == "global":
            self.mark_global(int(msg["rank"]), int(msg["step"]))
            return {}
        if op == "list":
            return {"versions": self.list_versions(int(msg["rank"]))}
        if op == "peer_list":
            if self.redundancy is None:
                return {"versions": []}
            return {"versions": self.redundancy.candidates(int(msg["rank"]))}
        if op == "recover":
            if self.redundancy is None:
                raise RuntimeError("redundancy.scheme is none: nothing to recover from peers")
            return self.redundancy.recover(int(msg["rank"]), int(msg["step"]))
        if op and op.startswith("sched_"):  # the scheduled transport's trainers (issue 4)
            if self.redundancy is None or not self.redundancy.scheduled:
                raise RuntimeError(f"{op}: redundancy.transport is not 'scheduled' on node {self.node}")
            red = self.redundancy
            if op == "sched_pin":
                return red.sched_pin(int(msg["rank"]), int(msg["step"]))
            if op == "sched_unpin":
                self.unpin_rank(int(msg["rank"]))
                return {}
            if op == "sched_recv_begin":
                return red.sched_recv_begin(int(msg["src_rank"]), int(msg["step"]), int(msg["length"]))
            if op == "sched_recv_done":
                return red.sched_recv_done(int(msg["src_rank"]), int(msg["step"]))
        if op == "status":
            return {"status": self.status()}
        if op == "persist":
            step = int(msg.get("step", self.newest_consistent_step()))
            return {"queued": self.request_persist(step, "requested"), "step": step}
        if op == "wait_persisted":
            deadline = time.time() + float(msg.get("timeout", 60))
            while time.time() < deadline:
                with self.lock:
                    if not self._queued_steps and self._persist_q.empty():
                        return {"persisted": list(self.persisted)}
                time.sleep(0.05)
            raise TimeoutError("persists still pending")
        if op in ("bye", "shutdown"):
            return {}
        raise ValueError(f"unknown op {op!r}")

    def shutdown(self, remove_segments: bool = True) -> None:
        """Clean shutdown: finish queued persists, remove segments and the socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._persist_q.put(None)
        if self._server is not None:
            self._server.shutdown()
        if self._persist_thread is not None:
            self._persist_thread.join(timeout=300)  # let queued persists finish
        if self.monitor is not None:
            self.monitor.stop()
        if self.redundancy is not None:
            self.redundancy.close()
            if remove_segments:
                self.redundancy.remove_segments()
        with self.lock:
            if remove_segments:
                for rec in list(self.ranks.values()):
                    self._drop_rank(rec)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        log.info("agent node %d: shut down%s", self.node, " (segments removed)" if remove_segments else "")
        self._done.set()


class BusyError(RuntimeError):
    pass


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ft.agent", description="megatron-ft per-node snapshot agent")
    p.add_argument("--config", default=None, help="job YAML (default: embedded local-cpu.yaml)")
    p.add_argument("--node", type=int, required=True, help="node index")
    p.add_argument("--run-id", default=None)
    p.add_argument("--persist-interval", type=int, default=None)
    p.add_argument("--persist-dir", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[agent n{args.node} %(asctime)s] %(levelname)s %(message)s")
    cfg = ftconfig.load(args.config)
    changes: dict = {}
    if args.run_id:
        changes["run_id"] = args.run_id
    pers = {}
    if args.persist_interval is not None:
        pers["interval"] = args.persist_interval
    if args.persist_dir:
        pers["dir"] = args.persist_dir
    if pers:
        changes["persist"] = pers
    if changes:
        cfg = ftconfig.replace(cfg, **changes)
    agent = Agent(cfg, args.node)
    agent.adopt_existing()
    agent.start_peers()

    def on_signal(signum, frame):  # clean shutdown on SIGTERM / SIGINT
        threading.Thread(target=agent.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.serve_forever()
    agent._done.wait(timeout=600)  # the shutdown thread drains persists and removes segments
    return 0


if __name__ == "__main__":
    sys.exit(main())
