"""Job and cluster configuration: a YAML file plus ``--inmem-ckpt*`` flags, parsed into frozen,
validated models (pydantic v2: types, ranges, literal choices and unknown keys are its work; the
project words every message).

Every invalid value raises :class:`ConfigError` naming the field, the value and what is
allowed. Flags override the file; the file overrides the defaults below. The embedded
default is ``configs/local-cpu.yaml`` (2 simulated nodes x 2 ranks, TP1 PP2 DP2). A key given
twice in the file is an error; :func:`schema` is the JSON Schema of the file
(``megatron-ft config --schema``).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      field_validator, model_validator)


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


def _check_num(path: str, value: Any, minimum: float = 0.0, maximum: Optional[float] = None,
               strict: bool = False) -> None:
    """A real number >= minimum (> minimum when ``strict``) and <= maximum."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
            or (value <= minimum if strict else value < minimum) or (maximum is not None and value > maximum)):
        lo = f"> {minimum}" if strict else f">= {minimum}"
        hi = f" and <= {maximum}" if maximum is not None else ""
        _fail(path, value, f"must be a number {lo}{hi}")


AUTO = "auto"

#: the redundancy schemes, defined once (the planners and the simulator use these)
Scheme = Literal["none", "replica", "xor", "rs"]
SCHEMES: tuple[str, ...] = get_args(Scheme)
Transport = Literal["agent", "scheduled"]
Prefer = Literal["newest", "certified"]
Mode = Literal["pipelined", "one-buffer", "naive", "blocking", "bubble", "end"]
Idle = Literal["network", "device", "auto"]
#: compare_modes only: "local" = snapshots, no peer traffic; "off" = no snapshots either
Baseline = Literal["local", "off"]
CompareMode = Literal[get_args(Mode) + get_args(Baseline)]  # type: ignore[valid-type]


class Allowed(str):
    """Annotated metadata: what a field allows, in the words every message uses."""


def _int(minimum: int, maximum: Optional[int] = None) -> Any:
    hi = f" and <= {maximum}" if maximum is not None else ""
    return Annotated[StrictInt, Field(ge=minimum, le=maximum), Allowed(f"must be an integer >= {minimum}{hi}")]


def _num(minimum: float = 0.0, maximum: Optional[float] = None, strict: bool = False) -> Any:
    lo = f"> {minimum}" if strict else f">= {minimum}"
    hi = f" and <= {maximum}" if maximum is not None else ""
    bound = Field(gt=minimum, le=maximum) if strict else Field(ge=minimum, le=maximum)
    return Annotated[StrictFloat, bound, Allowed(f"must be a number {lo}{hi}")]


def _choice(t: Any) -> Any:
    return Annotated[t, Allowed(f"must be one of {', '.join(get_args(t))}")]


Flag = Annotated[StrictBool, Allowed("must be true or false")]
Text = Annotated[StrictStr, Field(min_length=1), Allowed("must be a non-empty string")]


class _Section(BaseModel):
    """A frozen section: unknown keys, wrong types and out-of-range values are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_default=True)


def _auto_interval(data: Any, section: str, placeholder: int, minimum: int) -> Any:
    """``interval: auto`` becomes ``interval=placeholder, auto=True``: readers that only know
    numbers (the agent) see the placeholder; the trainer's policy picks the real interval
    (``megatron_ft/policy/runtime.py``). A number together with ``auto: true`` is a conflict."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    interval, auto = data.get("interval", placeholder), data.get("auto", False)
    if interval == AUTO:
        interval, auto = placeholder, True if auto is False else auto
        data.update(interval=placeholder, auto=auto)
    if not isinstance(auto, bool):
        _fail(f"{section}.auto", auto, "must be true or false")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < minimum:
        _fail(f"{section}.interval", interval, f"must be an integer >= {minimum} or 'auto'")
    if auto and interval != placeholder:
        _fail(f"{section}.interval", interval,
              f"conflicts with {section}.auto=true: write 'interval: auto', or a number without auto")
    return data


