"""``megatron-ft launch``: per node, start the snapshot agent, then a real torchrun elastic agent.

::

    megatron-ft launch --nodes 2 --nproc-per-node 2 [--node-rank I] [--config F] -- script.py args...
    megatron-ft launch --standby --nodes 2 --config F -- script.py args...

With ``--standby`` this process is a spare machine: it polls the agents' store (docs/health.md)
for the root agent's ``failed/<node>`` verdict, claims that node with a compare-and-set of
``claim/<node>/<failed agent pid>/<verdict time>`` and then runs as that node's launcher (below).

With ``--node-rank I`` this process is node I's launcher (one per machine). Without it, all N
nodes are simulated on this machine: N launcher instances share a c10d rendezvous on loopback
(the first hosts it), each with its own agent and its own shared memory.

A node's launcher:

1. starts the agent in its own session (it outlives every trainer and is nobody's child but
   the launcher's) and waits for its socket;
2. runs ``torchrun --rdzv-backend c10d --max-restarts R`` with ``MFT_NODE_RANK``, ``MFT_CONFIG``,
   ``MFT_RUN_ID`` and ``MFT_AGENT_SOCKET`` in the workers' environment (trainers derive a stable
   rank ``node_rank * nproc_per_node + local_rank`` from them, so a restarted worker finds its
   own snapshots on its own node);
3. restarts the agent if it dies while training runs (the new agent re-adopts the shared memory);
4. when torchrun ends, asks the agent to shut down cleanly (segments removed) and returns
   torchrun's exit code.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

import psutil
import yaml

from . import clock
from . import config as ftconfig
from . import fatal
from . import network, scheduler
from .agent import shm
from .clock import Deadline
from .agent.protocol import AgentClient, AgentError, socket_path
from .health import progress as hp
from .health.monitor import stood_down_path
from .rendezvous import (FatalWatch, JobEnded, NodeOwners, RdzvGeneration, Rendezvous,  # noqa: F401 (re-exported)
                         claim_failed_node)
from .spares import prestart
from .spares.lifetime import die_with_parent
from .trainer.in_process import nccl_env_defaults
from .transport import credential

#: set in the trainers' environment unless it already sets them: none by default. ``TORCH_GLOO_LAZY_INIT=1``
#: (a gloo group connects a pair of its ranks on their first operation together instead of a full mesh
#: when the group is made) is the operator's choice, not set here: measured with torch 2.13, a collective
#: that needs a pair to a peer that died before the pair connected waits out the group's whole timeout
#: (Megatron's: 10 minutes) instead of failing at once, and a chaos trial hung on it (docs/architecture.md,
#: "At scale: groups")
GLOO_ENV_DEFAULTS: dict[str, str] = {}


def _write_config(cfg: ftconfig.FTConfig, path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    return path


class NodeLauncher:
    def __init__(self, cfg: ftconfig.FTConfig, cfg_path: str, node: int, nodes: int, nproc: int,
                 script: list[str], run_dir: str, log=print):
        self.cfg, self.cfg_path, self.node, self.nodes, self.nproc = cfg, cfg_path, node, nodes, nproc
        self.script = script
        self.run_dir = run_dir
        self.node_dir = os.path.join(run_dir, f"node{node}")
        os.makedirs(self.node_dir, exist_ok=True)
        self.sock = socket_path(cfg.agent.socket_dir, cfg.run_id, node)
        self.agent: Optional[subprocess.Popen] = None
        self.torchrun: Optional[subprocess.Popen] = None
        self.agent_restarts = 0
        self.log = log
        self.rendezvous = Rendezvous(cfg, node)
        self.rdzv = self.rendezvous.initial()
        # another node's fatal record, seen on the job record (a job with a store), and this node's own
        self.fatal_watch: Optional[FatalWatch] = None
        self._fatal: Optional[tuple[int, str, int]] = None
        self.pool: Optional[subprocess.Popen] = None  # warm spare trainers (launch.warm_spares)
        self.pool_socket: Optional[str] = None
        # a standby's agent and torchrun, started while it waited (spares.prestart; see run_standby)
        self.waiting_agent: Optional[subprocess.Popen] = None
        self.waiting_torchrun: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ the job's end by a fatal record
    def fatal_now(self) -> Optional[tuple[int, str, int]]:
        """(node, message, exit code) of the record that ends the job, if any: this node's own file (one
        file: a trainer here ended the job; put into the store once, for the others), else what
        :class:`FatalWatch` saw in the job record. A job with no store (one node) reads the run
        directory's records (its own node's). Called every 0.2 s: no scan of every node's directory."""
        if self._fatal is not None:
            return self._fatal
        own = fatal.read_node(self.run_dir, self.node)
        if own is not None:
            self._fatal = (self.node, own[0], own[1])
            self.rendezvous.record_fatal(own[0], own[1])
        elif self.fatal_watch is not None:
            self._fatal = self.fatal_watch.seen
        elif self.rendezvous.store is None and (f := fatal.read(self.run_dir)) is not None:
            self._fatal = (f[0], f[1], fatal.exit_code(self.run_dir))
        return self._fatal

    def fatal_at_end(self) -> Optional[tuple[int, str, int]]:
        """As :meth:`fatal_now`, and once (the end of a torchrun) the run directory's records of every node
        (simulated nodes and a shared run directory: a record the store lost with its root)."""
        if (f := self.fatal_now()) is not None:
            return f
        if (g := fatal.read(self.run_dir)) is not None:
            self._fatal = (g[0], g[1], fatal.exit_code(self.run_dir))
        return self._fatal

    # ------------------------------------------------------------------ warm spares
    def start_pool(self) -> None:
        """The node's warm spare trainers, warm before torchrun starts (bounded by
        ``launch.start_timeout_s``); without them the trainers start cold, as they would anyway."""
        from .spares import pool

        if self.pool is None:  # else a standby's, started while it waited
            if not self.cfg.launch.warm_spares:
                return
            self.pool_socket = pool.socket_path(self.cfg.agent.socket_dir, self.cfg.run_id, self.node)
            self.pool = pool.start(self.pool_socket, os.path.join(self.node_dir, "spares.log"),
                                   pool.imports_for(self.script), pool.own_trees(self.script))
            with open(os.path.join(self.node_dir, "spares.pid"), "w") as f:
                f.write(str(self.pool.pid))
        why = pool.wait_warm(self.pool, self.pool_socket or "", self.cfg.launch.start_timeout_s)
        if why:
            self.log(f"[launch n{self.node}] {why}; trainers start cold")
            self.pool = None

    def stop_pool(self) -> None:
        if self.pool is not None:
            from .spares import pool

            pool.stop(self.pool, self.pool_socket or "")
            self.pool = None

    # ------------------------------------------------------------------ agent
    def adopt_agent(self) -> bool:
        """A restarted launcher: take over this node's agent if the previous launcher's is still
        alive (it waits ``launch.start_timeout_s`` for this), so its slots serve the restarted
        trainers from local memory."""
        try:
            with open(os.path.join(self.node_dir, "agent.pid")) as f:
                pid = int(f.read())
            proc = psutil.Process(pid)
            if "megatron_ft.agent" not in " ".join(proc.cmdline()) or not os.path.exists(self.sock):
                return False
            c = AgentClient(self.sock, self.cfg.agent.request_timeout_s)
            try:
                c.connect({"rank": -1, "local_rank": -1, "pid": os.getpid(), "run_id": self.cfg.run_id})
                c.request("adopt", launcher_pid=os.getpid())
            finally:
                c.close(orderly=True)
        except (OSError, ValueError, psutil.Error, AgentError):
            return False
        self.agent = _AdoptedProcess(proc)
        self.log(f"[launch n{self.node}] adopted the running agent (pid {pid}) and its slots")
        return True

    def start_agent(self) -> None:
        if self.adopt_agent():
            return
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass
        args = ["--config", self.cfg_path, "--node", str(self.node), "--launcher-pid", str(os.getpid())]
        log_path = os.path.join(self.node_dir, "agent.log")
        waiting, self.waiting_agent = self.waiting_agent, None
        # the launcher's environment as a cold start would inherit it (a standby's MFT_NODE_HOST among it)
        env = dict(os.environ, MFT_RUN_DIR=self.run_dir)  # its events (hang verdicts) beside the trainers'
        if waiting is not None and prestart.hand_over(waiting, args, env=env, log=log_path):
            self.agent = waiting
        else:
            with open(log_path, "ab") as logf:
                self.agent = subprocess.Popen([sys.executable, "-m", "megatron_ft.agent", *args], env=env,
                                              stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        with open(os.path.join(self.node_dir, "agent.pid"), "w") as f:
            f.write(str(self.agent.pid))
        limit = self.cfg.launch.start_timeout_s
        deadline = Deadline(limit, f"node {self.node}'s agent")
        while not os.path.exists(self.sock):
            if self.agent.poll() is not None:
                raise AgentStartError(f"node {self.node}: its agent exited with {self.agent.returncode} at start-up; "
                                      f"see {self.node_dir}/agent.log")
            if deadline.expired():
                self.kill_agent()
                raise AgentStartError(f"node {self.node}: its agent did not open {self.sock} within "
                                      f"launch.start_timeout_s={limit:g} s; see {self.node_dir}/agent.log")
            if (f := self.fatal_now()) is not None:
                self.kill_agent()
                raise AgentStartError(f"node {f[0]} ended the job: {f[1]}")
            deadline.pause(0.05)

    def kill_agent(self) -> None:
        """SIGKILL the agent while the job ends, and unlink what it held in shared memory: a killed
        agent cannot (the segments of this run and node; nothing else adopts them once the job ends)."""
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()
        left = shm.remove_node_segments(self.cfg.agent.shm_dir, self.cfg.run_id, self.node)
        if left:
            self.log(f"[launch n{self.node}] removed {len(left)} shared-memory segment(s) of the killed agent")

    def stop_agent(self) -> None:
        if self.agent is None or self.agent.poll() is not None:
            return
        try:
            c = AgentClient(self.sock, self.cfg.agent.request_timeout_s)
            c.connect({"rank": -1, "local_rank": -1, "pid": os.getpid(), "run_id": self.cfg.run_id})
            c.request("shutdown")
            c.close(orderly=False)
            self.agent.wait(timeout=300)
        except Exception:
            self.agent.terminate()
            try:
                self.agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill_agent()

    # ------------------------------------------------------------------ torchrun
    def torchrun_cmd(self) -> list[str]:
        lc = self.cfg.launch
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nodes}", f"--nproc-per-node={self.nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv.addr}:{self.rdzv.port}",
            f"--rdzv-id={self.cfg.run_id}-g{self.rdzv.gen}",
            # a node that never arrives ends the rendezvous after launch.start_timeout_s, not 15 minutes
            f"--rdzv-conf=is_host={'true' if self.node == self.rdzv.node else 'false'},"
            f"join_timeout={max(1, int(lc.start_timeout_s))},"
            f"keep_alive_interval={lc.rdzv_keep_alive_s},keep_alive_max_attempt={lc.rdzv_keep_alive_attempts}",
            f"--max-restarts={lc.max_restarts}", "--monitor-interval=0.1",
            # with warm spares torchrun's workers are stand-ins for trainers forked from the pool
            *(["-m", "megatron_ft.spares.worker"] if self.pool is not None else []),
            *self.script,
        ]

    def run(self) -> int:
        rc: Optional[int] = None
        try:
            rc = self._run()
            return rc
        except KeyboardInterrupt:  # stopped outside torchrun's watch (starting, between generations)
            self._stop_torchrun()
            self.rendezvous.record_end(130)
            self.stop_agent()
            rc = 130
            return rc
        finally:
            self.stop_pool()
            if self.fatal_watch is not None:
                self.fatal_watch.stop()
            if self.rendezvous is not None and rc != fatal.EXIT_STOOD_DOWN:  # the job goes on without this node
                self.rendezvous.record_end(rc)

    def _run(self) -> int:
        with open(os.path.join(self.node_dir, "launcher.pid"), "w") as f:
            f.write(str(os.getpid()))
        for old in (fatal.record_path(self.run_dir, self.node), stood_down_path(self.run_dir, self.node)):
            try:  # a record of an earlier run in this directory
                os.unlink(old)
            except FileNotFoundError:
                pass
        problem = preflight(self.cfg) or network.node_address_problem(self.cfg, self.node)
        if self.rendezvous.store is not None:
            self.fatal_watch = FatalWatch(self.cfg).start()
        if problem:
            return self._end_job(problem)
        try:
            self.start_agent()
        except AgentStartError as e:
            return self._end_job(str(e))
        self.start_pool()
        env = network.trainer_env(self.cfg, dict(os.environ))  # GLOO/NCCL_SOCKET_IFNAME: network.interface
        env.update(MFT_NODE_RANK=str(self.node), MFT_CONFIG=self.cfg_path,
                   MFT_RUN_ID=self.cfg.run_id, MFT_AGENT_SOCKET=self.sock, MFT_RUN_DIR=self.run_dir,
                   # a fresh worker store per rendezvous round (see megatron_ft/trainer/distributed.py), at
                   # launch.trainer_port rather than torchrun's ephemeral MASTER_PORT
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", MFT_TRAINER_PORT=str(self.cfg.launch.trainer_port),
                   # how long a trainer looks for its round's store (a round whose host is gone never forms)
                   MFT_JOIN_TIMEOUT_S=str(self.cfg.launch.start_timeout_s))
        if self.cfg.hang.enabled:  # where each trainer says where it is, from its start (the hang watch)
            env[hp.ENV] = hp.board_path(self.cfg.agent.shm_dir, self.cfg.run_id, self.node)
        for var, value in GLOO_ENV_DEFAULTS.items():  # torchrun passes them on to its workers
            env.setdefault(var, value)  # a value of the user's environment wins
        env.pop("MFT_TORCHRUN_RANK", None)  # set by each trainer for itself (megatron_ft.megatron.upstream)
        env.pop("MFT_IN_PROCESS_GRACE_S", None)  # set below when in-process restart is on
        env.pop("MFT_IN_PROCESS_FD", None)
        if self.pool is not None:
            env["MFT_SPARES_SOCKET"] = self.pool_socket or ""
            env["MFT_FAST_RESTARTS"] = str(self.cfg.launch.fast_restarts if self.cfg.launch.max_restarts else 0)
            if self.cfg.launch.in_process_restart:
                env["MFT_IN_PROCESS_GRACE_S"] = str(self.cfg.launch.in_process_grace_s)
                for var, value in nccl_env_defaults(True).items():  # torchrun passes them on to its workers
                    env.setdefault(var, value)  # a value of the user's environment wins
        self.rdzv = self.rendezvous.current(self.log)
        self.log(f"[launch n{self.node}] rendezvous generation {self.rdzv.gen} hosted by node {self.rdzv.node} at "
                 f"{self.rdzv.addr}:{self.rdzv.port}")
        while True:
            self.rendezvous.begin(self.rdzv)
            rc = self._run_torchrun(env)
            if rc == fatal.EXIT_STOOD_DOWN:
                return rc
            if rc is None:  # fatal or interrupted: the job is over
                return f[2] if (f := self.fatal_at_end()) is not None else 130
            if rc == 0 or self.fatal_at_end() is not None:
                break
            nxt = self.rendezvous.after_failure(self.rdzv, self.log)
            if nxt is None:
                break
            self.log(f"[launch n{self.node}] the rendezvous host (node {self.rdzv.node}) is gone; joining "
                     f"generation {nxt.gen} hosted by node {nxt.node} at {nxt.addr}:{nxt.port}")
            self.rdzv = nxt
        self.rendezvous.record_end(rc)  # while this node's agent (maybe the store's root) still runs
        self.stop_agent()
        if (f := self.fatal_at_end()) is not None:  # a trainer ended the job as torchrun exited
            return self._end_job(f"node {f[0]}: {f[1]}", record=False)
        return rc

    def _run_torchrun(self, env: dict) -> Optional[int]:
        """One torchrun for the current rendezvous generation; its exit code, or None when the job
        ended (a fatal record, an interrupt) and the agent was stopped."""
        # torchrun (and so its workers) ends with this launcher; the agent waits for a new launcher
        cmd = self.torchrun_cmd()
        waiting, self.waiting_torchrun = self.waiting_torchrun, None
        if waiting is not None and prestart.hand_over(waiting, cmd[3:], env=env):
            self.torchrun = waiting
        else:
            self.torchrun = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        with open(os.path.join(self.node_dir, "torchrun.pid"), "w") as f:
            f.write(str(self.torchrun.pid))
        next_publish = Deadline(2.0, "the next look at the rendezvous record")
        try:
            while self.torchrun.poll() is None:
                if (f := self.fatal_now()) is not None:
                    self._stop_torchrun()
                    self.stop_agent()
                    self._end_job(f"node {f[0]}: {f[1]}", record=False)
                    return None
                if next_publish.expired():
                    self.rendezvous.keep_published(self.rdzv)
                    next_publish = Deadline(2.0, "the next look at the rendezvous record")
                if self.agent is not None and self.agent.poll() is not None and (
                        self.agent.poll() == fatal.EXIT_STOOD_DOWN or os.path.exists(stood_down_path(self.run_dir,
                                                                                                     self.node))):
                    self.log(f"[launch n{self.node}] the agent stood down: this node was judged lost while its "
                             f"agent did not run, and a standby took its place; ending this node's trainers")
                    self._stop_torchrun()
                    return fatal.EXIT_STOOD_DOWN
                if self.agent is not None and self.agent.poll() is not None:
                    self.agent_restarts += 1
                    self.log(f"[launch n{self.node}] agent died (exit {self.agent.returncode}); restarting it "
                             f"(restart {self.agent_restarts}), it re-adopts the node's shared memory")
                    try:
                        self.start_agent()
                    except AgentStartError as e:  # the node cannot protect its ranks: end the job, said once
                        self._stop_torchrun()
                        self.kill_agent()  # and unlink the segments the dead agent left
                        self._end_job(f"{e} (restarting it after it died mid-job)",
                                      record=self.fatal_now() is None)
                        return None
                clock.pause(0.2)  # supervising torchrun: the job's own length bounds this loop
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (stop_on_signals): the job is stopped on this node
            self.torchrun.send_signal(signal.SIGINT)
            self.torchrun.wait()
            self.rendezvous.record_end(130)  # while this node's agent (maybe the store's root) still runs
            self.stop_agent()
            return None
        return self.torchrun.returncode

    def _stop_torchrun(self) -> None:
        """SIGTERM torchrun (it stops its workers), SIGKILL after 30 s."""
        if self.torchrun is None or self.torchrun.poll() is not None:
            return
        self.torchrun.terminate()
        try:
            self.torchrun.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.torchrun.kill()
            self.torchrun.wait()

    def _end_job(self, message: str, record: bool = True) -> int:
        """This node cannot run (or another node said so): record it for the other launchers (the file
        and the store's ``fatal/<node>``), say why, and return the recorded exit code: the record that
        ended the job's (:meth:`fatal_at_end`)."""
        if record:
            fatal.write(self.run_dir, self.node, message)  # fatal_at_end puts it into the store
        self.log(f"[launch n{self.node}] job ended: {message}")
        f = self.fatal_at_end()
        return f[2] if f is not None else fatal.EXIT_CODE


