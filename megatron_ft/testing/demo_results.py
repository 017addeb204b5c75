"""The demo's results, read from a finished run's files: every rank's losses and final state against
the reference run's (bit for bit), the reference run's reuse, the recovery's phases, the snapshots'
stall, and the root agents' failure verdicts in their logs.

Nothing here runs or kills a process: these are the readers :mod:`megatron_ft.testing.demo_summary`
builds the demo's summary from (and the tests use directly, as ``megatron_ft.testing.demo.<name>``)."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import time
from typing import Optional

from .. import rank_files
from .helpers import read_jsonl


def losses(run_dir: str, discarded: Optional[dict] = None) -> dict[tuple[int, int], set[str]]:
    """(rank, iteration) -> loss hex strings seen (several when an iteration was re-run). ``discarded``:
    trainer life -> the restored step its guard refused; what that life trained after it was rolled
    back, and is not compared."""
    out: dict[tuple[int, int], set[str]] = {}
    prog = os.path.join(run_dir, "progress")
    discarded = discarded or {}
    for name in sorted(os.listdir(prog)) if os.path.isdir(prog) else []:
        for rec in read_jsonl(os.path.join(prog, name)):
            if life(rec) in discarded and rec["iteration"] > discarded[life(rec)]:
                continue
            # the project's script logs the loss; upstream's runner also a digest of the parameters
            value = "|".join(str(rec[k]) for k in ("loss_hex", "state_digest") if rec.get(k) is not None)
            if value:
                out.setdefault((rec["rank"], rec["iteration"]), set()).add(value)
    return out


def final_states(run_dir: str, world: int) -> dict[int, dict]:
    out = {}
    for r in range(world):
        path = os.path.join(run_dir, "final", f"state.rank{r}.json")
        with open(path) as f:
            out[r] = json.load(f)
    return out


def compare(ref_dir: str, run_dir: str, world: int, discarded: Optional[dict] = None) -> tuple[bool, list[str]]:
    problems = []
    ref_l, run_l = losses(ref_dir), losses(run_dir, discarded)
    if not ref_l:
        problems.append("reference run logged no losses")
    for key, want in sorted(ref_l.items()):
        got = run_l.get(key)
        if got is None:
            problems.append(f"rank {key[0]} iteration {key[1]}: no loss logged")
        elif got != want:
            problems.append(f"rank {key[0]} iteration {key[1]}: loss {sorted(got)} != reference {sorted(want)}")
    try:
        ref_s, run_s = final_states(ref_dir, world), final_states(run_dir, world)
    except FileNotFoundError as e:
        problems.append(f"final state missing: {e}")
        return False, problems
    for r in range(world):
        for section in sorted(set(ref_s[r]) | set(run_s[r])):
            if ref_s[r].get(section) != run_s[r].get(section):
                a, b = ref_s[r].get(section), run_s[r].get(section)
                keys = sorted(k for k in (set(a) | set(b)) if a.get(k) != b.get(k)) if isinstance(a, dict) and isinstance(b, dict) else []
                problems.append(f"rank {r}: final {section} differs {keys[:4]}")
    return not problems, problems


def reference_key(targs: list[str], world: int) -> str:
    """The name of a reference run's directory under ``--reference-dir``: one per job (its training
    arguments and world size), so that runs of different shapes sharing the directory keep theirs.

    >>> reference_key(["--iters", "10"], 4) == reference_key(["--iters", "10"], 4) != reference_key([], 4)
    True
    """
    return "ref-" + hashlib.sha1(json.dumps([targs, world]).encode()).hexdigest()[:12]


def reference_matches(ref_dir: str, targs: list[str], world: int) -> bool:
    try:
        with open(os.path.join(ref_dir, "args.json")) as f:
            rec = json.load(f)
        final_states(ref_dir, world)
    except (OSError, ValueError):
        return False
    return {k: rec.get(k) for k in ("train_args", "world")} == {"train_args": targs, "world": world}


BREAKDOWN_NAMES = {"detect_respawn": "detect + respawn", "imports": "imports", "rendezvous": "rendezvous",
                   "build": "build", "restore": "restore", "first_iteration": "first iteration"}


def recovery_breakdown(restores: list[dict], progress: list[dict], kill_time: float) -> Optional[dict]:
    """The phases of the recovery of the restarted rank that completed an iteration first (an
    iteration needs every rank, so then the job trains again), from its restore event's timeline
    and its progress; they add up to kill -> that iteration. None without a restarted rank."""
    best = None
    for e in restores:
        tl = e.get("timeline")
        first = min((r["time"] for r in progress if life(r) == life(e) and r["time"] > kill_time), default=None)
        if tl is None or first is None or e["time"] < kill_time:
            continue
        if best is None or first < best[1]:
            best = (e, first)
    if best is None:
        return None
    e, first = best
    tl = e["timeline"]
    rdzv = tl.get("rendezvous_start") is not None and tl.get("rendezvous_end") is not None
    out = {"detect_respawn": tl["process_start"] - kill_time,
           "imports": (tl["rendezvous_start"] if rdzv else tl["ready"]) - tl["process_start"],
           "rendezvous": tl["rendezvous_end"] - tl["rendezvous_start"] if rdzv else None,
           "build": tl["ready"] - tl["rendezvous_end"] if rdzv else None,
           "restore": e["time"] - tl["ready"]}
    phases = {k: (round(v, 3) if v is not None else None) for k, v in out.items()}
    # the last phase is what remains of the (rounded) recovery, so the phases add up to it exactly
    phases["first_iteration"] = round(round(first - kill_time, 3) - sum(v for v in phases.values() if v), 3)
    return phases


def raw_copy_seconds(nbytes: int, reps: int = 5) -> float:
    """The fastest of ``reps`` plain copies of ``nbytes`` bytes into memory already touched (one
    thread): what a snapshot's stall is measured against."""
    import torch

    src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    best = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best


