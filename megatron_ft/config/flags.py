"""The Megatron-style ``--inmem-ckpt*`` flags: added to a training script's parser, read from a
training command by the launcher, applied over the file (with the launcher's ``MFT_CONFIG`` and
``MFT_RUN_ID``), and the settings a trainer and its node's agent must agree on."""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from .fields import AUTO, ConfigError
from .job import FTConfig
from .loading import load, replace


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


#: Megatron-LM's flags for the batch sizes a training command trains at (its parser takes no abbreviations)
BATCH_FLAGS = ("--global-batch-size", "--micro-batch-size")


def batch_sizes(argv: list[str]) -> tuple[Optional[int], Optional[int]]:
    """(global batch, micro-batch) that a training command's arguments give with Megatron-LM's
    ``--global-batch-size`` and ``--micro-batch-size``, as ``--flag N`` or ``--flag=N`` (the last one
    given wins, as argparse has it); None for a flag that is absent. A value that is not an integer
    >= 1, or a flag with no value, is a :class:`~megatron_ft.config.ConfigError` naming it (pure).

    >>> batch_sizes(["pretrain_gpt.py", "--global-batch-size", "18", "--micro-batch-size=2"])
    (18, 2)
    >>> batch_sizes(["pretrain_gpt.py", "--micro-batch-size", "4", "--micro-batch-size", "2"])
    (None, 2)
    >>> batch_sizes(["pretrain_gpt.py", "--global-batch-size=many"])
    Traceback (most recent call last):
    ...
    megatron_ft.config.ConfigError: the training command's --global-batch-size='many' is invalid: must be an integer >= 1
    """
    found: dict[str, Optional[int]] = dict.fromkeys(BATCH_FLAGS)
    for i, arg in enumerate(argv):
        flag, eq, text = arg.partition("=")
        if flag not in found:
            continue
        if not eq:
            text = argv[i + 1] if i + 1 < len(argv) else ""
        if not (text.isascii() and text.isdigit() and int(text) >= 1):
            raise ConfigError(f"the training command's {flag}={text!r} is invalid: must be an integer >= 1")
        found[flag] = int(text)
    return found["--global-batch-size"], found["--micro-batch-size"]
