"""The agent's persistence: the node's consistent versions written to disk on their own thread -
every ``persist.interval`` agreed steps, on request (``persist`` op), and at once when a trainer's
connection drops without ``bye`` ("save at breakpoint").

Owns the queue, the persisted and queued steps, the errors and the next due step under
``Persister.lock`` (innermost: nothing is taken under it; never held across a call into the slot
store or any disk I/O). Reads the slots through the slot store's pins (:meth:`SlotStore.pin_step`),
verifies and writes them with no lock held (:mod:`.persist`). Not collective: each node writes its
own ranks' files and its marker.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Optional

from ..clock import wait_until
from . import persist
from .. import config as ftconfig
from ..capture import snapfile

log = logging.getLogger("megatron_ft.agent")


class Persister:
    """One node's persistence (see the module); ``slots``: its :class:`~.slot_store.SlotStore`;
    ``stop``: set when the agent shuts down (the persist under way, and the one queued next, finish)."""

    def __init__(self, cfg: ftconfig.FTConfig, node: int, slots, stop: threading.Event):
        self.cfg, self.node, self.slots, self._stop = cfg, node, slots, stop
        self.lock = threading.Lock()
        self.persisted: list[int] = []
        self.errors: list[str] = []
        self._q: "queue.Queue[Optional[tuple[int, str]]]" = queue.Queue()
        self._queued: set[int] = set()
        self._due = 0  # the next step at which an interval persist is due
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="persist", daemon=True)
        self._thread.start()

    def due(self, low: int) -> Optional[int]:
        """``low``: the step every local rank agreed on; it, when an interval persist is due (at the next
        multiple of the interval; if that step was skipped - its snapshot found both slots busy, e.g.
        during a persist - the next consistent step catches up), else None. Pure bookkeeping."""
        interval = self.cfg.persist.interval
        with self.lock:
            if interval > 0 and low >= max(self._due, interval):
                self._due = (low // interval + 1) * interval
                return low
        return None

    def rewound(self, step: int) -> None:
        """The job resumed from ``step``: persists of newer steps are of an abandoned future."""
        interval = self.cfg.persist.interval
        with self.lock:
            self.persisted = [p for p in self.persisted if p <= step]
            if interval > 0:
                self._due = min(self._due, (max(step, 0) // interval + 1) * interval)

    def request(self, step: int, reason: str) -> bool:
        """Queue a persist of ``step``; False when it is persisted or queued already (or negative)."""
        with self.lock:
            if step < 0 or step in self.persisted or step in self._queued:
                return False
            self._queued.add(step)
        self._q.put((step, reason))
        return True

    def breakpoint(self, rank: int) -> None:
        """``rank``'s trainer was lost: with ``persist.on_failure``, the newest consistent step to disk."""
        if self.cfg.persist.on_failure:
            step = self.slots.newest_consistent_step()
            if step >= 0 and self.request(step, f"breakpoint (rank {rank} lost)"):
                log.warning("agent node %d: saving step %d at breakpoint", self.node, step)

    def wait(self, wait_s: float) -> list[int]:
        """The persisted steps once nothing is queued or being written (TimeoutError after ``wait_s``)."""
        def idle() -> Optional[list[int]]:
            with self.lock:
                return list(self.persisted) if not self._queued and self._q.empty() else None

        return wait_until(idle, wait_s, "the persists still pending")

    def status(self) -> dict:
        with self.lock:
            return {"persisted": list(self.persisted), "persist_errors": list(self.errors[-5:]),
                    "pending_persists": self._q.qsize()}

    def close(self) -> None:
        """After ``stop`` was set: let the persist under way finish (at most 300 s)."""
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout=300)

    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self._q.get()
            if item is None:
                return
            step, reason = item
            try:
                self._persist(step, reason)
            except Exception as e:  # a failed persist never stops the agent
                msg = f"persist of step {step} ({reason}) failed: {e}"
                log.error("agent node %d: %s", self.node, msg)
                with self.lock:
                    self.errors.append(msg)
            finally:
                with self.lock:
                    self._queued.discard(step)

    def _persist(self, step: int, reason: str) -> None:
        """Write every local rank's clean version of ``step`` to disk, each verified (size, record
        and every chunk checksum) before a byte is written: a corrupt slot is invalidated and
        nothing of the step is written, so it never counts towards ``persist.keep``."""
        base = self.cfg.persist.dir
        try:
            refs = self.slots.pin_step(step)
        except KeyError as e:
            raise RuntimeError(f"{e.args[0]} any longer") from None
        t0 = time.perf_counter()
        nbytes = 0
        try:
            bad = {}
            for rank, ref in refs.items():
                try:
                    persist.verify_container(ref.segment.mm)
                except snapfile.SnapshotFormatError as e:
                    bad[rank] = e
            if bad:
                for rank in bad:
                    self.slots.invalidate(rank, step)
                raise RuntimeError("not persisted, corrupt in shared memory: " +
                                   "; ".join(f"rank {r}: {e}" for r, e in bad.items()))
            for rank, ref in refs.items():
                nbytes += persist.write_container(ref.segment.mm, persist.rank_file(base, self.cfg.run_id, step, rank))
            persist.mark_persisted(base, self.cfg.run_id, step, self.node, {r: ref.segment.mm for r, ref in refs.items()},
                                   self.cfg.cluster.world_size)  # this node's files are durable: its marker
        finally:
            self.slots.unpin(refs)
        dt = time.perf_counter() - t0
        with self.lock:
            self.persisted.append(step)
        persist.prune(base, self.cfg.run_id, list(refs), self.cfg.persist.keep, protect=step)
        log.info("agent node %d: persisted step %d (%s): %.1f MiB in %.2f s", self.node, step, reason,
                 nbytes / 2**20, dt)