class ClusterConfig(_Section):
    """The machines: ``nodes`` x ``ranks_per_node`` training processes."""

    nodes: _int(1) = 2
    ranks_per_node: _int(1) = 2

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


class ParallelConfig(_Section):
    """Megatron model parallelism; data parallelism is what is left of the world size. ``expert``: a
    mixture-of-experts job's expert parallelism (``--expert-model-parallel-size``, EP; 1 for a dense
    model): each expert's parameters and optimizer state live on the expert-data-parallel ranks only,
    EDP = DP x TP / (EP x ETP) = DP / EP of them (expert tensor parallelism ETP equal to TP)."""

    tensor: _int(1) = 1
    pipeline: _int(1) = 2
    expert: _int(1) = 1


class SnapshotConfig(_Section):
    """In-memory snapshots (trainer -> agent shared memory)."""

    interval: Union[StrictInt, Literal["auto"]] = 1  # iterations between snapshots, or "auto"
    chunk_mib: _int(1, 1024) = 4  # checksum / copy unit
    enabled: Flag = True
    auto: Flag = False  # set by "interval: auto"
    measure_iterations: _int(1) = 5  # snapshots measured before "auto" decides
    #: finish each snapshot before training goes on (its copy and the ranks' agreement become training
    #: time). Off: the copy runs during the next forward/backward and the optimizer step waits for it.
    synchronous: Flag = False
    #: who decides which step every rank holds: ``agents`` (the default: each trainer waits only for its
    #: own copy; the node agents aggregate the commits through the store, off the training path) or
    #: ``collective`` (every snapshot ends in a MIN all-reduce over every rank, which the next optimizer
    #: step waits for: the design of before, kept for comparison in benchmarks/scale.py)
    agreement: Literal["agents", "collective"] = "agents"

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: Any) -> Any:
        return _auto_interval(data, "snapshot", 1, 1)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_mib << 20


class PersistConfig(_Section):
    """Asynchronous persistence of the newest consistent snapshot to disk by the agents."""

    interval: Union[StrictInt, Literal["auto"]] = 0  # iterations between persists; 0 = only at breakpoints
    dir: Text = "/tmp/megatron-ft/persist"
    keep: _int(1) = 2  # persisted steps kept per rank
    on_failure: Flag = True  # "save at breakpoint" when a trainer dies
    auto: Flag = False  # set by "interval: auto": the trainers ask the agents to persist
    bandwidth_mib_s: _num(0.0, strict=True) = 500.0  # write bandwidth per node to dir

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: Any) -> Any:
        return _auto_interval(data, "persist", 0, 0)


class AgentConfig(_Section):
    """The per-node snapshot agent (REFT's snapshot management process)."""

    shm_dir: Text = "/dev/shm"
    socket_dir: Text = "/tmp/megatron-ft/sockets"
    #: how long a trainer started by ``megatron-ft launch`` waits for its node's agent to listen (one its
    #: launcher is restarting), and an agent for the health store
    connect_timeout_s: Annotated[StrictFloat, Field(gt=0), Allowed("must be a positive number of seconds")] = 60.0
    #: the bound on every request to an agent (a trainer's, a launcher's, a peer agent's); one that
    #: waits on purpose (e.g. for queued persists) says its own
    request_timeout_s: _num(1.0) = 30.0
    #: shared memory the agent's slots may use; 0 = whatever shm_dir has free. Peer block versions
    #: (redundancy) are created outside it and not yet counted: leave room for them beyond the limit
    shm_limit_mib: _int(0) = 0
    #: true: a trainer that cannot reach its agent or get its slots ends the job (exit 2, never retried);
    #: false: it trains unprotected, saying so
    required: Flag = True


