"""``megatron-ft launch``: per node, start the snapshot agent, then a real torchrun elastic agent.

In parts: :mod:`.command` (the command line, the job's configuration and secret, which node this host
is), :mod:`.node` (a node's launcher), :mod:`.standby` (a spare machine that takes a failed node's place).

::

    megatron-ft launch --nodes 2 --nproc-per-node 2 [--node-rank I] [--config F] -- script.py args...
    megatron-ft launch --standby --nodes 2 --config F -- script.py args...

With ``--standby`` this process is a spare machine: it polls the agents' store (docs/health.md)
for the root agent's ``failed/<node>`` verdict, claims that node with a compare-and-set of
``claim/<node>/<failed agent pid>/<verdict time>`` and then runs as that node's launcher (below).

With ``--node-rank I`` this process is node I's launcher (one per machine). Without it, all N
nodes are simulated on this machine: N launcher instances share a c10d rendezvous on loopback
(the first hosts it), each with its own agent and its own shared memory.

A node's launcher:

1. starts the agent in its own session (it outlives every trainer and is nobody's child but
   the launcher's) and waits for its socket;
2. runs ``torchrun --rdzv-backend c10d --max-restarts R`` with ``MFT_NODE_RANK``, ``MFT_CONFIG``,
   ``MFT_RUN_ID`` and ``MFT_AGENT_SOCKET`` in the workers' environment (trainers derive a stable
   rank ``node_rank * nproc_per_node + local_rank`` from them, so a restarted worker finds its
   own snapshots on its own node);
3. restarts the agent if it dies while training runs (the new agent re-adopts the shared memory);
4. when torchrun ends, asks the agent to shut down cleanly (segments removed) and returns
   torchrun's exit code.
"""
from __future__ import annotations

from ..rendezvous import FatalWatch, JobEnded, NodeOwners, RdzvGeneration, Rendezvous, claim_failed_node
from .command import add_parser, job_config, main, simulate_nodes, stop_on_signals, with_job_secret
from .agent_process import AgentStartError, preflight
from .node import GLOO_ENV_DEFAULTS, NodeLauncher, write_config
from .standby import AGENT_MODULE, AGENT_PRELOAD, STARTED, TORCHRUN_MODULE, run_standby

__all__ = [  # the command line's entry, the parts' public names, and the rendezvous' (read through here)
    "add_parser", "main", "job_config", "with_job_secret", "simulate_nodes", "stop_on_signals",
    "NodeLauncher", "AgentStartError", "GLOO_ENV_DEFAULTS", "preflight", "write_config",
    "run_standby", "STARTED", "AGENT_MODULE", "AGENT_PRELOAD", "TORCHRUN_MODULE",
    "FatalWatch", "JobEnded", "NodeOwners", "RdzvGeneration", "Rendezvous", "claim_failed_node",
]
