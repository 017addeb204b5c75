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
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, get_args

import yaml

from . import faults
from .. import config as ftconfig
from .. import rank_files, tiers
from ..agent.protocol import socket_path
from ..spares.pool import socket_path as spares_socket_path
from .helpers import read_jsonl, with_free_ports
from .hosts import HostBed, off_plan

REPO_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")


@dataclass(frozen=True)
class Program:
    """The training program the demo runs under ``megatron-ft launch``: the project's
    ``scripts/pretrain_gpt.py``, or upstream Megatron-LM's own ``pretrain_gpt.py`` (patched copy) run
    by :mod:`megatron_ft.testing.megatron_lm`, which records every iteration's parameter digest.
    ``{run_dir}`` in the training arguments becomes the run's directory."""

    script: tuple[str, ...]
    upstream: bool = False

    def command(self, targs: list[str], run_dir: str, cfg_path: str, inmem: bool,
                fault: Optional[str] = None) -> list[str]:
        """The training command for ``megatron-ft launch``; ``fault`` (:mod:`megatron_ft.testing.faults`)
        wraps it in the fault injector."""
        out = [*self.script, *(a.replace("{run_dir}", run_dir) for a in targs)]
        if not self.upstream:
            out += ["--dump-final-state", os.path.join(run_dir, "final", "state")]
        if inmem:
            out += ["--inmem-ckpt", "--inmem-ckpt-config", cfg_path]
        return faults.wrap(out, fault) if fault else out


PROJECT_SCRIPT = Program((os.path.join(REPO_SCRIPTS, "pretrain_gpt.py"),))


def upstream_program(src: str, workdir: str) -> Program:
    """Upstream ``pretrain_gpt.py`` from ``src`` (an unpatched tree or its archive), patched into
    ``workdir/megatron-lm``."""
    from . import megatron_lm

    tree = megatron_lm.patched_tree(src, os.path.join(workdir, "megatron-lm"))
    megatron_lm.check_imports(tree)  # a missing package named now, not inside the reference run's log
    return Program((megatron_lm.__file__, os.path.join(tree, "pretrain_gpt.py")), upstream=True)






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
#: injected kill points that damage the committed slot first: restore must reject that version
DAMAGE_POINTS = ("corrupt-after-commit", *faults.REWRITES, *faults.TRUNCATE_TO)
#: scenarios whose failure is a hang: exactly one hang verdict per victim is expected, in every other
#: scenario none
HANG_SCENARIOS = ("hang", "hang-in-restore")
#: scenarios without a failure: the job trains through, no trainer restarts, no verdict of any kind
NO_FAILURE = ("none", "slow")
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


def persisted_steps(cfg: ftconfig.FTConfig) -> list[int]:
    """Steps every rank has persisted (complete sets) in the job's persist directory."""
    from ..agent import persist

    return persist.complete_steps(cfg.persist.dir, cfg.run_id, cfg.cluster.world_size)


def kill_node(cfg: ftconfig.FTConfig, run_dir: str, node: int, trainer_pids: list[int],
              bed: Optional[HostBed] = None) -> list[int]:
    """Lose simulated node ``node``: SIGKILL its trainers, its launcher's process group (launcher,
    torchrun) and its agent, and remove its shared memory and its Unix sockets (its agent's, its spare
    pool's), as if the machine had died. On the multi-host bed (``bed``) the host dies: every process on
    it at once, its /dev/shm with it (its sockets are in the machine's shared /tmp: removed here too)."""
    if bed is not None:
        pids = bed.lose(node)
        forget_sockets(cfg, node)
        return pids
    pids = []
    for pid in trainer_pids:
        try:
            os.kill(pid, signal.SIGKILL)
            pids.append(pid)
        except ProcessLookupError:
            pass
    for name in ("launcher", "agent"):
        pid = node_pid(run_dir, node, name)
        if pid is None:
            continue
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
        pids.append(pid)
    for name in os.listdir(cfg.agent.shm_dir):
        if name.startswith(f"mft.{cfg.run_id}.n{node}."):
            os.unlink(os.path.join(cfg.agent.shm_dir, name))
    forget_sockets(cfg, node)
    return pids


