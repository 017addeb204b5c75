"""The sections that say how the job runs: its machines and parallelism (``cluster``, ``parallel``),
the snapshots and their persistence (``snapshot``, ``persist``), the processes that serve them
(``agent``, ``launch``), and how those processes find, reach and trust each other (``health``,
``network``, ``security``)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from .fields import AUTO, Allowed, Flag, Text, _fail, _int, _num, _Section


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


class ElasticConfig(_Section):
    """``cluster.elastic``: going on at fewer data-parallel replicas after a node is lost with no standby
    or replacement (``recovery.elastic_after_s`` turns it on). ``min_data_parallel``: the job never goes
    on below this data-parallel size; it must not exceed the job's own (checked with the layout)."""

    min_data_parallel: _int(1) = 1


class ClusterConfig(_Section):
    """The machines: ``nodes`` x ``ranks_per_node`` training processes; ``elastic``: the smallest
    data-parallel size the job may go on at (:class:`ElasticConfig`)."""

    nodes: _int(1) = 2
    ranks_per_node: _int(1) = 2
    elastic: ElasticConfig = ElasticConfig()

    @field_validator("elastic", mode="before")
    @classmethod
    def _empty_elastic(cls, v: Any) -> Any:
        return {} if v is None else v  # "elastic:" with nothing under it: the defaults

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
    #: torchrun's rendezvous backend: ``megatron-ft`` (nodes joined by their node id; a lost node's place
    #: is open to its replacement at once, nothing polls: megatron_ft/torchrun/node_rendezvous.py) or
    #: ``c10d`` (torch's own, which waits out a lost node's keep-alives: the two settings below)
    rendezvous: Literal["megatron-ft", "c10d"] = "megatron-ft"
    #: ``c10d`` only: torchrun's rendezvous drops a node whose torchrun sent no keep-alive for
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