class _AdoptedProcess:
    """The Popen verbs the launcher uses, for an agent it adopted (not its child)."""

    def __init__(self, proc: "psutil.Process"):
        self.proc, self.pid, self.returncode = proc, proc.pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None and not self.proc.is_running():
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        try:
            self.proc.wait(timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"agent pid {self.pid}", timeout or 0) from None
        except psutil.NoSuchProcess:
            pass
        self.returncode = -1 if self.returncode is None else self.returncode
        return self.returncode

    def terminate(self) -> None:
        try:
            self.proc.terminate()
        except psutil.NoSuchProcess:
            pass

    def kill(self) -> None:
        try:
            self.proc.kill()
        except psutil.NoSuchProcess:
            pass


class AgentStartError(RuntimeError):
    """A node's agent could not start."""


def preflight(cfg: ftconfig.FTConfig) -> Optional[str]:
    """What keeps this node from protecting its trainers, checked before anything starts (None: fine)."""
    from .transport.wire import private_directory

    try:  # the agent's and the spare pool's sockets: private to the job's user
        private_directory(cfg.agent.socket_dir)
    except OSError as e:
        return f"agent.socket_dir={cfg.agent.socket_dir!r} cannot hold the job's sockets: {e}"
    if not cfg.agent.required:
        return None
    d = cfg.agent.shm_dir
    if not os.path.isdir(d):
        return (f"agent.shm_dir={d!r} does not exist (or is not a directory): create it or point agent.shm_dir at a "
                f"tmpfs; agent.required: false trains unprotected")
    if not os.access(d, os.W_OK | os.X_OK):
        return f"agent.shm_dir={d!r} is not writable by this user"
    need = cfg.agent.shm_limit_mib << 20
    free = shm.shm_free_bytes(d)
    if need and free < need:
        return (f"agent.shm_dir={d!r} has {free / 2**20:.0f} MiB free but agent.shm_limit_mib="
                f"{cfg.agent.shm_limit_mib}; enlarge it or lower the limit")
    return None