class LaunchConfig(_Section):
    """How ``megatron-ft launch`` starts torchrun on each node."""

    master_addr: Text = "127.0.0.1"
    #: torchrun's rendezvous: generation 0 at ``master_addr:rdzv_port``; a generation a survivor hosts
    #: after node 0's launcher was lost takes the next free port of ``rdzv_port .. rdzv_port + rdzv_ports - 1``
    rdzv_port: _int(1024, 65535) = 29400
    rdzv_ports: _int(1, 1000) = 8
    #: the trainers' process-group store of each torchrun attempt, hosted by torchrun's rank 0 (or its
    #: warm-spare keeper) at ``MASTER_ADDR:trainer_port``; fast restart round ``n`` at ``trainer_port + n``
    #: (torchrun would pick an ephemeral ``MASTER_PORT``)
    trainer_port: _int(1024, 65535) = 29700
    max_restarts: _int(0) = 3
    #: a node whose agent does not start within this many seconds ends the job, naming the node
    start_timeout_s: _num(1.0) = 120.0
    #: torchrun's rendezvous drops a node whose torchrun sent no keep-alive for
    #: ``rdzv_keep_alive_s x rdzv_keep_alive_attempts`` seconds (its wall clock against the others':
    #: keep the hosts' clocks in sync); a lost node's place opens for its replacement only then
    #: (torch's defaults, 5 s x 3, made every node loss wait 10-15 s)
    rdzv_keep_alive_s: _int(1) = 1
    #: a failed trainer restarts the job beneath torchrun, from the warm spares, up to this many times
    #: per torchrun attempt (megatron_ft/spares/fast_restart.py); 0: torchrun restarts every time.
    #: Needs warm_spares; none with max_restarts 0
    fast_restarts: _int(0) = 3
    #: in a fast restart round, trainers that survived keep their process (its imports; on a GPU its CUDA
    #: context) and rejoin the round in it, building their model again and restoring into it
    #: (megatron_ft/trainer/in_process.py; scripts that run their training through it); false: every
    #: round replaces every trainer by a fresh fork. Needs fast_restarts
    in_process_restart: Flag = True
    #: a survivor asked to rejoin in place that has not unwound within this many seconds (stuck where no
    #: abort reaches, or its device unusable) is replaced by a fresh fork; ``auto``: 2 s for trainers on
    #: gloo, 10 s on NCCL, whose communicators' abort and device check come on top
    #: (megatron_ft/spares/fast_restart.py ``AUTO_GRACE_S``). A number applies to every backend
    in_process_grace_s: Annotated[Union[Annotated[StrictFloat, Field(ge=0.1)], Literal["auto"]],
                                  Allowed("must be a number >= 0.1 (seconds) or 'auto'")] = AUTO
    rdzv_keep_alive_attempts: _int(1) = 3
    #: keep a pool of warm spare trainers on every node (torch and megatron-core already imported):
    #: torchrun's restarted workers start from it in a fraction of a second (megatron_ft/spares)
    warm_spares: Flag = True


