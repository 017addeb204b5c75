"""``megatron-ft demo --fail node --elastic``: lose a node with nobody to take its place, go on at fewer
data-parallel replicas from memory, bring the node back and grow again - each compared bit for bit with
Megatron's own reshard.

1. the job (``megatron-ft launch``, ``--inmem-ckpt``, ``recovery.elastic_after_s`` on) trains on N nodes at
   DP; after ``--kill-at`` (and the group's first complete copy) one node's machine is lost and no
   replacement comes: after ``elastic_after_s`` the survivors go on as generation 1 at DP' from the step
   every rank had (the lost ranks' containers from their peers' copies, or decoded);
2. ``--grow-after`` iterations later the node comes back (a new launcher for its slot): the job grows to DP
   again as generation 2, from memory;
3. the reference, without megatron-ft: Megatron's distributed checkpoint (megatron-core's
   ``dist_checkpointing``, torch_dist; :mod:`megatron_ft.megatron.dist_reference`; with ``--megatron-lm``,
   upstream's own ``--save``/``--load``) saved at DP at the shrink's step and loaded at DP', saved there at the
   grow-back's step and loaded at DP, trained to the end;
4. every iteration's loss (the last one logged where an iteration ran twice) and every rank's final model,
   optimizer and RNG digests (upstream: its parameters' and buffers' digest, :mod:`.megatron_lm`) against
   that reference.

The last line printed is one JSON object: ``scenario`` (``node-elastic``), ``recovered_from`` (the worst tier
of the shrink's containers), ``resumed_step``, ``data_parallel_before`` / ``data_parallel_after``, the
``shrink`` and ``grow`` (step, sizes, each new rank's sources and their tiers, the seconds they took),
``bitwise_identical`` and ``details``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass
from typing import Optional

from .. import config as ftconfig
from ..launch.generation import fitted_redundancy, read_pointer
from ..redundancy.exchange import holders_of_whole
from ..redundancy.plan import plan_from_config
from .demo_jobs import (PROJECT_SCRIPT, Program, _kill_tree, kill_node, launch_job, node_workers, start_replacement,
                        upstream_program, wait_group_complete, wait_job)
from .demo_results import _all_records, final_states
from .demo_scenarios import default_victim_node
from .helpers import on_hosts, read_jsonl, with_free_ports

#: the demo's cluster for each scheme: a global batch both sizes divide with micro-batch 2
ELASTIC_SHAPES = {
    "replica": ({"cluster": {"nodes": 3, "ranks_per_node": 2}, "parallel": {"tensor": 1, "pipeline": 2},
                 "redundancy": {"scheme": "replica", "replicas": 2}}, 12),
    "xor": ({"cluster": {"nodes": 3, "ranks_per_node": 2}, "parallel": {"tensor": 1, "pipeline": 2},
             "redundancy": {"scheme": "xor"}}, 12),
    "rs": ({"cluster": {"nodes": 4, "ranks_per_node": 1}, "parallel": {"tensor": 1, "pipeline": 1},
            "redundancy": {"scheme": "rs", "k": 2, "m": 2}}, 24),
}


def promised_tier(cfg: ftconfig.FTConfig, node: int) -> str:
    """The tier the lost node's ranks come from: a surviving node's whole copy of each (``peer_memory``), else
    decoded from the group."""
    plan = plan_from_config(cfg)
    rpn = cfg.cluster.ranks_per_node
    whole = all(len(holders_of_whole(plan, r)) > 1 for r in range(node * rpn, (node + 1) * rpn))
    return "peer_memory" if whole else "decoded"


def check_elastic_arguments(args: argparse.Namespace) -> None:
    """Refuse what ``--elastic`` cannot run with (a clear ConfigError)."""
    if args.fail != "node":
        raise ftconfig.ConfigError(f"--elastic is invalid with --fail={args.fail}: it loses a node (--fail node)")
    for flag, given in (("--standby", args.standby), ("--slurm", args.slurm), ("--moe", args.moe),
                        ("--second-failure", args.second_failure)):
        if given:
            raise ftconfig.ConfigError(f"{flag} is invalid with --elastic: the elastic demo loses one node with no "
                                       f"standby (on this machine, or with --hosts on hosts of their own)")
    if args.elastic_after_s <= 0:
        raise ftconfig.ConfigError(f"--elastic-after-s={args.elastic_after_s} is invalid: must be > 0 seconds")
    if args.grow_after < 1 or args.kill_at + args.grow_after + 3 > args.iters:
        raise ftconfig.ConfigError(f"--grow-after={args.grow_after} with --kill-at={args.kill_at} is invalid for "
                                   f"--iters={args.iters}: the node comes back after kill-at + grow-after "
                                   f"iterations, and 3 must follow")


def elastic_config(args: argparse.Namespace, workdir: str) -> tuple[ftconfig.FTConfig, int]:
    """The job's configuration and global batch (``--redundancy``'s shape, replica by default)."""
    shape, batch = ELASTIC_SHAPES[args.redundancy or "replica"]
    cfg = ftconfig.replace(ftconfig.load(args.config), run_id=f"demo-elastic-{os.getpid()}",
                           persist={"dir": os.path.join(workdir, "persist"), "interval": 1000}, **shape)
    cfg = ftconfig.replace(cfg, recovery={"elastic_after_s": args.elastic_after_s})
    if args.hosts:  # hosts of their own, as the demo names them (each its /dev/shm; the file system shared)
        return on_hosts(cfg, workdir), batch
    return with_free_ports(cfg), batch


def _say(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, flush=True)


def _restores(run_dir: str, generation: int) -> list[dict]:
    """The re-sliced restores of ``generation``'s trainers (one event per rank and life)."""
    return [r for r in _all_records(run_dir, "events")
            if r.get("event") == "restore" and (r.get("resliced") or {}).get("generation") == generation]