def stop_on_signals() -> None:
    """SIGTERM to a launcher (a supervisor's or scheduler's stop: systemd, Slurm's scancel, the kubelet)
    takes Ctrl-C's path: torchrun stops its workers, the launcher records the job's end and shuts its
    agent down cleanly (segments removed), instead of dying at once and leaving the agent waiting
    ``launch.start_timeout_s`` for a launcher that will not come. A second SIGTERM is ignored (SIGKILL
    still ends it). SIGINT stops it the same way even where it started with SIGINT ignored (a
    background command of a non-interactive shell inherits that, and Python then never raises
    KeyboardInterrupt)."""
    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def simulate_nodes(args: argparse.Namespace, script: list[str]) -> int:
    """Start one launcher per simulated node on this machine and wait for all of them."""
    procs = []
    for i in range(args.nodes):
        cmd = [sys.executable, "-m", "megatron_ft.cli", "launch", f"--nodes={args.nodes}",
               f"--nproc-per-node={args.nproc_per_node}", f"--node-rank={i}", f"--run-dir={args.run_dir}"]
        if args.config:
            cmd.append(f"--config={args.config}")
        procs.append(subprocess.Popen(cmd + ["--", *script], start_new_session=True))
        if i == 0:
            clock.pause(0.5)  # let node 0 host the rendezvous store first
    rcs = []
    try:
        for p in procs:
            rcs.append(p.wait())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every node's launcher stops its node (stop_on_signals)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        rcs = [p.wait() for p in procs]
    return max(rcs, default=0)


