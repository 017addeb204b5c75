"""``megatron-ft launch``'s command line: the job's configuration (one source of truth: the YAML with the
training command's ``--inmem-ckpt*`` flags applied), its secret, the node this host is (given, or said by
Slurm or Kubernetes), then this node's launcher, a standby, or every node simulated on this machine.

With ``recovery.elastic_after_s`` on, a job that could not go on at fewer data-parallel replicas after
losing a node - by its layout, or by the training command's ``--global-batch-size`` and
``--micro-batch-size`` (:func:`megatron_ft.config.flags.batch_sizes`) - is refused before anything starts (:func:`elastic_refusal_of`).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from math import gcd
from typing import Any, Optional

from .. import clock
from .. import config as ftconfig
from .. import network, scheduler
from ..config.flags import batch_sizes
from ..policy.elastic import elastic_refusal, shrink_sizes
from ..transport import credential
from .node import NodeLauncher, write_config
from .standby import run_standby


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="start agents and torchrun (simulates all nodes when --node-rank is absent)")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: cluster.nodes)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="trainers per node (default: cluster.ranks_per_node)")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's node index; omit to simulate all nodes here")
    p.add_argument("--config", default=None, help="job YAML (default: embedded configs/local-cpu.yaml)")
    p.add_argument("--run-dir", default=None, help="logs, pids and progress (default: /tmp/megatron-ft/runs/<run_id>)")
    p.add_argument("--standby", action="store_true",
                   help="a standby node: wait for the root agent's verdict that a node failed, claim that "
                        "node rank (no two standbys take the same), then run as that node")
    p.add_argument("--standby-timeout", type=float, default=0.0,
                   help="--standby: give up after this many seconds without a failed node (0: wait for ever)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- training script and its arguments")
    p.set_defaults(func=main)


def job_config(config: Optional[str], script: list[str]) -> ftconfig.FTConfig:
    """One source of truth: the YAML (``--config``, else the training command's
    ``--inmem-ckpt-config``, else the default) with the training command's ``--inmem-ckpt*`` flags
    applied, as the trainers apply them, so that the agents persist where and when the trainers
    look. Two different YAML files on the launcher and the training command are an error."""
    flags = ftconfig.command_flags(script[1:])
    if config and flags.inmem_ckpt_config and os.path.realpath(config) != os.path.realpath(flags.inmem_ckpt_config):
        raise ftconfig.ConfigError(f"--config={config} and the training command's --inmem-ckpt-config="
                                   f"{flags.inmem_ckpt_config} name different files: give one, or the same file")
    return ftconfig.apply_flags(ftconfig.load(config or flags.inmem_ckpt_config), flags)


def elastic_refusal_of(cfg: ftconfig.FTConfig, global_batch: Optional[int] = None,
                       micro_batch: Optional[int] = None) -> Optional[str]:
    """Why ``cfg``'s job, with shrinking on (``recovery.elastic_after_s`` > 0), could not go on at fewer
    data-parallel replicas after losing one node, as the message of a
    :class:`~megatron_ft.config.ConfigError`: the reason of
    :func:`megatron_ft.policy.elastic.elastic_refusal` (the batch checked where both sizes are given),
    then what would fit. None when it could go on, or when shrinking is off."""
    if not cfg.recovery.elastic:
        return None
    c, p = cfg.cluster, cfg.parallel
    layout = (c.nodes, c.ranks_per_node, p.tensor, p.pipeline, p.expert)
    least = c.elastic.min_data_parallel
    why = elastic_refusal(*layout, global_batch, micro_batch, least)
    if why is None:
        return None
    head = (f"recovery.elastic_after_s={cfg.recovery.elastic_after_s:g} is invalid for this job: it needs a "
            f"smaller data-parallel size to go on at, and {why}")
    if global_batch and micro_batch and elastic_refusal(*layout, min_data_parallel=least) is None:  # the batch
        shrunk = (c.world_size - c.ranks_per_node) // (p.tensor * p.pipeline)
        return f"{head}; {_batches_that_fit(cfg.data_parallel, shrunk, global_batch, micro_batch)}"
    fits = _sizes_text(shrink_sizes(*layout, global_batch, micro_batch, least))
    where = f"fits only after losing more nodes: {fits}" if fits else "fits no smaller number of nodes"
    return f"{head}; this layout {where} (or set recovery.elastic_after_s: 0, off)"


def describe_elastic(cfg: ftconfig.FTConfig) -> Optional[str]:
    """The sizes ``cfg``'s job would go on at, largest first, for ``megatron-ft config FILE`` (None:
    shrinking is off). The training command's batch sizes are checked at launch, not here."""
    if not cfg.recovery.elastic:
        return None
    c, p = cfg.cluster, cfg.parallel
    fits = _sizes_text(shrink_sizes(c.nodes, c.ranks_per_node, p.tensor, p.pipeline, p.expert,
                                    min_data_parallel=c.elastic.min_data_parallel)) or "none"
    return (f"recovery.elastic_after_s={cfg.recovery.elastic_after_s:g}: a node lost with no standby or replacement "
            f"within that many seconds -> fewer data-parallel replicas (DP {cfg.data_parallel} now, at least "
            f"cluster.elastic.min_data_parallel={c.elastic.min_data_parallel}): {fits}; the training command's "
            f"batch sizes are checked at launch (the refusal at launch is in place; the continuation is not yet)")