def forget_sockets(cfg: ftconfig.FTConfig, node: int) -> None:
    """A lost node's Unix sockets (its agent's, its spare pool's) gone with its machine."""
    for path in (socket_path(cfg.agent.socket_dir, cfg.run_id, node),
                 spares_socket_path(cfg.agent.socket_dir, cfg.run_id, node)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def start_replacement(cfg: ftconfig.FTConfig, run_dir: str, node: Optional[int], targs: list[str],
                      log_path: str, program: Program = PROJECT_SCRIPT, bed: Optional[HostBed] = None,
                      new_host: bool = True) -> subprocess.Popen:
    """A new machine takes the lost node's place: its launcher, a fresh agent (empty memory), torchrun.
    ``node`` None: a standby launcher (``launch --standby``) that waits for the root agent's verdict
    on a failed node and takes that node's place. On the multi-host bed the launcher runs on host
    ``node``: a new one brought up under the lost one's name (``new_host``), or the live one; a
    standby on host ``cluster.nodes``, under its own name."""
    cfg_path = os.path.join(run_dir, "job.yaml")
    cmd = [sys.executable, "-m", "megatron_ft.cli", "launch", f"--config={cfg_path}", f"--run-dir={run_dir}",
           "--standby" if node is None else f"--node-rank={node}", "--",
           *program.command(targs, run_dir, cfg_path, inmem=True)]
    out = open(log_path, "wb")
    if bed is not None and node is not None:
        if new_host:
            bed.replace(node)
        return bed.popen(node, cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    if bed is not None:  # the standby: a host of its own beside the job's (the bed's next one)
        return bed.popen(cfg.cluster.nodes, cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


class JobOnHosts:
    """A job on the multi-host bed: one ``megatron-ft launch --node-rank i`` on each host ``i``, with the
    Popen verbs the demo uses on a job (its exit code: the largest of its launchers', as on one machine)."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> Optional[int]:
        rcs = [p.poll() for p in self.procs]
        return None if any(rc is None for rc in rcs) else max(rcs)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return max(p.returncode for p in self.procs)


def launch_job(cfg: ftconfig.FTConfig, run_dir: str, script_args: list[str], inmem: bool,
               log_path: str, fault: Optional[str] = None, program: Program = PROJECT_SCRIPT,
               bed: Optional[HostBed] = None) -> "subprocess.Popen | JobOnHosts":
    """The job: ``megatron-ft launch`` simulating every node here, or on the bed one launcher per host."""
    launch, script = launch_command(cfg, run_dir, script_args, inmem, fault, program)
    logf = open(log_path, "wb")
    if bed is None:
        return subprocess.Popen(launch + script, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    procs = []
    for i in range(cfg.cluster.nodes):
        procs.append(bed.popen(i, launch + [f"--node-rank={i}"] + script, stdout=logf, stderr=subprocess.STDOUT,
                               start_new_session=True))
        if i == 0:
            time.sleep(0.5)  # node 0 hosts the first rendezvous: let it start first (as on one machine)
    return JobOnHosts(procs)


def launch_command(cfg: ftconfig.FTConfig, run_dir: str, script_args: list[str], inmem: bool,
                   fault: Optional[str], program: Program) -> tuple[list[str], list[str]]:
    """``cfg`` written to ``run_dir/job.yaml``; the ``megatron-ft launch`` command of a node without its
    node rank, and its ``-- training command`` part."""
    os.makedirs(run_dir, exist_ok=True)
    cfg_path = os.path.join(run_dir, "job.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    launch = [sys.executable, "-m", "megatron_ft.cli", "launch", f"--config={cfg_path}", f"--run-dir={run_dir}"]
    return launch, ["--", *program.command(script_args, run_dir, cfg_path, inmem, fault)]


def slurm_job(slurm, cfg: ftconfig.FTConfig, run_dir: str, script_args: list[str], log_path: str,
              fault: Optional[str], program: Program, hosts: int):
    """The job as one Slurm batch job on the bed: ``srun`` runs ``megatron-ft launch`` (no ``--node-rank``:
    each takes its node from the step, :mod:`megatron_ft.scheduler`) on each of ``hosts`` hosts."""
    from .slurm import SlurmJob

    launch, script = launch_command(cfg, run_dir, script_args, True, fault, program)
    return SlurmJob(slurm, run_dir, launch + script, hosts, log_path)


def watch_slurm_node(slurm, node: int, out: dict, deadline: float) -> None:
    """Until ``deadline``: when Slurm marks lost host ``node`` DOWN (``sinfo``), in ``out`` its state and
    the seconds since the loss."""
    t0, name = time.time(), slurm.name(node)
    while time.time() < deadline:
        try:
            state = slurm.node_states().get(name, "")
        except Exception:  # the controller busy: ask again
            state = ""
        if state.startswith("down"):
            out.update({"name": name, "state": state, "down_after_s": round(time.time() - t0, 1),
                        "since": slurm.down_since(name)})
            return
        time.sleep(0.5)


def _kill_tree(p: "subprocess.Popen | JobOnHosts") -> None:
    if hasattr(p, "cancel"):  # a Slurm job: its processes are slurmd's children on the bed's hosts
        p.cancel()
        return
    if isinstance(p, JobOnHosts):
        for proc in p.procs:
            _kill_tree(proc)
        return
    try:
        import psutil

        procs = psutil.Process(p.pid).children(recursive=True)
        for c in procs:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
    except Exception:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_job(p: subprocess.Popen, timeout: float, what: str, log_path: str) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(p)
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s; log: {log_path}")
    except BaseException:  # interrupted (SIGINT, SIGTERM): never leave the job running
        _kill_tree(p)
        raise
    if rc != 0:
        tail = open(log_path, errors="replace").read()[-3000:]
        raise RuntimeError(f"{what} failed with exit code {rc}; log {log_path}:\n{tail}")


def losses(run_dir: str, discarded: Optional[dict] = None) -> dict[tuple[int, int], set[str]]:
    """(rank, iteration) -> loss hex strings seen (several when an iteration was re-run). ``discarded``:
    trainer life -> the restored step its guard refused; what that life trained after it was rolled
    back, and is not compared."""
    out: dict[tuple[int, int], set[str]] = {}
    prog = os.path.join(run_dir, "progress")
    discarded = discarded or {}
    for name in sorted(os.listdir(prog)) if os.path.isdir(prog) else []:
        for rec in read_jsonl(os.path.join(prog, name)):
            if life(rec) in discarded and rec["iteration"] > discarded[life(rec)]:
                continue
            # the project's script logs the loss; upstream's runner also a digest of the parameters
            value = "|".join(str(rec[k]) for k in ("loss_hex", "state_digest") if rec.get(k) is not None)
            if value:
                out.setdefault((rec["rank"], rec["iteration"]), set()).add(value)
    return out


def final_states(run_dir: str, world: int) -> dict[int, dict]:
    out = {}
    for r in range(world):
        path = os.path.join(run_dir, "final", f"state.rank{r}.json")
        with open(path) as f:
            out[r] = json.load(f)
    return out


def compare(ref_dir: str, run_dir: str, world: int, discarded: Optional[dict] = None) -> tuple[bool, list[str]]:
    problems = []
    ref_l, run_l = losses(ref_dir), losses(run_dir, discarded)
    if not ref_l:
        problems.append("reference run logged no losses")
    for key, want in sorted(ref_l.items()):
        got = run_l.get(key)
        if got is None:
            problems.append(f"rank {key[0]} iteration {key[1]}: no loss logged")
        elif got != want:
            problems.append(f"rank {key[0]} iteration {key[1]}: loss {sorted(got)} != reference {sorted(want)}")
    try:
        ref_s, run_s = final_states(ref_dir, world), final_states(run_dir, world)
    except FileNotFoundError as e:
        problems.append(f"final state missing: {e}")
        return False, problems
    for r in range(world):
        for section in sorted(set(ref_s[r]) | set(run_s[r])):
            if ref_s[r].get(section) != run_s[r].get(section):
                a, b = ref_s[r].get(section), run_s[r].get(section)
                keys = sorted(k for k in (set(a) | set(b)) if a.get(k) != b.get(k)) if isinstance(a, dict) and isinstance(b, dict) else []
                problems.append(f"rank {r}: final {section} differs {keys[:4]}")
    return not problems, problems


def reference_key(targs: list[str], world: int) -> str:
    """The name of a reference run's directory under ``--reference-dir``: one per job (its training
    arguments and world size), so that runs of different shapes sharing the directory keep theirs.

    >>> reference_key(["--iters", "10"], 4) == reference_key(["--iters", "10"], 4) != reference_key([], 4)
    True
    """
    return "ref-" + hashlib.sha1(json.dumps([targs, world]).encode()).hexdigest()[:12]


def reference_matches(ref_dir: str, targs: list[str], world: int) -> bool:
    try:
        with open(os.path.join(ref_dir, "args.json")) as f:
            rec = json.load(f)
        final_states(ref_dir, world)
    except (OSError, ValueError):
        return False
    return {k: rec.get(k) for k in ("train_args", "world")} == {"train_args": targs, "world": world}


BREAKDOWN_NAMES = {"detect_respawn": "detect + respawn", "imports": "imports", "rendezvous": "rendezvous",
                   "build": "build", "restore": "restore", "first_iteration": "first iteration"}


def recovery_breakdown(restores: list[dict], progress: list[dict], kill_time: float) -> Optional[dict]:
    """The phases of the recovery of the restarted rank that completed an iteration first (an
    iteration needs every rank, so then the job trains again), from its restore event's timeline
    and its progress; they add up to kill -> that iteration. None without a restarted rank."""
    best = None
    for e in restores:
        tl = e.get("timeline")
        first = min((r["time"] for r in progress if life(r) == life(e) and r["time"] > kill_time), default=None)
        if tl is None or first is None or e["time"] < kill_time:
            continue
        if best is None or first < best[1]:
            best = (e, first)
    if best is None:
        return None
    e, first = best
    tl = e["timeline"]
    rdzv = tl.get("rendezvous_start") is not None and tl.get("rendezvous_end") is not None
    out = {"detect_respawn": tl["process_start"] - kill_time,
           "imports": (tl["rendezvous_start"] if rdzv else tl["ready"]) - tl["process_start"],
           "rendezvous": tl["rendezvous_end"] - tl["rendezvous_start"] if rdzv else None,
           "build": tl["ready"] - tl["rendezvous_end"] if rdzv else None,
           "restore": e["time"] - tl["ready"]}
    phases = {k: (round(v, 3) if v is not None else None) for k, v in out.items()}
    # the last phase is what remains of the (rounded) recovery, so the phases add up to it exactly
    phases["first_iteration"] = round(round(first - kill_time, 3) - sum(v for v in phases.values() if v), 3)
    return phases


def raw_copy_seconds(nbytes: int, reps: int = 5) -> float:
    """The fastest of ``reps`` plain copies of ``nbytes`` bytes into memory already touched (one
    thread): what a snapshot's stall is measured against."""
    import torch

    src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    best = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best


def snapshot_stall(run_dir: str) -> Optional[dict]:
    """What training saw of its snapshots (every trainer life that closed: the survivors and the
    restarted ones): the slowest rank's median stall per snapshot, the largest single stall, one
    rank's snapshot bytes, and - measured here, now - a raw copy of those bytes, so that the stall
    can be read against it."""
    lives = [e for e in _all_records(run_dir, "events") if e.get("event") == "snapshots"
             and e.get("stall_median_s") is not None]
    if not lives:
        return None
    nbytes = max(e["nbytes"] for e in lives)
    raw = raw_copy_seconds(nbytes)
    stall = max(e["stall_median_s"] for e in lives)
    out = {"snapshots": sum(e["taken"] for e in lives), "failed": sum(e["failed"] for e in lives),
           "stall_median_s": round(stall, 6), "stall_max_s": round(max(e["stall_max_s"] for e in lives), 6),
           "bytes_per_rank": nbytes, "raw_copy_s": round(raw, 6), "stall_vs_raw_copy": round(stall / raw, 4)}
    saves = []  # upstream Megatron-LM: its whole save call per snapshot (the harness times it)
    for path in glob.glob(os.path.join(run_dir, "saves", "rank*.json")):
        with open(path) as f:
            secs = sorted(json.load(f)["seconds"])
        saves.append(secs[len(secs) // 2])
    if saves:
        out["megatron_save_median_s"] = round(max(saves), 6)
    return out


def restarted_by(restores: list[dict]) -> Optional[str]:
    """``'fast round N'`` or ``'torchrun restart N'`` (or both, e.g. a round then a node's loss):
    the newest of each among the restores after the kill."""
    rounds = max((e.get("fast_round", 0) for e in restores), default=0)
    restarts = max((e.get("restart_count", 0) for e in restores), default=0)
    parts = ([f"fast round {rounds}"] if rounds else []) + ([f"torchrun restart {restarts}"] if restarts else [])
    return " + ".join(parts) or None


def _progress(run_dir: str, rank: int) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "progress", f"rank{rank}.jsonl"))


def life(rec: dict) -> tuple[int, int]:
    """Which trainer life wrote a progress or event record: its process, and the attempt in it (an
    in-process restart keeps the process and counts attempts)."""
    return rec["pid"], rec.get("in_process_attempt", 0)


def _all_records(run_dir: str, kind: str) -> list[dict]:
    """Every record of ``run_dir/<kind>``'s ``.jsonl`` files, flat or per node (:mod:`megatron_ft.rank_files`)."""
    return [r for path in rank_files.all_files(os.path.join(run_dir, kind), ".jsonl") for r in read_jsonl(path)]


def node_pid(run_dir: str, node: int, name: str) -> Optional[int]:
    """The pid node ``node``'s launcher wrote for its ``launcher`` or ``agent`` (None: not there yet)."""
    try:
        with open(os.path.join(run_dir, f"node{node}", f"{name}.pid")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def agent_protected(cfg, node: int) -> Optional[int]:
    """The newest step node ``node``'s agent protects for every one of its ranks (the job's agreed
    version, as its status says; None: no answer, or a rank with none yet)."""
    from ..agent.protocol import agent_status

    try:
        ranks = agent_status(cfg, node)["ranks"]
    except (OSError, KeyError, RuntimeError):
        return None
    steps = [r["global_step"] for r in ranks.values()]
    return min(steps) if len(steps) == cfg.cluster.ranks_per_node and min(steps) >= 0 else None


def node_workers(run_dir: str, node: int) -> list[int]:
    """Process ids of node ``node``'s trainers now: the children of its launcher's torchrun, or with
    warm spares the trainers its pool's keepers forked for them (a fast restart round forks new
    ones under the same workers)."""
    import psutil

    from ..spares.fast_restart import STORE_PROCESS_NAME

    out = []
    try:
        launcher = psutil.Process(node_pid(run_dir, node, "launcher") or -1)
        for child in launcher.children():
            if "megatron_ft.torchrun" in " ".join(child.cmdline()):  # the launcher's torchrun
                out = [w.pid for w in child.children() if "megatron_ft.spares.worker" not in " ".join(w.cmdline())]
        pool = node_pid(run_dir, node, "spares")
        if pool is not None:
            out += [t.pid for keeper in psutil.Process(pool).children() for t in keeper.children()
                    if t.name() != STORE_PROCESS_NAME]
    except (OSError, ValueError, psutil.Error):
        pass
    return out


def kill_during_recovery(run_dir: str, nodes: int, known: set[int], prefer_not: set[int], delay: float,
                         deadline: float, p: subprocess.Popen, log_path: str,
                         last: int) -> Optional[tuple[int, int, float]]:
    """A second failure while the first recovery runs: once a trainer of the restarted generation
    exists (a pid not in ``known``), wait ``delay`` seconds (importing, rendezvous, restore) and
    SIGKILL it. A trainer on a node outside ``prefer_not`` is chosen when one appears as soon.
    Returns (node, pid, time), or None when the job trained its ``last`` iteration first: the recovery
    is over, and a kill now would strike a trainer on its way out, which is not this failure."""
    while True:
        fresh = [(n, w) for n in range(nodes) for w in node_workers(run_dir, n) if w not in known]
        if fresh:
            fresh.sort(key=lambda nw: nw[0] in prefer_not)
            node, pid = fresh[0]
            time.sleep(delay)
            if any(r["iteration"] >= last for r in _all_records(run_dir, "progress")):
                return None
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended on its own (its generation was torn down): the failure still counts
            return node, pid, time.time()
        if p.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"no restarted trainer appeared for the second failure; log {log_path}")
        time.sleep(0.02)


GROUP_COMPLETE = re.compile(r"step (\d+) is complete in group")


def wait_group_complete(run_dir: str, nodes: int, p, deadline: float, log_path: str) -> int:
    """Wait until every node's agent logged a step complete in its group; the smallest such step."""
    while True:
        steps = []
        for n in range(nodes):
            try:
                with open(os.path.join(run_dir, f"node{n}", "agent.log"), errors="replace") as f:
                    found = GROUP_COMPLETE.findall(f.read())
            except OSError:
                found = []
            steps.append(min(map(int, found)) if found else None)
        if all(s is not None for s in steps):
            return min(steps)
        if p.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"no step became complete in the redundancy groups (agents: {steps}); log {log_path}")
        time.sleep(0.05)


def wait_fault(run_dir: str, victims: list[int], p: subprocess.Popen, timeout: float,
               log_path: str) -> tuple[float, int]:
    """Wait for the injected faults' event lines; return the time of the first and the newest step they
    fired at (a fault fires at its step, or the first step after it that reaches its point)."""
    deadline = time.time() + timeout
    while True:
        fired = [e for v in victims
                 for e in read_jsonl(rank_files.find_rank_file(os.path.join(run_dir, "events"), v, ".jsonl") or "")
                 if e.get("event") == "fault"]
        if len(fired) == len(victims):
            return min(e["time"] for e in fired), max(e["step"] for e in fired)
        if p.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the injected fault never fired; log {log_path}")
        time.sleep(0.05)


def slow_down(pid: int, stop_s: float, period_s: float, seconds: float, job) -> dict:
    """Slow process ``pid`` without failing it: SIGSTOP for ``stop_s`` of every ``period_s``, for
    ``seconds`` or until the process or ``job`` ends; it is always left running (SIGCONT). Returns
    {"pid", "cycles", "seconds", "stop_s", "period_s"}."""
    t0, cycles = time.time(), 0
    try:
        while time.time() - t0 < seconds and job.poll() is None:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                break
            cycles += 1
            time.sleep(stop_s)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                break
            time.sleep(max(0.0, period_s - stop_s))
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return {"pid": pid, "cycles": cycles, "seconds": round(time.time() - t0, 2), "stop_s": stop_s,
            "period_s": period_s}


def pause_agent(pid: Optional[int], seconds: float) -> dict:
    """SIGSTOP a node agent ``pid`` for ``seconds``, then SIGCONT (always). Returns {"pid", "seconds",
    "stopped_at", "continued_at"}."""
    if pid is None:
        raise RuntimeError("the node's agent wrote no pid file: nothing to pause")
    os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        time.sleep(seconds)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    t1 = time.time()
    return {"pid": pid, "seconds": round(t1 - t0, 2), "stopped_at": t0, "continued_at": t1}


def choose_victims(args: argparse.Namespace, cfg: ftconfig.FTConfig) -> tuple[list[int], list[int]]:
    """(ranks that fail, nodes lost) for ``args.fail``; a clear error for a node outside the cluster."""
    rpn, nodes = cfg.cluster.ranks_per_node, cfg.cluster.nodes

    def ranks(node: int) -> list[int]:
        return list(range(node * rpn, (node + 1) * rpn))

    def check(node: int, lo: int, why: str = "", flag: str = "--victim-node") -> int:
        if not lo <= node < nodes:
            raise ftconfig.ConfigError(f"{flag}={node} is invalid for --fail {args.fail}: must be in "
                                       f"[{lo}, {nodes - 1}]{why}")
        return node

    if args.fail in ("trainer", "hang", "hang-in-restore", "slow"):
        return [args.victim_rank if args.victim_rank is not None else cfg.cluster.world_size - 1], []
    if args.fail in ("all-trainers", "agent", "agent-pause"):
        return ranks(check(args.victim_node if args.victim_node is not None else
                           (0 if args.fail == "all-trainers" else nodes - 1), 0)), []
    if args.fail == "launcher":  # node 0's too: the survivors move the rendezvous, whatever the scheme
        return ranks(check(args.victim_node if args.victim_node is not None else nodes - 1, 0)), []
    if args.fail == "node":
        node = check(args.victim_node if args.victim_node is not None else default_victim_node(cfg), 0)
        return ranks(node), [node]
    if args.fail == "two-nodes":
        if nodes < 3:
            raise ftconfig.ConfigError(f"--fail two-nodes needs a cluster of at least 3 nodes, not {nodes}")
        first = check(args.victim_node if args.victim_node is not None else default_victim_node(cfg), 0)
        if getattr(args, "other_node", None) is not None:
            other = check(args.other_node, 0, flag="--other-node")
            if other == first:
                raise ftconfig.ConfigError(f"--other-node={other} is invalid: it must differ from --victim-node "
                                           f"({first})")
        else:
            other = next(n for n in range(nodes - 1, -1, -1) if n != first)
        return ranks(first) + ranks(other), sorted([first, other])
    return [], []


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
    if args.fail == "hang-in-restore":
        cfg = ftconfig.replace(cfg, hang=RESTORE_HANG_LIMITS)
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
        # hosts of their own: every host has the default ports to itself; the job's secret is a file every
        # host reads (the bed's hosts share this machine's file system but /dev/shm)
        from ..transport.credential import job_secret_file

        secret = cfg.security.secret_file or job_secret_file("", {}, workdir, multi_host=False)
        return ftconfig.replace(cfg, launch={"master_addr": "node0"}, health={"host_pattern": "node{node}"},
                                network={"interface": "eth0"}, security={"secret_file": secret})
    return with_free_ports(cfg)


def host_listeners(bed: HostBed, cfg: ftconfig.FTConfig) -> dict:
    """What listens on each host of ``bed`` now: megatron-ft's own servers as ``[host, owner, port,
    address]``, and those off the configuration's port plan (:func:`megatron_ft.testing.hosts.off_plan`)."""
    own, off = set(), []
    for i in range(cfg.cluster.nodes):
        found = bed.listeners(i)
        own |= {(bed.plan.name(i), s.owner, s.port, s.address) for s in found if s.owner != "trainer"}
        off += [f"{bed.plan.name(i)}: {x}" for x in off_plan(cfg, found)]
    return {"own": [list(x) for x in sorted(own)], "off_plan": off}


def stranger_probe(bed: HostBed, cfg: ftconfig.FTConfig) -> dict:
    """From the bed's last host (not one of the job's), without the job's secret: every operation of the
    coordination store to every node's store port and, with peer redundancy, every request of the
    agents' peer protocol to every node's peer port. {"probes": n, "challenged": n, "served": [what was
    served]}: the job's own connections prove the secret; these must all be refused before any effect."""
    from ..agent.peer_protocol import PEER_MESSAGES
    from ..health.wire_store import STORE_MESSAGES
    from ..network import peer_port

    nodes = range(cfg.cluster.nodes)
    store = {"get": {"key": f"mft/{cfg.run_id}/root"}, "set": {"key": f"mft/{cfg.run_id}/failed/0", "value": "{}"},
             "compare_set": {"key": f"mft/{cfg.run_id}/root", "expected": "0", "desired": "1"},
             "delete": {"key": f"mft/{cfg.run_id}/root"},
             "watch": {"key": f"mft/{cfg.run_id}/agreed", "value": None, "wait_s": 0.1}}
    assert set(store) == set(STORE_MESSAGES.ops), STORE_MESSAGES.ops  # every op of each protocol
    probes = [([[bed.plan.address(i), cfg.health.store_port] for i in nodes], store)]
    if cfg.redundancy.scheme != "none":
        peer = {"holds": {}, "announce": {"node": 0, "step": 10 ** 6},
                "get": {"what": "primary", "step": 1, "lo": 0, "hi": 64, "rank": 0},
                "put": {"key": "copy.r0", "kind": "copy", "step": 10 ** 6, "length": 0, "src": 0, "expect": 0,
                        "meta": {}}}
        assert set(peer) == set(PEER_MESSAGES.ops), PEER_MESSAGES.ops
        probes.append(([[bed.plan.address(i), peer_port(cfg, i)] for i in nodes], peer))
    results = []
    for addrs, requests in probes:
        out = bed.run(cfg.cluster.nodes, [sys.executable, "-m", "megatron_ft.testing.hosts", "probe",
                                          json.dumps(addrs), json.dumps(requests)])
        results += json.loads(out.stdout.strip().splitlines()[-1])
    return {"probes": len(results), "challenged": sum(p["challenged"] for p in results),
            "served": [p for p in results if p["served"]]}


def _run_demo(args: argparse.Namespace, bed: Optional[HostBed], slurm=None) -> dict:
    workdir = os.path.abspath(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    cfg = demo_config(args, workdir)
    world = cfg.cluster.world_size
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

    # 1. reference (or an earlier one with the same arguments)
    ref_dir = (os.path.join(os.path.abspath(args.reference_dir), reference_key(targs, world)) if args.reference_dir
               else os.path.join(workdir, "reference"))
    ref_seconds = 0.0
    if reference_matches(ref_dir, targs, world):
        say(f"[demo] reusing the reference run in {ref_dir}")
        with open(os.path.join(ref_dir, "args.json")) as f:
            cold_start_seconds = json.load(f).get("cold_start_seconds")
    else:
        say(f"[demo] reference run: {world} ranks (TP{cfg.parallel.tensor} PP{cfg.parallel.pipeline} "
            f"DP{cfg.data_parallel}), {args.iters} iterations, no megatron-ft ...")
        shutil.rmtree(ref_dir, ignore_errors=True)
        t0 = time.time()
        # the same job started cold (no warm spares): the yardstick of a recovery's time
        ref_cfg = with_free_ports(cfg, run_id=cfg.run_id + "-ref", launch={"warm_spares": False})
        ref_log = ref_dir + ".log"
        p = launch_job(ref_cfg, ref_dir, targs, inmem=False, log_path=ref_log, program=program, bed=bed)
        wait_job(p, args.timeout, "reference run", ref_log)
        first = min((r["time"] for r in _all_records(ref_dir, "progress")), default=None)
        cold_start_seconds = round(first - t0, 3) if first is not None else None
        with open(os.path.join(ref_dir, "args.json"), "w") as f:
            json.dump({"train_args": targs, "world": world, "cold_start_seconds": cold_start_seconds}, f)
        ref_seconds = time.time() - t0
        say(f"[demo] reference done in {ref_seconds:.1f} s")

    # 2. the job with megatron-ft and a failure
    run_dir = os.path.join(workdir, "run")
    log_path = os.path.join(workdir, "run.log")
    say(f"[demo] megatron-ft run, failure: {args.fail}" + (f" after iteration {args.kill_at}" if args.fail != "none" else ""))
    t0 = time.time()
    rpn = cfg.cluster.ranks_per_node
    fault = None
    if victims and args.kill_point != "after-iteration":
        fault = (f"{args.kill_point}{faults.WITH_AGENT if args.with_agent else ''}:{args.kill_at}:"
                 f"{','.join(map(str, victims))}")
    elif args.fail == "hang-in-restore":  # the victim's next life hangs in its restore, whichever step it chose
        fault = f"{args.restore_hang}-restore:{faults.ANY_STEP}:{','.join(map(str, victims))}"
    if slurm is not None:  # one batch job: srun starts a launcher on every host of the allocation
        p = slurm_job(slurm, cfg, run_dir, targs, log_path, fault, program, hosts=cfg.cluster.nodes + bool(args.standby))
        say(f"[demo] submitted Slurm job {p.job_id}: {cfg.cluster.nodes + bool(args.standby)} hosts"
            + (", the last a standby" if args.standby else ""))
    else:
        p = launch_job(cfg, run_dir, targs, inmem=True, log_path=log_path, fault=fault, program=program, bed=bed)
    replacements: list[tuple[subprocess.Popen, str]] = []  # (launcher, its log)
    replacement_log = os.path.join(workdir, "standby.log" if args.standby else "replacement.log")
    slurm_lost: dict = {}  # --slurm: what Slurm made of the lost host (watch_slurm_node)
    if args.standby and slurm is None:
        replacements.append((start_replacement(cfg, run_dir, None, targs, replacement_log, program, bed),
                             replacement_log))
        say(f"[demo] a standby node waits for the root agent's failure verdict (log {replacement_log})")
    kill_time = None
    killed_pids = []
    listeners: Optional[dict] = None  # hosts of their own: what listens where (host_listeners)
    stranger: Optional[dict] = None  # hosts of their own: an outsider's probes (stranger_probe)
    # the settings the job runs with (the training command's --inmem-ckpt* flags applied), and the
    # complete persisted steps when a node was lost: a recovery from disk must take the newest of them
    eff_cfg = ftconfig.apply_flags(cfg, ftconfig.command_flags(targs))
    persisted_at_kill: list[int] = []
    # per lost node, the steps its agent had logged complete in its group when the node died: with none, the
    # group holds no version to rebuild from (a loss during the first exchange) and a fresh start is right
    complete_at_loss: dict[int, list[int]] = {}
    agent_killed = None
    protected_from = None  # --fail agent: the first step the restarted agent must hold
    hang_time = None  # hang scenarios: when the victim hung (the SIGSTOP, or its restart reaching the restore)
    slowed: dict = {}  # --fail slow: what the duty cycle did (slow_down)
    paused: dict = {}  # --fail agent-pause: the agent stopped and continued (pause_agent)
    second = None
    deadline = time.time() + args.timeout

    def lose_nodes(trainer_pids: list[int]) -> None:
        """The lost nodes' machines die; a replacement (or the standby) takes each one's place."""
        nonlocal killed_pids, persisted_at_kill
        for n in lost_nodes:
            killed_pids += kill_node(cfg, run_dir, n, trainer_pids, bed)
            trainer_pids = []
        persisted_at_kill = persisted_steps(eff_cfg)
        for n in lost_nodes:  # read once the agent is dead: its log is final (the replacement appends later)
            try:
                with open(os.path.join(run_dir, f"node{n}", "agent.log"), errors="replace") as f:
                    complete_at_loss[n] = sorted(int(x) for x in GROUP_COMPLETE.findall(f.read()))[-3:]
            except OSError:
                complete_at_loss[n] = []
        if slurm is not None:
            threading.Thread(target=watch_slurm_node, args=(slurm, lost_nodes[0], slurm_lost, deadline),
                             name="slurm-node", daemon=True).start()
        say(f"[demo] node(s) {lost_nodes} lost: SIGKILL -> their launchers, torchrun, trainers {victims} and agents "
            f"(pids {killed_pids}); their shared memory removed. "
            + ("The standby takes the place of one once the root agent declares it failed" if args.standby
               else f"Starting replacement node(s) {lost_nodes}"))
        if not args.standby and slurm is None:
            for n in lost_nodes:
                log = replacement_log if len(lost_nodes) == 1 else os.path.join(workdir, f"replacement{n}.log")
                replacements.append((start_replacement(cfg, run_dir, n, targs, log, program, bed), log))

    def wait_iteration(ranks: list[int], iteration: int) -> dict[int, list[dict]]:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"job ended before rank(s) {ranks} reached iteration {iteration}; log {log_path}")
            if time.time() > deadline:
                raise RuntimeError(f"rank(s) {ranks} never reached iteration {iteration}; log {log_path}")
            recs = {v: _progress(run_dir, v) for v in ranks}
            if all(recs[v] and recs[v][-1]["iteration"] >= iteration for v in ranks):
                return recs
            time.sleep(0.02)

    def kill_trainers(recs: dict[int, list[dict]]) -> None:
        nonlocal kill_time
        how = signal.SIGSTOP if args.fail == "hang" else signal.SIGKILL  # hang: alive, doing nothing
        for v in victims:
            pid = recs[v][-1]["pid"]
            try:
                os.kill(pid, how)
                killed_pids.append(pid)
            except ProcessLookupError:
                pass
        kill_time = time.time()
        say(f"[demo] {how.name} -> rank(s) {victims} (pids {killed_pids})"
            + (": never resumed; the agents must find it hung and end it" if args.fail == "hang" else ""))

    def look_around() -> None:
        """Hosts of their own: once the job trains, what listens where, and what an outsider on the
        network gets from it (beside the run: the failure's timing is the demo's, not this look's)."""
        nonlocal listeners, stranger
        while not _progress(run_dir, 0) and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        listeners = host_listeners(bed, cfg)
        listened.set()
        stranger = stranger_probe(bed, cfg)

    listened = threading.Event()
    looking = threading.Thread(target=look_around, name="look-around", daemon=True) if bed is not None else None
    if looking is not None:
        looking.start()
    try:
        if args.kill_agent and victims:  # two iterations before the trainers' failure
            wait_iteration(victims[:1], max(1, args.kill_at - 2))
            agent_killed = (victims[0] // rpn, node_pid(run_dir, victims[0] // rpn, "agent"))
            os.kill(agent_killed[1], signal.SIGKILL)
            say(f"[demo] SIGKILL -> agent of node {agent_killed[0]} (pid {agent_killed[1]}); the launcher restarts it")
        if victims and args.kill_point != "after-iteration":
            kill_time, fired_at = wait_fault(run_dir, victims, p, args.timeout, log_path)
            if fired_at != args.kill_at:  # the snapshot of step kill_at was skipped (the agreement pending)
                say(f"[demo] the snapshot of step {args.kill_at} was not taken: the fault fired at step {fired_at}")
                args.kill_at = fired_at
            say(f"[demo] rank(s) {victims} SIGKILLed themselves at {args.kill_point} of step {args.kill_at}")
            if args.with_agent:
                fired = [e for e in _all_records(run_dir, "events") if e.get("event") == "fault"]
                agent_killed = (victims[0] // rpn, fired[0].get("agent_killed"))
                say(f"[demo] ... after SIGKILLing their node's agent (pid {agent_killed[1]}); its launcher restarts it")
            if lost_nodes:  # the rest of the machine goes with them
                lose_nodes([])
        elif victims:
            if lost_nodes and cfg.redundancy.scheme != "none":
                # the group's first complete copy comes after the peers connected (and, scheduled, after
                # the trainers' profiled iterations and the plan's interval), which a loaded machine
                # lengthens: the loss waits for it (until then the group holds no copy and the promise of
                # peer memory does not apply yet)
                done = wait_group_complete(run_dir, cfg.cluster.nodes, p, deadline, log_path)
                reached = max(r["iteration"] for r in _progress(run_dir, victims[0]))
                if reached > args.kill_at:
                    say(f"[demo] the group's first complete copy (step {done}) came after iteration {reached}: "
                        f"the node is lost after iteration {reached + 1} instead of {args.kill_at}")
                    args.kill_at = reached + 1
            recs = wait_iteration(victims, args.kill_at)
            if looking is not None:  # every host's listeners seen before the failure (tens of ms)
                listened.wait(30)
            if args.kill_delay > 0:
                time.sleep(args.kill_delay)
                recs = {v: _progress(run_dir, v) for v in victims}
            if lost_nodes:
                lose_nodes([recs[v][-1]["pid"] for v in victims])
                kill_time = time.time()
            elif args.fail == "launcher":
                node = victims[0] // rpn
                lpid = node_pid(run_dir, node, "launcher")
                os.kill(lpid, signal.SIGKILL)
                killed_pids.append(lpid)
                kill_time = time.time()
                say(f"[demo] SIGKILL -> launcher of node {node} (pid {lpid}); starting it again"
                    + (f" in {args.relaunch_delay:g} s (a supervisor's restart)" if args.relaunch_delay else ""))
                time.sleep(args.relaunch_delay)
                replacements.append((start_replacement(cfg, run_dir, node, targs, replacement_log, program, bed,
                                                       new_host=False),
                                     replacement_log))
            elif args.fail == "agent":
                # the agent dies at this moment; its launcher restarts it and the new agent must protect
                # the next steps: once it runs and the node's trainers finished two more iterations,
                # they are SIGKILLed and must resume from it, at a step taken after its restart
                node = victims[0] // rpn
                old = node_pid(run_dir, node, "agent")
                os.kill(old, signal.SIGKILL)
                agent_killed = (node, old)
                say(f"[demo] SIGKILL -> agent of node {node} (pid {old}) inside iteration {args.kill_at + 1}")
                import psutil

                from ..agent.protocol import socket_path

                sock = socket_path(cfg.agent.socket_dir, cfg.run_id, node)
                # restarted: a new pid, alive, listening on the node's socket (the launcher removes it first)
                while not ((new := node_pid(run_dir, node, "agent")) and new != old and psutil.pid_exists(new)
                           and os.path.exists(sock)):
                    if p.poll() is not None or time.time() > deadline:
                        raise RuntimeError(f"node {node}'s agent was never restarted; log {log_path}")
                    time.sleep(0.05)
                done = max(_progress(run_dir, v)[-1]["iteration"] for v in victims)
                protected_from = done + 1
                last = int(dict(zip(targs, targs[1:])).get("--train-iters", args.iters))
                if protected_from + 2 > last:
                    raise RuntimeError(f"the agent restarted after iteration {done}: too late to check it "
                                       f"protects the next steps of {last}; use a smaller --kill-at")
                say(f"[demo] agent of node {node} restarted (pid {new}) after iteration {done}")
                # the new agent protects a step taken after its restart once the job agreed on it: a step
                # the killed agent never committed waits first for the node's trainers' next snapshot
                # to abandon it, so this takes a few iterations, not one
                while (held := agent_protected(cfg, node)) is None or held < protected_from:
                    recs = wait_iteration(victims, 0)
                    if min(r[-1]["iteration"] for r in recs.values()) >= last:
                        raise RuntimeError(f"node {node}'s restarted agent protected no step >= {protected_from} "
                                           f"before the job's last iteration {last} (holds {held}); log {log_path}")
                    time.sleep(0.05)
                say(f"[demo] it protects step {held} for every rank of its node")
                kill_trainers(wait_iteration(victims, held + 1))
            elif args.fail == "slow":  # no failure: the victim only runs slower for a while
                pid = recs[victims[0]][-1]["pid"]
                say(f"[demo] slowing rank {victims[0]} (pid {pid}): SIGSTOP {args.slow_stop:g} s of every "
                    f"{args.slow_period:g} s for at most {args.slow_seconds:g} s; no hang verdict may follow")
                slowed.update(slow_down(pid, args.slow_stop, args.slow_period, args.slow_seconds, p))
                say(f"[demo] duty cycle over: {slowed['cycles']} stop(s) in {slowed['seconds']} s")
            elif args.fail == "agent-pause":
                node = victims[0] // rpn
                paused.update(pause_agent(node_pid(run_dir, node, "agent"), args.pause_seconds))
                paused["node"] = node
                say(f"[demo] agent of node {node} (pid {paused['pid']}) SIGSTOPped for {paused['seconds']} s, "
                    f"then SIGCONT")
            else:
                kill_trainers(recs)
                if args.fail == "hang":
                    hang_time = kill_time
                elif args.fail == "hang-in-restore":
                    hang_time, _ = wait_fault(run_dir, victims, p, max(1.0, deadline - time.time()), log_path)
                    say(f"[demo] the restarted rank(s) {victims} hung in their restore ({args.restore_hang}): "
                        f"the agents must find it after hang.restore_s={cfg.hang.restore_s:g} s and end it")
        if args.second_failure and kill_time is not None:
            known = {r["pid"] for r in _all_records(run_dir, "progress")} | set(killed_pids)
            second = kill_during_recovery(run_dir, cfg.cluster.nodes, known, set(lost_nodes) | {victims[0] // rpn},
                                          args.second_delay, deadline, p, log_path, args.iters)
            if second is None:
                say(f"[demo] no second failure: the job trained its last iteration within {args.second_delay} s "
                    f"of the restarted trainer's start")
            else:
                say(f"[demo] second failure during the recovery: SIGKILL -> restarted trainer pid {second[1]} on "
                    f"node {second[0]}, {args.second_delay} s after it started")
        wait_job(p, args.timeout, "megatron-ft run", log_path)
        for r, rlog in replacements:
            wait_job(r, args.timeout, "standby node" if args.standby else "replacement node", rlog)
    finally:
        killed = False
        for proc in (p, *(r for r, _ in replacements)):
            if proc is not None and proc.poll() is None:
                _kill_tree(proc)
                killed = True
        if killed:  # its agents were SIGKILLed too: their segments are this demo's to remove
            for name in os.listdir(cfg.agent.shm_dir):
                if name.startswith(f"mft.{cfg.run_id}."):
                    os.unlink(os.path.join(cfg.agent.shm_dir, name))
    run_seconds = time.time() - t0

    # 3. results. torchrun's restart counters differ between nodes (only the failed node's counts),
    # so "before" and "after" the failure are told apart by trainer lives (process and in-process
    # attempt): the lives that logged progress before the kill are the first, every other came after.
    progress = _all_records(run_dir, "progress")
    first_lives = {life(r) for r in progress if kill_time is not None and r["time"] <= kill_time}
    last_before_kill = max((r["iteration"] for r in progress if life(r) in first_lives), default=0)
    events = _all_records(run_dir, "events")
    after = [e for e in events
             if e.get("event") == "restore" and kill_time is not None and life(e) not in first_lives]
    # what the failed ranks recovered from (the others restore their own local copy)
    # the guard's loss check rolled back these lives' restored steps (they exited; their restarts restored older ones)
    rollback_events = [e for e in events if e.get("event") == "rollback"]
    refused = {e["step"] for e in rollback_events}
    sources = sorted({e["source"] for e in after if not victims or e["rank"] in victims})
    recovered_from = sources[0] if len(sources) == 1 else ("none" if not sources else "+".join(sources))
    resumed = max((e["step"] for e in after if e["step"] not in refused), default=-1)
    recovery_seconds = None
    # the restarted processes are those whose restore came after the kill (a rank that had not yet
    # logged progress when the kill landed is not a restarted one)
    restarted_lives = {life(e) for e in after if e["time"] > (kill_time or 0)}
    restarted = [r["time"] for r in progress if kill_time is not None and life(r) in restarted_lives
                 and r["time"] > kill_time]
    if restarted:
        recovery_seconds = round(min(restarted) - kill_time, 3)
    breakdown = recovery_breakdown(after, progress, kill_time) if kill_time is not None else None
    first_gen = [r["time"] for r in progress if kill_time is None or life(r) in first_lives]
    start_seconds = round(min(first_gen) - t0, 3) if first_gen else None
    if looking is not None:
        looking.join(60)
    identical, problems = compare(ref_dir, run_dir, world, {life(e): e["step"] for e in rollback_events})
    hangs = [e for e in events if e.get("event") == "hang"]
    verdict_time = min((e["time"] for e in hangs), default=None)
    hang_detected_s = (round(verdict_time - hang_time, 3)
                       if verdict_time is not None and hang_time is not None and args.fail in HANG_SCENARIOS else None)
    # the verdict -> the job's next completed iteration (the stalled job completes none in between)
    after_verdict_s = (round(min(r["time"] for r in progress if r["time"] > verdict_time) - verdict_time, 3)
                       if hang_detected_s is not None and any(r["time"] > verdict_time for r in progress) else None)
    expected_hangs = sorted(victims) if args.fail in HANG_SCENARIOS and hang_time is not None else []
    hang_ok = sorted(e["rank"] for e in hangs) == expected_hangs
    if not hang_ok and expected_hangs:
        problems.append(f"hang verdicts on rank(s) {sorted(e['rank'] for e in hangs)}, want exactly one on each of "
                        f"{expected_hangs}")
    elif not hang_ok:
        problems.append(f"false hang verdict(s): {[(e['rank'], e['phase'], e['quiet_s']) for e in hangs]}")
    # no failure: one life per rank (a restart would mean something was judged failed)
    lives: dict[int, set] = {}
    for r in progress:
        lives.setdefault(r["rank"], set()).add(life(r))
    restarted_ranks = sorted(r for r, ls in lives.items() if len(ls) > 1) if args.fail in NO_FAILURE else []
    if restarted_ranks:
        problems.append(f"rank(s) {restarted_ranks} restarted in a run without a failure")
    expected_verdicts = set(lost_nodes) | ({agent_killed[0]} if agent_killed is not None else set())
    false_verdicts = unexpected_verdicts(run_dir, expected_verdicts)
    pause_outcome = None
    if paused:  # either the node is not judged and trains through, or it is judged lost and its ranks recovered
        judged = [v for v in false_verdicts if v.startswith(f"node {paused['node']} ")]
        moved = [r for r in victims if len(lives.get(r, ())) > 1]
        if judged and not moved and paused["node"] in withdrawn_verdicts(run_dir):
            judged, pause_outcome = [], "trained through"  # the root withdrew it once the agent ran again
            false_verdicts = [v for v in false_verdicts if not v.startswith(f"node {paused['node']} ")]
        pause_outcome = PAUSE_OUTCOMES[(bool(judged), bool(moved))]
        if judged and moved:  # the verdict was acted on: not a false one
            false_verdicts = [v for v in false_verdicts if v not in judged]
        elif judged or moved:
            problems.append(f"agent paused {paused['seconds']} s: {pause_outcome} (verdicts {judged}, ranks "
                            f"restarted {moved})")
    problems += [f"false failure verdict: {v}" for v in false_verdicts]
    problems += [f"off the port plan: {x}" for x in (listeners or {}).get("off_plan", [])]
    problems += [f"an outsider was served: {x}" for x in (stranger or {}).get("served", [])]
    promise = None
    if kill_time is not None:
        failure = ("corrupt" if args.kill_point in DAMAGE_POINTS else "hang" if args.fail == "hang-in-restore"
                   else args.fail)
        if lost_nodes:
            from ..redundancy.plan import plan_from_config

            promise = tiers.promised("node", cfg.redundancy.scheme,
                                     beyond_tolerance=not plan_from_config(cfg).survives(lost_nodes))
            if promise in ("peer_memory", "decoded") and not any(complete_at_loss.values()):
                promise = "none"  # lost before its group completed any version: nothing in memory to rebuild
        else:
            promise = tiers.promised(failure, cfg.redundancy.scheme)
    unprotected = False
    if protected_from is not None:  # the restarted agent must have protected the steps after its restart
        last_restore = {}
        for e in sorted(after, key=lambda e: e["time"]):
            if e["rank"] in victims:
                last_restore[e["rank"]] = e["step"]
        if not last_restore or min(last_restore.values()) < protected_from:
            unprotected = True
            problems.append(f"the restarted agent did not protect the steps after its restart: the node's trainers "
                            f"resumed from step(s) {sorted(set(last_restore.values()))}, want >= {protected_from}")
    # from disk, at least the newest step persisted whole before the loss (a node's loss without redundancy):
    # a newer one the survivors' agents finished writing after it (the lost nodes' files already written) is
    # as good; with none persisted whole yet, a fresh start is all there is
    want_step = max((s for s in persisted_at_kill if s <= last_before_kill), default=None)
    if promise == "disk" and want_step is None:
        promise = "none"
    step_ok = not (kill_time is not None and recovered_from == "disk" and want_step is not None
                   and resumed < want_step)
    if not step_ok:
        problems.append(f"resumed from persisted step {resumed}, but step {want_step} was persisted whole "
                        f"before the failure")
    # recovery.prefer: certified - the restore takes a certified version, at least the newest one certified
    # before the failure (a later certification may land while the kill does) - from memory: the peers keep
    # their blocks of it too; a loss beyond the redundancy goes to disk, where it need not be
    certified_at_kill = max((e["step"] for e in events if e.get("event") == "certified" and kill_time is not None
                             and e["time"] <= kill_time), default=None)
    if (eff_cfg.recovery.prefer == "certified" and kill_time is not None and certified_at_kill is not None and after
            and recovered_from not in ("disk", "none")):
        uncertified = sorted({e["step"] for e in after if e.get("certified") is not True})
        if uncertified or resumed < certified_at_kill:
            step_ok = False
            problems.append(f"recovery.prefer: certified, step {certified_at_kill} certified before the failure, "
                            f"but the job resumed from step {resumed}" +
                            (f" (not certified: step(s) {uncertified})" if uncertified else ""))
    # from peer memory, at least the newest step every lost node's agent had seen complete in its group (its
    # log is final): the survivors hold those copies. A survivor may have seen a newer one complete that the
    # lost agent never heard of, so this is a floor, not the step itself. How far it trails the failure is
    # the transfers' lag - a loaded machine lengthens it - not a fault.
    held_at_loss = (min(max(v) for v in complete_at_loss.values())
                    if complete_at_loss and all(complete_at_loss.values()) else None)
    if (kill_time is not None and recovered_from in ("peer_memory", "decoded") and held_at_loss is not None
            and not refused and eff_cfg.recovery.prefer == "newest" and resumed < held_at_loss):
        step_ok = False
        problems.append(f"resumed from step {resumed} out of peer memory, but step {held_at_loss} was complete "
                        f"in the lost node's group before the failure")
    summary = {
        "scenario": args.fail,
        "megatron_lm_series": series if args.megatron_lm else None,
        "promised_tier": promise,
        "tier_ok": bool(promise in (None, "none") or (recovered_from != "none" and tiers.meets(recovered_from, promise)))
        and step_ok and not unprotected,
        "newest_persisted_before_failure": want_step,
        "group_complete_at_loss": {str(n): v for n, v in complete_at_loss.items()} if lost_nodes else None,
        "newest_complete_at_loss": held_at_loss,
        "certified_before_failure": certified_at_kill,
        "transport": cfg.redundancy.transport if cfg.redundancy.scheme != "none" else None,
        "recovered_from": recovered_from if args.fail != "none" else "none",
        "resumed_step": resumed,
        "lost_iterations": (last_before_kill - resumed) if kill_time is not None and resumed >= 0 else
        (last_before_kill if kill_time is not None else 0),
        "recovery_seconds": recovery_seconds,
        # --fail hang: the stop -> the agent's verdict (and SIGKILL); the recovery follows it
        # (hang-in-restore: the restarted victim reaching its restore -> the verdict)
        "hang_detected_s": hang_detected_s,
        "hang_verdicts": [{k: e[k] for k in ("rank", "phase", "quiet_s", "bound_s", "iteration_p99_s")} for e in hangs],
        "hang_ok": hang_ok,
        "recovery_seconds_after_verdict": after_verdict_s,
        "hang_to_iteration_s": round(hang_detected_s + after_verdict_s, 3)
        if hang_detected_s is not None and after_verdict_s is not None else None,
        "restarted_ranks": restarted_ranks,
        "slowed": slowed or None,
        "agent_paused": paused or None,
        "agent_pause_outcome": pause_outcome,
        "restore_seconds": round(max((e["seconds"] for e in after), default=0.0), 4),
        # restored versions the guard refused (NaN or Inf in bytes that verified): every rank rolled back
        # or whose losses after the restore failed it (every rank dropped the version and restarted)
        "rollbacks": max((e.get("rollbacks", 0) for e in after), default=0) + len(refused),
        "recovery_breakdown": breakdown,
        # how the restarted trainers came: a fast restart round beneath torchrun (warm spares), or
        # torchrun's own restart of its workers (its restart count)
        "restarted_by": restarted_by(after) if kill_time is not None else None,
        # ranks whose trainer survived and rejoined in its own process (in-process restart)
        "kept_in_place": sorted({e["rank"] for e in after if life(e)[1] > 0}),
        # ranks whose restore went into weights built uninitialised (the restore overwrote them)
        "built_uninitialised": sorted({e["rank"] for e in after if e.get("weights_initialised") is False}),
        "cold_start_seconds": cold_start_seconds,
        "start_seconds": start_seconds,
        "warm_spares": cfg.launch.warm_spares,
        "recovery_vs_cold_start": round(recovery_seconds / cold_start_seconds, 3)
        if recovery_seconds and cold_start_seconds else None,
        "bitwise_identical": identical,
        # the training-visible stall per snapshot against a raw copy of the same bytes
        "snapshot_stall": snapshot_stall(run_dir),
        "false_verdicts": false_verdicts,
        "kill_point": args.kill_point if kill_time is not None else None,
        "agent_killed": agent_killed is not None,
        "lost_nodes": lost_nodes,
        "second_failure": {"node": second[0], "pid": second[1], "after_first_s": round(second[2] - kill_time, 2)}
        if second else None,
        "standby": bool(args.standby),
        "killed_after_iteration": args.kill_at if kill_time is not None else None,
        "last_iteration_before_kill": last_before_kill if kill_time is not None else None,
        "iterations": args.iters,
        "world_size": world,
        "reference_seconds": round(ref_seconds, 1),
        "run_seconds": round(run_seconds, 1),
        "problems": problems[:10],
        "workdir": workdir,
    }
    if slurm is not None:
        lost = dict(slurm_lost)
        if lost:  # Slurm's own clock: the host was marked DOWN no later than the job ended
            end = slurm.job_end(p.job_id)
            lost["job_end"] = end
            lost["during_the_job"] = bool(lost["since"] and end and lost["since"] <= end)
        summary["slurm"] = {"job": p.job_id, "lost_node": lost or None}
    if listeners is not None:  # hosts of their own: megatron-ft's servers seen before the failure
        summary["listeners"] = listeners
    if stranger is not None:
        summary["stranger"] = stranger
    say("")
    say("=" * 72)
    say(f" scenario            : {args.fail}")
    if kill_time is not None:
        say(f" killed              : rank(s) {victims} after iteration {args.kill_at} "
            f"(job had reached {last_before_kill})")
        say(f" recovered from      : {summary['recovered_from']} (step {resumed}, "
            f"{summary['lost_iterations']} iteration(s) lost); promised: {promise} or better -> "
            f"{'OK' if summary['tier_ok'] else 'WRONG TIER'}")
        if summary["hang_detected_s"] is not None:
            v = summary["hang_verdicts"][0]
            say(f" hang found          : {summary['hang_detected_s']} s after the hang (rank {v['rank']} quiet "
                f"{v['quiet_s']} s in {v['phase']}; bound {v['bound_s']} s from the iteration p99 "
                f"{v['iteration_p99_s']} s); then SIGKILL and the normal recovery")
        if summary["rollbacks"]:
            say(f" rolled back         : {summary['rollbacks']} restored version(s) refused by the guard "
                f"(NaN or Inf in bytes that verified, or losses after the restore)")
        say(f" recovery            : {recovery_seconds} s kill -> first iteration after restart "
            f"(restore itself {summary['restore_seconds']} s); the job's cold start (reference run, no warm "
            f"spares) {cold_start_seconds} s launch -> first iteration, so {summary['recovery_vs_cold_start']}x")
        kept = summary["kept_in_place"]
        say(f"   restarted by       : {summary['restarted_by']}"
            + (f" (ranks {kept} kept in their processes" + (
                f", {summary['built_uninitialised']} with their weights built uninitialised for the restore)"
                if summary["built_uninitialised"] else ")") if kept else ""))
        if breakdown:
            say("   where it went      : " + ", ".join(f"{BREAKDOWN_NAMES[k]} {v:.2f} s" for k, v in breakdown.items()
                                                   if v is not None))
    if slowed:
        say(f" slowed              : rank {victims[0]} stopped {slowed['stop_s']:g} s of every {slowed['period_s']:g} s, "
            f"{slowed['cycles']} times over {slowed['seconds']} s; hang verdicts: {len(hangs)}, restarts: "
            f"{restarted_ranks or 'none'}")
    if paused:
        say(f" agent paused        : node {paused['node']}'s agent stopped {paused['seconds']} s "
            f"(health.timeout_s={cfg.health.timeout_s:g} s): {pause_outcome}")
    say(f" bitwise identical   : {identical}  (final model, optimizer, scheduler, RNG of {world} ranks; "
        f"every iteration's loss)")
    st = summary["snapshot_stall"]
    if st:
        say(f" snapshot stall      : {st['stall_median_s'] * 1e3:.2f} ms per snapshot (median, slowest rank; largest "
            f"{st['stall_max_s'] * 1e3:.1f} ms) for {st['bytes_per_rank']} bytes per rank, a raw copy of which takes "
            f"{st['raw_copy_s'] * 1e3:.2f} ms: {st['stall_vs_raw_copy']}x"
            + (f"; Megatron's whole save call {st['megatron_save_median_s'] * 1e3:.1f} ms (its state dict and ours)"
               if "megatron_save_median_s" in st else ""))
        if st["raw_copy_s"] < 1e-3:
            say("   (a copy this small takes microseconds: the ratio shows the fixed cost of taking a snapshot, not "
                "a copy's; a state of hundreds of MB per rank gives the figure that means something)")
    for pr in problems[:10]:
        say(f"   ! {pr}")
    say("=" * 72)
    return summary


VERDICT_LINE = re.compile(r"root: node (\d+) (.*): hardware failure")
WITHDRAWN_LINE = re.compile(r"root: node (\d+)'s agent \(pid \d+\) runs again after its failure verdict.*withdrawn")


def withdrawn_verdicts(run_dir: str) -> set[int]:
    """The nodes whose failure verdict a root withdrew (their judged agent ran again and nobody had
    claimed the node: ``megatron_ft.health.monitor``), from the agents' logs."""
    out = set()
    for path in sorted(glob.glob(os.path.join(run_dir, "node*", "agent.log"))):
        with open(path, errors="replace") as f:
            out |= {int(m.group(1)) for m in WITHDRAWN_LINE.finditer(f.read())}
    return out


def unexpected_verdicts(run_dir: str, expected: set[int]) -> list[str]:
    """The root agents' failure verdicts (their logs) on nodes this run did not take down: a live node
    judged failed, e.g. a heartbeat late under load."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "node*", "agent.log"))):
        with open(path, errors="replace") as f:
            for line in f:
                m = VERDICT_LINE.search(line)
                if m and int(m.group(1)) not in expected:
                    out.append(f"node {m.group(1)} ({m.group(2)}; {os.path.basename(os.path.dirname(path))}'s log)")
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="kill trainers mid-run, recover from memory, compare bit for bit")
    p.add_argument("--config", default=None, help="job YAML (default: embedded configs/local-cpu.yaml)")
    p.add_argument("--fail", choices=["trainer", "hang", "hang-in-restore", "slow", "all-trainers", "agent",
                                      "agent-pause", "launcher", "node", "two-nodes", "none"],
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
    p.add_argument("--redundancy", choices=sorted(DEMO_SHAPES), default=None,
                   help="peer redundancy for the run, with a cluster shape that shows it (see DEMO_SHAPES)")
    p.add_argument("--transport", choices=["agent", "scheduled"], default="agent",
                   help="who sends the peer copies (with --redundancy replica): the agents, or the trainers in "
                        "planned chunks inside the training timeline's idle time")
    p.add_argument("--schedule-mode", choices=list(ftconfig.ScheduleConfig.MODES), default="pipelined",
                   help="--transport scheduled: when the chunks go (docs/scheduling.md)")
    p.add_argument("--kill-at", type=int, default=12, help="kill after the victim finished this iteration")
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
    p.add_argument("--hosts", action="store_true",
                   help="run every node on a host of its own (root: network, mount and UTS namespaces; "
                        "megatron_ft/testing/hosts.py): its own address and name, /dev/shm and link")
    p.add_argument("--slurm", action="store_true",
                   help="with --hosts: a real Slurm on the hosts (munge, slurmctld on an extra host, a slurmd per "
                        "host; megatron_ft/testing/slurm.py) runs the job as one sbatch job, srun starting a "
                        "launcher per host (with --standby the allocation's extra host is the standby)")
    p.add_argument("--host-shm-mib", type=int, default=512, help="--hosts: each host's /dev/shm")
    p.add_argument("--link-rate", default=None, help="--hosts: every link's rate (tc tbf, e.g. 100mbit)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
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
    def stop(signum, frame):  # SIGTERM (e.g. a timeout): unwind, so run_demo's cleanup kills the jobs
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    from .megatron_lm import UpstreamImportError

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
