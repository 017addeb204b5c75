"""The demo's processes: the training program and its command, the job launched (simulated nodes on
this machine, a launcher per host of the multi-host bed, or one Slurm batch job), waited for and
killed, and the primitives a failure scenario injects with (a node lost, a replacement or standby
started, a process slowed or paused, a trainer of the restarted generation killed) and waits on (an
iteration, an injected fault, a step complete in the redundancy groups).

Each primitive does one thing to the job and returns what it did; which of them a failure uses, and
when, is the scenario's (:mod:`megatron_ft.testing.demo_scenarios`)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import yaml

from . import faults
from .. import clock
from .. import config as ftconfig
from .. import rank_files
from ..agent.protocol import socket_path
from ..spares.pool import socket_path as spares_socket_path
from .demo_results import _all_records
from .helpers import read_jsonl, sigkill_each
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
    pids = sigkill_each(trainer_pids)
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


def _ask_for_stacks(p: "subprocess.Popen | JobOnHosts", settle_s: float = 2.0) -> None:
    """A job that outlived its bound, about to be killed: every process of it on this machine asked for
    its threads' stacks (SIGUSR1: the trainers write them into the job's log and end, the agents write
    them and go on; a process without the handler ends, as it was about to), then ``settle_s`` for them
    to be written."""
    import psutil

    if not isinstance(p, subprocess.Popen):
        return
    try:
        procs = psutil.Process(p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for c in procs:
        try:
            c.send_signal(signal.SIGUSR1)
        except psutil.NoSuchProcess:
            pass
    clock.pause(settle_s)


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
        _ask_for_stacks(p)
        _kill_tree(p)
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s (every process's stacks asked "
                           f"for with SIGUSR1 first); log: {log_path}")
    except BaseException:  # interrupted (SIGINT, SIGTERM): never leave the job running
        _kill_tree(p)
        raise
    if rc != 0:
        tail = open(log_path, errors="replace").read()[-3000:]
        raise RuntimeError(f"{what} failed with exit code {rc}; log {log_path}:\n{tail}")


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