class HealthConfig(_Section):
    """Coordination among the agents: the key-value store, heartbeats, failure detection.

    ``store``: ``embedded`` (served by the root agent on the project's authenticated wire; every agent
    runs a server at ``hosts[node]:store_port``, or ``127.0.0.1:store_port + node`` when ``hosts`` is
    empty, i.e. all nodes simulated on one machine) or ``etcd://host:port`` (an external etcd cluster).

    ``etcd_ca_file``: etcd over TLS (HTTPS), its server certificate checked against this CA; with
    ``etcd_cert_file`` and ``etcd_key_file`` the agents present a client certificate (etcd's
    ``--client-cert-auth``). Empty: plain HTTP.
    """

    store: Annotated[StrictStr, Field(pattern=r"^(embedded|etcd://[A-Za-z0-9_.-]+:\d{1,5})$"),
                     Allowed("must be 'embedded' or 'etcd://HOST:PORT'")] = "embedded"
    store_port: _int(1024, 65535) = 29500
    heartbeat_s: _num(0.01) = 0.25
    timeout_s: _num(0.1) = 5.0
    hosts: Annotated[tuple[Annotated[StrictStr, Field(min_length=1)], ...],
                     Allowed("must be a list of host names, one per node (or empty: one machine)")] = ()
    host_pattern: StrictStr = ""  # e.g. "gpu-{node:04d}.cluster.internal", instead of listing hosts
    etcd_ca_file: StrictStr = ""
    etcd_cert_file: StrictStr = ""
    etcd_key_file: StrictStr = ""

    @model_validator(mode="after")
    def _check(self) -> "HealthConfig":
        tls = {"health.etcd_ca_file": self.etcd_ca_file, "health.etcd_cert_file": self.etcd_cert_file,
               "health.etcd_key_file": self.etcd_key_file}
        for name, value in tls.items():
            if value and not self.store.startswith("etcd://"):
                _fail(name, value, f"is for an etcd store; health.store is {self.store!r}")
        if bool(self.etcd_cert_file) != bool(self.etcd_key_file):
            given = "health.etcd_cert_file" if self.etcd_cert_file else "health.etcd_key_file"
            _fail(given, tls[given], "needs its pair: give health.etcd_cert_file and health.etcd_key_file together")
        if self.etcd_cert_file and not self.etcd_ca_file:
            _fail("health.etcd_cert_file", self.etcd_cert_file, "needs health.etcd_ca_file (a client certificate is "
                                                                "only sent over TLS)")
        if self.timeout_s <= self.heartbeat_s:
            _fail("health.timeout_s", self.timeout_s, f"must be larger than health.heartbeat_s={self.heartbeat_s}")
        if self.host_pattern and "{node" not in self.host_pattern:
            _fail("health.host_pattern", self.host_pattern, "must be empty or a format string containing {node}, "
                                                            "e.g. 'gpu-{node:04d}.cluster'")
        if self.hosts and self.host_pattern:
            _fail("health.host_pattern", self.host_pattern, "must be empty when health.hosts lists the hosts")
        return self

    @property
    def group_answer_s(self) -> float:
        """How long a replacement's agent waits for every member of its redundancy group to say what
        it holds before its restore lists what the group can rebuild: a root failover moves the store
        (up to ``timeout_s``) and the survivors re-publish their addresses at their next heartbeats.
        At least 15 s."""
        return max(15.0, 2 * self.timeout_s + 4 * self.heartbeat_s)

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


class NetworkConfig(_Section):
    """The network the job's hosts share (megatron_ft/network.py).

    ``interface``: that network's interface on every host (e.g. ``eth0``, ``ib0``; empty: not set).
    When set, every server megatron-ft runs itself (the agents' peer transport, a rendezvous
    generation its launcher hosts) listens on that interface's address only, and the trainers get
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` from it unless their environment sets them. The
    names in ``health.hosts`` / ``health.host_pattern`` must resolve to addresses on that network.

    ``replication_dscp``: the DiffServ code point the agents' connections to their peers carry (the
    snapshot copies and parity of ``redundancy.transport: agent``; the IP header's TOS / traffic class
    byte is ``dscp << 2``). 0 leaves them unmarked. On a network whose switches and hosts give a lower
    class to ``8`` (CS1, the usual "lower effort" class) the job's collectives go first and the copies
    take what they leave of the link (docs/operators.md). The scheduled transport's chunks travel on the
    job's own backend (gloo, NCCL) and are not marked.
    """

    interface: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.:@-]{0,15}$"),
                         Allowed("must be empty or a network interface name (at most 15 characters, "
                                 "e.g. eth0)")] = ""
    #: the agents' peer transport (snapshot copies, parity, rebuilds): every agent of a job with
    #: ``redundancy.scheme`` other than none listens on ``peer_port`` (``+ node`` on one machine)
    peer_port: _int(1024, 65535) = 29600
    replication_dscp: _int(0, 63) = 0


class SecurityConfig(_Section):
    """Who may talk to the servers megatron-ft runs (docs/security.md).

    ``secret_file``: a file holding the job's secret (at least 16 bytes), the same on every host (shared
    storage, a Kubernetes Secret); every TCP connection to an agent's store or peer transport proves it both ways
    (HMAC-SHA256 challenge and response) before anything else is read. Empty: ``MFT_JOB_SECRET_FILE``
    from the environment; else, when every node runs on this machine, one the launchers generate in the
    run directory (``job.secret``, mode 0600). A job of hosts of their own without one is refused at
    launch.
    """

    secret_file: StrictStr = ""