def _wait(what: str, pred, deadline: float, job, log_path: str, poll: float = 0.5):
    while True:
        got = pred()
        if got:
            return got
        if job.poll() is not None:
            raise RuntimeError(f"the job ended ({job.returncode}) while waiting for {what}; log {log_path}")
        if time.time() > deadline:
            raise RuntimeError(f"no {what} within the demo's --timeout; log {log_path}")
        time.sleep(poll)


def _reached(run_dir: str, rank: int, since: float = 0.0) -> int:
    recs = [r for r in read_jsonl(os.path.join(run_dir, "progress", f"rank{rank}.jsonl")) if r.get("time", 0) >= since]
    return max((r["iteration"] for r in recs), default=-1)


def _generation_done(run_dir: str, generation: int, world: int) -> Optional[list[dict]]:
    recs = _restores(run_dir, generation)
    return recs if len({r["rank"] for r in recs}) >= world else None


def last_losses(run_dir: str) -> dict[tuple[int, int], str]:
    """(rank, iteration) -> the loss it logged last (an iteration that ran again after a restore: its new one)."""
    out: dict[tuple[int, int], tuple[float, str]] = {}
    for rec in _all_records(run_dir, "progress"):
        if rec.get("loss_hex") is None:
            continue
        key = (rec["rank"], rec["iteration"])
        if key not in out or rec["time"] >= out[key][0]:
            out[key] = (rec["time"], str(rec["loss_hex"]))
    return {k: v for k, (_, v) in out.items()}


@dataclass(frozen=True)
class ElasticTrainer:
    """What the elastic demo trains: the project's ``scripts/pretrain_gpt.py`` or upstream Megatron-LM's own
    ``pretrain_gpt.py`` (``program``), its arguments (``targs``, the reference's too), the job's pacing."""

    program: Program
    targs: list[str]
    pace: list[str]

    @property
    def upstream(self) -> bool:
        return self.program.upstream

    def reference(self, load: Optional[str], save: Optional[str], at: Optional[int]) -> list[str]:
        """A reference segment's own arguments: load Megatron's distributed checkpoint from ``load``, save one
        in ``save`` after iteration ``at`` and stop. The project's script saves and loads through megatron-core's
        library (:mod:`megatron_ft.megatron.dist_reference`); upstream's, its own ``--ckpt-format torch_dist``
        checkpoint (``--save``/``--load``, given after its defaults; ``--exit-interval`` saves and stops)."""
        if self.upstream:
            out = ["--load", load or "{run_dir}/megatron-save", "--save", save or "{run_dir}/megatron-save"]
            return out + (["--exit-interval", str(at)] if save else [])
        out = ["--ref-load-dir", load] if load else []
        return out + (["--ref-save-dir", save, "--ref-save-at", str(at), "--ref-stop-after-save"] if save else [])


def elastic_trainer(args: argparse.Namespace, cfg: ftconfig.FTConfig, batch: int, workdir: str) -> ElasticTrainer:
    """The program and arguments of ``--megatron-lm`` (upstream, patched into the workdir) or of the project's
    script, with the demo's global batch (both data-parallel sizes divide it)."""
    shape = ["--tensor-model-parallel-size", str(cfg.parallel.tensor), "--pipeline-model-parallel-size",
             str(cfg.parallel.pipeline), "--global-batch-size", str(batch), "--train-iters", str(args.iters)]
    if args.megatron_lm:
        from . import megatron_lm

        program = upstream_program(args.megatron_lm, workdir)
        base = megatron_lm.demo_args(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.data_parallel, args.iters,
                                     "{run_dir}")
        return ElasticTrainer(program, [*base, *shape, *(args.train_arg or [])],
                              [megatron_lm.PACE, str(args.min_iteration_s)])
    return ElasticTrainer(PROJECT_SCRIPT, [*shape, "--log-interval", "5", *(args.train_arg or [])],
                          ["--min-iteration-s", str(args.min_iteration_s)])


