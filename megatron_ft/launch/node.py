"""A node's launcher: its agent, its warm spare pool and its torchrun, from the job's start to its end.

:class:`NodeLauncher` is one node's launcher (``megatron-ft launch --node-rank I``, or one of the simulated
nodes, or a standby that claimed a node): it checks what the node needs (:func:`~.agent_process.preflight`), starts the
agent and waits for its socket, runs torchrun generation after generation (:mod:`megatron_ft.rendezvous`),
restarts a dead agent, and ends the job when a node records a fatal error. Its calls are one thread's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import psutil
import yaml

from .. import clock
from .. import config as ftconfig
from .. import fatal
from .. import network
from ..agent import shm
from ..agent.protocol import AgentClient, AgentError, socket_path
from ..clock import Deadline
from ..config.flags import batch_sizes
from ..health import progress as hp
from ..health.store import StoreUnavailable
from ..health.monitor import stood_down_path
from ..rendezvous import FatalWatch, Rendezvous
from ..spares import prestart
from ..spares.lifetime import die_with_parent
from ..trainer.in_process import nccl_env_defaults
from .agent_process import AdoptedProcess, AgentStartError, preflight, wait_ports_free
from .elastic import NEXT, ElasticWatch, Handover, HandoverError
from .generation import ENV as GENERATION_ENV
from .generation import GenerationRecord, generation_config, generation_dir, pointer_path, read_pointer, write_pointer

#: how a launcher runs torchrun (a standby pre-starts it): torch's, with megatron-ft's rendezvous backend
TORCHRUN_MODULE = "megatron_ft.torchrun"

#: set in the trainers' environment unless it already sets them: none by default. ``TORCH_GLOO_LAZY_INIT=1``
#: (a gloo group connects a pair of its ranks on their first operation together instead of a full mesh
#: when the group is made) is the operator's choice, not set here: measured with torch 2.13, a collective
#: that needs a pair to a peer that died before the pair connected waits out the group's whole timeout
#: (Megatron's: 10 minutes) instead of failing at once, and a chaos trial hung on it (docs/architecture.md,
#: "At scale: groups")
GLOO_ENV_DEFAULTS: dict[str, str] = {}


def write_config(cfg: ftconfig.FTConfig, path: str) -> str:
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
        # going on at fewer data-parallel replicas (recovery.elastic_after_s): this host's node slot (generation
        # 0's node id), generation 0's configuration, the generation this launcher runs, its watch, and what
        # its trainers are told of it
        self.slot, self.base_cfg = node, cfg
        self.generation = GenerationRecord.first(cfg)
        self.elastic: Optional[ElasticWatch] = None
        self._next: Optional[GenerationRecord] = None
        self.gen_env: dict[str, str] = {}

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
        from ..spares import pool

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
            from ..spares import pool

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
        self.agent = AdoptedProcess(proc)
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
        """torchrun for the current generation (``python -m megatron_ft.torchrun``: torch's, with the
        ``megatron-ft`` rendezvous backend registered), with ``launch.rendezvous``'s backend."""
        lc = self.cfg.launch
        # a node that never arrives ends the rendezvous after launch.start_timeout_s, not 15 minutes
        conf = (f"is_host={'true' if self.node == self.rdzv.node else 'false'},"
                f"join_timeout={max(1, int(lc.start_timeout_s))},")
        conf += (f"node={self.node}" if lc.rendezvous == "megatron-ft" else
                 f"keep_alive_interval={lc.rdzv_keep_alive_s},keep_alive_max_attempt={lc.rdzv_keep_alive_attempts}")
        return [
            sys.executable, "-m", TORCHRUN_MODULE,
            f"--nnodes={self.nodes}", f"--nproc-per-node={self.nproc}",
            f"--rdzv-backend={lc.rendezvous}", f"--rdzv-endpoint={self.rdzv.addr}:{self.rdzv.port}",
            f"--rdzv-id={self.cfg.run_id}-g{self.rdzv.gen}", f"--rdzv-conf={conf}",
            f"--max-restarts={lc.max_restarts}", "--monitor-interval=0.1",
            # with warm spares torchrun's workers are stand-ins for trainers forked from the pool
            *(["-m", "megatron_ft.spares.worker"] if self.pool is not None else []),
            *self.script,
        ]

    def run(self) -> int:
        rc: Optional[int] = None
        try:
            running = read_pointer(self.run_dir) if self.cfg.recovery.elastic else None
            if running is not None and running.number > 0:
                rc = self._come_back(running)  # the job went on without this slot: grow it back
                if rc is not None:
                    return rc
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
        env.pop(GENERATION_ENV, None)
        env.update(self.gen_env)  # a generation > 0: its record (its trainers' first restore is re-sliced)
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
        if self.cfg.recovery.elastic and self.rendezvous.store is not None:
            self.elastic = ElasticWatch(self.generation, self.slot, self.base_cfg, self.rendezvous,
                                        batch_sizes(self.script), lambda m: self.log(f"[launch n{self.node}] {m}"))
        while True:
            self.rendezvous.begin(self.rdzv)
            rc = self._run_torchrun(env)
            if rc == fatal.EXIT_STOOD_DOWN:
                return rc
            if rc == NEXT_GENERATION and self._next is not None:
                return self._hand_over(self._next)
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
        self._drop_imports()
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
                    self._release_imports()
                if self.elastic is not None and (nxt := self.elastic.tick()) is not None:
                    self.log(f"[launch n{self.node}] generation {nxt.number} ({nxt.kind}): stopping this node's "
                             f"trainers for the handover")
                    self._stop_torchrun()
                    self._next = nxt
                    return NEXT_GENERATION
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

    # ------------------------------------------------------------------ generations (recovery.elastic_after_s)
    def _hand_over(self, rec: GenerationRecord) -> int:
        """This node's part in the handover to ``rec`` (:mod:`.elastic`), with its old agent still running;
        then the old agent stops and the new generation starts here (or this slot waits, idle)."""
        log = lambda m: self.log(f"[launch n{self.node}] {m}")  # noqa: E731
        client = AgentClient(self.sock, self.cfg.agent.request_timeout_s)
        try:
            client.connect({"rank": -1, "local_rank": -1, "pid": os.getpid(), "run_id": self.cfg.run_id})
            plan = Handover(rec, self.slot, self.rendezvous.store, self.cfg, self.base_cfg, client, log).run()
        except (HandoverError, AgentError, OSError) as e:
            client.close(orderly=True)
            self.stop_agent()
            self._drop_imports()
            self._drop_imports_of(rec)
            return self._end_job(f"the handover to generation {rec.number} ({rec.kind}) failed: {e}")
        client.close(orderly=True)
        self.stop_agent()
        self._drop_imports()  # the previous generation's imports (generation 2 on)
        return self._start_generation(plan)

    def _come_back(self, running: GenerationRecord) -> Optional[int]:
        """This slot is back while the job runs without it (generation ``running``): say so in that
        generation's store, wait for the decider's grow-back, gather what this node's ranks need and start
        the new generation here. None: nothing answers for ``running`` (an earlier job's pointer, removed):
        start as generation 0."""
        from ..health.store import StoreClient

        old_cfg = generation_config(self.base_cfg, running)
        store = StoreClient(old_cfg)
        try:
            store.connect(5.0)
        except StoreUnavailable:  # an earlier job's pointer (a job of this run id that ended)
            self.log(f"[launch n{self.slot}] the run directory names generation {running.number}, which nobody "
                     f"serves: starting the job")
            try:
                os.unlink(pointer_path(self.run_dir))
            except FileNotFoundError:
                pass
            return None
        if self.slot in running.slots:
            store.close()
            return self._end_job(f"slot {self.slot} is node {running.node_of(self.slot)} of the running generation "
                                 f"{running.number}: a launcher started again inside a generation after the first "
                                 f"is not built (its node's ranks restart from the job's next generation or its "
                                 f"disk tier)")
        log = lambda m: self.log(f"[launch slot {self.slot}] {m}")  # noqa: E731
        log(f"back while generation {running.number} runs on slots {list(running.slots)}: asking to grow")
        deadline = Deadline(self.cfg.launch.start_timeout_s, f"generation {running.number + 1} with slot {self.slot}")
        try:
            nxt = None
            store.set(f"elastic/returned/{self.slot}", json.dumps({"pid": os.getpid(), "time": time.time()}))
            while True:
                raw = store.get(NEXT)
                nxt = GenerationRecord.from_json(raw) if raw else None
                if nxt is not None and nxt.number == running.number + 1 and self.slot in nxt.slots:
                    break
                if deadline.expired():  # the job goes on without this slot; nothing of it is this launcher's
                    log(f"generation {running.number} did not grow to take this slot within launch.start_timeout_s="
                        f"{self.cfg.launch.start_timeout_s:g} s; this launcher exits, the job goes on without it")
                    return fatal.EXIT_CODE
                deadline.pause(0.2)
            plan = Handover(nxt, self.slot, store, old_cfg, self.base_cfg, None, log).run()
        except (HandoverError, StoreUnavailable, OSError) as e:
            if nxt is not None:
                self._drop_imports_of(nxt)
            # the running generation's launchers end the job, saying why, when its handover cannot finish
            log(f"the handover to generation {running.number + 1} failed here: {e}; this launcher exits")
            return fatal.EXIT_CODE
        finally:
            store.close()
        return self._start_generation(plan)

    def _start_generation(self, plan: GenerationRecord) -> int:
        """Run ``plan``'s generation on this slot: its configuration, node number, directories, agent and
        torchrun (:meth:`_run`), its trainers told of ``plan`` (their first restore is re-sliced)."""
        write_pointer(self.run_dir, plan)
        i = plan.node_of(self.slot)
        if i is None:
            self.log(f"[launch slot {self.slot}] generation {plan.number} leaves this slot idle; it waits to grow back")
            return self._come_back(plan) or 0
        try:
            cfg = generation_config(self.base_cfg, plan)
        except ftconfig.ConfigError as e:  # nothing of it started: its imports go, the job ends saying why
            shm.remove_node_segments(self.base_cfg.agent.shm_dir, plan.run_id, i)
            return self._end_job(f"generation {plan.number} ({plan.kind}) cannot run: {e}")
        self.node_dir = os.path.join(generation_dir(self.run_dir, plan.number), f"node{i}")
        os.makedirs(self.node_dir, exist_ok=True)
        self.cfg_path = write_config(cfg, os.path.join(self.node_dir, "config.yaml"))
        rec_path = os.path.join(self.node_dir, "generation.json")
        with open(rec_path, "w", encoding="utf-8") as f:
            f.write(plan.to_json())
        self.gen_env = {GENERATION_ENV: rec_path}
        if self.fatal_watch is not None:
            self.fatal_watch.stop()
            self.fatal_watch = None
        self.stop_pool()
        self.cfg, self.node, self.nodes, self.generation = cfg, i, len(plan.slots), plan
        self.sock = socket_path(cfg.agent.socket_dir, cfg.run_id, i)
        self.agent, self._fatal, self._next, self.elastic = None, None, None, None
        self.rendezvous = Rendezvous(cfg, i)
        self.rdzv = self.rendezvous.initial()
        try:
            wait_ports_free(cfg, i, Deadline(cfg.launch.start_timeout_s, f"node {i}'s ports of generation {plan.number}"))
        except AgentStartError as e:
            self._drop_imports()
            return self._end_job(str(e))
        self.log(f"[launch slot {self.slot}] generation {plan.number}: node {i} of {self.nodes} (DP "
                 f"{plan.data_parallel}), restoring step {plan.step} re-sliced from DP {plan.previous.data_parallel}")
        return self._run()

    def _release_imports(self) -> None:
        """Once every rank of this node agreed a step of this generation newer than the one it restored from,
        nothing restores from the previous generation's containers again: unlink them (their memory is about
        a generation's state per node). Asked every 2 s until then, one status request to the agent."""
        if not self.gen_env or self.agent is None or self.agent.poll() is not None:
            return
        try:
            client = AgentClient(self.sock, self.cfg.agent.request_timeout_s)
            client.connect({"rank": -1, "local_rank": -1, "pid": os.getpid(), "run_id": self.cfg.run_id})
            try:
                ranks = client.request("status")["status"].get("ranks", {})
            finally:
                client.close(orderly=True)
        except (OSError, AgentError):
            return
        agreed = [int(v.get("global_step", -1)) for v in ranks.values()]
        if len(agreed) < self.nproc or min(agreed) <= self.generation.step:
            return
        gone = shm.remove_segments(self.cfg.agent.shm_dir, lambda name: bool(
            (m := shm.held_by(name, self.cfg.run_id, self.node)) and m.group(0).startswith("in")))
        self.gen_env = {}
        self.log(f"[launch n{self.node}] every rank here agreed step {min(agreed)} of generation "
                 f"{self.generation.number}: released {len(gone)} container(s) of generation {self.generation.number - 1}")

    def _drop_imports_of(self, rec: GenerationRecord) -> None:
        """Unlink what this slot gathered for generation ``rec`` that never started here."""
        i = rec.node_of(self.slot)
        if i is not None:
            shm.remove_node_segments(self.base_cfg.agent.shm_dir, rec.run_id, i)

    def _drop_imports(self) -> None:
        """Unlink what this node's generation held of the one before (its imports) and anything else of it left."""
        if self.generation.number > 0:
            shm.remove_node_segments(self.cfg.agent.shm_dir, self.cfg.run_id, self.node)

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


#: what :meth:`NodeLauncher._run_torchrun` returns when the job moves to its next generation
NEXT_GENERATION = -1001
