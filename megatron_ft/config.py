"""Job and cluster configuration: a YAML file plus ``--inmem-ckpt*`` flags, parsed into frozen,
validated dataclasses.

Every invalid value raises :class:`ConfigError` naming the field, the value and what is
allowed. Flags override the file; the file overrides the defaults below. The embedded
default is ``configs/local-cpu.yaml`` (2 simulated nodes x 2 ranks, TP1 PP2 DP2).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


def _fail(path: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: {allowed}")


def _check_int(path: str, value: Any, minimum: int, maximum: Optional[int] = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (
        maximum is not None and value > maximum
    ):
        hi = f" and <= {maximum}" if maximum is not None else ""
        _fail(path, value, f"must be an integer >= {minimum}{hi}")


def _check_str(path: str, value: Any, pattern: Optional[str] = None, what: str = "") -> None:
    if not isinstance(value, str) or not value:
        _fail(path, value, "must be a non-empty string")
    if pattern is not None and not re.fullmatch(pattern, value):
        _fail(path, value, what or f"must match {pattern}")


def _check_num(path: str, value: Any, minimum: float = 0.0, maximum: Optional[float] = None,
               strict: bool = False) -> None:
    """A real number >= minimum (> minimum when ``strict``) and <= maximum."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
            or (value <= minimum if strict else value < minimum) or (maximum is not None and value > maximum)):
        lo = f"> {minimum}" if strict else f">= {minimum}"
        hi = f" and <= {maximum}" if maximum is not None else ""
        _fail(path, value, f"must be a number {lo}{hi}")


AUTO = "auto"


def _normalize_auto_interval(obj: Any, section: str, placeholder: int, minimum: int) -> None:
    """``interval: auto`` becomes ``interval=placeholder, auto=True``: readers that only
    know numbers (the agent) see the placeholder; the trainer's policy picks the real interval
    (``megatron_ft/policy/runtime.py``). A number together with ``auto: true`` is a conflict."""
    if obj.interval == AUTO:
        object.__setattr__(obj, "interval", placeholder)
        object.__setattr__(obj, "auto", True)
    if not isinstance(obj.auto, bool):
        _fail(f"{section}.auto", obj.auto, "must be true or false")
    if not isinstance(obj.interval, int) or isinstance(obj.interval, bool) or obj.interval < minimum:
        _fail(f"{section}.interval", obj.interval, f"must be an integer >= {minimum} or 'auto'")
    if obj.auto and obj.interval != placeholder:
        _fail(f"{section}.interval", obj.interval,
              f"conflicts with {section}.auto=true: write 'interval: auto', or a number without auto")