def run_reference(cfg: ftconfig.FTConfig, trainer: ElasticTrainer, workdir: str, step: int, grow: int,
                  nodes_after: int, timeout: float, say, bed=None) -> dict[str, str]:
    """The three reference segments (no megatron-ft): DP to ``step`` saved, DP' from it to ``grow`` saved, DP
    from that to the end; their directories by name."""
    dirs = {k: os.path.join(workdir, f"reference-{k}") for k in ("A", "B", "C")}
    ckpt = {k: os.path.join(workdir, f"reference-{k}.ckpt") for k in ("A", "B")}
    segments = [
        ("A", cfg.cluster.nodes, trainer.reference(None, ckpt["A"], step)),
        ("B", nodes_after, trainer.reference(ckpt["A"], ckpt["B"], grow)),
        ("C", cfg.cluster.nodes, trainer.reference(ckpt["B"], None, None)),
    ]
    for name, nodes, extra in segments:
        for d in (dirs[name], ckpt.get(name, "")):
            if d:
                shutil.rmtree(d, ignore_errors=True)
        seg_cfg = with_free_ports(cfg, run_id=f"{cfg.run_id}-ref{name}", cluster={"nodes": nodes},
                                  redundancy=fitted_redundancy(cfg.redundancy, nodes), launch={"warm_spares": False},
                                  recovery={"elastic_after_s": 0})
        say(f"[demo] reference {name}: {nodes} nodes, {' '.join(extra)}")
        p = launch_job(seg_cfg, dirs[name], [*trainer.targs, *extra], inmem=False, log_path=dirs[name] + ".log",
                       program=trainer.program, bed=bed)
        wait_job(p, timeout, f"reference segment {name}", dirs[name] + ".log")
    return dirs


def compare_elastic(job_dir: str, refs: dict[str, str], step: int, grow: int, world: int) -> list[str]:
    """Every loss of the reference segments against the job's last logged one, and the final states."""
    problems = []
    job = last_losses(job_dir)
    want: dict[tuple[int, int], str] = {}
    for name, lo, hi in (("A", 0, step), ("B", step, grow), ("C", grow, 10 ** 9)):
        want.update({k: v for k, v in last_losses(refs[name]).items() if lo < k[1] <= hi})
    if not want:
        problems.append("the reference logged no losses")
    for key, value in sorted(want.items()):
        if job.get(key) != value:
            problems.append(f"rank {key[0]} iteration {key[1]}: loss {job.get(key)} != reference {value}")
    try:
        ref_s, run_s = final_states(refs["C"], world), final_states(job_dir, world)
    except FileNotFoundError as e:
        return problems + [f"final state missing: {e}"]
    for r in range(world):
        for section in sorted(set(ref_s[r]) | set(run_s[r])):
            if ref_s[r].get(section) != run_s[r].get(section):
                problems.append(f"rank {r}: final {section} differs")
    return problems


def _generation_summary(recs: list[dict], lost_at: float) -> dict:
    first = recs[0]["resliced"]
    tiers = {str(r["rank"]): r["resliced"]["tiers"] for r in sorted(recs, key=lambda r: r["rank"])}
    done = max(r["time"] for r in recs)
    return {"step": recs[0]["step"], "data_parallel_before": first["data_parallel_before"],
            "data_parallel_after": first["data_parallel_after"], "sources": tiers,
            "recovered_from": max((r["source"] for r in recs), key=("local_memory", "peer_memory", "decoded").index),
            "seconds_from_event": round(done - lost_at, 3),
            "seconds_from_decision": round(done - first["decided_at"], 3),
            "restore_seconds": round(max(r["seconds"] for r in recs), 3)}


