"""Where a launcher stands in a batch scheduler's allocation: a Slurm step or a Kubernetes indexed Job.

``megatron-ft launch`` without ``--node-rank`` asks :func:`allocation` (pure: it reads only the
environment it is given) and, inside a scheduler's allocation, runs as the node it names:

* **Slurm** - inside a job step (``srun``, one task per node: ``SLURM_STEP_ID`` is set): the step's
  hosts are ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) expanded with python-hostlist,
  their count checked against ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``); this host's place is
  ``SLURMD_NODENAME``'s position among them (else ``SLURM_NODEID``). The first ``cluster.nodes``
  hosts are the job's nodes, in order (node 0: the rendezvous); :func:`placed` names them in
  ``health.hosts`` and node 0 in ``launch.master_addr`` unless the cluster file set either. The hosts
  after them are standbys (``launch --standby``): each takes the place of a node the root agent declares
  lost, under its own name.
* **Kubernetes** - a pod of an indexed Job (``JOB_COMPLETION_INDEX``): the index is the node rank.
  The hosts are the pods' names under the job's headless Service, which the rendered cluster file
  gives as ``health.host_pattern`` (``megatron-ft deploy kubernetes``).

Outside both (no ``SLURM_STEP_ID``, no ``JOB_COMPLETION_INDEX``) nothing changes: without
``--node-rank`` the launcher simulates every node on this machine. A batch script that calls the
launcher without ``srun`` is outside a step: it must ``srun`` it (``examples``/``docs/deploy.md``).

    >>> a = allocation({"SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_STEP_NUM_NODES": "3",
    ...                 "SLURMD_NODENAME": "gpu08", "SLURM_NODEID": "1"})
    >>> a.scheduler, a.index, a.hosts
    ('slurm', 1, ('gpu07', 'gpu08', 'gpu09'))
    >>> allocation({"JOB_COMPLETION_INDEX": "3"}).index, allocation({}) is None
    (3, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from .config import ConfigError, FTConfig, replace


@dataclass(frozen=True)
class Allocation:
    """This launcher's place in the scheduler's allocation."""

    scheduler: str  # "slurm" | "kubernetes"
    index: int  # this host's place, from 0: the node rank when below cluster.nodes
    hosts: tuple[str, ...]  # every host of the allocation in order (Kubernetes: () - the cluster file names them)
    said_by: str  # the variables that said so, for the launcher's log line

    def node_rank(self, nodes: int) -> Optional[int]:
        """This host's node rank in a job of ``nodes`` nodes, or None: a host beyond the nodes, a standby."""
        return self.index if self.index < nodes else None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        value = int(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is invalid: must be an integer") from None
    if value < 0:
        raise ConfigError(f"{name}={value} is invalid: must be >= 0")
    return value


def _slurm(env: Mapping[str, str]) -> Allocation:
    import hostlist  # python-hostlist: Slurm's compressed host lists ("gpu[01-04,07]")

    var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    if not env.get(var):
        raise ConfigError("a Slurm step without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: cannot tell its hosts")
    try:
        hosts = tuple(hostlist.expand_hostlist(env[var]))
    except hostlist.BadHostlist as e:
        raise ConfigError(f"{var}={env[var]!r} is invalid: {e}") from None
    count_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    if env.get(count_var) and _int(env, count_var) != len(hosts):
        raise ConfigError(f"{var}={env[var]!r} names {len(hosts)} hosts but {count_var}={env[count_var]}")
    name = env.get("SLURMD_NODENAME", "")
    if name in hosts:
        return Allocation("slurm", hosts.index(name), hosts, f"SLURMD_NODENAME={name} in {var}")
    if "SLURM_NODEID" not in env:
        raise ConfigError(f"a Slurm step whose host ({name or 'SLURMD_NODENAME unset'}) is not in {var}="
                          f"{env[var]!r} and no SLURM_NODEID: cannot tell this host's place")
    index = _int(env, "SLURM_NODEID")
    if index >= len(hosts):
        raise ConfigError(f"SLURM_NODEID={index} is invalid: {var} names {len(hosts)} hosts")
    return Allocation("slurm", index, hosts, f"SLURM_NODEID={index}")


def allocation(env: Mapping[str, str]) -> Optional[Allocation]:
    """The allocation this process runs in (module doc), or None outside one. Pure."""
    if "SLURM_STEP_ID" in env:
        return _slurm(env)
    if "JOB_COMPLETION_INDEX" in env:
        index = _int(env, "JOB_COMPLETION_INDEX")
        return Allocation("kubernetes", index, (), f"JOB_COMPLETION_INDEX={index}")
    return None


def placed(cfg: FTConfig, alloc: Allocation) -> FTConfig:
    """``cfg`` with the allocation's hosts: a Slurm step's first ``cluster.nodes`` hosts as
    ``health.hosts`` and its first as ``launch.master_addr``, unless the cluster file names the hosts
    (``health.hosts``/``host_pattern``) or the rendezvous host itself. Pure.

    >>> from megatron_ft.config import from_dict
    >>> cfg = placed(from_dict({"cluster": {"nodes": 2}}), Allocation("slurm", 0, ("a1", "a2"), ""))
    >>> cfg.health.hosts, cfg.launch.master_addr
    (('a1', 'a2'), 'a1')
    """
    nodes = cfg.cluster.nodes
    if not alloc.hosts:
        return cfg
    if len(alloc.hosts) < nodes:
        raise ConfigError(f"the {alloc.scheduler} allocation has {len(alloc.hosts)} hosts ({', '.join(alloc.hosts)}) "
                          f"but cluster.nodes={nodes}: allocate at least {nodes}")
    hosts = alloc.hosts[:nodes]
    changes: dict = {}
    if cfg.health.one_machine:
        changes["health"] = {"hosts": list(hosts)}
    if cfg.launch.master_addr in ("127.0.0.1", "localhost"):
        changes["launch"] = {"master_addr": hosts[0]}
    return replace(cfg, **changes) if changes else cfg