STARTED = time.time()  # this launcher's start (a standby heeds only job ends recorded after it, less a timeout)


def run_standby(args: argparse.Namespace, cfg: ftconfig.FTConfig, script: list[str]) -> int:
    """``--standby``: wait for the root's failure verdict on some node, claim it, become it."""
    who = f"{socket.gethostname()}:{os.getpid()}"
    pool, pool_socket = None, None
    # the agent and torchrun of the node it will become, their imports done while it waits
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, f"standby{os.getpid()}.agent.log"), "ab") as logf:
        agent = prestart.start(AGENT_MODULE, AGENT_PRELOAD, stdout=logf, stderr=subprocess.STDOUT,
                               start_new_session=True)
    torchrun = prestart.start(TORCHRUN_MODULE, (TORCHRUN_MODULE,), preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    if cfg.launch.warm_spares:  # warm while waiting: the node it takes over starts no trainer cold
        from .spares import pool as spares

        pool_socket = spares.socket_path(cfg.agent.socket_dir, f"{cfg.run_id}.standby{os.getpid()}", 0)
        pool = spares.start(pool_socket, os.path.join(args.run_dir, f"standby{os.getpid()}.spares.log"),
                            spares.imports_for(script), spares.own_trees(script))
    try:
        return _standby(args, cfg, script, who, pool, pool_socket, agent, torchrun)
    finally:
        if pool is not None:
            spares.stop(pool, pool_socket or "")
        for proc in (agent, torchrun):
            prestart.discard(proc)  # never handed a node


#: what a standby pre-starts (``spares.prestart``): its node's agent and torchrun, imports done
AGENT_MODULE, AGENT_PRELOAD = "megatron_ft.agent", ("megatron_ft.agent.server",)
TORCHRUN_MODULE = "torch.distributed.run"


def _standby(args: argparse.Namespace, cfg: ftconfig.FTConfig, script: list[str], who: str,
             pool: Optional[subprocess.Popen], pool_socket: Optional[str], agent: subprocess.Popen,
             torchrun: subprocess.Popen) -> int:
    from .health.store import StoreClient

    client = StoreClient(cfg)
    print(f"[standby {who}] waiting for a failed node of run {cfg.run_id} ({client.where})", flush=True)
    try:
        node, verdict = claim_failed_node(client, args.nodes, who, timeout_s=args.standby_timeout,
                                          log=lambda m: print(m, flush=True), since=STARTED - cfg.health.timeout_s)
    except JobEnded as e:  # nothing to take over: the standby's part of the job is done
        print(f"[standby {who}] {e} with no failed node to take over; standing down", flush=True)
        return 0
    own = socket.gethostname()
    if not cfg.health.one_machine and own != cfg.health.host_of(node):
        # a host of its own: the node's agent serves under this host's name (the others find its store and
        # peer address through the root's store; network.node_host)
        os.environ[network.NODE_HOST_VARIABLE] = own
    print(f"[standby {who}] node {node} failed ({verdict.get('kind')}, agent pid {verdict['pid']}, detected by "
          f"node {verdict.get('detected_by')}); claimed it, starting as node {node}"
          + (f" on this host ({own}, not {cfg.health.host_of(node)})" if network.NODE_HOST_VARIABLE in os.environ
             else ""), flush=True)
    cfg_path = _write_config(cfg, os.path.join(args.run_dir, f"node{node}", "config.yaml"))
    launcher = NodeLauncher(cfg, cfg_path, node, args.nodes, args.nproc_per_node, script, args.run_dir)
    if pool is not None:
        launcher.pool, launcher.pool_socket = pool, pool_socket  # started before the failure
    launcher.waiting_agent, launcher.waiting_torchrun = agent, torchrun  # likewise
    return launcher.run()


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="start agents and torchrun (simulates all nodes when --node-rank is absent)")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: cluster.nodes)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="trainers per node (default: cluster.ranks_per_node)")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's node index; omit to simulate all nodes here")
    p.add_argument("--config", default=None, help="job YAML (default: embedded configs/local-cpu.yaml)")
    p.add_argument("--run-dir", default=None, help="logs, pids and progress (default: /tmp/megatron-ft/runs/<run_id>)")
    p.add_argument("--standby", action="store_true",
                   help="a standby node: wait for the root agent's verdict that a node failed, claim that "
                        "node rank (no two standbys take the same), then run as that node")
    p.add_argument("--standby-timeout", type=float, default=0.0,
                   help="--standby: give up after this many seconds without a failed node (0: wait for ever)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- training script and its arguments")
    p.set_defaults(func=main)


