"""The slot store's side of the job-wide agreement (:mod:`.agreement`, :mod:`.job_agreement`): each
local rank's newest finished step (``seen``), the node's report computed from the version table, the
refusal of a ``begin`` that would overwrite a version the job has not resolved yet, and the
snapshots skipped that way.

No lock of its own and no I/O: every method is called under ``SlotStore.lock``. The job agreement it
reports to is attached by the agent service once it joined (:meth:`NodeAgreement.attach`; none with
``snapshot.agreement: collective``); its ``report`` only hands the report to its thread, or in a
one-node job decides at once and calls back ``SlotStore.protect_agreed`` on the same thread (the
slot store's lock is re-entrant). Not collective.
"""
from __future__ import annotations

from typing import Any, Optional

from .agreement import NodeReport, PendingAgreement, Verdict, node_report, resolved
from .versions import CLEAN, VersionTable


#: anomalous iterations a node's report carries at most (the newest; the root judges them in order)
MAX_ANOMALIES = 64


class NodeAgreement:
    """See the module. ``job``: the attached :class:`~.job_agreement.JobAgreement` (its ``verdict``
    and non-blocking ``report``), or None."""

    def __init__(self, ranks_per_node: int):
        self.ranks_per_node = ranks_per_node
        self.job: Optional[Any] = None
        self.seen: dict[int, int] = {}  # local rank -> the newest step it finished with
        self.skipped_pending = 0  # begins refused while the slot's version waited for the job
        # recovery.prefer: certified - each local rank's newest judged iteration and its anomalous ones
        self.judged: dict[int, int] = {}
        self.anomalies: dict[int, set[int]] = {}

    def attach(self, job: Any, table: VersionTable) -> None:
        self.job = job
        self.report(table)

    @property
    def agreed(self) -> int:
        """The job's agreed step as this node knows it (-1: none, or no agreement)."""
        return self.job.verdict.agreed if self.job is not None else -1

    def check_begin(self, rank: int, slot: Any, step: int, table: VersionTable) -> None:
        """:class:`PendingAgreement` if ``slot`` (the one ``begin`` would hand out for ``step``) holds a
        version the job has not resolved yet. The first ``begin`` of a rank this agent sees (an agent
        restarted over its slots knows them, not how far its ranks went) says the rank finished with every
        older step: a step the old agent never committed is abandoned now, one snapshot sooner."""
        if rank not in self.seen:
            self.finished(rank, step - 1, table)
        if self.job is None or slot.state != CLEAN:
            return
        verdict = self.job.verdict
        if not resolved(slot.step, verdict, table.clean_steps(), self.seen):
            self.skipped_pending += 1
            raise PendingAgreement(f"rank {rank}: snapshot of step {step} skipped: its step {slot.step} waits for "
                                   f"the job's agreement (agreed: step {verdict.agreed})")

    def finished(self, rank: int, step: int, table: VersionTable, always: bool = False) -> None:
        """``rank`` is done with ``step`` (committed, failed or skipped): the node's report when that is
        news (``always``: report anyway, the table changed)."""
        if step > self.seen.get(rank, -1):
            self.seen[rank] = step
            self.report(table)
        elif always:
            self.report(table)

    def rewound(self, rank: int, step: int, table: VersionTable) -> None:
        """``rank`` resumes from ``step``: the steps after it begin again."""
        self.seen[rank] = step
        self.report(table)

    def judge(self, rank: int, iteration: int, anomalous: bool, table: VersionTable) -> int:
        """``rank`` judged ``iteration``'s loss (``recovery.prefer: certified``): the node's report carries
        it to the root's certifier. The newest certified step as this node knows it."""
        self.judged[rank] = max(iteration, self.judged.get(rank, -1))
        if anomalous:
            self.anomalies.setdefault(rank, set()).add(iteration)
        done = self.job.verdict.judged if self.job is not None else -1
        for its in self.anomalies.values():
            its.difference_update([it for it in its if it <= done])
        self.report(table)
        return self.job.verdict.certified if self.job is not None else -1

    def report(self, table: VersionTable) -> None:
        """This node's report, handed to the job agreement's reporting thread (no I/O)."""
        if self.job is None:
            return
        report = node_report(table.clean_steps(), self.seen, self.ranks_per_node)
        if self.judged:  # recovery.prefer: certified
            judged = min(self.judged.values()) if len(self.judged) >= self.ranks_per_node else -1
            done = self.job.verdict.judged
            bad = sorted({it for its in self.anomalies.values() for it in its if it > done})[-MAX_ANOMALIES:]
            report = NodeReport(report.held, report.seen, judged, tuple(bad))
        self.job.report(report)

    def adopt_verdict(self, verdict: Verdict) -> None:
        assert self.job is not None
        self.job.verdict = verdict

    def status(self) -> Optional[dict]:
        if self.job is None:
            return None
        v = self.job.verdict
        return {"agreed": v.agreed, "abandoned": list(v.abandoned), "skipped_pending": self.skipped_pending,
                "seen": {str(r): s for r, s in self.seen.items()}}
