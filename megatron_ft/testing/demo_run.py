"""One demo run's shared state: :class:`Run`, the context the driver (:mod:`megatron_ft.testing.demo`)
builds and every failure scenario (:mod:`megatron_ft.testing.demo_scenarios`) reads and writes.

The contract: the driver fills the job's settings (``args``, ``cfg``, the training program and its
arguments, the chosen ``victims`` and ``lost_nodes``, the scenario), the reference run's results, and
the running job (``p``, ``t0``, ``deadline``, ``eff_cfg``); a scenario records what its failure did in
the "what the failure did" fields (``kill_time``, ``killed_pids``, ``agent_killed``, ``hang_time``,
the lost nodes' ``persisted_at_kill`` and ``complete_at_loss``, the launchers it started in
``replacements``), which the summary (:mod:`megatron_ft.testing.demo_summary`) then judges. What only one
scenario needs (a slowed rank's duty cycle, a paused agent) stays on that scenario's own object."""
from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import config as ftconfig
from .demo_jobs import Program
from .demo_results import _progress
from .hosts import HostBed


@dataclass
class Run:
    """The demo's run: its settings, its reference, its job, and what its failure did."""

    args: argparse.Namespace
    cfg: ftconfig.FTConfig
    workdir: str
    program: Program
    targs: list[str]  # the training arguments ({run_dir} not yet replaced)
    say: Callable[..., None]
    scenario: Any  # the failure (a demo_scenarios.Scenario)
    victims: list[int]  # the ranks that fail
    lost_nodes: list[int]  # the nodes whose machines die
    series: Optional[str] = None  # --megatron-lm: the patch series applied to upstream's tree
    bed: Optional[HostBed] = None  # --hosts: every node on a host of its own
    slurm: Any = None  # --slurm: the Slurm on the bed (slurm.SlurmOnBed, started)
    # the reference run (or an earlier one with the same arguments)
    ref_dir: str = ""
    ref_seconds: float = 0.0
    cold_start_seconds: Optional[float] = None
    # the job with megatron-ft
    p: Any = None  # the job: a Popen, a JobOnHosts or a SlurmJob
    t0: float = 0.0  # when it was started
    deadline: float = 0.0  # when every wait on it gives up
    run_seconds: float = 0.0
    # the settings the job runs with (the training command's --inmem-ckpt* flags applied)
    eff_cfg: Optional[ftconfig.FTConfig] = None
    replacements: list[tuple[subprocess.Popen, str]] = field(default_factory=list)  # (launcher, its log)
    slurm_lost: dict = field(default_factory=dict)  # --slurm: what Slurm made of the lost host
    # what the failure did
    kill_time: Optional[float] = None  # when it struck (None: nothing failed)
    killed_pids: list[int] = field(default_factory=list)
    agent_killed: Optional[tuple[int, Optional[int]]] = None  # (node, pid) of a node agent SIGKILLed
    hang_time: Optional[float] = None  # hang scenarios: when the victim hung
    second: Optional[tuple[int, int, float]] = None  # --second-failure: (node, pid, time)
    # a node lost: the complete persisted steps then (a recovery from disk must take the newest of them),
    # and per lost node the steps its agent had logged complete in its group when it died
    persisted_at_kill: list[int] = field(default_factory=list)
    complete_at_loss: dict[int, list[int]] = field(default_factory=dict)
    # hosts of their own: what listens where, an outsider's probes, and the thread that looks
    listeners: Optional[dict] = None
    stranger: Optional[dict] = None
    listened: threading.Event = field(default_factory=threading.Event)
    looking: Optional[threading.Thread] = None

    @property
    def world(self) -> int:
        return self.cfg.cluster.world_size

    @property
    def rpn(self) -> int:
        return self.cfg.cluster.ranks_per_node

    @property
    def run_dir(self) -> str:
        return os.path.join(self.workdir, "run")

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "run.log")

    @property
    def replacement_log(self) -> str:
        return os.path.join(self.workdir, "standby.log" if self.args.standby else "replacement.log")

    def wait_iteration(self, ranks: list[int], iteration: int) -> dict[int, list[dict]]:
        """Wait until every rank of ``ranks`` logged ``iteration`` (or a later one); their progress."""
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"job ended before rank(s) {ranks} reached iteration {iteration}; "
                                   f"log {self.log_path}")
            if time.time() > self.deadline:
                raise RuntimeError(f"rank(s) {ranks} never reached iteration {iteration}; log {self.log_path}")
            recs = {v: _progress(self.run_dir, v) for v in ranks}
            if all(recs[v] and recs[v][-1]["iteration"] >= iteration for v in ranks):
                return recs
            time.sleep(0.02)