def job_config(config: Optional[str], script: list[str]) -> ftconfig.FTConfig:
    """One source of truth: the YAML (``--config``, else the training command's
    ``--inmem-ckpt-config``, else the default) with the training command's ``--inmem-ckpt*`` flags
    applied, as the trainers apply them, so that the agents persist where and when the trainers
    look. Two different YAML files on the launcher and the training command are an error."""
    flags = ftconfig.command_flags(script[1:])
    if config and flags.inmem_ckpt_config and os.path.realpath(config) != os.path.realpath(flags.inmem_ckpt_config):
        raise ftconfig.ConfigError(f"--config={config} and the training command's --inmem-ckpt-config="
                                   f"{flags.inmem_ckpt_config} name different files: give one, or the same file")
    return ftconfig.apply_flags(ftconfig.load(config or flags.inmem_ckpt_config), flags)


def with_job_secret(cfg: ftconfig.FTConfig, run_dir: str) -> ftconfig.FTConfig:
    """``cfg`` naming the job's secret file in ``security.secret_file`` when the job's agents serve
    anything over TCP (the store of a job of several nodes, the peer transport): found or generated by
    :func:`megatron_ft.transport.credential.job_secret_file`, so that the node's configuration file hands
    it to the agent, the trainers and a standby alike. A :class:`~megatron_ft.config.ConfigError` (exit 2,
    before anything starts) when a job of hosts of their own names none."""
    from .health.store import store_needed

    if not store_needed(cfg):
        return cfg
    path = credential.job_secret_file(cfg.security.secret_file, os.environ, run_dir, network.multi_host(cfg))
    return ftconfig.replace(cfg, security={"secret_file": path})


