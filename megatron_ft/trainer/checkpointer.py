"""The trainer-side entry point: restore on start, snapshot after every N-th iteration.

Framework-neutral: it takes a StateAdapter (megatron, plain torch, ...). The training loop calls

    ckpt = InMemoryCheckpointer(cfg, adapter, rank, world_size, topology)
    result = ckpt.restore()                      # once, after building model and optimizer
    loop:
        ...forward/backward...
        ckpt.before_optimizer_step()             # waits only if the last copy is unfinished
        optimizer.step(); scheduler.step()
        ckpt.after_iteration(iteration, consumed_samples)
    ckpt.close()

Construction and ``restore()`` are collective across all ranks. Snapshots are not: each rank waits
only for its own copy and the node agents agree on the step every rank holds (``snapshot.agreement:
agents``); megatron-ft then makes no process group of its own - the restore's few collectives and the
verdicts below run on the default group, on the training thread, where every rank calls them at the
same point of its program. (``snapshot.agreement: collective`` makes one world gloo group, whose
all-reduce the snapshot worker runs beside training.) ``after_iteration`` is
collective while the guard watches the iterations after a restore (its verdicts go through the agents
where they decide the restore) and, with ``agreement: collective`` and ``recovery.prefer: certified``,
or ``interval: auto``, every iteration (those verdicts go over the coordination group). Nothing here ever raises into training because a snapshot failed: failures are logged.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import config as ftconfig
from .. import fatal, faultpoints, rank_files
from ..agent import persist
from ..agent.protocol import AgentClient, socket_path
from ..health import progress as hp
from ..policy.runtime import AutoIntervals
from . import distributed as ftdist
from . import guard, in_process
from . import progress as rank_progress
from .guard import RollbacksExhausted
from .recovery import Restorer, RestoreResult, collective_device, refuse_version
from .snapshot import SnapshotEngine, stall_summary

log = logging.getLogger("megatron_ft")

#: how long a rank waits for a job-wide decision of its restore: for the slowest rank's part before it
#: (a multi-GiB load and verify, a rebuild from the group, a disk read)
DECISION_WAIT_S = 900.0


def _node_of(cfg: ftconfig.FTConfig, rank: int) -> int:
    return int(os.environ.get("MFT_NODE_RANK", rank // cfg.cluster.ranks_per_node))


def _agent_socket(cfg: ftconfig.FTConfig, node: int) -> str:
    """The node agent's socket: the one ``megatron-ft launch`` names, else the configured one."""
    return os.environ.get("MFT_AGENT_SOCKET") or socket_path(cfg.agent.socket_dir, cfg.run_id, node)


def agent_holds_version(cfg: ftconfig.FTConfig, rank: int) -> bool:
    """Whether this node's agent holds a clean version of ``rank`` now (one ``list`` on a short-lived
    connection, closed in order; bounded by ``agent.request_timeout_s``). False when the agent cannot be
    asked. Not collective."""
    client = AgentClient(_agent_socket(cfg, _node_of(cfg, rank)), cfg.agent.request_timeout_s)
    try:
        client.connect({"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "pid": os.getpid(),
                        "run_id": cfg.run_id})
        return bool(client.request("list", rank=rank)["versions"])
    except Exception as e:
        log.info("rank %d: could not ask the agent for its versions (%s): the weights are initialised", rank, e)
        return False
    finally:
        client.close(orderly=True)