@dataclass(frozen=True)
class ClusterConfig:
    """The machines: ``nodes`` x ``ranks_per_node`` training processes."""

    nodes: int = 2
    ranks_per_node: int = 2

    def __post_init__(self) -> None:
        _check_int("cluster.nodes", self.nodes, 1)
        _check_int("cluster.ranks_per_node", self.ranks_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron model parallelism; data parallelism is what is left of the world size."""

    tensor: int = 1
    pipeline: int = 2

    def __post_init__(self) -> None:
        _check_int("parallel.tensor", self.tensor, 1)
        _check_int("parallel.pipeline", self.pipeline, 1)


@dataclass(frozen=True)
class SnapshotConfig:
    """In-memory snapshots (trainer -> agent shared memory)."""

    interval: int = 1  # iterations between snapshots, or "auto" (measured, then chosen)
    chunk_mib: int = 4  # checksum / copy unit
    enabled: bool = True
    auto: bool = False  # set by "interval: auto"
    measure_iterations: int = 5  # snapshots measured before "auto" decides

    def __post_init__(self) -> None:
        _normalize_auto_interval(self, "snapshot", 1, 1)
        _check_int("snapshot.measure_iterations", self.measure_iterations, 1)
        _check_int("snapshot.chunk_mib", self.chunk_mib, 1, 1024)
        if not isinstance(self.enabled, bool):
            _fail("snapshot.enabled", self.enabled, "must be true or false")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_mib << 20


@dataclass(frozen=True)
class PersistConfig:
    """Asynchronous persistence of the newest consistent snapshot to disk by the agents."""

    interval: int = 0  # iterations between persisted snapshots; 0 = only at breakpoints
    dir: str = "/tmp/megatron-ft/persist"
    keep: int = 2  # persisted steps kept per rank
    on_failure: bool = True  # "save at breakpoint" when a trainer dies
    auto: bool = False  # set by "interval: auto": the trainers ask the agents to persist
    bandwidth_mib_s: float = 500.0  # write bandwidth per node to dir; "auto" persists no faster

    def __post_init__(self) -> None:
        _normalize_auto_interval(self, "persist", 0, 0)
        _check_num("persist.bandwidth_mib_s", self.bandwidth_mib_s, 0.0, strict=True)
        _check_str("persist.dir", self.dir)
        _check_int("persist.keep", self.keep, 1)
        if not isinstance(self.on_failure, bool):
            _fail("persist.on_failure", self.on_failure, "must be true or false")


@dataclass(frozen=True)
class AgentConfig:
    """The per-node snapshot agent (REFT's snapshot management process)."""

    shm_dir: str = "/dev/shm"
    socket_dir: str = "/tmp/megatron-ft/sockets"
    connect_timeout_s: float = 60.0
    #: the bound on every request to an agent (a trainer's, a launcher's, a peer agent's); one that
    #: waits on purpose (e.g. for queued persists) says its own
    request_timeout_s: float = 30.0
    shm_limit_mib: int = 0  # shared memory the agent may use; 0 = whatever shm_dir has free
    #: true: a trainer that cannot reach its agent or get its slots ends the job (exit 2, never retried);
    #: false: it trains unprotected, saying so
    required: bool = True

    def __post_init__(self) -> None:
        _check_str("agent.shm_dir", self.shm_dir)
        if not isinstance(self.required, bool):
            _fail("agent.required", self.required, "must be true or false")
        _check_int("agent.shm_limit_mib", self.shm_limit_mib, 0)
        _check_str("agent.socket_dir", self.socket_dir)
        if not isinstance(self.connect_timeout_s, (int, float)) or self.connect_timeout_s <= 0:
            _fail("agent.connect_timeout_s", self.connect_timeout_s, "must be a positive number of seconds")
        _check_num("agent.request_timeout_s", self.request_timeout_s, 1.0)


@dataclass(frozen=True)
class LaunchConfig:
    """How ``megatron-ft launch`` starts torchrun on each node."""

    master_addr: str = "127.0.0.1"
    rdzv_port: int = 29400
    max_restarts: int = 3
    #: a node whose agent does not start within this many seconds ends the job, naming the node
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check_str("launch.master_addr", self.master_addr)
        _check_int("launch.rdzv_port", self.rdzv_port, 1024, 65535)
        _check_int("launch.max_restarts", self.max_restarts, 0)
        _check_num("launch.start_timeout_s", self.start_timeout_s, 1.0)


@dataclass(frozen=True)
class HealthConfig:
    """Coordination among the agents: the key-value store, heartbeats, failure detection.

    ``store``: ``embedded`` (a torch TCPStore hosted by the root agent; every agent runs one at
    ``hosts[node]:store_port``, or ``127.0.0.1:store_port + node`` when ``hosts`` is empty, i.e.
    all nodes simulated on one machine) or ``etcd://host:port`` (an external etcd cluster).
    """

    store: str = "embedded"
    store_port: int = 29500
    heartbeat_s: float = 0.5
    timeout_s: float = 5.0
    hosts: tuple = ()
    host_pattern: str = ""  # e.g. "gpu-{node:04d}.cluster.internal", instead of listing hosts

    def host_of(self, node: int) -> str:
        """Where node ``node``'s agent listens (store server, peer transport)."""
        if self.hosts:
            return self.hosts[node]
        if self.host_pattern:
            return self.host_pattern.format(node=node)
        return "127.0.0.1"  # every node simulated on this machine

    def host_list(self, nodes: int) -> list:
        """Every node's host (empty: all nodes simulated on this machine, ports offset by node)."""
        return [] if self.one_machine else [self.host_of(n) for n in range(nodes)]

    @property
    def one_machine(self) -> bool:
        return not self.hosts and not self.host_pattern

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not (self.store == "embedded" or re.fullmatch(
                r"etcd://[A-Za-z0-9_.-]+:\d{1,5}", self.store)):
            _fail("health.store", self.store, "must be 'embedded' or 'etcd://HOST:PORT'")
        _check_int("health.store_port", self.store_port, 1024, 65535)
        _check_num("health.heartbeat_s", self.heartbeat_s, 0.01)
        _check_num("health.timeout_s", self.timeout_s, 0.1)
        if self.timeout_s <= self.heartbeat_s:
            _fail("health.timeout_s", self.timeout_s, f"must be larger than health.heartbeat_s={self.heartbeat_s}")
        if isinstance(self.hosts, list):
            object.__setattr__(self, "hosts", tuple(self.hosts))
        if not isinstance(self.hosts, tuple) or not all(isinstance(h, str) and h for h in self.hosts):
            _fail("health.hosts", self.hosts, "must be a list of host names, one per node (or empty: one machine)")
        if not isinstance(self.host_pattern, str) or (self.host_pattern and "{node" not in self.host_pattern):
            _fail("health.host_pattern", self.host_pattern, "must be empty or a format string containing {node}, "
                                                            "e.g. 'gpu-{node:04d}.cluster'")
        if self.hosts and self.host_pattern:
            _fail("health.host_pattern", self.host_pattern, "must be empty when health.hosts lists the hosts")


@dataclass(frozen=True)
class FailureConfig:
    """The failure model behind ``interval: auto`` and ``megatron-ft simulate`` (docs/policy.md)."""

    node_mttf_hours: float = 1600.0  # mean time to failure of one node; 1600 h = 1.5 % of nodes a day
    weibull_shape: float = 1.0  # c in REFT eq. 1 (1 = exponential; > 1 wear-out, < 1 infant mortality)
    software_fraction: float = 0.5  # failures that leave the node and its memory intact
    replacement_minutes: float = 5.0  # wait for a new node when no standby is free (GEMINI: 4-7 min)
    standby_nodes: int = 0  # idle spares that replace a failed node at once
    restart_minutes: float = 4.5  # detect + restart + warm up, for every failure

    def __post_init__(self) -> None:
        _check_num("failure.node_mttf_hours", self.node_mttf_hours, 0.0, strict=True)
        _check_num("failure.weibull_shape", self.weibull_shape, 0.0, 20.0, strict=True)
        _check_num("failure.software_fraction", self.software_fraction, 0.0, 1.0)
        _check_num("failure.replacement_minutes", self.replacement_minutes, 0.0)
        _check_int("failure.standby_nodes", self.standby_nodes, 0)
        _check_num("failure.restart_minutes", self.restart_minutes, 0.0)


@dataclass(frozen=True)
class SimulateConfig:
    """``megatron-ft simulate``: the job and the costs of each checkpointing strategy (docs/policy.md).
    Defaults are GEMINI's GPT-2 100B on p4d.24xlarge (sections 7.2-7.3)."""

    nodes: tuple = (16, 32, 64, 128, 256, 512, 1000)  # cluster sizes to sweep
    gpus_per_node: int = 8
    days: float = 30.0  # simulated wall time per run
    runs: int = 3  # independent runs per point (seeds seed, seed+1, ...)
    seed: int = 0
    iteration_seconds: float = 62.0
    snapshot_seconds: float = 3.0  # in-memory snapshot, start to complete in (peer) memory
    snapshot_stall_seconds: float = 0.0  # training time lost per in-memory snapshot
    memory_restore_seconds: float = 30.0  # resume from local memory
    peer_restore_seconds: float = 60.0  # resume from a replica or by decoding
    checkpoint_seconds: float = 558.0  # persistent checkpoint, start to durable (t_ckpt)
    checkpoint_stall_seconds: float = 81.0  # serialization that blocks training, per checkpoint
    retrieve_seconds: float = 558.0  # read the newest persistent checkpoint back (t_rtol)
    fixed_interval_hours: float = 3.0  # persistent-only baseline (BLOOM: every 3 h)
    persist_interval_hours: Any = AUTO  # megatron-ft's disk tier: hours or "auto"
    replicas: int = 2  # replica scheme: copies per node (GEMINI m)
    xor_group: int = 4  # xor scheme: nodes per parity group (REFT sharding group)
    rs_k: int = 4  # rs scheme: data nodes per group (ECHECK k)
    rs_m: int = 2  # rs scheme: parity nodes per group (ECHECK m)

    def __post_init__(self) -> None:
        nodes = self.nodes
        if isinstance(nodes, int) and not isinstance(nodes, bool):
            nodes = (nodes,)
        if not isinstance(nodes, (list, tuple)) or not nodes:
            _fail("simulate.nodes", self.nodes, "must be a non-empty list of integers >= 1")
        for i, n in enumerate(nodes):
            _check_int(f"simulate.nodes[{i}]", n, 1)
        object.__setattr__(self, "nodes", tuple(nodes))
        _check_int("simulate.gpus_per_node", self.gpus_per_node, 1)
        _check_num("simulate.days", self.days, 0.0, strict=True)
        _check_int("simulate.runs", self.runs, 1)
        _check_int("simulate.seed", self.seed, 0)
        _check_num("simulate.iteration_seconds", self.iteration_seconds, 0.0, strict=True)
        for name in ("snapshot_seconds", "snapshot_stall_seconds", "memory_restore_seconds",
                     "peer_restore_seconds", "checkpoint_stall_seconds", "retrieve_seconds"):
            _check_num(f"simulate.{name}", getattr(self, name), 0.0)
        _check_num("simulate.checkpoint_seconds", self.checkpoint_seconds, 0.0, strict=True)
        _check_num("simulate.fixed_interval_hours", self.fixed_interval_hours, 0.0, strict=True)
        if self.persist_interval_hours != AUTO:
            _check_num("simulate.persist_interval_hours", self.persist_interval_hours, 0.0, strict=True)
        _check_int("simulate.replicas", self.replicas, 1)
        _check_int("simulate.xor_group", self.xor_group, 2)
        _check_int("simulate.rs_k", self.rs_k, 1)
        _check_int("simulate.rs_m", self.rs_m, 1)


@dataclass(frozen=True)
class RedundancyConfig:
    """Peer redundancy of the in-memory snapshots against lost nodes (``megatron-ft plan``).

    ``none``: each node keeps only its own snapshot; ``replica``: GEMINI's mixed placement of
    ``replicas`` copies (the node's own included); ``xor``: REFT's RAIM5 parity inside each
    sharding group (``group_size`` nodes per parity group, 0 = the sharding group's whole node set);
    ``rs``: ECHECK's Cauchy Reed-Solomon with ``k`` data + ``m`` parity nodes per coding group.
    """

    scheme: str = "none"
    replicas: int = 2  # replica: copies of each node's snapshot, its own included (GEMINI m)
    group_size: int = 0  # xor: nodes per parity group; 0 = a whole sharding group (REFT)
    k: int = 4  # rs: data nodes per coding group (ECHECK k)
    m: int = 2  # rs: parity nodes per coding group; any m of a group's k + m nodes may fail
    #: who moves the bytes to the peers: ``agent`` (the agents exchange every consistent version as
    #: soon as it is clean) or ``scheduled`` (the trainers send it in planned chunks inside the idle
    #: spans / bubbles of the training timeline; the ``schedule`` section says how)
    transport: str = "agent"

    SCHEMES = ("none", "replica", "xor", "rs")
    TRANSPORTS = ("agent", "scheduled")

    def __post_init__(self) -> None:
        if self.scheme not in self.SCHEMES:
            _fail("redundancy.scheme", self.scheme, f"must be one of {', '.join(self.SCHEMES)}")
        _check_int("redundancy.replicas", self.replicas, 2)
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0 \
                or self.group_size == 1:
            _fail("redundancy.group_size", self.group_size,
                  "must be 0 (a whole sharding group) or an integer >= 2 (nodes per parity group)")
        _check_int("redundancy.k", self.k, 1)
        _check_int("redundancy.m", self.m, 1)
        if self.transport not in self.TRANSPORTS:
            _fail("redundancy.transport", self.transport, f"must be one of {', '.join(self.TRANSPORTS)}")
        if self.transport == "scheduled" and self.scheme != "replica":
            _fail("redundancy.transport", self.transport,
                  f"the scheduled transport sends whole copies: it needs redundancy.scheme=replica, "
                  f"not {self.scheme!r} (use transport: agent)")

    def check_cluster(self, nodes: int) -> None:
        """Cross-checks against ``cluster.nodes`` (called by :class:`FTConfig`)."""
        if self.scheme == "replica" and self.replicas > nodes:
            _fail("redundancy.replicas", self.replicas,
                  f"a replica group needs cluster.nodes >= redundancy.replicas, but cluster.nodes={nodes}")
        if self.scheme == "xor":
            if nodes < 2:
                _fail("redundancy.scheme", self.scheme, f"xor parity needs cluster.nodes >= 2, but cluster.nodes={nodes}")
            if self.group_size > nodes:
                _fail("redundancy.group_size", self.group_size,
                      f"must be <= cluster.nodes={nodes} (or 0 for a whole sharding group)")
        if self.scheme == "rs" and self.k + self.m > nodes:
            _fail("redundancy.k", self.k, f"a coding group needs cluster.nodes >= redundancy.k + redundancy.m = "
                                          f"{self.k + self.m}, but cluster.nodes={nodes}")


@dataclass(frozen=True)
class ScheduleConfig:
    """How the scheduled transport (``redundancy.transport: scheduled``) times checkpoint traffic
    (``docs/scheduling.md``).

    ``mode``: ``pipelined`` (GEMINI: chunks of R/p bytes in the network idle spans through p
    rotating sub-buffers), ``one-buffer`` (the same partition, one buffer of R: each chunk waits for
    the previous one's copy), ``naive`` (one chunk per idle span, as large as the span holds: its
    buffer can exceed R), ``blocking`` (everything at the start of the iteration, training waits),
    ``bubble`` (BAFT: the pipeline bubbles shared with the receiving node) or ``end`` (everything
    after the optimizer step, training waits). The first ``profile_iterations`` iterations are
    profiled without checkpoint traffic; the plan is made from them.

    ``idle``: which profiled spans ``pipelined``, ``one-buffer`` and ``naive`` fill. ``network``
    (GEMINI): the spans in which no send, receive or collective runs - free time when a NIC moves the
    bytes and the GPU computes meanwhile. ``device``: the spans in which the rank waits (its
    pipeline bubbles, the regular P2P time reserved at both ends as BAFT does) - the only free time
    where the host's cores both compute and move the bytes (gloo on a CPU-only machine). ``auto``:
    ``device`` when the job trains on CPU, else ``network``.
    """

    mode: str = "pipelined"
    sub_buffers: int = 4  # p
    reserved_mib: float = 64.0  # R: sender-side buffer memory for checkpoint traffic
    mu: float = 0.9  # share of each profiled idle span the plan may use
    profile_iterations: int = 20  # W (GEMINI: 20)
    bandwidth_mib_s: float = 0.0  # link for the plan; 0 = estimated from the profile's P2P transfers
    alpha_s: float = 0.0  # per-chunk start-up time of the link model f(s) = alpha + s/B
    idle: str = "network"  # network | device | auto: the spans the GEMINI modes fill (see above)
    #: a peer copy at most every this many iterations (N); a plan that would need n < N iterations is
    #: spread over about N, using n/N of every span per iteration (modes.plan_sends_every): GEMINI's
    #: "reduce the checkpoint frequency to amortize" when the traffic interferes anyway
    min_interval: int = 1
    #: benchmarks (benchmarks/scheduling.py): rotate through these modes in one job, each for
    #: ``compare_iterations`` iterations ("local": no peer traffic), so every mode sees the same machine
    compare_modes: tuple = ()
    compare_iterations: int = 6

    MODES = ("pipelined", "one-buffer", "naive", "blocking", "bubble", "end")
    IDLE = ("network", "device", "auto")
    #: compare_modes only: "local" = snapshots, no peer traffic; "off" = no snapshots either
    BASELINES = ("local", "off")

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            _fail("schedule.mode", self.mode, f"must be one of {', '.join(self.MODES)}")
        _check_int("schedule.sub_buffers", self.sub_buffers, 1, 64)
        _check_num("schedule.reserved_mib", self.reserved_mib, 0.0, strict=True)
        _check_num("schedule.mu", self.mu, 0.0, 1.0, strict=True)
        _check_int("schedule.profile_iterations", self.profile_iterations, 2)
        _check_num("schedule.bandwidth_mib_s", self.bandwidth_mib_s, 0.0)
        _check_num("schedule.alpha_s", self.alpha_s, 0.0)
        if self.idle not in self.IDLE:
            _fail("schedule.idle", self.idle, f"must be one of {', '.join(self.IDLE)}")
        if isinstance(self.compare_modes, (list, str)):
            modes = self.compare_modes.split(",") if isinstance(self.compare_modes, str) else self.compare_modes
            object.__setattr__(self, "compare_modes", tuple(m.strip() for m in modes if m.strip()))
        bad = [m for m in self.compare_modes if m not in self.MODES + self.BASELINES]
        if not isinstance(self.compare_modes, tuple) or bad:
            _fail("schedule.compare_modes", list(self.compare_modes) if isinstance(self.compare_modes, tuple)
                  else self.compare_modes, f"must list modes of {', '.join(self.MODES + self.BASELINES)}")
        _check_int("schedule.compare_iterations", self.compare_iterations, 2)
        _check_int("schedule.min_interval", self.min_interval, 1)

    @property
    def reserved_bytes(self) -> int:
        return int(self.reserved_mib * 2**20)


@dataclass(frozen=True)
class FTConfig:
    """Everything megatron-ft needs to know about a job."""

    run_id: str = "megatron-ft"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    persist: PersistConfig = field(default_factory=PersistConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    redundancy: RedundancyConfig = field(default_factory=RedundancyConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def __post_init__(self) -> None:
        _check_str("run_id", self.run_id, r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}",
                   "must be 1-64 characters of letters, digits, '_', '.', '-' (starting with a letter or digit)")
        mp = self.parallel.tensor * self.parallel.pipeline
        if self.cluster.world_size % mp:
            raise ConfigError(
                f"parallel.tensor*parallel.pipeline={mp} does not divide the world size "
                f"cluster.nodes*cluster.ranks_per_node={self.cluster.world_size}: the world size must be a "
                f"multiple of tensor*pipeline"
            )
        self.redundancy.check_cluster(self.cluster.nodes)
        if self.health.hosts and len(self.health.hosts) != self.cluster.nodes:
            _fail("health.hosts", list(self.health.hosts), f"must list cluster.nodes={self.cluster.nodes} hosts")

    @property
    def data_parallel(self) -> int:
        return self.cluster.world_size // (self.parallel.tensor * self.parallel.pipeline)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["simulate"]["nodes"] = list(d["simulate"]["nodes"])
        d["health"]["hosts"] = list(d["health"]["hosts"])  # YAML-safe (safe_dump has no tuples)
        d["schedule"]["compare_modes"] = list(d["schedule"]["compare_modes"])
        return d


_SECTIONS = {
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "snapshot": SnapshotConfig,
    "persist": PersistConfig,
    "agent": AgentConfig,
    "launch": LaunchConfig,
    "failure": FailureConfig,
    "simulate": SimulateConfig,
    "redundancy": RedundancyConfig,
    "health": HealthConfig,
    "schedule": ScheduleConfig,
}

DEFAULT_CONFIG_PATH = os.path.join(os.path.dirname(__file__), "configs", "local-cpu.yaml")


def from_dict(data: Mapping[str, Any], source: str = "<dict>") -> FTConfig:
    """Build a validated config from a mapping (as loaded from YAML). Unknown keys are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    known = {"run_id", *(_SECTIONS)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    if "run_id" in data:
        kwargs["run_id"] = data["run_id"]
    for name, cls in _SECTIONS.items():
        section = data.get(name) or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"{source}: {name}={section!r} must be a mapping")
        allowed = {f.name for f in fields(cls)}
        bad = sorted(set(section) - allowed)
        if bad:
            raise ConfigError(f"{source}: unknown key(s) {[f'{name}.{b}' for b in bad]}; allowed: "
                              f"{sorted(f'{name}.{a}' for a in allowed)}")
        kwargs[name] = cls(**section)
    return FTConfig(**kwargs)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"key {key!r} is given twice (first {seen[key]}); each key may appear once", key_node.start_mark)
            seen[key] = f"line {key_node.start_mark.line + 1}"
        return super().construct_mapping(node, deep=deep)


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def load(path: Optional[str] = None) -> FTConfig:
    """Load a config file (the embedded default ``local-cpu.yaml`` when ``path`` is None)."""
    path = path or DEFAULT_CONFIG_PATH
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = load_yaml(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    return from_dict(data, source=path)


def replace(cfg: FTConfig, **sections: Mapping[str, Any]) -> FTConfig:
    """Return ``cfg`` with some fields of some sections replaced (validated again)."""
    kwargs: dict[str, Any] = {}
    for name, changes in sections.items():
        if name == "run_id":
            kwargs["run_id"] = changes
            continue
        kwargs[name] = dataclasses.replace(getattr(cfg, name), **changes)
    return dataclasses.replace(cfg, **kwargs)


# ---------------------------------------------------------------- Megatron-style flags


def add_inmem_ckpt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--inmem-ckpt*`` flags to a Megatron-style argument parser."""
    g = parser.add_argument_group("megatron-ft in-memory checkpointing")
    g.add_argument("--inmem-ckpt", action="store_true", help="snapshot training state into host memory")
    g.add_argument("--inmem-ckpt-config", metavar="PATH", default=None,
                   help="megatron-ft cluster/job YAML (default: the embedded configs/local-cpu.yaml)")
    g.add_argument("--inmem-ckpt-interval", type=_int_or_auto, metavar="N|auto", default=None,
                   help="iterations between in-memory snapshots (default 1; auto: measured, then chosen)")
    g.add_argument("--inmem-ckpt-persist-interval", type=_int_or_auto, metavar="N|auto", default=None,
                   help="iterations between snapshots persisted to disk by the agents (0: only on failure; auto)")
    g.add_argument("--inmem-ckpt-persist-dir", metavar="DIR", default=None,
                   help="directory for persisted snapshots")
    return parser


def _int_or_auto(text: str) -> Any:
    return AUTO if text == AUTO else int(text)


def from_args(args: argparse.Namespace) -> FTConfig:
    """The config file named by ``--inmem-ckpt-config`` (or the default), overridden by flags
    and by the launcher's environment (``MFT_CONFIG``, ``MFT_RUN_ID``)."""
    path = getattr(args, "inmem_ckpt_config", None) or os.environ.get("MFT_CONFIG")
    return apply_flags(load(path), args)


def command_flags(argv: list[str]) -> argparse.Namespace:
    """The ``--inmem-ckpt*`` flags of a training command (its other arguments ignored): the
    launcher reads them so that its agents use what the trainers use."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_inmem_ckpt_args(p)
    try:
        known, _ = p.parse_known_args(argv)
    except SystemExit as e:  # argparse already printed which flag and value
        raise ConfigError(f"the training command's --inmem-ckpt* flags are invalid: {' '.join(argv)}") from e
    return known


#: settings that a trainer and its node's agent must agree on (a trainer that sees a difference refuses to start)
SHARED_SETTINGS = ("persist.dir", "persist.interval", "persist.keep", "redundancy.scheme", "snapshot.interval")


def shared_settings(cfg: FTConfig) -> dict[str, Any]:
    out = {}
    for key in SHARED_SETTINGS:
        section, field_name = key.split(".")
        value = getattr(getattr(cfg, section), field_name)
        if section == "persist" and field_name == "dir":
            value = os.path.abspath(value)
        out[key] = value
    return out


def settings_differ(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``key: a vs b`` for every shared setting that differs (keys missing on either side ignored)."""
    return [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in SHARED_SETTINGS
            if k in mine and k in theirs and mine[k] != theirs[k]]


def apply_flags(cfg: FTConfig, args: argparse.Namespace) -> FTConfig:
    """``cfg`` with the ``--inmem-ckpt*`` flags in ``args`` and ``MFT_RUN_ID`` applied."""
    snap: dict[str, Any] = {}
    pers: dict[str, Any] = {}
    if getattr(args, "inmem_ckpt_interval", None) is not None:
        snap["interval"] = args.inmem_ckpt_interval
        snap["auto"] = args.inmem_ckpt_interval == AUTO
    if getattr(args, "inmem_ckpt_persist_interval", None) is not None:
        pers["interval"] = args.inmem_ckpt_persist_interval
        pers["auto"] = args.inmem_ckpt_persist_interval == AUTO
    if getattr(args, "inmem_ckpt_persist_dir", None) is not None:
        pers["dir"] = args.inmem_ckpt_persist_dir
    changes: dict[str, Any] = {}
    if snap:
        changes["snapshot"] = snap
    if pers:
        changes["persist"] = pers
    if os.environ.get("MFT_RUN_ID"):
        changes["run_id"] = os.environ["MFT_RUN_ID"]
    return replace(cfg, **changes) if changes else cfg
