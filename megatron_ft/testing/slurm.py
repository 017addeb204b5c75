"""A real Slurm on the multi-host test bed (harness only): munge, a controller and one ``slurmd`` per host.

:class:`SlurmOnBed` starts, on a :class:`~megatron_ft.testing.hosts.HostBed`: ``munged`` with a key and
socket of its own (the bed's hosts share this machine's files, so every daemon and client reaches its
socket; ``AuthInfo=socket=...``) and ``slurmctld`` on the bed's last host (``SlurmctldHost`` is that
host's name), and a ``slurmd`` named after each compute host on it (entered with the bed's ``nsenter``;
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups needed), with a small
``SlurmdTimeout`` so that a host that dies is marked DOWN in seconds. Everything lives in one directory
(configuration, state, spool, logs); :meth:`SlurmOnBed.stop` ends every daemon and the bed takes the
rest. Debian 12: ``apt-get install slurmctld slurmd slurm-client munge`` (``scripts/setup.sh``).

:class:`SlurmJob` is a batch job submitted with ``sbatch`` from the controller's host, with the verbs the
demo uses on a job (``poll``, ``wait``). Its script runs each node's command under ``srun`` (one task per
host, ``--kill-on-bad-exit=0``: a lost host's task does not end the others) and records every task's exit
status as ``<run_dir>/slurm-exit/<host>``; the job's status is the largest of the hosts that did not die.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from typing import Optional

from .hosts import HostBed

#: job states of a job that has not ended
ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "UNKNOWN")
#: what the bed's Slurm needs on this machine
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
SLURMD_TIMEOUT_S = 10
UP_TIMEOUT_S = 60.0


def unavailable_reason() -> Optional[str]:
    """Why no Slurm can run on the bed here (None: it can)."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm on the test bed needs {', '.join(missing)} (Debian: apt-get install slurmctld slurmd " \
               f"slurm-client munge)"
    return None


def slurm_conf(workdir: str, controller: str, computes: list[str], cpus: int) -> str:
    """The bed cluster's ``slurm.conf`` (pure): one partition of the compute hosts, root daemons,
    no cgroups, no accounting, every path under ``workdir``."""
    nodes = ",".join(computes)
    return "\n".join([
        "ClusterName=mftbed", f"SlurmctldHost={controller}",
        "AuthType=auth/munge", f"AuthInfo=socket={workdir}/munge.sock", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root", "SlurmctldPort=6817", "SlurmdPort=6818",
        f"StateSaveLocation={workdir}/ctld", f"SlurmdSpoolDir={workdir}/spool-%n",
        f"SlurmctldPidFile={workdir}/slurmctld.pid", f"SlurmdPidFile={workdir}/slurmd-%n.pid",
        f"SlurmctldLogFile={workdir}/slurmctld.log", f"SlurmdLogFile={workdir}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none", "MpiDefault=none",
        "MailProg=/bin/true", "ReturnToService=2", f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
        "SchedulerType=sched/builtin", "SelectType=select/linear", "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        f"NodeName={nodes} CPUs={cpus} State=UNKNOWN",
        f"PartitionName=bed Nodes={nodes} Default=YES MaxTime=INFINITE State=UP", ""])