def snapshot_stall(run_dir: str) -> Optional[dict]:
    """What training saw of its snapshots (every trainer life that closed: the survivors and the
    restarted ones): the slowest rank's median stall per snapshot, the largest single stall, one
    rank's snapshot bytes, and - measured here, now - a raw copy of those bytes, so that the stall
    can be read against it."""
    lives = [e for e in _all_records(run_dir, "events") if e.get("event") == "snapshots"
             and e.get("stall_median_s") is not None]
    if not lives:
        return None
    nbytes = max(e["nbytes"] for e in lives)
    raw = raw_copy_seconds(nbytes)
    stall = max(e["stall_median_s"] for e in lives)
    out = {"snapshots": sum(e["taken"] for e in lives), "failed": sum(e["failed"] for e in lives),
           "stall_median_s": round(stall, 6), "stall_max_s": round(max(e["stall_max_s"] for e in lives), 6),
           "bytes_per_rank": nbytes, "raw_copy_s": round(raw, 6), "stall_vs_raw_copy": round(stall / raw, 4)}
    saves = []  # upstream Megatron-LM: its whole save call per snapshot (the harness times it)
    for path in glob.glob(os.path.join(run_dir, "saves", "rank*.json")):
        with open(path) as f:
            secs = sorted(json.load(f)["seconds"])
        saves.append(secs[len(secs) // 2])
    if saves:
        out["megatron_save_median_s"] = round(max(saves), 6)
    return out


def restarted_by(restores: list[dict]) -> Optional[str]:
    """``'fast round N'`` or ``'torchrun restart N'`` (or both, e.g. a round then a node's loss):
    the newest of each among the restores after the kill."""
    rounds = max((e.get("fast_round", 0) for e in restores), default=0)
    restarts = max((e.get("restart_count", 0) for e in restores), default=0)
    parts = ([f"fast round {rounds}"] if rounds else []) + ([f"torchrun restart {restarts}"] if restarts else [])
    return " + ".join(parts) or None


def _progress(run_dir: str, rank: int) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "progress", f"rank{rank}.jsonl"))


def life(rec: dict) -> tuple[int, int]:
    """Which trainer life wrote a progress or event record: its process, and the attempt in it (an
    in-process restart keeps the process and counts attempts)."""
    return rec["pid"], rec.get("in_process_attempt", 0)


def _all_records(run_dir: str, kind: str) -> list[dict]:
    """Every record of ``run_dir/<kind>``'s ``.jsonl`` files, flat or per node (:mod:`megatron_ft.rank_files`)."""
    return [r for path in rank_files.all_files(os.path.join(run_dir, kind), ".jsonl") for r in read_jsonl(path)]


VERDICT_LINE = re.compile(r"root: node (\d+) (.*): hardware failure")
WITHDRAWN_LINE = re.compile(r"root: node (\d+)'s agent \(pid \d+\) runs again after its failure verdict.*withdrawn")


def withdrawn_verdicts(run_dir: str) -> set[int]:
    """The nodes whose failure verdict a root withdrew (their judged agent ran again and nobody had
    claimed the node: ``megatron_ft.health.monitor``), from the agents' logs."""
    out = set()
    for path in sorted(glob.glob(os.path.join(run_dir, "node*", "agent.log"))):
        with open(path, errors="replace") as f:
            out |= {int(m.group(1)) for m in WITHDRAWN_LINE.finditer(f.read())}
    return out


def unexpected_verdicts(run_dir: str, expected: set[int]) -> list[str]:
    """The root agents' failure verdicts (their logs) on nodes this run did not take down: a live node
    judged failed, e.g. a heartbeat late under load."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "node*", "agent.log"))):
        with open(path, errors="replace") as f:
            for line in f:
                m = VERDICT_LINE.search(line)
                if m and int(m.group(1)) not in expected:
                    out.append(f"node {m.group(1)} ({m.group(2)}; {os.path.basename(os.path.dirname(path))}'s log)")
    return out
