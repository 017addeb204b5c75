"""Job and cluster configuration: a YAML file plus ``--inmem-ckpt*`` flags, parsed into frozen,
validated models (pydantic v2: types, ranges, literal choices and unknown keys are its work; the
project words every message).

Every invalid value raises :class:`ConfigError` naming the field, the value and what is
allowed. Flags override the file; the file overrides the defaults below. The embedded
default is ``configs/local-cpu.yaml`` (2 simulated nodes x 2 ranks, TP1 PP2 DP2). A key given
twice in the file is an error; :func:`schema` is the JSON Schema of the file
(``megatron-ft config --schema``).

The package, read top to bottom:

* :mod:`~megatron_ft.config.fields` - :class:`ConfigError`, the checks that raise it, the choices and
  the field types every section is written in;
* :mod:`~megatron_ft.config.runtime_sections` - how the job runs: ``cluster``, ``parallel``,
  ``snapshot``, ``persist``, ``agent``, ``launch``, ``health``, ``network``, ``security``;
* :mod:`~megatron_ft.config.recovery_sections` - what meets a failure: ``recovery``, ``hang``,
  ``failure``, ``simulate``, ``redundancy``, ``schedule``;
* :mod:`~megatron_ft.config.job` - :class:`FTConfig`, the whole job, its cross-section checks and
  its port plan;
* :mod:`~megatron_ft.config.loading` - :func:`load`, :func:`from_dict`, :func:`replace`, the YAML
  loader, the error messages and :func:`schema`;
* :mod:`~megatron_ft.config.flags` - the ``--inmem-ckpt*`` flags.

Callers import every name from the package itself (``from megatron_ft import config``,
``from megatron_ft.config import ConfigError``), never from its modules.
"""
from .fields import (AUTO, SCHEMES, Allowed, Baseline, CompareMode, ConfigError, Flag, Idle, Mode, Prefer, Scheme,
                     Text, Transport, _check_int, _check_num, _fail)
from .flags import (SHARED_SETTINGS, add_inmem_ckpt_args, apply_flags, command_flags, from_args, settings_differ,
                    shared_settings)
from .job import SECTIONS, FTConfig, PortRange, port_clash, port_plan
from .loading import DEFAULT_CONFIG_PATH, from_dict, load, load_yaml, replace, schema
from .recovery_sections import (FailureConfig, HangConfig, RecoveryConfig, RedundancyConfig, ScheduleConfig,
                                SimulateConfig)
from .runtime_sections import (AgentConfig, ClusterConfig, ElasticConfig, HealthConfig, LaunchConfig, NetworkConfig,
                               ParallelConfig, PersistConfig, SecurityConfig, SnapshotConfig)

__all__ = [
    # fields: the error, the checks the planners share, the choices and field types
    "ConfigError", "_fail", "_check_int", "_check_num", "AUTO", "Scheme", "SCHEMES", "Transport", "Prefer", "Mode",
    "Idle", "Baseline", "CompareMode", "Allowed", "Flag", "Text",
    # the sections
    "ClusterConfig", "ElasticConfig", "ParallelConfig", "SnapshotConfig", "PersistConfig", "AgentConfig",
    "LaunchConfig", "HealthConfig", "NetworkConfig", "SecurityConfig", "RecoveryConfig", "HangConfig", "FailureConfig",
    "SimulateConfig", "RedundancyConfig", "ScheduleConfig",
    # the job and its ports
    "FTConfig", "SECTIONS", "PortRange", "port_plan", "port_clash",
    # loading
    "DEFAULT_CONFIG_PATH", "schema", "from_dict", "load_yaml", "load", "replace",
    # the --inmem-ckpt* flags
    "add_inmem_ckpt_args", "from_args", "command_flags", "SHARED_SETTINGS", "shared_settings", "settings_differ",
    "apply_flags",
]
