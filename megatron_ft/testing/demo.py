"""``megatron-ft demo``: train the tiny GPT on CPU, kill trainers mid-run, recover, compare bit for bit.

1. a reference run, uninterrupted and without megatron-ft, same seed;
2. the same job with ``--inmem-ckpt`` under ``megatron-ft launch``; when the victim has finished
   iteration ``--kill-at``, it is sent SIGKILL (``--fail trainer``: one trainer;
   ``all-trainers``: every trainer of node 0; ``none``: nobody). torchrun restarts the workers,
   which restore from their agents' shared memory;
3. the final model, optimizer state, scheduler and RNG digests of every rank, and the loss of
   every iteration (including re-run ones), are compared with the reference.

The last line printed is one JSON object: scenario, recovered_from, resumed_step,
lost_iterations, recovery_seconds, bitwise_identical, and details.

The run itself is a driver over failure scenarios: :mod:`megatron_ft.testing.demo_scenarios` holds one
class per ``--fail`` value (its victims, its failure's steps, its own checks; the scenario contract is
in that module's docstring) and the table :data:`SCENARIOS`; this module starts the run (reference,
job), lets the scenario inject its failure, waits for the job and cleans up; the shared state is a
:class:`~megatron_ft.testing.demo_run.Run`; :mod:`megatron_ft.testing.demo_summary` compares with the
reference and builds the summary and the report. The processes' primitives are in
:mod:`megatron_ft.testing.demo_jobs`, the readers of a run's files in :mod:`megatron_ft.testing.demo_results`
(their names stay importable from here).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Optional, get_args

from .. import config as ftconfig
# the demo's parts, importable from here as before (tests, benchmarks, megatron_ft.cli)
from .demo_jobs import (GROUP_COMPLETE, PROJECT_SCRIPT, REPO_SCRIPTS, JobOnHosts, Program,
                        _kill_tree, agent_protected, forget_sockets, host_listeners, kill_during_recovery,
                        kill_node, launch_command, launch_job, node_pid, node_workers, pause_agent,
                        persisted_steps, slow_down, slurm_job, start_replacement, stranger_probe,
                        upstream_program, wait_fault, wait_group_complete, wait_job, watch_slurm_node)
from .demo_results import (BREAKDOWN_NAMES, VERDICT_LINE, WITHDRAWN_LINE, _all_records, _progress,
                           compare, final_states, life, losses, raw_copy_seconds, recovery_breakdown,
                           reference_key, reference_matches, restarted_by, snapshot_stall, unexpected_verdicts,
                           withdrawn_verdicts)
from .demo_run import Run
from .demo_scenarios import (DAMAGE_POINTS, HANG_SCENARIOS, NO_FAILURE, PAUSE_OUTCOMES,
                             RESTORE_HANG_LIMITS, SCENARIOS, Scenario, default_victim_node, kill_agent_beforehand,
                             scenario_for, strike_during_recovery)
from .demo_summary import build_summary, print_report
from .helpers import on_hosts, with_free_ports
from .hosts import HostBed

#: the demo's names, those of its parts included: importable from here as before its parts moved out
#: (tests, benchmarks and megatron_ft.cli use them)
__all__ = [
    # this module: the command line, the configuration and the driver
    "add_parser", "main", "check_arguments", "run_demo", "demo_config", "choose_victims", "training_args",
    "MOE_TRAIN_ARGS", "moe_shape", "moe_train_args", "DEMO_SHAPES", "prepare_run", "run_reference", "start_job",
    "look_around", "drive_failure", "stop_leftovers", "_run_demo",
    # demo_jobs: the processes
    "REPO_SCRIPTS", "Program", "PROJECT_SCRIPT", "upstream_program", "persisted_steps", "kill_node",
    "forget_sockets", "start_replacement", "JobOnHosts", "launch_job", "launch_command", "slurm_job",
    "watch_slurm_node", "_kill_tree", "wait_job", "node_pid", "agent_protected", "node_workers",
    "kill_during_recovery", "GROUP_COMPLETE", "wait_group_complete", "wait_fault", "slow_down", "pause_agent",
    "host_listeners", "stranger_probe",
    # demo_results: a run's files read
    "losses", "final_states", "compare", "reference_key", "reference_matches", "BREAKDOWN_NAMES",
    "recovery_breakdown", "raw_copy_seconds", "snapshot_stall", "restarted_by", "_progress", "life", "_all_records",
    "VERDICT_LINE", "WITHDRAWN_LINE", "withdrawn_verdicts", "unexpected_verdicts",
    # demo_scenarios: the failures
    "SCENARIOS", "Scenario", "scenario_for", "DAMAGE_POINTS", "HANG_SCENARIOS", "NO_FAILURE", "PAUSE_OUTCOMES",
    "RESTORE_HANG_LIMITS", "default_victim_node", "kill_agent_beforehand", "strike_during_recovery",
    # demo_run, demo_summary: the run's state, its summary and report
    "Run", "build_summary", "print_report",
]


def training_args(cfg: ftconfig.FTConfig, iters: int, extra: list[str]) -> list[str]:
    """``scripts/pretrain_gpt.py`` arguments for the cluster: its TP and PP, and a global batch of about
    16 samples that every data-parallel size divides (micro-batch 2); ``extra`` comes last and wins."""
    dp = cfg.data_parallel
    return [
        "--tensor-model-parallel-size", str(cfg.parallel.tensor),
        "--pipeline-model-parallel-size", str(cfg.parallel.pipeline),
        "--global-batch-size", str(2 * dp * max(1, 8 // dp)),
        "--train-iters", str(iters), "--log-interval", "5", *extra,
    ]


#: --moe: the MoE GPT's flags (4 experts, top-2, the load-balancing loss, the aux-loss-free router bias,
#: the allgather dispatcher: it runs on gloo); the expert-parallel size comes from the config
MOE_TRAIN_ARGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather",
                  "--moe-aux-loss-coeff", "1e-2", "--moe-router-score-function", "sigmoid",
                  "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2"]


def moe_shape(cfg: ftconfig.FTConfig) -> dict:
    """``--moe``: TP1 PP1 and expert parallelism 2, or DP (every expert on one rank: EDP = 1) where the
    cluster has one rank per node (the rs shape, 4 nodes x 1: EP4)."""
    world = cfg.cluster.world_size
    return {"parallel": {"tensor": 1, "pipeline": 1, "expert": world if cfg.cluster.ranks_per_node == 1 else 2}}


def moe_train_args(cfg: ftconfig.FTConfig) -> list[str]:
    """The MoE GPT's flags for ``cfg``'s expert-parallel size."""
    return [*MOE_TRAIN_ARGS, "--expert-model-parallel-size", str(cfg.parallel.expert)]


# --redundancy SCHEME: a cluster on which the scheme is worth showing (all CPU, 4-6 processes)
DEMO_SHAPES = {
    "replica": {"redundancy": {"scheme": "replica", "replicas": 2}},  # 2 nodes x 2: each holds the other
    "xor": {"cluster": {"nodes": 3, "ranks_per_node": 2}, "redundancy": {"scheme": "xor"}},  # RAIM5 over 3 nodes, DP3
    "rs": {"cluster": {"nodes": 4, "ranks_per_node": 1}, "redundancy": {"scheme": "rs", "k": 2, "m": 2}},
}
DEMO_SHAPES["replica"]["cluster"] = {"nodes": 2, "ranks_per_node": 2}


def choose_victims(args: argparse.Namespace, cfg: ftconfig.FTConfig) -> tuple[list[int], list[int]]:
    """(ranks that fail, nodes lost) for ``args.fail``; a clear error for a node outside the cluster."""
    return scenario_for(args.fail).choose_victims(args, cfg)


def run_demo(args: argparse.Namespace) -> dict:
    """The demo; with ``--hosts`` every node on a host of its own (:class:`HostBed`), for its whole run."""
    if not getattr(args, "hosts", False):
        return _run_demo(args, None)
    cfg = demo_config(args, os.path.abspath(args.workdir))
    # one host more than the job has nodes: an outsider on the job's network (stranger_probe), the last
    # (with --slurm also the Slurm controller's); with --standby one more before it, the standby's
    with HostBed(cfg.cluster.nodes + 1 + bool(args.standby), shm_mib=args.host_shm_mib, rate=args.link_rate) as bed:
        if not args.slurm:
            return _run_demo(args, bed)
        from .slurm import SlurmOnBed

        slurm = SlurmOnBed(bed, os.path.join(os.path.abspath(args.workdir) + ".slurm"),
                           list(range(cfg.cluster.nodes + bool(args.standby))))
        try:
            return _run_demo(args, bed, slurm.start())
        finally:
            slurm.stop()


def demo_config(args: argparse.Namespace, workdir: str) -> ftconfig.FTConfig:
    """The job's configuration: ``--config`` (or the default), the demo's shape for ``--redundancy``, its
    own run id, ports and persist directory; with ``--hosts`` the nodes are named ``node<i>`` and reach
    each other on the bed's ``eth0``."""
    base = ftconfig.load(args.config)
    tag = f"demo-{args.fail}-{os.getpid()}"
    cfg = ftconfig.replace(base, run_id=tag, persist={"dir": os.path.join(workdir, "persist")})
    if getattr(args, "prefer", None):
        cfg = ftconfig.replace(cfg, recovery={"prefer": args.prefer})
    cfg = scenario_for(args.fail).configure(cfg)  # hang-in-restore: RESTORE_HANG_LIMITS
    if args.redundancy and args.config:  # the user's cluster, with this scheme (validated against it)
        cfg = ftconfig.replace(cfg, redundancy=DEMO_SHAPES[args.redundancy]["redundancy"])
    elif args.redundancy:  # the demo's own cluster for the scheme
        cfg = ftconfig.replace(cfg, **DEMO_SHAPES[args.redundancy])
    if getattr(args, "moe", False):
        cfg = ftconfig.replace(cfg, **moe_shape(cfg))
    if args.transport == "scheduled":  # the config says why if the scheme is not replica
        # profile a few iterations, then plan (the loss waits for the first complete copy, below): at
        # least 4, since the plan's link is the fastest pipeline transfer the profile saw, and a loaded
        # machine's first iterations saw 5 MiB/s on loopback (a copy every 27 iterations, none within
        # the job); idle "auto": on CPU the bubbles while a core is free (none with 4 ranks on 2 cores)
        cfg = ftconfig.replace(cfg, redundancy={"transport": "scheduled"},
                               schedule={"mode": args.schedule_mode, "idle": "auto", "profile_iterations": max(
                                   4, min(cfg.schedule.profile_iterations, args.kill_at // 2))})
    if getattr(args, "hosts", False):
        return on_hosts(cfg, workdir)
    return with_free_ports(cfg)


def _run_demo(args: argparse.Namespace, bed: Optional[HostBed], slurm=None) -> dict:
    """The demo's run: the reference, the job with megatron-ft and its scenario's failure, the summary."""
    run = prepare_run(args, bed, slurm)
    run_reference(run)
    start_job(run)
    try:
        drive_failure(run)
    finally:
        stop_leftovers(run)
    run.run_seconds = time.time() - run.t0
    summary = build_summary(run)
    print_report(run, summary)
    return summary


def prepare_run(args: argparse.Namespace, bed: Optional[HostBed], slurm) -> Run:
    """A fresh workdir, the job's configuration and training program, and the scenario with its victims
    (refused before anything runs)."""
    workdir = os.path.abspath(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    cfg = demo_config(args, workdir)
    series = None
    if args.megatron_lm:
        from . import megatron_lm

        program = upstream_program(args.megatron_lm, workdir)
        series = megatron_lm.series_of(os.path.join(workdir, "megatron-lm"))
        targs = megatron_lm.demo_args(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.data_parallel, args.iters,
                                      "{run_dir}") + (moe_train_args(cfg) if getattr(args, "moe", False) else []) \
            + (args.train_arg or [])
    else:
        program = PROJECT_SCRIPT
        targs = training_args(cfg, args.iters, (moe_train_args(cfg) if getattr(args, "moe", False) else [])
                              + (args.train_arg or []))
    say = (lambda *a: print(*a, flush=True)) if not args.quiet else (lambda *a: None)
    if args.megatron_lm:
        say(f"[demo] Megatron-LM from {args.megatron_lm}: the {series} patch series applied")
    victims, lost_nodes = choose_victims(args, cfg)  # refused before anything runs
    return Run(args=args, cfg=cfg, workdir=workdir, program=program, targs=targs, say=say,
               scenario=scenario_for(args.fail)(), victims=victims, lost_nodes=lost_nodes, series=series, bed=bed,
               slurm=slurm)


def run_reference(run: Run) -> None:
    """1. the reference run (or an earlier one with the same arguments): its directory, its time and its
    cold start in ``run``."""
    args, cfg, targs, world, say = run.args, run.cfg, run.targs, run.world, run.say
    ref_dir = (os.path.join(os.path.abspath(args.reference_dir), reference_key(targs, world)) if args.reference_dir
               else os.path.join(run.workdir, "reference"))
    run.ref_dir = ref_dir
    if reference_matches(ref_dir, targs, world):
        say(f"[demo] reusing the reference run in {ref_dir}")
        with open(os.path.join(ref_dir, "args.json")) as f:
            run.cold_start_seconds = json.load(f).get("cold_start_seconds")
        return
    say(f"[demo] reference run: {world} ranks (TP{cfg.parallel.tensor} PP{cfg.parallel.pipeline} "
        f"DP{cfg.data_parallel}), {args.iters} iterations, no megatron-ft ...")
    shutil.rmtree(ref_dir, ignore_errors=True)
    t0 = time.time()
    # the same job started cold (no warm spares): the yardstick of a recovery's time
    ref_cfg = with_free_ports(cfg, run_id=cfg.run_id + "-ref", launch={"warm_spares": False})
    ref_log = ref_dir + ".log"
    p = launch_job(ref_cfg, ref_dir, targs, inmem=False, log_path=ref_log, program=run.program, bed=run.bed)
    wait_job(p, args.timeout, "reference run", ref_log)
    first = min((r["time"] for r in _all_records(ref_dir, "progress")), default=None)
    run.cold_start_seconds = round(first - t0, 3) if first is not None else None
    with open(os.path.join(ref_dir, "args.json"), "w") as f:
        json.dump({"train_args": targs, "world": world, "cold_start_seconds": run.cold_start_seconds}, f)
    run.ref_seconds = time.time() - t0
    say(f"[demo] reference done in {run.ref_seconds:.1f} s")


def start_job(run: Run) -> None:
    """2. the job with megatron-ft (the scenario's fault injected into its trainers), the scenario
    prepared, and - hosts of their own - the look around the running job."""
    args, cfg, say = run.args, run.cfg, run.say
    say(f"[demo] megatron-ft run, failure: {args.fail}" + (f" after iteration {args.kill_at}" if args.fail != "none" else ""))
    run.t0 = time.time()
    fault = run.scenario.fault_spec(run)
    if run.slurm is not None:  # one batch job: srun starts a launcher on every host of the allocation
        run.p = slurm_job(run.slurm, cfg, run.run_dir, run.targs, run.log_path, fault, run.program,
                          hosts=cfg.cluster.nodes + bool(args.standby))
        say(f"[demo] submitted Slurm job {run.p.job_id}: {cfg.cluster.nodes + bool(args.standby)} hosts"
            + (", the last a standby" if args.standby else ""))
    else:
        run.p = launch_job(cfg, run.run_dir, run.targs, inmem=True, log_path=run.log_path, fault=fault,
                           program=run.program, bed=run.bed)
    run.scenario.prepare(run)
    run.eff_cfg = ftconfig.apply_flags(cfg, ftconfig.command_flags(run.targs))
    run.deadline = time.time() + args.timeout
    if run.bed is not None:
        run.looking = threading.Thread(target=look_around, args=(run,), name="look-around", daemon=True)
        run.looking.start()


def look_around(run: Run) -> None:
    """Hosts of their own: once the job trains, what listens where, and what an outsider on the
    network gets from it (beside the run: the failure's timing is the demo's, not this look's)."""
    while not _progress(run.run_dir, 0) and run.p.poll() is None and time.time() < run.deadline:
        time.sleep(0.05)
    run.listeners = host_listeners(run.bed, run.cfg)
    run.listened.set()
    run.stranger = stranger_probe(run.bed, run.cfg)


def drive_failure(run: Run) -> None:
    """The scenario's failure (with --kill-agent before it and --second-failure after it), then the job
    and the launchers it started, to their end."""
    args = run.args
    if args.kill_agent and run.victims:  # two iterations before the trainers' failure
        kill_agent_beforehand(run)
    run.scenario.inject(run)
    if args.second_failure and run.kill_time is not None:
        strike_during_recovery(run)
    wait_job(run.p, args.timeout, "megatron-ft run", run.log_path)
    for r, rlog in run.replacements:
        wait_job(r, args.timeout, "standby node" if args.standby else "replacement node", rlog)


def stop_leftovers(run: Run) -> None:
    """Never leave the job (or a launcher the scenario started) running."""
    killed = False
    for proc in (run.p, *(r for r, _ in run.replacements)):
        if proc is not None and proc.poll() is None:
            _kill_tree(proc)
            killed = True
    if killed:  # its agents were SIGKILLed too: their segments are this demo's to remove
        for name in os.listdir(run.cfg.agent.shm_dir):
            if name.startswith(f"mft.{run.cfg.run_id}."):
                os.unlink(os.path.join(run.cfg.agent.shm_dir, name))
    # nothing of the run is alive now: the sockets a SIGKILLed process could not unlink (a lost node's
    # replacement's, a standby's spare pool's) are this demo's to remove
    socket_dir = run.cfg.agent.socket_dir
    for name in os.listdir(socket_dir) if os.path.isdir(socket_dir) else []:
        if name.startswith(f"{run.cfg.run_id}."):
            try:
                os.unlink(os.path.join(socket_dir, name))
            except FileNotFoundError:
                pass


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="kill trainers mid-run, recover from memory, compare bit for bit")
    _add_failure_arguments(p)
    _add_job_arguments(p)
    _add_failure_detail_arguments(p)
    _add_bed_arguments(p)
    p.set_defaults(func=main)


def _add_failure_arguments(p: argparse.ArgumentParser) -> None:
    """The job's configuration, the failure (--fail: :data:`SCENARIOS`) and its scenarios' own settings."""
    p.add_argument("--config", default=None, help="job YAML (default: embedded configs/local-cpu.yaml)")
    p.add_argument("--fail", choices=list(SCENARIOS),
                   default="trainer",
                   help="hang: SIGSTOP the victim trainer, never resumed (the agents must find it hung); "
                        "hang-in-restore: SIGKILL it, and its restarted life hangs in its restore (--restore-hang); "
                        "slow: no failure, the victim stopped and continued in a duty cycle (--slow-*), no hang "
                        "verdict may follow; agent-pause: SIGSTOP the last node's agent for --pause-seconds, then "
                        "SIGCONT; node: lose a whole simulated node (trainers, agent, shared memory) and start a replacement; "
                        "two-nodes: lose --victim-node and the highest other node at once; "
                        "launcher: SIGKILL one node's launcher (its torchrun and trainers end with it, its agent "
                        "waits) and start the node's launcher again, which adopts the agent; agent: SIGKILL one "
                        "node's agent (its launcher restarts it), then, two iterations after the restart, that "
                        "node's trainers, which must resume from the new agent at a step it took")
    p.add_argument("--restore-hang", choices=["stall", "stop"], default="stall",
                   help="--fail hang-in-restore: the restarted victim's training thread sleeps for good (stall: "
                        "running, found after hang.restore_s) or the process SIGSTOPs itself (stop: found once seen "
                        "stopped for hang.floor_s)")
    p.add_argument("--slow-stop", type=float, default=0.3, help="--fail slow: seconds stopped per cycle")
    p.add_argument("--slow-period", type=float, default=0.6, help="--fail slow: seconds per cycle")
    p.add_argument("--slow-seconds", type=float, default=15.0,
                   help="--fail slow: how long the duty cycle lasts at most (it ends with the job)")
    p.add_argument("--pause-seconds", type=float, default=8.0,
                   help="--fail agent-pause: how long the agent stays stopped (health.timeout_s is 5 s by default)")


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The job's shape and training, the failure's moment and victims, where and how long the demo runs."""
    p.add_argument("--redundancy", choices=sorted(DEMO_SHAPES), default=None,
                   help="peer redundancy for the run, with a cluster shape that shows it (see DEMO_SHAPES)")
    p.add_argument("--transport", choices=["agent", "scheduled"], default="agent",
                   help="who sends the peer copies (with --redundancy replica): the agents, or the trainers in "
                        "planned chunks inside the training timeline's idle time")
    p.add_argument("--schedule-mode", choices=list(ftconfig.ScheduleConfig.MODES), default="pipelined",
                   help="--transport scheduled: when the chunks go (docs/scheduling.md)")
    p.add_argument("--kill-at", type=int, default=12, help="kill after the victim finished this iteration")
    p.add_argument("--elastic", action="store_true",
                   help="--fail node: no replacement comes; the job goes on at fewer data-parallel replicas from "
                        "memory (recovery.elastic_after_s), the node comes back --grow-after iterations later and the "
                        "job grows again; compared with Megatron's own reshard (megatron_ft/testing/demo_elastic.py)")
    p.add_argument("--elastic-after-s", type=float, default=3.0,
                   help="--elastic: recovery.elastic_after_s, the wait for a replacement before the shrink")
    p.add_argument("--min-iteration-s", type=float, default=0.3,
                   help="--elastic: the job's iterations padded to this many seconds, so that the node comes back "
                        "while it trains")
    p.add_argument("--grow-after", type=int, default=3,
                   help="--elastic: iterations at the smaller size before the node comes back")
    p.add_argument("--prefer", choices=get_args(ftconfig.Prefer), default=None,
                   help="recovery.prefer: restore the newest version, or the newest certified one")
    p.add_argument("--kill-delay", type=float, default=0.0,
                   help="after-iteration: wait this many seconds after the victims logged --kill-at before the "
                        "SIGKILL (a wall-clock moment inside the next iteration: copy, exchange, persist)")
    p.add_argument("--iters", type=int, default=24, help="training iterations")
    p.add_argument("--victim-rank", type=int, default=None, help="--fail trainer: rank to kill (default: last)")
    p.add_argument("--victim-node", type=int, default=None,
                   help="--fail all-trainers: node whose trainers die; --fail node: the node lost (default: one "
                        "whose ranks no other node holds whole, so xor/rs must decode)")
    p.add_argument("--other-node", type=int, default=None,
                   help="--fail two-nodes: the second node lost (default: the highest node other than --victim-node)")
    p.add_argument("--workdir", default="/tmp/megatron-ft/demo")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--train-arg", action="append", help="extra argument for pretrain_gpt.py (repeatable)")
    p.add_argument("--megatron-lm", metavar="DIR", default=None,
                   help="run upstream Megatron-LM's own pretrain_gpt.py from this unpatched tree (or its .tar.gz), "
                        "patched into a copy in the workdir, instead of scripts/pretrain_gpt.py")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--moe", action="store_true",
                   help="a mixture-of-experts GPT (4 experts, top-2, load-balancing loss, router expert bias) at "
                        "TP1 PP1 with expert parallelism 2 (EP = the world size on one rank per node: EDP 1); with "
                        "--megatron-lm, upstream's pretrain_gpt.py with the same flags")


def _add_failure_detail_arguments(p: argparse.ArgumentParser) -> None:
    """Where the failure strikes, what strikes with it or after it, and what replaces what it took."""
    p.add_argument("--kill-point", default="after-iteration",
                   choices=["after-iteration", "before-snapshot", "mid-copy", "after-commit", *DAMAGE_POINTS],
                   help="after-iteration: the demo SIGKILLs the victims once they logged --kill-at; the others: "
                        "the victims SIGKILL themselves at that point of step --kill-at (fault injection)")
    p.add_argument("--second-failure", action="store_true",
                   help="a second failure while the first recovery runs: SIGKILL the first trainer of the restarted "
                        "generation (one on another node where possible) --second-delay seconds after it starts")
    p.add_argument("--second-delay", type=float, default=1.0,
                   help="--second-failure: seconds after the restarted trainer appeared (import, rendezvous, restore)")
    p.add_argument("--with-agent", action="store_true",
                   help="--fail trainer with an injected --kill-point: the victim SIGKILLs its node's agent first, "
                        "then damages its slot and dies; the agent its launcher restarts finds the damage")
    p.add_argument("--kill-agent", action="store_true",
                   help="also SIGKILL the victims' node agent two iterations earlier (the launcher restarts it)")
    p.add_argument("--standby", action="store_true",
                   help="--fail node: start a standby launcher (launch --standby) with the job instead of a "
                        "replacement after the loss; the root agent's failure verdict makes it take the node's place")
    p.add_argument("--reference-dir", default=None,
                   help="reuse (or create) the reference run under this directory (one per job shape)")
    p.add_argument("--relaunch-delay", type=float, default=0.0,
                   help="--fail launcher: start the node's launcher again this many seconds after it died")


def _add_bed_arguments(p: argparse.ArgumentParser) -> None:
    """--hosts: every node on a host of its own (and a real Slurm on them)."""
    p.add_argument("--hosts", action="store_true",
                   help="run every node on a host of its own (root: network, mount and UTS namespaces; "
                        "megatron_ft/testing/hosts.py): its own address and name, /dev/shm and link")
    p.add_argument("--slurm", action="store_true",
                   help="with --hosts: a real Slurm on the hosts (munge, slurmctld on an extra host, a slurmd per "
                        "host; megatron_ft/testing/slurm.py) runs the job as one sbatch job, srun starting a "
                        "launcher per host (with --standby the allocation's extra host is the standby)")
    p.add_argument("--host-shm-mib", type=int, default=512, help="--hosts: each host's /dev/shm")
    p.add_argument("--link-rate", default=None, help="--hosts: every link's rate (tc tbf, e.g. 100mbit)")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse the combinations of arguments the demo cannot run (a clear ConfigError)."""
    # after-iteration kills once the victims finished --kill-at: a later iteration must follow; an
    # injected point fires inside step --kill-at, which may be the last
    last = args.iters - 1 if args.kill_point == "after-iteration" else args.iters
    if args.fail != "none" and not 1 <= args.kill_at <= last:
        raise ftconfig.ConfigError(f"--kill-at={args.kill_at} is invalid with --kill-point {args.kill_point}: must be "
                                   f"in [1, {last}]")
    if args.with_agent and (args.fail != "trainer" or args.kill_point == "after-iteration"):
        raise ftconfig.ConfigError(f"--with-agent is invalid with --fail={args.fail} --kill-point={args.kill_point}: "
                                   f"it needs --fail trainer and an injected --kill-point (one victim kills its agent)")
    if args.second_failure and args.fail == "none":
        raise ftconfig.ConfigError("--second-failure is invalid with --fail=none: it strikes during a recovery")
    if not 0 < args.slow_stop < args.slow_period:
        raise ftconfig.ConfigError(f"--slow-stop={args.slow_stop} is invalid with --slow-period={args.slow_period}: "
                                   f"must be > 0 and below the period")
    if args.slow_seconds <= 0 or args.pause_seconds <= 0:
        raise ftconfig.ConfigError(f"--slow-seconds={args.slow_seconds}, --pause-seconds={args.pause_seconds}: both "
                                   f"must be > 0 seconds")
    if args.fail in ("hang-in-restore", "slow", "agent-pause") and args.kill_point != "after-iteration":
        raise ftconfig.ConfigError(f"--kill-point={args.kill_point} is invalid with --fail={args.fail}: it brings its "
                                   f"own failure (after-iteration only)")
    if args.second_delay < 0:
        raise ftconfig.ConfigError(f"--second-delay={args.second_delay} is invalid: must be >= 0 seconds")
    if args.slurm and not args.hosts:
        raise ftconfig.ConfigError("--slurm is invalid without --hosts: Slurm's daemons run on the hosts of the bed")
    if args.slurm and args.fail in ("node", "two-nodes") and not args.standby:
        raise ftconfig.ConfigError(f"--slurm --fail {args.fail} needs --standby: the allocation's extra host takes "
                                   f"the lost node's place (the demo starts no replacement outside Slurm)")
    if args.slurm and args.fail in ("node", "two-nodes") and args.victim_node == 0:
        raise ftconfig.ConfigError("--slurm --victim-node 0 is invalid: node 0's host runs the job's batch script, "
                                   "and Slurm ends a job whose batch host dies (lose another node)")
    if args.slurm and args.fail in ("launcher", "agent"):
        raise ftconfig.ConfigError(f"--slurm is invalid with --fail={args.fail}: the demo restarts that process "
                                   f"itself, outside the Slurm step")
    if args.standby and args.fail != "node":
        raise ftconfig.ConfigError(f"--standby is invalid with --fail={args.fail}: a standby replaces a lost node "
                                   "(--fail node)")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)

    def stop(signum, frame):  # SIGTERM (e.g. a timeout): unwind, so run_demo's cleanup kills the jobs
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    from .megatron_lm import UpstreamImportError

    if args.elastic:
        from .demo_elastic import run_elastic_demo

        summary = run_elastic_demo(args)
        print(json.dumps(summary), flush=True)
        return 0 if summary["bitwise_identical"] else 1
    try:
        summary = run_demo(args)
    except UpstreamImportError as e:
        print(f"[demo] {e}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(summary), flush=True)
    if not summary["bitwise_identical"]:
        return 1
    if not summary["hang_ok"] or summary["restarted_ranks"]:
        print(f"[demo] FAILED: hang verdicts {[(v['rank'], v['phase']) for v in summary['hang_verdicts']]}"
              + (", want one on each of the victims" if args.fail in HANG_SCENARIOS else ", want none")
              + (f"; rank(s) {summary['restarted_ranks']} restarted without a failure" if summary["restarted_ranks"]
                 else ""), file=sys.stderr, flush=True)
        return 1
    if summary["false_verdicts"]:
        print(f"[demo] FAILED: the root agent judged a live node failed: {summary['false_verdicts'][:3]}",
              file=sys.stderr, flush=True)
        return 1
    if summary.get("promised_tier") and not summary["tier_ok"]:
        print(f"[demo] FAILED: recovered from {summary['recovered_from']}, but this failure must resume from "
              f"{summary['promised_tier']} or better", file=sys.stderr, flush=True)
        return 1
    return 0