class RecoveryConfig(_Section):
    """What a restore checks before training goes on (megatron_ft/trainer/guard.py, docs/recovery-time.md).

    ``guard``: every rank checks that the values it restored are finite; a version that fails on any rank
    is invalidated and every rank rolls back to the next older one. Then, where the training loop reports
    its loss, for ``guard_iterations`` iterations each loss is compared with the losses recorded before
    the failure: a replayed step within ``loss_tolerance`` (relative) of its recorded loss, a new step at
    most ``loss_spike`` times the largest recent recorded loss; an anomaly rolls every rank back to the
    version before the restored one. ``max_rollbacks``: at most this many rollbacks (in one restore, and
    counted by the agents across the restarts that loss rollbacks make); one more ends the job (exit 3)
    instead of restarting into garbage.

    ``prefer``: ``newest`` restores the newest version every rank can reach; ``certified`` the newest
    *certified* one - a version the job trained ``certify_after`` iterations past with no loss anomaly
    (every iteration's loss judged by the same rules, all ranks agreeing) - and an older version only
    where that one is not held. Two more slots per rank keep the certified version and the one being
    watched; an all-reduce per iteration carries the verdict."""

    guard: Flag = True
    max_rollbacks: _int(0) = 2
    guard_iterations: _int(0) = 3  # 0: no loss check
    loss_tolerance: _num(0.0, strict=True) = 0.05
    loss_spike: _num(1.0, strict=True) = 2.0
    prefer: _choice(Prefer) = "newest"
    certify_after: _int(1) = 3

    @property
    def marked_versions(self) -> int:
        """Versions every holder keeps beside its own: with ``prefer: certified``, the certified one and
        the one being watched - two more slots per rank, two more versions per peer block."""
        return 2 if self.prefer == "certified" else 0


class HangConfig(_Section):
    """A rank that stops progressing without dying (docs/recovery-time.md, "Hangs").

    Every trainer writes where it is (its own work, a collective, its agent, the restore, Megatron's
    own disk save) into a record its node agent reads every ``tick_s``. A rank quiet in its own work
    - or stopped - longer than the *bound* while every other rank of the job waits is declared hung,
    SIGKILLed, and recovered like a crash. The bound is ``k`` times the p99 of the job's recent
    iteration times, clamped to [``floor_s``, ``ceiling_s``]; until ``warmup_iterations`` iterations
    have been timed since the trainer started it is ``first_s``; a rank in its restore gets
    ``restore_s``, one in Megatron's own disk save ``save_s``, one from its start to its first iteration
    (imports, rendezvous, model and data set-up) ``start_s``. A trainer whose process has not ended
    ``exit_s`` after it began to exit ends itself (0: never). ``collective_s`` (0: off): every rank
    waiting in collectives that long with no rank to blame - a collective that deadlocked - restarts
    all of them. ``max_culprits`` (0: one node's ranks): at most that many hung ranks per verdict, and
    no more than the waiting ones (many ranks quiet in their own work is the job's work, not a hang). ``straggler_ratio`` / ``straggler_iterations``: a rank whose own work per iteration is
    over that ratio of its node's median for that many iterations in a row is reported (not killed)."""

    enabled: Flag = True
    tick_s: _num(0.01, strict=True) = 0.25
    k: _num(1.0) = 10.0
    floor_s: _num(0.1) = 5.0
    ceiling_s: _num(0.1) = 120.0
    warmup_iterations: _int(1) = 3
    first_s: _num(0.1) = 120.0
    restore_s: _num(0.1) = 300.0
    save_s: _num(0.1) = 3600.0
    start_s: _num(0.1) = 900.0
    exit_s: _num(0.0) = 120.0
    max_culprits: _int(0) = 0
    collective_s: _num(0.0) = 0.0
    straggler_ratio: _num(1.0, strict=True) = 1.2
    straggler_iterations: _int(1) = 20

    @model_validator(mode="after")
    def _check(self) -> "HangConfig":
        if self.ceiling_s < self.floor_s:
            _fail("hang.ceiling_s", self.ceiling_s, f"must be at least hang.floor_s={self.floor_s}")
        if self.tick_s * 4 > self.floor_s:
            _fail("hang.tick_s", self.tick_s, f"must be at most a quarter of hang.floor_s={self.floor_s}")
        return self


