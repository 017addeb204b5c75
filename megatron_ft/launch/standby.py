"""``megatron-ft launch --standby``: a spare machine that waits for the root agent's verdict that a node
failed, claims that node (no two standbys take the same) and becomes its launcher (:class:`~.node.NodeLauncher`).

While it waits it keeps the node's agent, torchrun and (``launch.warm_spares``) spare pool started, their
imports done (``spares.prestart``), so that the node it takes over starts nothing cold.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import time
from typing import Optional

from .. import config as ftconfig
from .. import network
from ..rendezvous import JobEnded, claim_failed_node
from ..spares import prestart
from ..spares.lifetime import die_with_parent
from .node import TORCHRUN_MODULE, NodeLauncher, write_config

STARTED = time.time()  # this launcher's start (a standby heeds only job ends recorded after it, less a timeout)


#: what a standby pre-starts (``spares.prestart``): its node's agent and torchrun, imports done
AGENT_MODULE, AGENT_PRELOAD = "megatron_ft.agent", ("megatron_ft.agent.server",)
TORCHRUN_PRELOAD = ("torch.distributed.run", "megatron_ft.torchrun.node_rendezvous")


def run_standby(args: argparse.Namespace, cfg: ftconfig.FTConfig, script: list[str]) -> int:
    """``--standby``: wait for the root's failure verdict on some node, claim it, become it."""
    who = f"{socket.gethostname()}:{os.getpid()}"
    pool, pool_socket = None, None
    # the agent and torchrun of the node it will become, their imports done while it waits
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, f"standby{os.getpid()}.agent.log"), "ab") as logf:
        agent = prestart.start(AGENT_MODULE, AGENT_PRELOAD, stdout=logf, stderr=subprocess.STDOUT,
                               start_new_session=True)
    torchrun = prestart.start(TORCHRUN_MODULE, TORCHRUN_PRELOAD, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    if cfg.launch.warm_spares:  # warm while waiting: the node it takes over starts no trainer cold
        from ..spares import pool as spares

        pool_socket = spares.socket_path(cfg.agent.socket_dir, f"{cfg.run_id}.standby{os.getpid()}", 0)
        pool = spares.start(pool_socket, os.path.join(args.run_dir, f"standby{os.getpid()}.spares.log"),
                            spares.imports_for(script), spares.own_trees(script))
    try:
        return _standby(args, cfg, script, who, pool, pool_socket, agent, torchrun)
    finally:
        if pool is not None:
            spares.stop(pool, pool_socket or "")
        for proc in (agent, torchrun):
            prestart.discard(proc)  # never handed a node


def _standby(args: argparse.Namespace, cfg: ftconfig.FTConfig, script: list[str], who: str,
             pool: Optional[subprocess.Popen], pool_socket: Optional[str], agent: subprocess.Popen,
             torchrun: subprocess.Popen) -> int:
    from ..health.store import StoreClient

    client = StoreClient(cfg)
    print(f"[standby {who}] waiting for a failed node of run {cfg.run_id} ({client.where})", flush=True)
    try:
        node, verdict = claim_failed_node(client, args.nodes, who, timeout_s=args.standby_timeout,
                                          log=lambda m: print(m, flush=True), since=STARTED - cfg.health.timeout_s)
    except JobEnded as e:  # nothing to take over: the standby's part of the job is done
        print(f"[standby {who}] {e} with no failed node to take over; standing down", flush=True)
        return 0
    own = socket.gethostname()
    if not cfg.health.one_machine and own != cfg.health.host_of(node):
        # a host of its own: the node's agent serves under this host's name (the others find its store and
        # peer address through the root's store; network.node_host)
        os.environ[network.NODE_HOST_VARIABLE] = own
    print(f"[standby {who}] node {node} failed ({verdict.get('kind')}, agent pid {verdict['pid']}, detected by "
          f"node {verdict.get('detected_by')}); claimed it, starting as node {node}"
          + (f" on this host ({own}, not {cfg.health.host_of(node)})" if network.NODE_HOST_VARIABLE in os.environ
             else ""), flush=True)
    cfg_path = write_config(cfg, os.path.join(args.run_dir, f"node{node}", "config.yaml"))
    launcher = NodeLauncher(cfg, cfg_path, node, args.nodes, args.nproc_per_node, script, args.run_dir)
    if pool is not None:
        launcher.pool, launcher.pool_socket = pool, pool_socket  # started before the failure
    launcher.waiting_agent, launcher.waiting_torchrun = agent, torchrun  # likewise
    return launcher.run()
