"""The ``megatron-ft`` command: launch, demo, status, simulate, plan, timeline."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from . import config as ftconfig


def _status(args: argparse.Namespace) -> int:
    from .protocol import AgentClient, socket_path

    cfg = ftconfig.load(args.config)
    rc = 0
    for node in range(cfg.cluster.nodes):
        path = socket_path(cfg.agent.socket_dir, cfg.run_id, node)
        try:
            c = AgentClient(path, timeout=5)
            c.connect({"rank": -1, "local_rank": -1, "pid": 0, "run_id": cfg.run_id})
            print(json.dumps(c.request("status")["status"], indent=1))
            c.close(orderly=True)
        except OSError as e:
            print(f"node {node}: no agent at {path} ({e})")
            rc = 1
    return rc


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-ft", description="in-memory fault tolerance for Megatron / DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo, launch

    from .redundancy import report as plan

    launch.add_parser(sub)
    demo.add_parser(sub)
    plan.add_parser(sub)
    from .policy import simulate

    simulate.add_parser(sub)  # issue 6: goodput simulation
    from .schedule import timeline

    timeline.add_parser(sub)  # issue 4: profiled timelines and the checkpoint plan
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