class InMemoryCheckpointer:
    def __init__(self, cfg: ftconfig.FTConfig, adapter: Any, rank: int, world_size: int,
                 topology: dict, node: Optional[int] = None, agent_socket: Optional[str] = None):
        self.cfg = cfg
        self.adapter = adapter
        self.rank = rank
        self.world_size = world_size
        self.identity = {"run_id": cfg.run_id, "rank": rank, "world_size": world_size, "topology": topology}
        self.node = node if node is not None else _node_of(cfg, rank)
        self.coord_group = (dist.new_group(backend="gloo")
                            if dist.is_initialized() and cfg.snapshot.agreement == "collective" else None)
        path = agent_socket or _agent_socket(cfg, self.node)
        self.client: Optional[AgentClient] = AgentClient(path, cfg.agent.request_timeout_s)
        # under megatron-ft launch (it names the socket) the node's agent serves this node, though it may
        # be restarting (its launcher restarts a dead agent): wait for it as long as agent.connect_timeout_s
        wait_s = cfg.agent.connect_timeout_s if os.environ.get("MFT_AGENT_SOCKET") and not agent_socket else 0.0
        self._agent_path = path
        self._agent_decides = False  # the agent makes job-wide decisions (hello)
        try:
            hello = self.client.connect({"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
                                         "pid": os.getpid(), "run_id": cfg.run_id}, wait_s)
            self._agent_decides = bool(hello.get("decides"))
            differ = ftconfig.settings_differ(ftconfig.shared_settings(cfg), hello.get("settings") or {})
            if differ:  # e.g. a flag the launcher did not see: the agents would persist elsewhere
                fatal.end_job(f"rank {rank}: this trainer's settings differ from its node agent's (trainer vs "
                              f"agent): {'; '.join(differ)}. Give them once, in the YAML or on the training "
                              f"command under `megatron-ft launch`, which passes them to both")
        except OSError as e:
            if cfg.agent.required:
                fatal.end_job(f"rank {rank}: no snapshot agent at {path} ({e}); start the job with `megatron-ft "
                              f"launch`, or set agent.required: false to train unprotected")
            log.error("rank %d: no snapshot agent at %s (%s): in-memory snapshots are OFF for this run "
                      "(agent.required: false)", rank, path, e)
            self.client = None
        # where the training thread is, for the agent's hang rule (docs/recovery-time.md, "Hangs"); the
        # training thread's requests to its agent are waits, not its own work
        self.tracker = (rank_progress.install(hp.board_path(cfg.agent.shm_dir, cfg.run_id, self.node),
                                              int(os.environ.get("LOCAL_RANK", rank % cfg.cluster.ranks_per_node)))
                        if cfg.hang.enabled and self.client is not None else None)
        if self.tracker is not None:
            self.client.request = _waiting_for_agent(self.client.request)  # type: ignore[union-attr,method-assign]
        self.engine = (SnapshotEngine(self.client, rank, self.identity, cfg.snapshot.chunk_bytes, self.coord_group,
                                      required=cfg.agent.required,
                                      collective=cfg.snapshot.agreement == "collective")
                       if self.client is not None and cfg.snapshot.enabled else None)
        self._events = _EventLog(rank, self.node)
        self._ready_at = time.time()  # model, groups and the agent connection are up
        self.last_restore: Optional[RestoreResult] = None
        self._watch: Optional[_Watch] = None  # the guard's loss check after a restore (see after_iteration)
        self._decide: Optional[Callable[[str, list[int]], list[int]]] = None  # the restore's, while its guard watches
        self._decide_done: Callable[[], None] = lambda: None
        self._decide_count = 0
        #: megatron-ft's own collectives over every rank, counted (benchmarks/scale.py): the guard's and the
        #: certifier's verdicts, the interval policy's (per_iteration); the restore's (at_restore)
        self.world_collectives = {"per_iteration": 0, "at_restore": 0}
        self._max = _max_over_ranks(self.coord_group, self.world_collectives)
        # recovery.prefer: certified - every iteration's loss judged, the versions trained past certified
        self.certifier = (guard.Certifier(cfg.recovery.certify_after)
                          if cfg.recovery.prefer == "certified" and self.engine is not None else None)
        self._recent_losses: dict[int, float] = {}  # this life's last guard.SPIKE_WINDOW losses (the spike rule)
        self._losses_reported: Optional[bool] = None  # some rank reports its loss (decided at the first judgement)
        self._certified_seen = -1  # agents mode: the newest certified step this rank recorded
        self._loss_rule = guard.LossRule(cfg.recovery.loss_tolerance, cfg.recovery.loss_spike)
        # "interval: auto" - measure the first snapshots, then pick the intervals
        self.auto = (AutoIntervals(cfg, self._max)
                     if self.engine is not None and (cfg.snapshot.auto or cfg.persist.auto) else None)

    def restore(self) -> RestoreResult:
        """Collective: every rank restores the same step (docs/recovery-time.md). Its decisions go
        through the agents where they make them (one all-reduce over every rank first: the restore's
        identifier, and whether every rank's agent decides)."""
        with rank_progress.phase(hp.RESTORE):
            res = self._restore()
        if self.tracker is not None:  # the first iteration (its allowance: hang.first_s)
            self.tracker.writer.enter(hp.WORK)
        return res

    def _restore(self) -> RestoreResult:
        started = time.time()
        decide, done = self._decisions()
        restorer = Restorer(self.rank, self.world_size, self.identity, self.cfg.run_id, self.cfg.persist.dir,
                            self.client, self.coord_group, self.cfg.health.group_answer_s,
                            self.cfg.recovery.guard, self.cfg.recovery.max_rollbacks,
                            self.cfg.recovery.prefer == "certified", decide=decide)
        try:
            res = restorer.restore(self.adapter)
        except RollbacksExhausted as e:  # every rank together: end the job, never restart into garbage
            done()
            self._events.write({"event": "restore", "source": "none", "step": -1, "rollbacks_exhausted": str(e)})
            fatal.end_job(str(e), fatal.EXIT_ROLLBACKS_EXHAUSTED)
        except BaseException:
            done()
            raise
        finally:
            self.world_collectives["at_restore"] += restorer.world_collectives
            self.world_collectives["agent_decisions"] = restorer.decisions
        # the guard's verdicts on the iterations after the restore go the same way, then the connection ends
        self._decide, self._decide_done, self._decide_count = decide, done, restorer.decisions
        self.last_restore = res
        if res.source == "none":
            msg = "no valid in-memory or persisted snapshot: starting fresh"
        else:
            msg = f"restored step {res.step} from {res.source} in {res.seconds:.3f} s"
            if res.certified is not None:
                msg += " (certified)" if res.certified else " (not certified)"
            if res.certified and self.certifier is not None:
                self.certifier.passed(res.step)
        if self.rank == 0 or res.rejected:
            log.warning("rank %d: %s%s", self.rank, msg, f" (rejected: {res.rejected})" if res.rejected else "")
        if self.rank == 0:
            print(f"[megatron-ft] {msg}", flush=True)
        self._events.write({"event": "restore", "source": res.source, "step": res.step, "seconds": res.seconds,
                            "rejected": res.rejected, "rollbacks": res.rollbacks, "certified": res.certified,
                            "timeline": _start_timeline(self._ready_at, started),
                            "weights_initialised": not in_process.uninitialised()})
        if res.source != "none" and self.engine is not None:
            # every rank holds this step: tell the agent so it protects it until a newer one is agreed
            self.engine.last_committed = self.engine.last_agreed = res.step
            try:
                self.client.request("global", rank=self.rank, step=res.step)  # type: ignore[union-attr]
            except Exception:
                pass
            self._watch = self._start_watch(res.step)
        if self._watch is None:
            self._end_decisions()
        return res

    def restored_elsewhere(self, res: RestoreResult) -> None:
        """Record a restore made outside :meth:`restore` (a new generation's re-sliced one, from the previous
        generation's containers): the event and the rank-0 line, as for any restore. Not collective."""
        self.last_restore = res
        msg = (f"restored step {res.step} re-sliced from data-parallel size {res.extra.get('data_parallel_before')} "
               f"to {res.extra.get('data_parallel_after')} ({res.source}) in {res.seconds:.3f} s")
        if self.rank == 0:
            log.warning("rank 0: %s", msg)
            print(f"[megatron-ft] {msg}", flush=True)
        self._events.write({"event": "restore", "source": res.source, "step": res.step, "seconds": res.seconds,
                            "rejected": [], "rollbacks": 0, "certified": None, "resliced": res.extra,
                            "timeline": _start_timeline(self._ready_at, time.time() - res.seconds),
                            "weights_initialised": not in_process.uninitialised()})

    def _end_decisions(self) -> None:
        """The restore's decisions and its guard's are over: their connection to the agent ends."""
        done, self._decide, self._decide_done = self._decide_done, None, lambda: None
        done()

    def _decisions(self):
        """``(decide, done)``: the restore's job-wide decisions through this rank's agent - on a connection
        of their own, shut down if an in-process restart aborts the round while one waits - or
        ``(None, ...)``: the collectives. Collective: one MIN all-reduce of (this rank's agent decides, a
        random identifier), so that every rank takes the same way and names the decisions alike. (The
        identifier comes from the operating system: the training's ``random`` is seeded alike in every
        process and must not be advanced here.)"""
        nothing = (None, lambda: None)
        if not (dist.is_available() and dist.is_initialized()) or self.cfg.snapshot.agreement != "agents":
            return nothing
        t = torch.tensor([int(self._agent_decides and self.client is not None), secrets.randbits(62)],
                         dtype=torch.int64, device=collective_device(self.coord_group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.coord_group)
        self.world_collectives["at_restore"] += 1
        every, ident = (int(x) for x in t.tolist())
        if not every:
            return nothing
        client = AgentClient(self._agent_path, self.cfg.agent.request_timeout_s)
        client.reconnects = 0  # a decision is never sent twice
        client.connect({"rank": self.rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "pid": os.getpid(),
                        "run_id": self.cfg.run_id, "role": "coordination"})
        unregister = in_process.on_round_abort(client.interrupt)
        seq = itertools.count()
        key = f"restore/{ident:016x}"

        def decide(how: str, values: list[int]) -> list[int]:
            with rank_progress.phase(hp.AGENT):  # waiting for every rank's part: not this rank's own work
                return [int(x) for x in client.request("decide", rank=self.rank, key=f"{key}/{next(seq)}", how=how,
                                                       values=[int(v) for v in values],
                                                       wait_s=DECISION_WAIT_S)["values"]]

        def done() -> None:
            unregister()
            client.close(orderly=True)

        return decide, done

    def _start_watch(self, step: int) -> "Optional[_Watch]":
        """Collective: after restoring ``step``, whether (and against which recorded losses) the next
        ``recovery.guard_iterations`` iterations' losses are checked - only in a job that reports its
        losses (some rank's agent recorded one), so every rank decides the same."""
        rec = self.cfg.recovery
        if not rec.guard or self.client is None:
            return None
        history: dict[int, float] = {}
        if rec.guard_iterations:
            try:
                held = self.client.request("losses", rank=self.rank)
                history = {int(k): float(v) for k, v in held["losses"].items()}
            except Exception as e:  # an agent that cannot say: this rank judges without a history
                log.warning("rank %d: the agent did not give the recorded losses (%s)", self.rank, e)
        if not self._any_rank(bool(history)):  # the value check was the whole guard: it passed
            self._certify(step)
            return None
        return _Watch(step, step + rec.guard_iterations, history)

    def _any_rank(self, flag: bool) -> bool:
        """Collective: ``flag`` on some rank - through the agents after a restore they decided (one
        decision: 2 messages per node), else one MAX all-reduce (this rank's flag alone without a group)."""
        if self._decide is not None:
            self._decide_count += 1
            self.world_collectives["agent_decisions"] = self._decide_count
            return bool(self._decide("max", [int(flag)])[0])
        return bool(self._max([float(flag)])[0]) if self._max is not None else flag

    def _judged_at_agent(self, iteration: int, why: Optional[str]) -> None:
        """Agents mode: this rank's verdict on ``iteration`` to its agent (one local request, no collective);
        the root's certifier judges the job's iterations as every node's verdicts arrive, and the agents
        mark the certified and watched versions. A new certified step in the reply is recorded."""
        if why is not None:
            log.warning("rank %d: iteration %d: %s: the versions before it are not certified", self.rank, iteration,
                        why)
        try:
            certified = int(self.client.request("judged", rank=self.rank, iteration=iteration,  # type: ignore[union-attr]
                                                anomalous=why is not None)["certified"])
        except Exception as e:  # a verdict the agent missed: the node's report waits for the next one
            log.warning("rank %d: could not give the agent the verdict on iteration %d: %s", self.rank, iteration, e)
            return
        if certified > self._certified_seen:
            self._certified_seen = certified
            self._events.write({"event": "certified", "step": certified, "at": iteration})

    def _agreed_now(self) -> int:
        """The newest step the job agreed on, as this rank's agent knows it now (agents mode: one local
        request; the collective agreement: the engine's)."""
        if self.cfg.snapshot.agreement == "collective" or self.client is None:
            return self.engine.last_agreed if self.engine is not None else -1
        try:
            return int(self.client.request("agreed", rank=self.rank)["agreed"])
        except Exception as e:  # an agent that cannot say: what the last commit's reply said
            log.warning("rank %d: the agent did not say which step the job agreed on: %s", self.rank, e)
            return self.engine.last_agreed if self.engine is not None else -1

    def _verdict(self, anomalous: bool, agreed: int) -> tuple[bool, int]:
        """Collective: (an anomaly on some rank, the agreed step every rank's agent knows) - one MAX
        all-reduce, so that every rank's certifier decides the same (the agents learn a verdict at
        slightly different moments)."""
        if self._max is None:
            return anomalous, agreed
        flag, neg = self._max([float(anomalous), float(-agreed)])
        return bool(flag), int(-neg)

    def _certify(self, step: int) -> None:
        """``step`` passed the guard: the agent records it certified and forgives the rollbacks it counted."""
        if self.certifier is not None:
            self.certifier.passed(step)
        self._tell_agent("certify", step)

    def _tell_agent(self, op: str, step: int) -> None:
        """``certify`` or ``watch`` ``step`` at this rank's agent. Best effort: a mark the agent missed
        costs only the version it would have kept (and, for ``certify``, a rollback count kept higher)."""
        try:
            self.client.request(op, rank=self.rank, step=step)  # type: ignore[union-attr]
        except Exception as e:
            log.warning("rank %d: could not %s step %d at the agent: %s", self.rank, op, step, e)

    def _judge(self, iteration: int, loss: Optional[float]) -> None:
        """Collective (every rank, every iteration; ``recovery.prefer: certified``): judge this iteration's
        loss against this life's recent ones, agree on the verdict, and tell the agent which version is
        now certified and which one is watched next."""
        assert self.certifier is not None and self.engine is not None
        why = guard.loss_anomaly(iteration, loss, self._recent_losses, self._loss_rule)
        if loss is not None:
            self._recent_losses[iteration] = loss
            for old in sorted(self._recent_losses)[:-guard.SPIKE_WINDOW]:
                del self._recent_losses[old]
        if self.cfg.snapshot.agreement == "agents":
            self._judged_at_agent(iteration, why)
            return
        self.engine.wait()  # the coordination group is free for the verdict (it is after before_optimizer_step)
        if self._losses_reported is None:  # a loop that reports no loss (upstream's train()) needs no verdicts
            self._losses_reported = self._any_rank(loss is not None)
        anomalous, agreed = self._verdict(why is not None and bool(self._losses_reported), self._agreed_now())
        if anomalous:
            log.warning("rank %d: iteration %d: %s: the versions before it are not certified", self.rank, iteration,
                        why or "the loss of another rank was an anomaly")
        decided = self.certifier.iteration(iteration, anomalous, agreed)
        if decided.certify is not None:
            self._tell_agent("certify", decided.certify)
            self._events.write({"event": "certified", "step": decided.certify, "at": iteration})
        if decided.watch is not None:
            self._tell_agent("watch", decided.watch)

    def _watched(self, iteration: int, loss: Optional[float]) -> bool:
        """Collective (every rank, every iteration of the watch): judge this iteration's loss; on an
        anomaly on any rank roll back (never returns). True while the watch goes on (no snapshot: the
        versions older than the restored one stay in the slots for a rollback)."""
        w = self._watch
        assert w is not None
        why = guard.loss_anomaly(iteration, loss, w.history, self._loss_rule)
        if self.engine is not None:
            self.engine.wait()  # the coordination group is free for the verdict
        if self._any_rank(why is not None):
            self._roll_back(w.step, iteration, why or "the loss of another rank failed the guard")
        if iteration < w.until:
            return True
        self._watch = None
        self._end_decisions()
        self._certify(w.step)
        self._events.write({"event": "guard_passed", "step": w.step, "iterations": iteration - w.step})
        return False

    def _roll_back(self, step: int, iteration: int, why: str) -> None:
        """Every rank, after the same verdict: drop the restored ``step`` and everything newer (the agent's
        ``refuse``; this rank's persisted file of it renamed ``*.corrupt``) and exit for a restart that
        restores the next older version; past ``recovery.max_rollbacks`` end the job instead."""
        log.error("rank %d: after restoring step %d, iteration %d failed the guard: %s; rolling back",
                  self.rank, step, iteration, why)
        rollbacks = refuse_version(self.client, self.rank, step,
                                   persist.rank_file(self.cfg.persist.dir, self.cfg.run_id, step, self.rank))
        self._events.write({"event": "rollback", "step": step, "at": iteration, "why": why, "rollbacks": rollbacks})
        limit = self.cfg.recovery.max_rollbacks
        if rollbacks > limit:
            fatal.end_job(f"rank {self.rank}: {rollbacks} restored versions failed the guard, more than "
                          f"recovery.max_rollbacks={limit}: nothing trustworthy is left to resume from (last: step "
                          f"{step}, {why})", fatal.EXIT_ROLLBACKS_EXHAUSTED)
        if self.rank == 0:
            print(f"[megatron-ft] step {step} failed the guard after its restore ({why}): rolling back "
                  f"(rollback {rollbacks} of at most {limit})", flush=True)
        self._events.close()
        os._exit(guard.EXIT_ROLLBACK)  # not SystemExit: no atexit handler or thread may hang the exit

    def before_optimizer_step(self) -> None:
        if self.tracker is not None:
            self.tracker.iteration()
        if self.engine is not None:
            t0 = time.perf_counter()
            with rank_progress.phase(hp.AGENT):
                st = self.engine.wait()
            waited = time.perf_counter() - t0
            if self.auto is not None:
                self.auto.waited(waited, st)
            if st is not None:
                st.stall_s += waited
            if st is not None and not st.ok:
                log.warning("rank %d: snapshot of step %d not taken: %s", self.rank, st.step, st.error)

    def after_iteration(self, iteration: int, consumed_samples: int, loss: Optional[float] = None) -> None:
        """``iteration`` is complete (``loss``: its training loss where this rank knows it). Collective
        while the guard watches the iterations after a restore, and every iteration with
        ``recovery.prefer: certified`` (in a loop that reports its loss)."""
        if self._watch is not None:
            if self._watched(iteration, loss):
                return
        elif self.certifier is not None:
            self._judge(iteration, loss)
        if self.engine is not None and self.auto is not None:
            self._auto_intervals()
        every = self.auto.snapshot_every if self.auto is not None else self.cfg.snapshot.interval
        if self.engine is None or iteration % every:
            return
        faultpoints.reached("before-snapshot", iteration, self.rank)
        t0 = time.perf_counter()
        if hasattr(self.adapter, "progress"):
            self.adapter.progress = {"iteration": iteration, "consumed_samples": consumed_samples}
        later = getattr(self.adapter, "capture_later", None)  # the encoding on the worker (see LaterCapture)
        try:
            taken = later() if later is not None else self.adapter.capture()
        except Exception as e:  # a state we cannot capture costs this snapshot, never the training
            log.warning("rank %d: could not capture the state of step %d: %s", self.rank, iteration, e)
            stats = self.engine.skip(iteration, f"capture failed: {e}")
        else:
            stats = (self.engine.snapshot_later(iteration, taken, loss) if later is not None
                     else self.engine.snapshot(iteration, *taken, loss))
        stats.stall_s = time.perf_counter() - t0  # and, in before_optimizer_step, the wait for the copy
        if self.cfg.snapshot.synchronous:
            self.before_optimizer_step()

    def _auto_intervals(self) -> None:
        """Let the policy measure / decide; ask the agent to persist when it is due."""
        # the policy's all-reduce shares the coordination group with the snapshot worker's
        # agreement: make sure the worker is idle (it always is after before_optimizer_step)
        self.engine.wait()  # type: ignore[union-attr]
        decision = self.auto.tick()  # type: ignore[union-attr]
        if decision is not None:
            log.info("rank %d: %s", self.rank, decision.line)
            if self.rank == 0:
                print(f"[megatron-ft] {decision.line}", flush=True)
            self._events.write({"event": "auto_intervals", "snapshot_every": decision.snapshot_every,
                                "persist_every": decision.persist_every, "reason": decision.line})
        step = self.auto.persist_step(self.engine.last_agreed)  # type: ignore[union-attr]
        if step is not None and self.client is not None:
            try:
                self.client.request("persist", rank=self.rank, step=step)
            except Exception as e:  # a persist request never stops training
                log.warning("rank %d: could not ask the agent to persist step %d: %s", self.rank, step, e)

    def close(self) -> None:
        self._end_decisions()
        if self.engine is not None:
            self.engine.close()
            if self.engine.history:  # what training saw of its snapshots (the demo reports it)
                self._events.write({"event": "snapshots", **stall_summary(self.engine.history),
                                    "agreement": self.cfg.snapshot.agreement,
                                    "world_collectives": {"per_snapshot": self.engine.world_collectives,
                                                          **self.world_collectives}})
        if self.client is not None:
            self.client.close(orderly=True)
        if self.tracker is not None:
            rank_progress.close(self.cfg.hang.exit_s)
            self.tracker = None
        self._events.close()


def _waiting_for_agent(request):
    """``request`` of the agent's client, reported as a wait for the agent while it blocks (on the
    training thread: see :mod:`.progress`)."""
    def waiting(op: str, **fields):
        with rank_progress.phase(hp.AGENT):
            return request(op, **fields)

    return waiting


@dataclass
class _Watch:
    """The guard's loss check after restoring ``step``: until iteration ``until``, against ``history``."""

    step: int
    until: int
    history: dict


def _max_over_ranks(group: Any, counts: dict):
    """MAX all-reduce of a few floats over every rank (``group``, else the default group; identity
    without torch.distributed); each call counted in ``counts["per_iteration"]``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None

    def reduce(vals: list) -> list:
        import torch

        t = torch.tensor(vals, dtype=torch.float64, device=collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        counts["per_iteration"] += 1
        return t.tolist()

    return reduce


def _start_timeline(ready: float, restore_start: float) -> dict:
    """When this trainer process started, joined the rendezvous, was ready (model, groups, agent)
    and began restoring (wall-clock seconds): the phases of a recovery (``benchmarks/recovery.py``)."""
    rdzv = ftdist.RENDEZVOUS_SPAN
    number, began = in_process.attempt()  # an in-process restart: its attempt's start stands for the process's
    return {"process_start": began if number else process_start_time(), "rendezvous_start": rdzv[0] if rdzv else None,
            "rendezvous_end": rdzv[1] if rdzv else None, "ready": ready, "restore_start": restore_start}


def process_start_time() -> float:
    """This process's start (its fork), wall clock, to about 10 ms: its start in clock ticks since
    boot (``/proc/self/stat``) against the uptime now. (psutil's ``create_time`` adds the boot time of
    ``/proc/stat``, whole seconds, so it can be up to a second early.)"""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


class _EventLog:
    """``$MFT_RUN_DIR/events/node<N>/rank<R>.jsonl`` (:mod:`megatron_ft.rank_files`): restores and other
    events, for the demo and tests."""

    def __init__(self, rank: int, node: int):
        self.rank = rank
        self._f = None
        run_dir = os.environ.get("MFT_RUN_DIR")
        if run_dir:
            path = rank_files.rank_path(os.path.join(run_dir, "events"), rank, ".jsonl", node)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "time": time.time(),
                                      "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                                      "fast_round": int(os.environ.get("MFT_FAST_ROUND", 0)),
                                      "in_process_attempt": in_process.attempt()[0], **rec}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