class FailureConfig(_Section):
    """The failure model behind ``interval: auto`` and ``megatron-ft simulate`` (docs/policy.md)."""

    node_mttf_hours: _num(0.0, strict=True) = 1600.0  # mean time to failure of one node
    weibull_shape: _num(0.0, 20.0, strict=True) = 1.0  # c in REFT eq. 1 (1 = exponential)
    software_fraction: _num(0.0, 1.0) = 0.5  # failures that leave the node and its memory intact
    replacement_minutes: _num(0.0) = 5.0  # wait for a new node when no standby is free (GEMINI: 4-7 min)
    standby_nodes: _int(0) = 0  # idle spares that replace a failed node at once
    restart_minutes: _num(0.0) = 4.5  # detect + restart + warm up, for every failure


class SimulateConfig(_Section):
    """``megatron-ft simulate``: the job and the costs of each checkpointing strategy (docs/policy.md).
    Defaults are GEMINI's GPT-2 100B on p4d.24xlarge (sections 7.2-7.3)."""

    nodes: Annotated[tuple[_int(1), ...], Field(min_length=1),
                     Allowed("must be a non-empty list of integers >= 1")] = (16, 32, 64, 128, 256, 512, 1000)
    gpus_per_node: _int(1) = 8
    days: _num(0.0, strict=True) = 30.0  # simulated wall time per run
    runs: _int(1) = 3  # independent runs per point (seeds seed, seed+1, ...)
    seed: _int(0) = 0
    iteration_seconds: _num(0.0, strict=True) = 62.0
    snapshot_seconds: _num(0.0) = 3.0  # in-memory snapshot, start to complete in (peer) memory
    snapshot_stall_seconds: _num(0.0) = 0.0  # training time lost per in-memory snapshot
    memory_restore_seconds: _num(0.0) = 30.0  # resume from local memory
    peer_restore_seconds: _num(0.0) = 60.0  # resume from a replica or by decoding
    checkpoint_seconds: _num(0.0, strict=True) = 558.0  # persistent checkpoint, start to durable (t_ckpt)
    checkpoint_stall_seconds: _num(0.0) = 81.0  # serialization that blocks training, per checkpoint
    retrieve_seconds: _num(0.0) = 558.0  # read the newest persistent checkpoint back (t_rtol)
    fixed_interval_hours: _num(0.0, strict=True) = 3.0  # persistent-only baseline (BLOOM: every 3 h)
    persist_interval_hours: Union[Annotated[StrictFloat, Field(gt=0)], Literal["auto"]] = AUTO
    replicas: _int(1) = 2  # replica scheme: copies per node (GEMINI m)
    xor_group: _int(2) = 4  # xor scheme: nodes per parity group (REFT sharding group)
    rs_k: _int(1) = 4  # rs scheme: data nodes per group (ECHECK k)
    rs_m: _int(1) = 2  # rs scheme: parity nodes per group (ECHECK m)

    @field_validator("nodes", mode="before")
    @classmethod
    def _one_size(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("persist_interval_hours", mode="before")
    @classmethod
    def _hours(cls, v: Any) -> Any:
        if v != AUTO:
            _check_num("simulate.persist_interval_hours", v, 0.0, strict=True)
        return v


class RedundancyConfig(_Section):
    """Peer redundancy of the in-memory snapshots against lost nodes (``megatron-ft plan``).

    ``none``: each node keeps only its own snapshot; ``replica``: GEMINI's mixed placement of
    ``replicas`` copies (the node's own included); ``xor``: REFT's RAIM5 parity inside each
    sharding group (``group_size`` nodes per parity group, 0 = the sharding group's whole node set);
    ``rs``: ECHECK's Cauchy Reed-Solomon with ``k`` data + ``m`` parity nodes per coding group.
    """

    scheme: _choice(Scheme) = "none"
    replicas: _int(2) = 2  # replica: copies of each node's snapshot, its own included (GEMINI m)
    group_size: Annotated[StrictInt, Field(ge=0), Allowed(
        "must be 0 (a whole sharding group) or an integer >= 2 (nodes per parity group)")] = 0
    k: _int(1) = 4  # rs: data nodes per coding group (ECHECK k)
    m: _int(1) = 2  # rs: parity nodes per coding group; any m of a group's k + m nodes may fail
    #: who moves the bytes to the peers: ``agent`` (the agents exchange every consistent version as
    #: soon as it is clean) or ``scheduled`` (the trainers send it in planned chunks inside the idle
    #: spans / bubbles of the training timeline; the ``schedule`` section says how)
    transport: _choice(Transport) = "agent"

    SCHEMES: ClassVar[tuple[str, ...]] = SCHEMES
    TRANSPORTS: ClassVar[tuple[str, ...]] = get_args(Transport)

    @model_validator(mode="after")
    def _check(self) -> "RedundancyConfig":
        if self.group_size == 1:
            _fail("redundancy.group_size", self.group_size,
                  "must be 0 (a whole sharding group) or an integer >= 2 (nodes per parity group)")
        if self.transport == "scheduled" and self.scheme != "replica":
            _fail("redundancy.transport", self.transport,
                  f"the scheduled transport sends whole copies: it needs redundancy.scheme=replica, "
                  f"not {self.scheme!r} (use transport: agent)")
        return self

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


class ScheduleConfig(_Section):
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

    mode: _choice(Mode) = "pipelined"
    sub_buffers: _int(1, 64) = 4  # p
    reserved_mib: _num(0.0, strict=True) = 64.0  # R: sender-side buffer memory for checkpoint traffic
    mu: _num(0.0, 1.0, strict=True) = 0.9  # share of each profiled idle span the plan (and the link gate) may use
    profile_iterations: _int(2) = 20  # W (GEMINI: 20)
    bandwidth_mib_s: _num(0.0) = 0.0  # link for the plan; 0 = estimated from the profile's P2P transfers
    alpha_s: _num(0.0) = 0.0  # per-chunk start-up time of the link model f(s) = alpha + s/B
    idle: _choice(Idle) = "network"  # the spans the GEMINI modes fill (see above)
    #: a peer copy at most every this many iterations (N); a plan that would need n < N iterations is
    #: spread over about N, using n/N of every span per iteration (modes.plan_sends_every): GEMINI's
    #: "reduce the checkpoint frequency to amortize" when the traffic interferes anyway
    min_interval: _int(1) = 1
    #: benchmarks (benchmarks/scheduling.py): rotate through these modes in one job, each for
    #: ``compare_iterations`` iterations ("local": no peer traffic), so every mode sees the same machine
    compare_modes: Annotated[tuple[CompareMode, ...],
                             Allowed(f"must list modes of {', '.join(get_args(CompareMode))}")] = ()
    compare_iterations: _int(2) = 6

    MODES: ClassVar[tuple[str, ...]] = get_args(Mode)
    IDLE: ClassVar[tuple[str, ...]] = get_args(Idle)
    BASELINES: ClassVar[tuple[str, ...]] = get_args(Baseline)

    @field_validator("compare_modes", mode="before")
    @classmethod
    def _modes(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [m.strip() for m in v.split(",") if m.strip()]
        return v

    @property
    def reserved_bytes(self) -> int:
        return int(self.reserved_mib * 2**20)


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


def schema() -> dict:
    """The JSON Schema of a cluster file (``megatron-ft config --schema``), for editors and checks."""
    out = FTConfig.model_json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "megatron-ft cluster file"
    return out


def _allowed(loc: tuple) -> Optional[str]:
    """The ``Allowed`` text of the field (or list element) at ``loc``: section, field[, index]."""
    model: Any = FTConfig
    ann: Any = None
    for part in loc:
        if isinstance(part, int):  # an element: the list's element type
            while get_origin(ann) is Annotated:
                ann = get_args(ann)[0]
            args = get_args(ann)
            ann = args[0] if args else None
            continue
        if model is None:
            return None
        info = model.model_fields.get(part)
        if info is None:
            return None
        ann = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        model = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) \
            else None
    while get_origin(ann) is Annotated:
        for meta in get_args(ann)[1:]:
            if isinstance(meta, Allowed):
                return str(meta)
        ann = get_args(ann)[0]
    return None


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _config_error(e: ValidationError, source: str, data: Mapping[str, Any]) -> ConfigError:
    """The first problem of a validation, in the project's words: the field, the value, what is allowed."""
    err = e.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), ConfigError):
        return err["ctx"]["error"]
    if err["type"] == "extra_forbidden":
        section = loc[:-1]
        model: Any = FTConfig if not section else FTConfig.model_fields[section[0]].annotation
        allowed = sorted(_path(section + (n,)) for n in model.model_fields)
        return ConfigError(f"{source}: unknown key(s) {[_path(loc)]}; allowed: {allowed}")
    if len(loc) == 1 and loc[0] in SECTIONS and err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return ConfigError(f"{source}: {loc[0]}={err['input']!r} must be a mapping")
    loc = tuple(p for p in loc if isinstance(p, int) or p in _FIELD_NAMES)  # drop union/validator branches
    value = err["input"]
    allowed = _allowed(loc)
    if allowed is None and loc and isinstance(loc[-1], int):  # an element with no words of its own: the list's
        loc = tuple(p for p in loc if not isinstance(p, int))
        allowed, value = _allowed(loc), data.get(loc[0], {}).get(loc[1], value) if len(loc) == 2 else value
    return ConfigError(f"{_path(loc)}={value!r} is invalid: {allowed or err['msg']}")