def main(args: argparse.Namespace) -> int:
    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        raise SystemExit("megatron-ft launch: give the training script after '--'")
    cfg = job_config(args.config, script)
    nodes = args.nodes if args.nodes is not None else cfg.cluster.nodes
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.cluster.ranks_per_node
    if nodes < 1:
        raise ftconfig.ConfigError(f"--nodes={nodes} is invalid: must be >= 1")
    if nproc < 1:
        raise ftconfig.ConfigError(f"--nproc-per-node={nproc} is invalid: must be >= 1")
    if (nodes, nproc) != (cfg.cluster.nodes, cfg.cluster.ranks_per_node):
        cfg = ftconfig.replace(cfg, cluster={"nodes": nodes, "ranks_per_node": nproc})
    args.nodes, args.nproc_per_node = nodes, nproc
    alloc = scheduler.allocation(os.environ) if args.node_rank is None and not args.standby else None
    if alloc is not None:  # a Slurm step or a Kubernetes indexed Job says which node this host is
        cfg = scheduler.placed(cfg, alloc)
        args.node_rank = alloc.node_rank(nodes)
        args.standby = args.node_rank is None
        what = (f"node {args.node_rank} of {nodes}" if not args.standby else
                f"a standby (host {alloc.index} of the allocation, beyond its {nodes} nodes)")
        print(f"[megatron-ft launch] {alloc.scheduler}: this host is {what} ({alloc.said_by}); nodes "
              f"{', '.join(cfg.health.host_list(nodes)) or 'simulated here'}, rendezvous on {cfg.launch.master_addr}",
              flush=True)
        if args.standby and cfg.redundancy.scheme == "none":
            print("[megatron-ft launch] redundancy.scheme is none: no agent declares a node lost and no memory "
                  "holds its state, so a standby has nothing to take over; this host does nothing (a lost node "
                  "is replaced by relaunching its rank, which restores from persist.dir)", flush=True)
            return 0
    args.run_dir = args.run_dir or os.path.join("/tmp/megatron-ft/runs", cfg.run_id)
    os.makedirs(args.run_dir, exist_ok=True)
    cfg = with_job_secret(cfg, args.run_dir)
    stop_on_signals()
    if args.standby:
        if args.node_rank is not None:
            raise ftconfig.ConfigError(f"--node-rank={args.node_rank} is invalid with --standby: a standby "
                                       "takes the rank of the node that failed")
        if cfg.redundancy.scheme == "none":
            raise ftconfig.ConfigError("--standby needs the agents' health store: redundancy.scheme is 'none' "
                                       "(set replica, xor or rs), so no agent watches for failed nodes")
        return run_standby(args, cfg, script)
    if args.node_rank is None:
        return simulate_nodes(args, script)
    if not 0 <= args.node_rank < nodes:
        raise ftconfig.ConfigError(f"--node-rank={args.node_rank} is invalid: must be in [0, {nodes - 1}]")
    cfg_path = _write_config(cfg, os.path.join(args.run_dir, f"node{args.node_rank}", "config.yaml"))
    return NodeLauncher(cfg, cfg_path, args.node_rank, nodes, nproc, script, args.run_dir).run()
