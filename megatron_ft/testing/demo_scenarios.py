"""The demo's failure scenarios (``megatron-ft demo --fail``): one class each, holding only its own steps
and checks; :data:`SCENARIOS` maps every ``--fail`` value to its class.

The scenario contract. The driver (:mod:`megatron_ft.testing.demo`) calls, in this order:

1. ``choose_victims(args, cfg)`` (class method): (ranks that fail, nodes lost), refused before anything
   runs; ``configure(cfg)`` (class method) adjusts the job's configuration (:func:`demo.demo_config`);
2. ``fault_spec(run)``: the fault the job's trainers are wrapped in (:mod:`megatron_ft.testing.faults`),
   or None;
3. ``prepare(run)``: once the job is started (a standby launcher beside it);
4. ``inject(run)``: waits for the failure's moment and injects it, recording in the
   :class:`~megatron_ft.testing.demo_run.Run` what it did (``kill_time``, ``killed_pids``, ``agent_killed``,
   ``hang_time``, the lost nodes' facts). The base class does what every scenario shares: an injected
   ``--kill-point`` (the victims kill themselves: :meth:`Scenario.await_injected_fault`), or the victims
   reaching ``--kill-at`` (:meth:`Scenario.reach_kill_moment`) and then :meth:`Scenario.strike`, which is
   what a scenario overrides;
5. the checks, while the summary is judged (:mod:`megatron_ft.testing.demo_summary`), each at its place
   in the list of problems: ``judge_verdicts`` (the failure verdicts this scenario accounts for),
   ``check_resumed_steps`` (the steps the victims resumed from), ``tier_failure`` (the failure whose
   promised tier applies); ``summary_fields`` fills the summary's :data:`SCENARIO_FIELDS`, and
   ``report`` prints the scenario's own lines.

The flags ``expects_hang`` (one hang verdict per victim is expected; in every other scenario none) and
``trains_through`` (no failure: no trainer may restart) are read by the shared checks. ``--kill-agent``
and ``--second-failure`` combine with any scenario: :func:`kill_agent_beforehand` and
:func:`strike_during_recovery`, which the driver runs before and after ``inject``."""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from typing import Optional

from . import faults
from .. import config as ftconfig
from ..agent.protocol import socket_path
from .demo_jobs import (GROUP_COMPLETE, agent_protected, kill_during_recovery, kill_node, node_pid, pause_agent,
                        persisted_steps, slow_down, start_replacement, wait_fault, wait_group_complete,
                        watch_slurm_node)
from .demo_results import _all_records, _progress, withdrawn_verdicts
from .demo_run import Run

#: injected kill points that damage the committed slot first: restore must reject that version
DAMAGE_POINTS = ("corrupt-after-commit", *faults.REWRITES, *faults.TRUNCATE_TO)
#: --fail agent-pause: (the paused node judged failed, its ranks restarted) -> what happened; the first
#: two are right, the others are not
PAUSE_OUTCOMES = {(False, False): "trained through", (True, True): "node recovered",
                  (True, False): "verdict without recovery", (False, True): "restart without verdict"}
#: --fail hang-in-restore: the job's ``hang`` allowances. The defaults (a restore 300 s, a new trainer's
#: first iterations 120 s) are sized for real restores and real first iterations; a rank waiting in a
#: collective counts as waiting after half of its own bound, and a restarted trainer's is ``first_s``, so
#: the verdict on a rank hung in its restore comes after max(restore_s, first_s / 2). Only this scenario
#: gets the small ones: every other keeps the shipped defaults the demo is there to show (and a smaller
#: first_s would judge a slow first iteration of an upstream Megatron-LM run, --megatron-lm).
RESTORE_HANG_LIMITS = {"restore_s": 15.0, "first_s": 30.0}
#: the summary's keys a scenario fills (``summary_fields``); None in every other scenario
SCENARIO_FIELDS = ("slowed", "agent_paused", "agent_pause_outcome")


def node_ranks(cfg: ftconfig.FTConfig, node: int) -> list[int]:
    """The ranks of node ``node``."""
    rpn = cfg.cluster.ranks_per_node
    return list(range(node * rpn, (node + 1) * rpn))