def _sizes_text(sizes: dict[int, int]) -> str:
    """``{nodes': DP'}`` in words: ``"2 nodes at DP 4, 1 node at DP 2"`` ("" for none)."""
    return ", ".join(f"{n} node{'s' * (n > 1)} at DP {dp}" for n, dp in sizes.items())


def _batches_that_fit(dp: int, shrunk: int, global_batch: int, micro_batch: int) -> str:
    """The batch sizes a job at ``dp`` replicas could go on with at ``shrunk`` replicas: a global batch
    that is a multiple of both DP x micro-batch (Megatron-LM's own rule) and DP' x micro-batch at this
    micro-batch, or this global batch at the micro-batches that divide it so.

    >>> _batches_that_fit(3, 2, 18, 2)
    'a global batch that fits DP 3 and DP 2 at micro-batch 2 is a multiple of 12 (12, 24, 36, ...), or the global batch 18 fits at micro-batch 1 or 3'
    """
    both = dp * shrunk // gcd(dp, shrunk)  # the least common multiple of DP and DP'
    step = both * micro_batch
    micro = [str(m) for m in range(1, global_batch // both + 1) if global_batch % (both * m) == 0]
    return (f"a global batch that fits DP {dp} and DP {shrunk} at micro-batch {micro_batch} is a multiple of "
            f"{step} ({step}, {2 * step}, {3 * step}, ...)"
            + (f", or the global batch {global_batch} fits at micro-batch {' or '.join(micro)}" if micro else ""))


def with_job_secret(cfg: ftconfig.FTConfig, run_dir: str) -> ftconfig.FTConfig:
    """``cfg`` naming the job's secret file in ``security.secret_file`` when the job's agents serve
    anything over TCP (the store of a job of several nodes, the peer transport): found or generated by
    :func:`megatron_ft.transport.credential.job_secret_file`, so that the node's configuration file hands
    it to the agent, the trainers and a standby alike. A :class:`~megatron_ft.config.ConfigError` (exit 2,
    before anything starts) when a job of hosts of their own names none."""
    from ..health.store import store_needed

    if not store_needed(cfg):
        return cfg
    path = credential.job_secret_file(cfg.security.secret_file, os.environ, run_dir, network.multi_host(cfg))
    return ftconfig.replace(cfg, security={"secret_file": path})


def main(args: argparse.Namespace) -> int:
    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        raise SystemExit("megatron-ft launch: give the training script after '--'")
    cfg = job_config(args.config, script)
    nodes = args.nodes if args.nodes is not None else cfg.cluster.nodes
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.cluster.ranks_per_node
    if nodes < 1:
        raise ftconfig.ConfigError(f"--nodes={nodes} is invalid: must be >= 1")
    if nproc < 1:
        raise ftconfig.ConfigError(f"--nproc-per-node={nproc} is invalid: must be >= 1")
    if (nodes, nproc) != (cfg.cluster.nodes, cfg.cluster.ranks_per_node):
        cfg = ftconfig.replace(cfg, cluster={"nodes": nodes, "ranks_per_node": nproc})
    args.nodes, args.nproc_per_node = nodes, nproc
    if cfg.recovery.elastic:  # before anything starts: a job that could not go on at fewer replicas
        why = elastic_refusal_of(cfg, *batch_sizes(script))
        if why:
            raise ftconfig.ConfigError(why)
    alloc = scheduler.allocation(os.environ) if args.node_rank is None and not args.standby else None
    if alloc is not None:  # a Slurm step or a Kubernetes indexed Job says which node this host is
        cfg = scheduler.placed(cfg, alloc)
        args.node_rank = alloc.node_rank(nodes)
        args.standby = args.node_rank is None
        what = (f"node {args.node_rank} of {nodes}" if not args.standby else
                f"a standby (host {alloc.index} of the allocation, beyond its {nodes} nodes)")
        print(f"[megatron-ft launch] {alloc.scheduler}: this host is {what} ({alloc.said_by}); nodes "
              f"{', '.join(cfg.health.host_list(nodes)) or 'simulated here'}, rendezvous on {cfg.launch.master_addr}",
              flush=True)
        if args.standby and cfg.redundancy.scheme == "none":
            print("[megatron-ft launch] redundancy.scheme is none: no agent declares a node lost and no memory "
                  "holds its state, so a standby has nothing to take over; this host does nothing (a lost node "
                  "is replaced by relaunching its rank, which restores from persist.dir)", flush=True)
            return 0
    args.run_dir = args.run_dir or os.path.join("/tmp/megatron-ft/runs", cfg.run_id)
    os.makedirs(args.run_dir, exist_ok=True)
    cfg = with_job_secret(cfg, args.run_dir)
    stop_on_signals()
    if args.standby:
        if args.node_rank is not None:
            raise ftconfig.ConfigError(f"--node-rank={args.node_rank} is invalid with --standby: a standby "
                                       "takes the rank of the node that failed")
        if cfg.redundancy.scheme == "none":
            raise ftconfig.ConfigError("--standby needs the agents' health store: redundancy.scheme is 'none' "
                                       "(set replica, xor or rs), so no agent watches for failed nodes")
        return run_standby(args, cfg, script)
    if args.node_rank is None:
        return simulate_nodes(args, script)
    if not 0 <= args.node_rank < nodes:
        raise ftconfig.ConfigError(f"--node-rank={args.node_rank} is invalid: must be in [0, {nodes - 1}]")
    cfg_path = write_config(cfg, os.path.join(args.run_dir, f"node{args.node_rank}", "config.yaml"))
    return NodeLauncher(cfg, cfg_path, args.node_rank, nodes, nproc, script, args.run_dir).run()


def stop_on_signals() -> None:
    """SIGTERM to a launcher (a supervisor's or scheduler's stop: systemd, Slurm's scancel, the kubelet)
    takes Ctrl-C's path: torchrun stops its workers, the launcher records the job's end and shuts its
    agent down cleanly (segments removed), instead of dying at once and leaving the agent waiting
    ``launch.start_timeout_s`` for a launcher that will not come. A second SIGTERM is ignored (SIGKILL
    still ends it). SIGINT stops it the same way even where it started with SIGINT ignored (a
    background command of a non-interactive shell inherits that, and Python then never raises
    KeyboardInterrupt)."""
    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def simulate_nodes(args: argparse.Namespace, script: list[str]) -> int:
    """Start one launcher per simulated node on this machine and wait for all of them."""
    procs = []
    for i in range(args.nodes):
        cmd = [sys.executable, "-m", "megatron_ft.cli", "launch", f"--nodes={args.nodes}",
               f"--nproc-per-node={args.nproc_per_node}", f"--node-rank={i}", f"--run-dir={args.run_dir}"]
        if args.config:
            cmd.append(f"--config={args.config}")
        procs.append(subprocess.Popen(cmd + ["--", *script], start_new_session=True))
        if i == 0:
            clock.pause(0.5)  # let node 0 host the rendezvous store first
    rcs = []
    try:
        for p in procs:
            rcs.append(p.wait())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every node's launcher stops its node (stop_on_signals)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        rcs = [p.wait() for p in procs]
    return max(rcs, default=0)
