"""An agent that asks for no secret: the baseline of the authentication comparison in
``benchmarks/redundancy.py``, and nothing else.

The product's agent (``python -m megatron_ft.agent``) refuses to start a job of several nodes or with
peer redundancy without the job's secret, and offers no setting that turns authentication off. To
measure what authentication costs the agents' replication, the benchmark runs the same agent code
(:func:`megatron_ft.agent.server.serve`) with no secret through this module, beside agents that prove
one, in the same run (``LocalCluster(..., authenticate=False)``). Its peer transport and store answer
anyone who reaches them: never run it outside a benchmark on one machine.

    python -m megatron_ft.testing.unauthenticated_agent --config JOB.yaml --node N
"""
from __future__ import annotations

import argparse
import logging
import sys

from .. import config as ftconfig
from ..agent.server import serve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ft.testing.unauthenticated_agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="job YAML (its security.secret_file is ignored)")
    p.add_argument("--node", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[agent n{args.node} unauthenticated %(asctime)s] %(levelname)s %(message)s")
    logging.getLogger(__name__).warning("agent node %d: no secret - its connections are not authenticated "
                                        "(the benchmarks' baseline only)", args.node)
    return serve(ftconfig.load(args.config), args.node, secret=None)


if __name__ == "__main__":
    sys.exit(main())