class SlurmOnBed:
    """Slurm on ``bed``: ``computes`` (host indices) run ``slurmd``, the bed's last host the controller."""

    def __init__(self, bed: HostBed, workdir: str, computes: list[int]):
        self.bed, self.workdir = bed, os.path.abspath(workdir)
        self.computes = computes
        self.controller = bed.hosts - 1
        self.conf = os.path.join(self.workdir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.procs: list[subprocess.Popen] = []

    def name(self, i: int) -> str:
        return self.bed.plan.name(i)

    def start(self) -> "SlurmOnBed":
        why = unavailable_reason()
        if why:
            raise RuntimeError(why)
        os.makedirs(os.path.join(self.workdir, "ctld"), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(slurm_conf(self.workdir, self.name(self.controller), [self.name(i) for i in self.computes],
                               os.cpu_count() or 1))
        key = os.path.join(self.workdir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        w = self.workdir
        self._daemon(self.controller, ["munged", "-F", "--force", f"--key-file={key}", f"--socket={w}/munge.sock",
                            f"--pid-file={w}/munged.pid", f"--log-file={w}/munged.log", f"--seed-file={w}/munged.seed"],
                     "munged")
        deadline = time.monotonic() + 10
        while not os.path.exists(f"{w}/munge.sock"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start; {w}/munged.out")
            time.sleep(0.05)
        self._daemon(self.controller, ["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld")
        for i in self.computes:
            self._daemon(i, ["slurmd", "-D", "-N", self.name(i), "-f", self.conf], f"slurmd-{self.name(i)}")
        self.wait_idle()
        return self

    def _daemon(self, host: int, argv: list[str], name: str) -> None:
        """A daemon on bed host ``host`` (so that the bed's end, or its reaper's, takes it too)."""
        out = open(os.path.join(self.workdir, f"{name}.out"), "wb")
        self.procs.append(self.bed.popen(host, argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True))

    def run(self, argv: list[str], timeout: float = 30.0, env: Optional[dict] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """A Slurm client command, from the controller's host (``env``: more variables; ``cwd``: its working
        directory, where ``sbatch`` has the job's output written - entering the host's namespaces leaves
        a process in ``/``)."""
        cmd = ["env", "-C", cwd, *argv] if cwd else argv
        return self.bed.run(self.controller, cmd, timeout=timeout, env={**self.env, **(env or {})})

    def job_state(self, job_id: str) -> str:
        """``JobState`` of job ``job_id`` (``RUNNING``, ``COMPLETED``, ...; ``UNKNOWN`` when not found)."""
        return self._show("job", job_id).get("JobState", "UNKNOWN")

    def node_states(self) -> dict[str, str]:
        """Each compute host's state as ``sinfo`` reports it (``idle``, ``alloc``, ``down*``, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def _show(self, kind: str, name: str) -> dict[str, str]:
        """``scontrol show KIND NAME`` as its ``key=value`` fields (one line each: ``-o``)."""
        out = self.run(["scontrol", "show", kind, name, "-o"])
        return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)

    def down_since(self, node: str) -> Optional[str]:
        """When Slurm marked ``node`` down (the ``[user@YYYY-MM-DDTHH:MM:SS]`` of its reason), or None."""
        out = self.run(["scontrol", "show", "node", node, "-o"]).stdout
        m = re.search(r"Reason=.*?\[[^@\]]*@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\]", out)
        return m.group(1) if m else None

    def job_end(self, job_id: str) -> Optional[str]:
        """Job ``job_id``'s ``EndTime`` (``YYYY-MM-DDTHH:MM:SS``), or None while it runs."""
        end = self._show("job", job_id).get("EndTime", "")
        return end if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", end) else None

    def wait_idle(self) -> None:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            states = self.node_states()
            if states and all(v == "idle" for v in states.values()) and len(states) == len(self.computes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bed's Slurm nodes are not idle within {UP_TIMEOUT_S:g} s: {states}; "
                                   f"logs in {self.workdir}")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs = []


class SlurmJob:
    """A batch job of ``slurm``: ``sbatch`` of a script that ``srun``s ``argv`` once per host of an
    allocation of ``hosts`` hosts (``--no-kill``: a lost host does not end the allocation)."""

    def __init__(self, slurm: SlurmOnBed, run_dir: str, argv: list[str], hosts: int, log_path: str):
        self.slurm, self.run_dir, self.log_path = slurm, run_dir, log_path
        exits = os.path.join(run_dir, "slurm-exit")
        os.makedirs(exits, exist_ok=True)
        self.exits = exits
        script = os.path.join(run_dir, "job.sbatch")
        quoted = " ".join(_quote(a) for a in argv)
        with open(script, "w") as f:
            f.write(f"#!/bin/bash\n#SBATCH --nodes={hosts} --ntasks-per-node=1 --no-kill --output={log_path}\n"
                    f"srun --kill-on-bad-exit=0 bash -c '{quoted}; echo $? > {exits}/$SLURMD_NODENAME'\n")
        out = slurm.run(["sbatch", "--parsable", script])
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        self.job_id = out.stdout.strip().split(";")[0]
        self.returncode: Optional[int] = None
        self.pid = 0  # no process of ours: scancel ends it

    def state(self) -> str:
        return self.slurm.job_state(self.job_id)

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        if self.state() in ACTIVE:
            return None
        rcs = []
        for name in os.listdir(self.exits):
            with open(os.path.join(self.exits, name)) as f:
                rcs.append(int(f.read().strip() or 1))
        self.returncode = max(rcs) if rcs else 1
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"slurm job {self.job_id}", timeout or 0)
            time.sleep(0.5)
        return int(self.returncode or 0)

    def cancel(self) -> None:
        self.slurm.run(["scancel", self.job_id])


def _quote(arg: str) -> str:
    """``arg`` inside the script's single-quoted ``bash -c`` string."""
    import shlex

    return shlex.quote(arg).replace("'", "'\"'\"'")