DEFAULT_CONFIG_PATH = os.path.join(os.path.dirname(__file__), "configs", "local-cpu.yaml")
_FIELD_NAMES = {n for m in (FTConfig, *(FTConfig.model_fields[s].annotation for s in SECTIONS)) for n in m.model_fields}


def from_dict(data: Mapping[str, Any], source: str = "<dict>") -> FTConfig:
    """Build a validated config from a mapping (as loaded from YAML). Unknown keys are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if not (k in SECTIONS and v is None)}  # "cluster:" with nothing under it
    try:
        return FTConfig.model_validate(data)
    except ValidationError as e:
        raise _config_error(e, source, data) from None


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


def replace(cfg: FTConfig, **sections: Any) -> FTConfig:
    """Return ``cfg`` with some fields of some sections replaced (validated again)."""
    data = cfg.to_dict()
    for name, changes in sections.items():
        if name == "run_id":
            data["run_id"] = changes
        elif name not in SECTIONS:
            raise ConfigError(f"unknown section {name!r}; allowed: {list(SECTIONS)}")
        else:
            data[name] = {**data[name], **changes}
    return from_dict(data, source="<replace>")


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
    g.add_argument("--inmem-ckpt-profile-iterations", type=_non_negative_int, metavar="W", default=0,
                   help="record each rank's timeline (compute, P2P, collectives, optimizer) for the first W "
                        "iterations into --inmem-ckpt-profile-dir (0: off; GEMINI uses 20)")
    g.add_argument("--inmem-ckpt-profile-dir", metavar="DIR", default=None,
                   help="where node<N>/rank<R>.json goes (default: $MFT_RUN_DIR/profile)")
    return parser


def _int_or_auto(text: str) -> Any:
    return AUTO if text == AUTO else int(text)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is invalid: must be >= 0 (0: off)")
    return value


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
SHARED_SETTINGS = ("persist.dir", "persist.interval", "persist.keep", "redundancy.scheme", "snapshot.interval",
                   "recovery.prefer", "snapshot.agreement")


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