def checked_node(args: argparse.Namespace, cfg: ftconfig.FTConfig, node: int, lo: int, why: str = "",
                 flag: str = "--victim-node") -> int:
    """``node``, or a clear error for a node outside the cluster."""
    nodes = cfg.cluster.nodes
    if not lo <= node < nodes:
        raise ftconfig.ConfigError(f"{flag}={node} is invalid for --fail {args.fail}: must be in "
                                   f"[{lo}, {nodes - 1}]{why}")
    return node


def default_victim_node(cfg: ftconfig.FTConfig) -> int:
    """The highest node (not 0, which hosts the rendezvous) whose ranks no other node holds whole."""
    from ..redundancy.exchange import holders_of_whole
    from ..redundancy.plan import plan_from_config

    plan = plan_from_config(cfg)
    rpn = cfg.cluster.ranks_per_node
    for n in range(cfg.cluster.nodes - 1, 0, -1):
        if all(len(holders_of_whole(plan, r)) == 1 for r in range(n * rpn, (n + 1) * rpn)):
            return n
    return cfg.cluster.nodes - 1


def kill_trainers(run: Run, recs: dict[int, list[dict]], how: signal.Signals = signal.SIGKILL,
                  note: str = "") -> None:
    """Send ``how`` to the victims' trainers (their newest lives in ``recs``): the failure's moment."""
    for v in run.victims:
        pid = recs[v][-1]["pid"]
        try:
            os.kill(pid, how)
            run.killed_pids.append(pid)
        except ProcessLookupError:
            pass
    run.kill_time = time.time()
    run.say(f"[demo] {how.name} -> rank(s) {run.victims} (pids {run.killed_pids})" + note)


