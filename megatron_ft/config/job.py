"""The whole job, :class:`FTConfig`: its sections, the checks across them, and the ports the job's
own servers listen on (:func:`port_plan`; a plan whose ranges clash, :func:`port_clash`, is one of
those checks). :data:`SECTIONS` names the sections."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

from pydantic import Field, StrictStr, model_validator

from .fields import Allowed, ConfigError, _fail, _Section
from .recovery_sections import (FailureConfig, HangConfig, RecoveryConfig, RedundancyConfig, ScheduleConfig,
                                SimulateConfig)
from .runtime_sections import (AgentConfig, ClusterConfig, HealthConfig, LaunchConfig, NetworkConfig, ParallelConfig,
                               PersistConfig, SecurityConfig, SnapshotConfig)


class FTConfig(_Section):
    """Everything megatron-ft needs to know about a job."""

    run_id: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"), Allowed(
        "must be 1-64 characters of letters, digits, '_', '.', '-' (starting with a letter or digit)")] = "megatron-ft"
    cluster: ClusterConfig = ClusterConfig()
    parallel: ParallelConfig = ParallelConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
    persist: PersistConfig = PersistConfig()
    agent: AgentConfig = AgentConfig()
    launch: LaunchConfig = LaunchConfig()
    failure: FailureConfig = FailureConfig()
    simulate: SimulateConfig = SimulateConfig()
    redundancy: RedundancyConfig = RedundancyConfig()
    health: HealthConfig = HealthConfig()
    network: NetworkConfig = NetworkConfig()
    security: SecurityConfig = SecurityConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    hang: HangConfig = HangConfig()

    @model_validator(mode="after")
    def _check(self) -> "FTConfig":
        mp = self.parallel.tensor * self.parallel.pipeline
        if self.cluster.world_size % mp:
            raise ConfigError(
                f"parallel.tensor*parallel.pipeline={mp} does not divide the world size "
                f"cluster.nodes*cluster.ranks_per_node={self.cluster.world_size}: the world size must be a "
                f"multiple of tensor*pipeline"
            )
        if self.data_parallel % self.parallel.expert:
            raise ConfigError(
                f"parallel.expert={self.parallel.expert} does not divide the data-parallel size "
                f"{self.data_parallel} (world / (tensor*pipeline)): with expert tensor parallelism equal to "
                f"parallel.tensor, megatron-core needs DP x TP to be a multiple of EP x TP")
        least = self.cluster.elastic.min_data_parallel
        if self.recovery.elastic and least > self.data_parallel:
            _fail("cluster.elastic.min_data_parallel", least,
                  f"must be at most the job's data-parallel size {self.data_parallel} (cluster.nodes*"
                  f"cluster.ranks_per_node={self.cluster.world_size} / parallel.tensor*parallel.pipeline={mp}) "
                  f"when recovery.elastic_after_s={self.recovery.elastic_after_s:g} turns shrinking on")
        if self.recovery.elastic and self.recovery.elastic_after_s >= self.launch.start_timeout_s:
            _fail("recovery.elastic_after_s", self.recovery.elastic_after_s,
                  f"must be below launch.start_timeout_s={self.launch.start_timeout_s:g}: the survivors wait that long "
                  f"for a lost node's replacement in their rendezvous, then the job ends")
        self.redundancy.check_cluster(self.cluster.nodes)
        if self.health.hosts and len(self.health.hosts) != self.cluster.nodes:
            _fail("health.hosts", list(self.health.hosts), f"must list cluster.nodes={self.cluster.nodes} hosts")
        clash = port_clash(self)
        if clash:
            raise ConfigError(clash)
        return self

    @property
    def data_parallel(self) -> int:
        return self.cluster.world_size // (self.parallel.tensor * self.parallel.pipeline)

    @property
    def expert_data_parallel(self) -> int:
        """EDP: the ranks that hold each expert's shard, DP x TP / (EP x ETP) = DP / EP (expert tensor
        parallelism ETP equal to TP)."""
        return self.data_parallel // self.parallel.expert

    def to_dict(self) -> dict:
        """Plain YAML-safe data (lists, not tuples) that :func:`from_dict` reads back."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------- the job's ports


@dataclass(frozen=True)
class PortRange:
    """One kind of server megatron-ft runs: it listens on a port of ``first .. first + count - 1`` of
    its host, moved by the setting ``setting``."""

    setting: str
    first: int
    count: int
    what: str  # the server, in a few words
    server: str  # the process that listens
    clients: str  # who connects to it
    when: str  # in which jobs it runs

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    @property
    def span(self) -> str:
        return str(self.first) if self.count == 1 else f"{self.first}-{self.last}"


def port_plan(cfg: "FTConfig") -> tuple[PortRange, ...]:
    """Every port megatron-ft's own processes listen on, by setting, lowest first (pure).

    On one machine (no ``health.hosts`` / ``host_pattern``) the agents' servers take ``port + node``;
    on hosts of their own every host uses the same ports."""
    per_node = cfg.cluster.nodes if cfg.health.one_machine else 1
    lc = cfg.launch
    rounds = 1 + (lc.fast_restarts if lc.warm_spares and lc.max_restarts else 0)
    plan = (
        PortRange("launch.rdzv_port", lc.rdzv_port, lc.rdzv_ports, "torchrun's rendezvous",
                  "the torchrun of node 0's launcher (generation 0), or of the lowest surviving node's after "
                  "node 0's launcher was lost (the next generation: the next free port of the range)",
                  "every node's torchrun", "every job"),
        PortRange("health.store_port", cfg.health.store_port, per_node, "the agents' coordination store",
                  "every node's agent (the lowest live one is the store everyone uses)",
                  "every node's agent, launcher and trainers", "jobs of more than one node or with peer redundancy"),
        PortRange("network.peer_port", cfg.network.peer_port, per_node, "the agents' peer transport",
                  "every node's agent", "the agents of the node's redundancy group, the root's liveness probe",
                  "redundancy.scheme other than none"),
        PortRange("launch.trainer_port", lc.trainer_port, rounds, "the trainers' store",
                  "torchrun's rank-0 trainer, or its warm-spare keeper (fast restart round n: trainer_port + n)",
                  "every trainer and keeper of the job", "every job under megatron-ft launch"),
    )
    return tuple(sorted(plan, key=lambda r: r.first))


def port_clash(cfg: "FTConfig") -> Optional[str]:
    """Why the port ranges of :func:`port_plan` cannot all be served (None: they can)."""
    plan = port_plan(cfg)
    for r in plan:
        if r.last > 65535:
            return (f"{r.setting}={r.first} is invalid: its ports {r.span} ({r.what}) run past 65535; "
                    f"it must leave {r.count} ports below 65536")
    for i, a in enumerate(plan):
        for b in plan[i + 1:]:
            if b.first <= a.last:
                return (f"{b.setting}={b.first} is invalid: its ports {b.span} ({b.what}) overlap {a.span} of "
                        f"{a.setting}={a.first} ({a.what}); move one of them")
    return None


SECTIONS = tuple(n for n in FTConfig.model_fields if n != "run_id")
