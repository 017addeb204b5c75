"""The ``megatron-ft`` command: launch, demo, chaos, status, config, simulate, plan, deploy, timeline, shm-mount."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from . import config as ftconfig


def _status(args: argparse.Namespace) -> int:
    from .agent.protocol import agent_status, socket_path

    cfg = ftconfig.load(args.config)
    rc = 0
    for node in range(cfg.cluster.nodes):  # an operator's command: one request per node, on demand
        try:
            print(json.dumps(agent_status(cfg, node), indent=1))
        except OSError as e:
            print(f"node {node}: no agent at {socket_path(cfg.agent.socket_dir, cfg.run_id, node)} ({e})")
            rc = 1
    return rc


def _config(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(ftconfig.schema(), indent=1))
        return 0
    from .launch.command import describe_elastic, elastic_refusal_of

    cfg = ftconfig.load(args.file)  # a ConfigError names the field, the value and what is allowed
    why = elastic_refusal_of(cfg)  # the launch's own check, without the training command's batch sizes
    if why:
        raise ftconfig.ConfigError(why)
    if args.ports:
        from .network import describe_ports

        print(describe_ports(cfg))
        return 0
    if args.print:
        print(json.dumps(cfg.to_dict(), indent=1))
        return 0
    elastic = describe_elastic(cfg)
    print(f"{args.file or ftconfig.DEFAULT_CONFIG_PATH}: valid" + (f"\n{elastic}" if elastic else ""))
    return 0


def _shm_mount(args: argparse.Namespace) -> int:
    from .agent import shm

    if args.check:
        backing = shm.page_backing(args.directory)
        print(f"{args.directory}: {backing} pages" + ("" if backing == shm.HUGE else
              " (a restore reads 4 KiB pages; `megatron-ft shm-mount DIR --size S` mounts a huge-page tmpfs)"))
        return 0 if backing == shm.HUGE else 1
    try:
        backing = shm.mount_huge_tmpfs(args.directory, args.size, args.huge)
    except (ValueError, shm.SharedMemoryError) as e:
        print(f"megatron-ft shm-mount: {e}", file=sys.stderr)
        return 2
    print(f"mounted a tmpfs at {args.directory} (size {args.size}, huge={args.huge}): {backing} pages; "
          f"set agent.shm_dir: {args.directory}")
    return 0 if backing == shm.HUGE else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-ft", description="in-memory fault tolerance for Megatron / DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import launch
    from .testing import demo

    from .redundancy import report as plan

    from .testing import chaos

    launch.add_parser(sub)
    demo.add_parser(sub)
    chaos.add_parser(sub)
    plan.add_parser(sub)
    from . import deploy

    deploy.add_parser(sub)  # manifests for Kubernetes
    from .policy import simulate

    simulate.add_parser(sub)  # goodput simulation
    from .schedule import timeline

    timeline.add_parser(sub)  # profiled timelines and the checkpoint plan
    p = sub.add_parser("shm-mount", help="mount a huge-page tmpfs for agent.shm_dir (root), or --check a directory")
    p.add_argument("directory", help="absolute path of the mount point (created if missing)")
    p.add_argument("--size", default="50%", help="tmpfs size: bytes, k/m/g suffix or %% of RAM (default 50%%)")
    p.add_argument("--huge", default="always", help="tmpfs huge= option: always (default), within_size, advise")
    p.add_argument("--check", action="store_true", help="only say which pages DIRECTORY has (exit 1: not huge)")
    p.set_defaults(func=_shm_mount)
    p = sub.add_parser("config", help="check a cluster file, or print the JSON Schema editors check it with")
    p.add_argument("file", nargs="?", default=None, help="cluster YAML (default: the embedded local-cpu.yaml)")
    p.add_argument("--schema", action="store_true", help="print the JSON Schema of a cluster file")
    p.add_argument("--print", action="store_true", help="print the validated configuration with every default")
    p.add_argument("--ports", action="store_true",
                   help="print every TCP port the job listens on, as a firewall table (docs/operators.md)")
    p.set_defaults(func=_config)
    p = sub.add_parser("status", help="print every agent's version table")
    p.add_argument("--config", default=None)
    p.set_defaults(func=_status)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ftconfig.ConfigError as e:
        print(f"megatron-ft: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
