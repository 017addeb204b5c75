"""The sections that say what meets a failure: the checks of a restore (``recovery``), the hang rule
(``hang``), the failure model and the simulator built on it (``failure``, ``simulate``), the peer
redundancy of the snapshots (``redundancy``) and the timing of its scheduled transport
(``schedule``)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import Field, StrictFloat, StrictInt, field_validator, model_validator

from .fields import (AUTO, SCHEMES, Allowed, Baseline, CompareMode, Flag, Idle, Mode, Prefer, Scheme, Transport,
                     _check_num, _choice, _fail, _int, _num, _Section)


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
    watched; an all-reduce per iteration carries the verdict.

    ``elastic_after_s`` (0: off): a node lost with no standby claiming it and no replacement within this
    many seconds makes the job go on at fewer data-parallel replicas (tensor x pipeline unchanged, at
    least ``cluster.elastic.min_data_parallel``; ``megatron_ft/policy/elastic.py``). A job that could not
    go on after losing one node is refused before anything starts, by ``megatron-ft config`` and
    ``megatron-ft launch`` (which checks the training command's batch sizes too:
    ``megatron_ft/launch/command.py``); the policy sits above this package, so loading a file does not
    check it. Only that refusal is built so far; the continuation is not yet."""

    guard: Flag = True
    max_rollbacks: _int(0) = 2
    guard_iterations: _int(0) = 3  # 0: no loss check
    loss_tolerance: _num(0.0, strict=True) = 0.05
    loss_spike: _num(1.0, strict=True) = 2.0
    prefer: _choice(Prefer) = "newest"
    certify_after: _int(1) = 3
    elastic_after_s: _num(0.0) = 0.0

    @property
    def elastic(self) -> bool:
        """Whether a lost node that nothing replaces in time makes the job go on at fewer replicas."""
        return self.elastic_after_s > 0

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