def run_elastic_demo(args: argparse.Namespace) -> dict:
    """The demo (see the module); with ``--hosts`` every node on a host of its own for the whole run (the job,
    the node's return under its name, the reference)."""
    check_elastic_arguments(args)
    workdir = os.path.abspath(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    cfg, batch = elastic_config(args, workdir)
    if not args.hosts:
        return _run_elastic(args, cfg, batch, workdir, None)
    from .hosts import HostBed

    with HostBed(cfg.cluster.nodes + 1, shm_mib=args.host_shm_mib, rate=args.link_rate) as bed:
        return _run_elastic(args, cfg, batch, workdir, bed)


def _run_elastic(args: argparse.Namespace, cfg: ftconfig.FTConfig, batch: int, workdir: str, bed) -> dict:
    say = lambda m: _say(args, m)  # noqa: E731
    rpn, nodes = cfg.cluster.ranks_per_node, cfg.cluster.nodes
    trainer = elastic_trainer(args, cfg, batch, workdir)
    victim = args.victim_node if args.victim_node is not None else default_victim_node(cfg)
    if not 0 <= victim < nodes:
        raise ftconfig.ConfigError(f"--victim-node={victim} is invalid: must be in [0, {nodes - 1}]")
    run_dir, log_path, rep_log = (os.path.join(workdir, n) for n in ("run", "job.log", "replacement.log"))
    deadline = time.time() + args.timeout
    say(f"[demo] elastic: {nodes} nodes x {rpn} ranks, TP{cfg.parallel.tensor} PP{cfg.parallel.pipeline} "
        f"DP{cfg.data_parallel}, {cfg.redundancy.scheme}, global batch {batch}; node {victim} lost after iteration "
        f"{args.kill_at} with no replacement, back {args.grow_after} iterations after the shrink"
        f"{'; upstream Megatron-LM from ' + args.megatron_lm if trainer.upstream else ''}")
    # the job's iterations padded (not the reference's: the numbers are the same) so that the node comes
    # back while it trains
    jargs = [*trainer.targs, *trainer.pace]
    job = launch_job(cfg, run_dir, jargs, True, log_path, program=trainer.program, bed=bed)
    rep = None
    try:
        wait_group_complete(run_dir, nodes, job, deadline, log_path)
        first = victim * rpn
        _wait(f"iteration {args.kill_at}", lambda: _reached(run_dir, first) >= args.kill_at, deadline, job, log_path, 0.1)
        lost_at_iteration = _reached(run_dir, first)
        kill_node(cfg, run_dir, victim, node_workers(run_dir, victim), bed)
        lost_at = time.time()
        say(f"[demo] node {victim} lost after iteration {lost_at_iteration}: no replacement")
        shrink = _wait("the shrink's restore on every rank", lambda: _generation_done(run_dir, 1, (nodes - 1) * rpn),
                       deadline, job, log_path)
        gen1 = read_pointer(run_dir)
        step = shrink[0]["step"]
        say(f"[demo] generation 1: DP {gen1.data_parallel} on slots {list(gen1.slots)} from step {step}")
        since = max(r["time"] for r in shrink)
        _wait(f"{args.grow_after} iterations at DP {gen1.data_parallel}",
              lambda: _reached(run_dir, 0, since) >= step + args.grow_after, deadline, job, log_path, 0.2)
        back_at = time.time()
        rep = start_replacement(cfg, run_dir, victim, jargs, rep_log, program=trainer.program, bed=bed)
        say(f"[demo] node {victim} back (a new launcher for its slot; log {rep_log})")
        grow = _wait("the grow-back's restore on every rank", lambda: _generation_done(run_dir, 2, nodes * rpn),
                     deadline, job, log_path)
        wait_job(job, max(1.0, deadline - time.time()), "the elastic job", log_path)
        rep.wait(timeout=max(1.0, deadline - time.time()))
    except BaseException:
        _kill_tree(job)
        if rep is not None:
            _kill_tree(rep)
        raise
    grow_step = grow[0]["step"]
    if grow_step >= args.iters:  # nothing trained at the grown size: no reference to compare with
        raise RuntimeError(f"the grow-back restored step {grow_step}, the job's last (--iters {args.iters}): nothing "
                           f"trained after it to compare; raise --iters (or --min-iteration-s) so that the node's "
                           f"return comes while the job still trains")
    refs = run_reference(cfg, trainer, workdir, step, grow_step, nodes - 1, max(60.0, deadline - time.time()), say,
                         bed)
    problems = compare_elastic(run_dir, refs, step, grow_step, nodes * rpn)
    shrink_s, grow_s = _generation_summary(shrink, lost_at), _generation_summary(grow, back_at)
    want_tier = promised_tier(cfg, victim)
    if shrink_s["recovered_from"] != want_tier:
        problems.append(f"the shrink's lost ranks came from {shrink_s['recovered_from']}, {want_tier} promised")
    if step < args.kill_at - 1:
        problems.append(f"the shrink resumed from step {step}, before the loss at iteration {lost_at_iteration} "
                        f"by more than one snapshot")
    return {"scenario": "node-elastic", "program": "megatron-lm" if trainer.upstream else "project",
            "redundancy": cfg.redundancy.scheme, "recovered_from": shrink_s["recovered_from"],
            "promised_tier": want_tier, "victim_node": victim, "hosts": bed is not None, "resumed_step": step,
            "lost_iterations": lost_at_iteration - step,
            "data_parallel_before": shrink_s["data_parallel_before"],
            "data_parallel_after": shrink_s["data_parallel_after"],
            "recovery_seconds": shrink_s["seconds_from_event"], "shrink": shrink_s, "grow": grow_s,
            "bitwise_identical": not problems, "details": problems[:20]}
