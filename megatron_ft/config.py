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

    interval: int = 1  # iterations between snapshots
    chunk_mib: int = 4  # checksum / copy unit
    enabled: bool = True

    def __post_init__(self) -> None:
        _check_int("snapshot.interval", self.interval, 1)
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

    def __post_init__(self) -> None:
        _check_int("persist.interval", self.interval, 0)
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

    def __post_init__(self) -> None:
        _check_str("agent.shm_dir", self.shm_dir)
        _check_str("agent.socket_dir", self.socket_dir)
        if not isinstance(self.connect_timeout_s, (int, float)) or self.connect_timeout_s <= 0:
            _fail("agent.connect_timeout_s", self.connect_timeout_s, "must be a positive number of seconds")


@dataclass(frozen=True)
class LaunchConfig:
    """How ``megatron-ft launch`` starts torchrun on each node."""

    master_addr: str = "127.0.0.1"
    rdzv_port: int = 29400
    max_restarts: int = 3

    def __post_init__(self) -> None:
        _check_str("launch.master_addr", self.master_addr)
        _check_int("launch.rdzv_port", self.rdzv_port, 1024, 65535)
        _check_int("launch.max_restarts", self.max_restarts, 0)


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

    @property
    def data_parallel(self) -> int:
        return self.cluster.world_size // (self.parallel.tensor * self.parallel.pipeline)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "snapshot": SnapshotConfig,
    "persist": PersistConfig,
    "agent": AgentConfig,
    "launch": LaunchConfig,
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


def load(path: Optional[str] = None) -> FTConfig:
    """Load a config file (the embedded default ``local-cpu.yaml`` when ``path`` is None)."""
    path = path or DEFAULT_CONFIG_PATH
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
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
    g.add_argument("--inmem-ckpt-interval", type=int, metavar="N", default=None,
                   help="iterations between in-memory snapshots (default 1)")
    g.add_argument("--inmem-ckpt-persist-interval", type=int, metavar="N", default=None,
                   help="iterations between snapshots persisted to disk by the agents (0: only on failure)")
    g.add_argument("--inmem-ckpt-persist-dir", metavar="DIR", default=None,
                   help="directory for persisted snapshots")
    return parser


def from_args(args: argparse.Namespace) -> FTConfig:
    """The config file named by ``--inmem-ckpt-config`` (or the default), overridden by flags
    and by the launcher's environment (``MFT_CONFIG``, ``MFT_RUN_ID``)."""
    path = getattr(args, "inmem_ckpt_config", None) or os.environ.get("MFT_CONFIG")
    cfg = load(path)
    snap: dict[str, Any] = {}
    pers: dict[str, Any] = {}
    if getattr(args, "inmem_ckpt_interval", None) is not None:
        snap["interval"] = args.inmem_ckpt_interval
    if getattr(args, "inmem_ckpt_persist_interval", None) is not None:
        pers["interval"] = args.inmem_ckpt_persist_interval
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
