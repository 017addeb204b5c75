"""The job record on etcd (:mod:`.job_record`): etcd derives no keys, so the reader folds them itself.

:class:`EtcdJobView` reads the record's keys once - one range read of ``[ended, rdzv]``, which holds
``ended``, ``failed/``, ``fatal/``, ``hb/`` and ``rdzv`` (and ``hang``, ``last_verdict``, which the fold
ignores) - then follows that range on one etcd watch stream (:meth:`~.etcd.EtcdKV.events`, thread
``job-view``), folding each event with :func:`~.job_record.apply`. On etcd ``hb/<n>`` is written when
its owners change, not every beat (:mod:`.etcd_liveness`), so every event the stream carries is a
change of the record: a reader's messages are one stream (re-opened every :data:`WATCH_S`) plus one
event per change, whatever N. A broken or compacted stream is read again from scratch (one range read).

Same interface as :class:`~.job_record.JobView` (``refresh``, ``wait``, ``record``, ``version``); its
``record`` is a copy, so the caller may read it while the thread folds the next change.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from ..clock import Deadline
from .etcd import EtcdKV
from .job_record import RANGE, JobRecord, apply
from .kv import StoreUnavailable

log = logging.getLogger("megatron_ft.health")

#: how long one watch stream of the record waits before it is opened again
WATCH_S = 10.0


class EtcdJobView:
    """The record of the job whose keys ``kv`` reads (see the module). The thread starts at the first
    :meth:`refresh` or :meth:`wait` (which read the keys first, raising :class:`StoreUnavailable` if etcd
    does not answer) and ends with :meth:`close` (within :data:`WATCH_S`) or the process."""

    def __init__(self, kv: EtcdKV, nodes: int):
        self.kv, self.nodes = kv, nodes
        self._rec = JobRecord(nodes=nodes, epoch="etcd")
        self.version = 0
        self._rev = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def record(self) -> JobRecord:
        with self._cond:
            r = self._rec  # its entries are frozen: the copy shares them
            return JobRecord(r.nodes, r.epoch, r.version, dict(r.owners), dict(r.failed), dict(r.fatal), r.ended, r.rdzv)

    def _load(self) -> None:
        rev, keys = self.kv.read_range(*RANGE)
        rec = JobRecord(nodes=self.nodes, epoch="etcd")
        for k in sorted(keys):
            apply(rec, k, keys[k])
        with self._cond:
            self._rec, self._rev = rec, rev
            self.version += 1
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._load()
            self._thread = threading.Thread(target=self._follow, name="job-view", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                for ev in self.kv.events(RANGE[0], self._rev + 1, WATCH_S, end=RANGE[1], stop=self._stop):
                    with self._cond:
                        self._rev = ev.rev
                        if apply(self._rec, ev.key, ev.value if ev.kind == "PUT" else None):
                            self.version += 1
                            self._cond.notify_all()
            except StoreUnavailable as e:
                if self._stop.is_set():
                    return
                log.warning("job record on etcd: %s; reading it again", e)
                self._stop.wait(1.0)
                try:
                    self._load()
                except StoreUnavailable:
                    pass

    def refresh(self, owners: bool = False) -> JobRecord:
        """The record as folded so far (owners always included)."""
        self._start()
        return self.record

    def complete(self) -> int:
        """How many nodes have an agent and a launcher (as folded so far)."""
        self._start()
        with self._cond:
            return self._rec.complete()

    def wait_complete(self, nodes: int, within_s: float) -> int:
        """:meth:`complete` once it reaches ``nodes``, or after ``within_s`` (folded by the watch thread:
        no request here)."""
        deadline = Deadline(within_s, "every node's agent and launcher")
        while (n := self.complete()) < nodes and not deadline.expired():
            self.wait(self.version, min(0.1, deadline.left()))
        return n

    def wait(self, after: int, wait_s: float) -> JobRecord:
        """The record once :attr:`version` is past ``after``, or after ``wait_s``."""
        self._start()
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self.version == after:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return self.record

    def close(self) -> None:
        self._stop.set()