class Scenario:
    """A failure of the demo (see the module's contract). The base class is also the shared flow of
    ``inject``: its ``strike`` SIGKILLs the victims' trainers."""

    #: one hang verdict per victim is expected (in every other scenario none)
    expects_hang = False
    #: no failure: the job trains through, no trainer restarts, no verdict of any kind
    trains_through = False
    #: the failure whose promised tier applies (megatron_ft.tiers), when not the --fail value
    failure_kind: Optional[str] = None
    #: what ``strike`` sends the victims' trainers, and what the demo says of it
    kill_signal = signal.SIGKILL
    kill_note = ""

    @classmethod
    def choose_victims(cls, args: argparse.Namespace, cfg: ftconfig.FTConfig) -> tuple[list[int], list[int]]:
        """(ranks that fail, nodes lost); a clear error for a node outside the cluster."""
        return [], []

    @classmethod
    def configure(cls, cfg: ftconfig.FTConfig) -> ftconfig.FTConfig:
        """The job's configuration for this scenario."""
        return cfg

    def fault_spec(self, run: Run) -> Optional[str]:
        """An injected --kill-point: the victims SIGKILL themselves (after damaging their slot) at step
        --kill-at."""
        args = run.args
        if run.victims and args.kill_point != "after-iteration":
            return (f"{args.kill_point}{faults.WITH_AGENT if args.with_agent else ''}:{args.kill_at}:"
                    f"{','.join(map(str, run.victims))}")
        return None

    def prepare(self, run: Run) -> None:
        """Once the job is started, before it trains."""

    def inject(self, run: Run) -> None:
        """Wait for the failure's moment and inject it."""
        if not run.victims:
            return
        if run.args.kill_point != "after-iteration":
            self.await_injected_fault(run)
        else:
            self.strike(run, self.reach_kill_moment(run))

    def await_injected_fault(self, run: Run) -> None:
        """The victims SIGKILL themselves at --kill-point of step --kill-at: wait until they did."""
        args, victims = run.args, run.victims
        run.kill_time, fired_at = wait_fault(run.run_dir, victims, run.p, args.timeout, run.log_path)
        if fired_at != args.kill_at:  # the snapshot of step kill_at was skipped (the agreement pending)
            run.say(f"[demo] the snapshot of step {args.kill_at} was not taken: the fault fired at step {fired_at}")
            args.kill_at = fired_at
        run.say(f"[demo] rank(s) {victims} SIGKILLed themselves at {args.kill_point} of step {args.kill_at}")
        if args.with_agent:
            fired = [e for e in _all_records(run.run_dir, "events") if e.get("event") == "fault"]
            run.agent_killed = (victims[0] // run.rpn, fired[0].get("agent_killed"))
            run.say(f"[demo] ... after SIGKILLing their node's agent (pid {run.agent_killed[1]}); its launcher "
                    f"restarts it")
        self.after_injected_fault(run)

    def after_injected_fault(self, run: Run) -> None:
        """What follows the victims' own death (the rest of a lost machine)."""

    def reach_kill_moment(self, run: Run) -> dict[int, list[dict]]:
        """Wait until the victims finished --kill-at (and --kill-delay more seconds); their progress."""
        args = run.args
        self.before_kill_moment(run)
        recs = run.wait_iteration(run.victims, args.kill_at)
        if run.looking is not None:  # every host's listeners seen before the failure (tens of ms)
            run.listened.wait(30)
        if args.kill_delay > 0:
            time.sleep(args.kill_delay)
            recs = {v: _progress(run.run_dir, v) for v in run.victims}
        return recs

    def before_kill_moment(self, run: Run) -> None:
        """What must have happened before the victims' --kill-at counts."""

    def strike(self, run: Run, recs: dict[int, list[dict]]) -> None:
        """The failure, once the victims reached their moment (``recs``: their progress)."""
        kill_trainers(run, recs, self.kill_signal, self.kill_note)

    def tier_failure(self, args: argparse.Namespace) -> str:
        """The failure (megatron_ft.tiers) whose promised recovery tier applies."""
        return "corrupt" if args.kill_point in DAMAGE_POINTS else self.failure_kind or args.fail

    def judge_verdicts(self, run: Run, lives: dict[int, set], false_verdicts: list[str],
                       problems: list[str]) -> list[str]:
        """The root agents' failure verdicts on nodes the run did not take down, less those this
        scenario accounts for (``lives``: rank -> its trainer lives)."""
        return false_verdicts

    def check_resumed_steps(self, run: Run, restores: list[dict], problems: list[str]) -> bool:
        """Whether the steps resumed from (``restores``: the restores after the failure) are this
        scenario's; a problem added when not."""
        return True

    def summary_fields(self, run: Run) -> dict:
        """This scenario's values of the summary's :data:`SCENARIO_FIELDS`."""
        return {}

    def report(self, run: Run, summary: dict) -> None:
        """This scenario's own lines of the report."""


class NoFailure(Scenario):
    """--fail none: nobody fails; the job trains through."""

    trains_through = True


class TrainerKill(Scenario):
    """--fail trainer: one rank's trainer (--victim-rank, by default the last) SIGKILLed."""

    @classmethod
    def choose_victims(cls, args, cfg):
        return [args.victim_rank if args.victim_rank is not None else cfg.cluster.world_size - 1], []


class NodeTrainersScenario(Scenario):
    """A failure of every rank of one node (--victim-node, by default :attr:`default_node`)."""

    #: the node whose ranks fail without --victim-node (None: the last)
    default_node: Optional[int] = None

    @classmethod
    def choose_victims(cls, args, cfg):
        default = cls.default_node if cls.default_node is not None else cfg.cluster.nodes - 1
        return node_ranks(cfg, checked_node(args, cfg, args.victim_node if args.victim_node is not None
                                            else default, 0)), []


class AllTrainersKill(NodeTrainersScenario):
    """--fail all-trainers: every trainer of a node (node 0 by default) SIGKILLed."""

    default_node = 0


class Hang(TrainerKill):
    """--fail hang: the victim trainer SIGSTOPped, never resumed: the agents must find it hung."""

    expects_hang = True
    kill_signal = signal.SIGSTOP  # alive, doing nothing
    kill_note = ": never resumed; the agents must find it hung and end it"

    def strike(self, run, recs):
        super().strike(run, recs)
        run.hang_time = run.kill_time


class HangInRestore(TrainerKill):
    """--fail hang-in-restore: the victim SIGKILLed, and its restarted life hangs in its restore
    (--restore-hang), under the small allowances :data:`RESTORE_HANG_LIMITS`."""

    expects_hang = True
    failure_kind = "hang"

    @classmethod
    def configure(cls, cfg):
        return ftconfig.replace(cfg, hang=RESTORE_HANG_LIMITS)

    def fault_spec(self, run):
        # the victim's next life hangs in its restore, whichever step it chose
        return super().fault_spec(run) or \
            f"{run.args.restore_hang}-restore:{faults.ANY_STEP}:{','.join(map(str, run.victims))}"

    def strike(self, run, recs):
        super().strike(run, recs)
        run.hang_time, _ = wait_fault(run.run_dir, run.victims, run.p, max(1.0, run.deadline - time.time()),
                                      run.log_path)
        run.say(f"[demo] the restarted rank(s) {run.victims} hung in their restore ({run.args.restore_hang}): "
                f"the agents must find it after hang.restore_s={run.cfg.hang.restore_s:g} s and end it")


class SlowRank(TrainerKill):
    """--fail slow: no failure, the victim stopped and continued in a duty cycle (--slow-*); no hang
    verdict may follow."""

    trains_through = True

    def __init__(self):
        self.slowed: dict = {}  # what the duty cycle did (slow_down)

    def strike(self, run, recs):
        args = run.args
        pid = recs[run.victims[0]][-1]["pid"]
        run.say(f"[demo] slowing rank {run.victims[0]} (pid {pid}): SIGSTOP {args.slow_stop:g} s of every "
                f"{args.slow_period:g} s for at most {args.slow_seconds:g} s; no hang verdict may follow")
        self.slowed.update(slow_down(pid, args.slow_stop, args.slow_period, args.slow_seconds, run.p))
        run.say(f"[demo] duty cycle over: {self.slowed['cycles']} stop(s) in {self.slowed['seconds']} s")

    def summary_fields(self, run):
        return {"slowed": self.slowed or None}

    def report(self, run, summary):
        if self.slowed:
            s = self.slowed
            run.say(f" slowed              : rank {run.victims[0]} stopped {s['stop_s']:g} s of every "
                    f"{s['period_s']:g} s, {s['cycles']} times over {s['seconds']} s; hang verdicts: "
                    f"{len(summary['hang_verdicts'])}, restarts: {summary['restarted_ranks'] or 'none'}")


class AgentKill(NodeTrainersScenario):
    """--fail agent: one node's agent SIGKILLed (its launcher restarts it), then, once the new agent
    protects a step taken after its restart, that node's trainers, which must resume from it."""

    def __init__(self):
        self.protected_from: Optional[int] = None  # the first step the restarted agent must hold

    def strike(self, run, recs):
        # the agent dies at this moment; its launcher restarts it and the new agent must protect
        # the next steps: once it runs and the node's trainers finished two more iterations,
        # they are SIGKILLed and must resume from it, at a step taken after its restart
        args = run.args
        node = run.victims[0] // run.rpn
        old = node_pid(run.run_dir, node, "agent")
        os.kill(old, signal.SIGKILL)
        run.agent_killed = (node, old)
        run.say(f"[demo] SIGKILL -> agent of node {node} (pid {old}) inside iteration {args.kill_at + 1}")
        new = self.await_restarted_agent(run, node, old)
        done = max(_progress(run.run_dir, v)[-1]["iteration"] for v in run.victims)
        self.protected_from = done + 1
        last = int(dict(zip(run.targs, run.targs[1:])).get("--train-iters", args.iters))
        if self.protected_from + 2 > last:
            raise RuntimeError(f"the agent restarted after iteration {done}: too late to check it "
                               f"protects the next steps of {last}; use a smaller --kill-at")
        run.say(f"[demo] agent of node {node} restarted (pid {new}) after iteration {done}")
        held = self.await_protected_step(run, node, last)
        run.say(f"[demo] it protects step {held} for every rank of its node")
        kill_trainers(run, run.wait_iteration(run.victims, held + 1))

    @staticmethod
    def await_restarted_agent(run: Run, node: int, old: int) -> int:
        """Node ``node``'s agent restarted: a new pid, alive, listening on the node's socket (the
        launcher removes it first); the new pid."""
        import psutil

        sock = socket_path(run.cfg.agent.socket_dir, run.cfg.run_id, node)
        while not ((new := node_pid(run.run_dir, node, "agent")) and new != old and psutil.pid_exists(new)
                   and os.path.exists(sock)):
            if run.p.poll() is not None or time.time() > run.deadline:
                raise RuntimeError(f"node {node}'s agent was never restarted; log {run.log_path}")
            time.sleep(0.05)
        return new

    def await_protected_step(self, run: Run, node: int, last: int) -> int:
        """The step the restarted agent protects for every rank of its node, once it is one taken
        after its restart: the job agreed on it. A step the killed agent never committed waits first
        for the node's trainers' next snapshot to abandon it, so this takes a few iterations, not one."""
        return await_protected(run, node, last, self.protected_from)

    def check_resumed_steps(self, run, restores, problems):
        """The restarted agent must have protected the steps after its restart."""
        if self.protected_from is None:
            return True
        last_restore = {}
        for e in sorted(restores, key=lambda e: e["time"]):
            if e["rank"] in run.victims:
                last_restore[e["rank"]] = e["step"]
        if not last_restore or min(last_restore.values()) < self.protected_from:
            problems.append(f"the restarted agent did not protect the steps after its restart: the node's trainers "
                            f"resumed from step(s) {sorted(set(last_restore.values()))}, want >= "
                            f"{self.protected_from}")
            return False
        return True


class AgentPause(NodeTrainersScenario):
    """--fail agent-pause: the last node's agent SIGSTOPped for --pause-seconds, then SIGCONT. Either the
    node is not judged and trains through, or it is judged lost and its ranks recover
    (:data:`PAUSE_OUTCOMES`)."""

    def __init__(self):
        self.paused: dict = {}  # the agent stopped and continued (pause_agent)
        self.pause_outcome: Optional[str] = None

    def strike(self, run, recs):
        node = run.victims[0] // run.rpn
        self.paused.update(pause_agent(node_pid(run.run_dir, node, "agent"), run.args.pause_seconds))
        self.paused["node"] = node
        run.say(f"[demo] agent of node {node} (pid {self.paused['pid']}) SIGSTOPped for {self.paused['seconds']} s, "
                f"then SIGCONT")

    def judge_verdicts(self, run, lives, false_verdicts, problems):
        if not self.paused:
            return false_verdicts
        node = self.paused["node"]
        judged = [v for v in false_verdicts if v.startswith(f"node {node} ")]
        moved = [r for r in run.victims if len(lives.get(r, ())) > 1]
        if judged and not moved and node in withdrawn_verdicts(run.run_dir):
            judged, self.pause_outcome = [], "trained through"  # the root withdrew it once the agent ran again
            false_verdicts = [v for v in false_verdicts if not v.startswith(f"node {node} ")]
        self.pause_outcome = PAUSE_OUTCOMES[(bool(judged), bool(moved))]
        if judged and moved:  # the verdict was acted on: not a false one
            false_verdicts = [v for v in false_verdicts if v not in judged]
        elif judged or moved:
            problems.append(f"agent paused {self.paused['seconds']} s: {self.pause_outcome} (verdicts {judged}, "
                            f"ranks restarted {moved})")
        return false_verdicts

    def summary_fields(self, run):
        return {"agent_paused": self.paused or None, "agent_pause_outcome": self.pause_outcome}

    def report(self, run, summary):
        if self.paused:
            run.say(f" agent paused        : node {self.paused['node']}'s agent stopped {self.paused['seconds']} s "
                    f"(health.timeout_s={run.cfg.health.timeout_s:g} s): {self.pause_outcome}")


class LauncherLoss(NodeTrainersScenario):
    """--fail launcher: one node's launcher SIGKILLed (its torchrun and trainers end with it, its agent
    waits) and started again (--relaunch-delay), adopting the agent. Node 0's too: the survivors move
    the rendezvous, whatever the scheme."""

    def strike(self, run, recs):
        args = run.args
        node = run.victims[0] // run.rpn
        lpid = node_pid(run.run_dir, node, "launcher")
        os.kill(lpid, signal.SIGKILL)
        run.killed_pids.append(lpid)
        run.kill_time = time.time()
        run.say(f"[demo] SIGKILL -> launcher of node {node} (pid {lpid}); starting it again"
                + (f" in {args.relaunch_delay:g} s (a supervisor's restart)" if args.relaunch_delay else ""))
        time.sleep(args.relaunch_delay)
        run.replacements.append((start_replacement(run.cfg, run.run_dir, node, run.targs, run.replacement_log,
                                                   run.program, run.bed, new_host=False),
                                 run.replacement_log))


class NodeLoss(Scenario):
    """--fail node: a whole node's machine lost (trainers, launcher, agent, shared memory); a replacement
    node takes its place, or with --standby a standby launcher started with the job once the root
    agent's verdict names the node (with --slurm the allocation's extra host)."""

    @classmethod
    def choose_victims(cls, args, cfg):
        node = checked_node(args, cfg, args.victim_node if args.victim_node is not None
                            else default_victim_node(cfg), 0)
        return node_ranks(cfg, node), [node]

    def prepare(self, run):
        if run.args.standby and run.slurm is None:
            run.replacements.append((start_replacement(run.cfg, run.run_dir, None, run.targs, run.replacement_log,
                                                       run.program, run.bed), run.replacement_log))
            run.say(f"[demo] a standby node waits for the root agent's failure verdict (log {run.replacement_log})")

    def after_injected_fault(self, run):
        self.lose_nodes(run, [])  # the rest of the machine goes with them

    def before_kill_moment(self, run):
        # the group's first complete copy comes after the peers connected (and, scheduled, after
        # the trainers' profiled iterations and the plan's interval), which a loaded machine
        # lengthens: the loss waits for it (until then the group holds no copy and the promise of
        # peer memory does not apply yet)
        if run.cfg.redundancy.scheme == "none":
            return
        done = wait_group_complete(run.run_dir, run.cfg.cluster.nodes, run.p, run.deadline, run.log_path)
        reached = max(r["iteration"] for r in _progress(run.run_dir, run.victims[0]))
        if reached > run.args.kill_at:
            run.say(f"[demo] the group's first complete copy (step {done}) came after iteration {reached}: "
                    f"the node is lost after iteration {reached + 1} instead of {run.args.kill_at}")
            run.args.kill_at = reached + 1

    def strike(self, run, recs):
        self.lose_nodes(run, [recs[v][-1]["pid"] for v in run.victims])
        run.kill_time = time.time()

    @staticmethod
    def lose_nodes(run: Run, trainer_pids: list[int]) -> None:
        """The lost nodes' machines die; a replacement (or the standby) takes each one's place."""
        args, lost_nodes = run.args, run.lost_nodes
        for n in lost_nodes:
            run.killed_pids += kill_node(run.cfg, run.run_dir, n, trainer_pids, run.bed)
            trainer_pids = []
        run.persisted_at_kill = persisted_steps(run.eff_cfg)
        for n in lost_nodes:  # read once the agent is dead: its log is final (the replacement appends later)
            try:
                with open(os.path.join(run.run_dir, f"node{n}", "agent.log"), errors="replace") as f:
                    run.complete_at_loss[n] = sorted(int(x) for x in GROUP_COMPLETE.findall(f.read()))[-3:]
            except OSError:
                run.complete_at_loss[n] = []
        if run.slurm is not None:
            threading.Thread(target=watch_slurm_node, args=(run.slurm, lost_nodes[0], run.slurm_lost, run.deadline),
                             name="slurm-node", daemon=True).start()
        run.say(f"[demo] node(s) {lost_nodes} lost: SIGKILL -> their launchers, torchrun, trainers {run.victims} and "
                f"agents (pids {run.killed_pids}); their shared memory removed. "
                + ("The standby takes the place of one once the root agent declares it failed" if args.standby
                   else f"Starting replacement node(s) {lost_nodes}"))
        if not args.standby and run.slurm is None:
            for n in lost_nodes:
                log = run.replacement_log if len(lost_nodes) == 1 else os.path.join(run.workdir, f"replacement{n}.log")
                run.replacements.append((start_replacement(run.cfg, run.run_dir, n, run.targs, log, run.program,
                                                           run.bed), log))


class TwoNodeLoss(NodeLoss):
    """--fail two-nodes: --victim-node and --other-node (by default the highest other node) lost at once."""

    @classmethod
    def choose_victims(cls, args, cfg):
        nodes = cfg.cluster.nodes
        if nodes < 3:
            raise ftconfig.ConfigError(f"--fail two-nodes needs a cluster of at least 3 nodes, not {nodes}")
        first = checked_node(args, cfg, args.victim_node if args.victim_node is not None
                             else default_victim_node(cfg), 0)
        if getattr(args, "other_node", None) is not None:
            other = checked_node(args, cfg, args.other_node, 0, flag="--other-node")
            if other == first:
                raise ftconfig.ConfigError(f"--other-node={other} is invalid: it must differ from --victim-node "
                                           f"({first})")
        else:
            other = next(n for n in range(nodes - 1, -1, -1) if n != first)
        return node_ranks(cfg, first) + node_ranks(cfg, other), sorted([first, other])


#: --fail value -> its scenario (the order of the command line's choices)
SCENARIOS: dict[str, type[Scenario]] = {
    "trainer": TrainerKill, "hang": Hang, "hang-in-restore": HangInRestore, "slow": SlowRank,
    "all-trainers": AllTrainersKill, "agent": AgentKill, "agent-pause": AgentPause, "launcher": LauncherLoss,
    "node": NodeLoss, "two-nodes": TwoNodeLoss, "none": NoFailure,
}
#: scenarios whose failure is a hang: exactly one hang verdict per victim is expected, in every other
#: scenario none
HANG_SCENARIOS = tuple(sorted(name for name, s in SCENARIOS.items() if s.expects_hang))
#: scenarios without a failure: the job trains through, no trainer restarts, no verdict of any kind
NO_FAILURE = tuple(sorted(name for name, s in SCENARIOS.items() if s.trains_through))


def scenario_for(fail: str) -> type[Scenario]:
    """The scenario of ``--fail fail`` (a value without one fails nobody)."""
    return SCENARIOS.get(fail, NoFailure)


def kill_agent_beforehand(run: Run) -> None:
    """--kill-agent: SIGKILL the victims' node agent two iterations before the failure (its launcher
    restarts it, and the new agent re-adopts the node's memory). Where the demo strikes the trainers itself
    (``after-iteration``), not before the agent protects a step: killed before any step was agreed, the
    job would hold nothing the promised tier could come from."""
    run.wait_iteration(run.victims[:1], max(1, run.args.kill_at - 2))
    node = run.victims[0] // run.rpn
    if run.args.kill_point == "after-iteration":
        held = await_protected(run, node, int(dict(zip(run.targs, run.targs[1:])).get("--train-iters", run.args.iters)))
        run.say(f"[demo] the agent of node {node} protects step {held}")
    run.agent_killed = (node, node_pid(run.run_dir, node, "agent"))
    os.kill(run.agent_killed[1], signal.SIGKILL)
    run.say(f"[demo] SIGKILL -> agent of node {run.agent_killed[0]} (pid {run.agent_killed[1]}); the launcher "
            f"restarts it")


def await_protected(run: Run, node: int, last: int, at_least: int = 0) -> int:
    """The step node ``node``'s agent protects for every rank of the node, once one >= ``at_least`` (the
    job agreed on it); RuntimeError if none before the victims trained the job's ``last`` iteration."""
    while (held := agent_protected(run.cfg, node)) is None or held < at_least:
        recs = run.wait_iteration(run.victims, 0)
        if min(r[-1]["iteration"] for r in recs.values()) >= last:
            raise RuntimeError(f"node {node}'s agent protected no step >= {at_least} before the job's last "
                               f"iteration {last} (holds {held}); log {run.log_path}")
        time.sleep(0.05)
    return held


def strike_during_recovery(run: Run) -> None:
    """--second-failure: SIGKILL the first trainer of the restarted generation (one on another node where
    possible) --second-delay seconds after it appeared; ``run.second`` says which (None: the job trained
    its last iteration first)."""
    args = run.args
    known = {r["pid"] for r in _all_records(run.run_dir, "progress")} | set(run.killed_pids)
    run.second = kill_during_recovery(run.run_dir, run.cfg.cluster.nodes, known,
                                      set(run.lost_nodes) | {run.victims[0] // run.rpn}, args.second_delay,
                                      run.deadline, run.p, run.log_path, args.iters)
    if run.second is None:
        run.say(f"[demo] no second failure: the job trained its last iteration within {args.second_delay} s "
                f"of the restarted trainer's start")
    else:
        run.say(f"[demo] second failure during the recovery: SIGKILL -> restarted trainer pid {run.second[1]} on "
                f"node {run.second[0]}, {args.second_delay} s after it started")
