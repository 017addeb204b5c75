#!/usr/bin/env python3
"""Checkpoint traffic on a rate-limited link: training alone, with the agent transport, and with the
scheduled transport (GEMINI's pipelined mode, BAFT's bubbles), where the two compete for one link.

Two hosts of the multi-host test bed (``megatron_ft/testing/hosts.py``: a network namespace each, named
``node0``/``node1``, private /dev/shm, each on a core of its own unless ``--no-own-cores``), every link
rate-limited with ``tc ... tbf`` at both ends (burst 256 KiB, 100 ms of queue), one rank per host:
PP=2 across the link (every micro-batch's activations and gradients cross it) and GEMINI replicas
m = 2 (each host holds the other's copy, so every checkpoint byte crosses it as well). Per link rate,
``--reps`` repetitions, each running these jobs in turn (interleaved: the machine's drift reaches
every kind alike):

* ``none``: megatron-ft off (no snapshot, no traffic);
* ``local``: a snapshot every iteration, no copy leaves the host (what the snapshots cost by
  themselves: on a CPU host the cores that train also copy);
* ``agent``: ``redundancy.transport: agent``: a snapshot every iteration, the agents exchange each
  version as soon as it is clean (whenever the link is free of the previous one);
* ``pipelined`` (GEMINI) and ``bubble`` (BAFT): ``redundancy.transport: scheduled`` in that
  ``schedule.mode``, ``schedule.idle: network``, the link's rate as ``schedule.bandwidth_mib_s``
  (an operator knows theirs), after ``--profile`` iterations profiled without checkpoint traffic;
  each chunk goes through the link gate (``megatron_ft/schedule/link_gate.py``: right after one of
  training's network calls, within mu of the shortest idle span the profile saw after that call);
* ``agent-dscp``: the agent transport with ``network.replication_dscp: 8`` (CS1, lower effort): on a
  bed with ``--classes`` (a network with traffic classes: every link queues that DSCP behind
  everything else, ``megatron_ft.testing.hosts.shaping``) the copies take what training leaves of
  the link; without classes it is the agent transport.

A figure is the median over the repetitions of a job's mean iteration time after the profile (the
same iterations in every job). Targets, per rate: ``pipelined``, ``bubble`` and ``agent-dscp`` <= 3 % over ``none`` and <= half of the agent
transport's overhead. They must be met where the profiled network idle time covers the checkpoint's
bytes at that rate (the plan fits: ``fits``, idle left >= 0); elsewhere the table shows the idle time
per iteration and the traffic time the bytes need, which explain the miss. Each verdict also names
``local``'s share (the snapshots' own cost, without a byte on the link).

The default model has a sequence of 256: compute per iteration about 4x that of a sequence of 64 for
the same state, so that a snapshot's copy costs about 1 % of an iteration on these CPU hosts, as the
device-to-host copy of a GPU host does not take the GPU's compute (at 64 it took 12 %, and no
transport could be within 3 % of ``none``).

``--paired N`` adds one job per repetition in which ``off`` (no snapshot, no traffic), ``local`` and
``pipelined`` take turns of ``--turn`` iterations (``schedule.compare_modes``): each turn is compared
with the ``off`` turn next to it, so that the machine's drift between jobs and within one cancels (the
separate jobs' medians move by 10 % between runs on this machine); its lines follow the verdicts.
The scheduled jobs also report the CPU time of the transport's own threads per iteration (``cpu_s`` of
the transport file): on these CPU hosts it comes out of the cores that train. ``--min-interval N``
(``schedule.min_interval``) sends a copy at most every N iterations.

    python3 benchmarks/link.py                             # 50 and 200 Mbit/s, 5 repetitions
    python3 benchmarks/link.py --rates 200mbit --kinds none --paired 90 --no-docs   # paired turns
    python3 benchmarks/link.py --rates 200mbit --kinds none --paired 144 --min-interval 12 --no-docs
    python3 benchmarks/link.py --rates 100mbit --reps 1 --no-docs
    python3 benchmarks/link.py --classes --kinds none,agent,agent-dscp,pipelined   # its own section

Needs root, iproute2 and the megatron extra (the test bed's requirements); writes its section of
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import scheduling  # noqa: E402  (this directory: the scheduled modes' job and transport records)
from _docs import write_section  # noqa: E402

from megatron_ft import config as ftconfig  # noqa: E402
from megatron_ft.testing import demo  # noqa: E402
from megatron_ft.testing.hosts import LOWER_EFFORT_DSCP, HostBed, unavailable_reason  # noqa: E402
from megatron_ft.transport.credential import job_secret_file  # noqa: E402

DOCS = scheduling.DOCS
HEADING = "## Checkpoint traffic on a rate-limited link"
HEADING_CLASSES = "## Checkpoint traffic on a rate-limited link with traffic classes"
OVERHEAD_MAX = 0.03  # scheduled over none
RATIO_MAX = 0.5  # scheduled overhead / agent overhead
KINDS = ("none", "local", "agent", "pipelined", "bubble", "agent-dscp")
JUDGED = ("pipelined", "bubble", "agent-dscp")  # against the targets
PAIRED_MODES = ("off", "local", "pipelined")  # --paired: one job per repetition, these in turn


def rate_bits(rate: str) -> float:
    """tc's rate text as bits per second.

    >>> rate_bits("100mbit"), rate_bits("1gbit"), rate_bits("500kbit")
    (100000000.0, 1000000000.0, 500000.0)
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.strip().lower())
    if not m:
        raise ValueError(f"--rates: {rate!r} is not a tc rate like 100mbit, 1gbit or 500kbit")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9, None: 1.0}[m.group(2)]


def job_config(kind: str, rate: str, workdir: str, args: argparse.Namespace) -> ftconfig.FTConfig:
    """The job of ``kind`` (one of :data:`KINDS`) on the bed's two hosts."""
    cfg = scheduling.job_config(2, "none" if kind == "none" else "scheduled", workdir, args, [])
    link_mib_s = round(rate_bits(rate) / 8 / 2**20, 3)  # the plan's link: the rate the bed gives it
    if kind in ("agent", "agent-dscp"):
        cfg = ftconfig.replace(cfg, redundancy={"scheme": "replica", "replicas": 2, "transport": "agent"})
    elif kind == "local":  # snapshots every iteration, no copy leaves the host
        cfg = ftconfig.replace(cfg, schedule={"compare_modes": ["local"]})
    elif kind == "paired":  # off, local and pipelined in turn inside one job
        cfg = ftconfig.replace(cfg, schedule={"mode": "pipelined", "compare_modes": list(PAIRED_MODES),
                                              "compare_iterations": args.turn, "bandwidth_mib_s": link_mib_s})
    elif kind != "none":
        cfg = ftconfig.replace(cfg, schedule={"mode": kind, "bandwidth_mib_s": link_mib_s})
    if kind != "none":
        cfg = ftconfig.replace(cfg, snapshot={"interval": args.snapshot_interval})
    if kind not in ("none", "local", "agent", "agent-dscp"):
        cfg = ftconfig.replace(cfg, schedule={"min_interval": args.min_interval})
    secret = job_secret_file("", {}, workdir, multi_host=False)  # one file the bed's hosts all read
    dscp = LOWER_EFFORT_DSCP if kind == "agent-dscp" else 0
    return ftconfig.replace(cfg, run_id=f"blink-{kind}-{os.getpid()}", launch={"master_addr": "node0"},
                            health={"host_pattern": "node{node}"},
                            network={"interface": "eth0", "replication_dscp": dscp}, security={"secret_file": secret})


def run_job(bed: HostBed, kind: str, rate: str, iters: int, args: argparse.Namespace, tag: str) -> str:
    run_dir = os.path.join(args.workdir, f"{kind}-{tag}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = job_config(kind, rate, args.workdir, args)
    log_path = run_dir + ".log"
    p = demo.launch_job(cfg, run_dir, scheduling.train_args(2, iters, args), inmem=kind != "none",
                        log_path=log_path, bed=bed)
    demo.wait_job(p, args.timeout, f"{kind} at {rate}", log_path)
    return run_dir


def mean_after(run_dir: str, first: int) -> float:
    return statistics.mean(scheduling.iteration_times(run_dir, first))


def plan_figures(run_dir: str, iterations: int) -> dict:
    """A scheduled job's plan, over its ranks (``transport/rank*.json``): the mode it planned (a ``bubble``
    job without a bubble shared with its receiver plans ``pipelined``), the idle time per iteration, the
    copy's traffic time per iteration, the interval planned and achieved, training's wait per iteration,
    the copy's bytes, and whether every send fits its span."""
    trs = list(scheduling.transport_records(run_dir).values())
    scheds = [next((s for s in t["plan"]["schedules"].values() if s), None) for t in trs]
    if not all(scheds):
        return {}
    idle = [sum(b - a for a, b in t["plan"]["spans"]) for t in trs]
    transfer = [s["planned_transfer_s"] / s["interval_iterations"] for s in scheds]
    sent = min(sum(1 for x in t["transfers"] if x["bytes"] > 0) for t in trs)
    return {"planned_mode": "/".join(sorted({s["mode"] for s in scheds})),
            "idle_s": min(idle), "transfer_s": max(transfer), "idle_left_s": min(i - x for i, x in zip(idle, transfer)),
            "interval_planned": max(s["interval_iterations"] for s in scheds),
            "interval_achieved": iterations / sent if sent else None,
            "stall_s": max(sum(t.get("stall_by_mode", {}).values()) for t in trs) / max(1, iterations),
            "cpu_ms": transport_cpu_ms(trs, next(iter(trs[0]["plan"]["schedules"]))),  # the configured mode's label
            "container_bytes": max(t["plan"]["nbytes"] for t in trs), "fits": all(s["fits"] for s in scheds)}


def transport_cpu_ms(trs: "list[dict]", label: str) -> "float | None":
    """The CPU time of the scheduled transport's own threads (its driver, which makes every chunk's
    system calls, and its receivers; ``cpu_s`` of the ranks' transport files ``trs``) per iteration
    run in mode ``label``, on the busiest rank, in ms: on a CPU host it comes out of the cores that train."""
    out = []
    for t in trs:
        n = sum(1 for rec in t["iteration_s"] if rec[1] == label)
        if n and t.get("cpu_s"):
            out.append(sum(t["cpu_s"].values()) / n * 1e3)
    return max(out) if out else None


def copies_completed(run_dir: str) -> int:
    """How many versions became complete in the group during an agent-transport job (node 0's agent
    says so for each): what the copies achieved, beside what training paid for them."""
    try:
        with open(os.path.join(run_dir, "node0", "agent.log"), encoding="utf-8") as f:
            return len({m.group(1) for m in demo.GROUP_COMPLETE.finditer(f.read())})
    except OSError:
        return 0


def measure_rate(rate: str, args: argparse.Namespace) -> list[dict]:
    """Every repetition's figures at ``rate``: rows of {rate, rep, mode, iteration_s, ...}."""
    rows = []
    first = args.profile + 1  # the first iteration measured (its predecessor's end is known)
    iters = args.profile + args.measured
    with HostBed(2, shm_mib=args.shm_mib, rate=rate, classes=args.classes, own_cores=args.own_cores) as bed:
        for rep in range(args.reps):
            if args.paired:
                t0 = time.time()
                d = run_job(bed, "paired", rate, args.profile + args.paired, args, f"{rate}-{rep}")
                trs = list(scheduling.transport_records(d).values())
                for r in scheduling.mode_results(d, 2, args):
                    rows.append({"rate": rate, "rep": rep, "mode": f"{r['mode']} (paired)", "paired": True,
                                 "iteration_s": r["iteration_s"], "turns": r["turns"], "run_dir": d,
                                 "cpu_ms": transport_cpu_ms(trs, r["mode"]) if r["mode"] not in ("off", "local") else None})
                print(f"[{rate} rep {rep}] paired job: " + ", ".join(
                    f"{r['mode']} {r['iteration_s']:.3f}" for r in rows if r["rep"] == rep and r.get("paired")
                    and r["rate"] == rate) + f" s/it ({time.time() - t0:.0f} s)", flush=True)
            for kind in args.kinds:
                t0 = time.time()
                d = run_job(bed, kind, rate, iters, args, f"{rate}-{rep}")
                row = {"rate": rate, "rep": rep, "mode": kind, "iteration_s": mean_after(d, first), "run_dir": d}
                if kind in ("pipelined", "bubble"):
                    row.update(plan_figures(d, iters - args.profile))
                elif kind not in ("none", "local"):  # the agents copy whenever they can: how often they got a copy through
                    row.update(copies=copies_completed(d), iterations=iters)
                rows.append(row)
                print(f"[{rate} rep {rep}] {kind}: {row['iteration_s']:.3f} s/it"
                      + (f" (planned {row.get('planned_mode')}, a copy every {row.get('interval_planned')} it)"
                         if "planned_mode" in row else "")
                  + (f" ({row['copies']} copies complete in {iters} it)" if "copies" in row else "")
                  + f" ({time.time() - t0:.0f} s)", flush=True)
    return rows


def summarize(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (rate, mode): the median over repetitions, the repetitions' figures, and the plan's numbers."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        out.setdefault((r["rate"], r["mode"]), {"reps": []})["reps"].append(r)
    for key, s in out.items():
        s["iteration_s"] = statistics.median(r["iteration_s"] for r in s["reps"])
        for k in ("idle_s", "transfer_s", "idle_left_s", "interval_planned", "interval_achieved", "container_bytes",
                  "stall_s", "cpu_ms"):
            vals = [r[k] for r in s["reps"] if r.get(k) is not None]
            if vals:
                s[k] = statistics.median(vals)
        if any("copies" in r for r in s["reps"]):  # the agents' copies over every repetition, not a median of some
            copies, iters = sum(r["copies"] for r in s["reps"]), sum(r["iterations"] for r in s["reps"])
            s["interval_achieved"] = iters / copies if copies else None
            s["copies"], s["iterations"] = copies, iters
        if any("fits" in r for r in s["reps"]):
            s["fits"] = all(r.get("fits") for r in s["reps"])
            s["planned_mode"] = "/".join(sorted({r.get("planned_mode", "?") for r in s["reps"]}))
    return out


def verdicts(summary: dict, rates: list[str]) -> list[str]:
    """Per rate and scheduled mode: met, or missed with why (a miss where the idle time covers the bytes
    is a failure of the transport; where it does not, the copies cannot keep up whatever training
    pays, and the figures say how far apart the two are)."""
    out = []
    for rate in rates:
        none = summary.get((rate, "none"), {}).get("iteration_s")
        agent = summary.get((rate, "agent"), {}).get("iteration_s")
        if not none or not agent:
            continue
        agent_over = agent / none - 1
        local = summary.get((rate, "local"), {}).get("iteration_s")
        local_part = f"; local {local / none - 1:+.1%}" if local else ""
        for mode in JUDGED:
            s = summary.get((rate, mode))
            if s is None:
                continue
            over = s["iteration_s"] / none - 1
            ok = over <= OVERHEAD_MAX and (agent_over <= 0 or over <= RATIO_MAX * agent_over)
            if "idle_s" not in s:  # not planned into idle time (agent-dscp): met or not, by the figures
                every = {k: (f"{x['interval_achieved']:.1f} it" if x.get("interval_achieved") else "none completed")
                         for k, x in (("it", s), ("agent", summary[(rate, "agent")]))}
                out.append(f"{rate} {mode}: {'met' if ok else 'MISSED'} ({over:+.1%} vs none; agent {agent_over:+.1%}"
                           f"{local_part}; "
                           f"a copy every {every['it']}, the agent transport's every {every['agent']})")
                continue
            covered = bool(s.get("fits")) and s.get("idle_left_s", -1) >= 0
            why = (f"idle {s.get('idle_s', 0):.3f} s/it, the copy needs {s.get('transfer_s', 0):.3f} s/it "
                   f"({s.get('container_bytes', 0) / 2**20:.1f} MiB every {s.get('interval_planned', '?')} it)")
            if not covered:  # the plan itself says the copies cannot keep up without slowing training
                out.append(f"{rate} {mode}: missed, the idle time does not cover the bytes ({over:+.1%} vs none; "
                           f"agent {agent_over:+.1%}{local_part}; {why})")
            elif ok:
                out.append(f"{rate} {mode}: met ({over:+.1%} vs none; agent {agent_over:+.1%}{local_part})")
            else:  # what the copies add to the snapshots' own cost, and the CPU the transport took for them
                traffic = (f"; {s['iteration_s'] / local - 1:+.1%} over local" if local else "") + (
                    f", the transport's threads {s['cpu_ms']:.1f} ms of CPU per iteration" if s.get("cpu_ms") else "")
                out.append(f"{rate} {mode}: MISSED although the idle time covers the bytes ({over:+.1%} vs none; "
                           f"agent {agent_over:+.1%}{local_part}{traffic}; {why})")
    return out


def paired(rows: list[dict], rates: list[str]) -> list[str]:
    """The paired jobs' lines: per rate, each mode's turns against the ``off`` turn next to it in the
    same job (the median over every repetition's turn pairs: the machine's drift between jobs, and
    between turns, cancels), beside the modes' job means."""
    out = []
    for rate in rates:
        by: dict[str, list[dict]] = {}
        for r in rows:
            if r["rate"] == rate and r.get("paired"):
                by.setdefault(r["mode"].split(" ")[0], []).append(r)
        for mode in PAIRED_MODES[1:]:
            turns = {m: {"turns_by_round": [r["turns"] for r in by.get(m, [])]} for m in (mode, "off")}
            over = scheduling.paired_overhead(turns[mode], turns["off"])
            if over is not None:
                pairs = sum(min(len(a), len(b)) for a, b in zip(*(t["turns_by_round"] for t in turns.values())))
                means = ", ".join(f"{m['iteration_s']:.3f}/{o['iteration_s']:.3f}" for m, o in zip(by[mode], by["off"]))
                cpu = [r["cpu_ms"] for r in by[mode] if r.get("cpu_ms") is not None]
                cpu_part = (f"; the transport's threads {statistics.median(cpu):.1f} ms of CPU per {mode} iteration"
                            if cpu else "")
                out.append(f"{rate} paired: {mode} {over:+.1%} over off (median of {pairs} "
                           f"turn pairs; job means {mode}/off: {means} s{cpu_part})")
    return out


def table(summary: dict, rates: list[str]) -> str:
    lines = ["| link | job | iteration (s), median | vs none | repetitions (s) | planned | idle/it (s) | "
             "copy traffic/it (s) | a copy every (it, planned / achieved) | MiB per copy | training waited/it (s) | "
             "transport CPU/it (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        none = summary.get((rate, "none"), {}).get("iteration_s")
        for mode in KINDS:
            s = summary.get((rate, mode))
            if s is None:
                continue
            it = s["iteration_s"]
            vs_none = f"{it / none - 1:+.1%}" if none and mode != "none" else "-"
            reps = ", ".join(f"{r['iteration_s']:.3f}" for r in s["reps"])
            plan = ["-"] * 7
            if "idle_s" in s:
                achieved = f" / {s['interval_achieved']:.1f}" if s.get("interval_achieved") else ""
                plan = [s["planned_mode"], f"{s['idle_s']:.3f}", f"{s['transfer_s']:.3f}",
                        f"{s['interval_planned']:.0f}{achieved}", f"{s['container_bytes'] / 2**20:.1f}",
                        f"{s.get('stall_s', 0.0):.4f}", f"{s['cpu_ms']:.1f}" if s.get("cpu_ms") is not None else "-"]
            elif "copies" in s:  # the agent transport: no plan, the copies it got through
                got = (f"- / {s['interval_achieved']:.1f} ({s['copies']} in {s['iterations']} it)"
                       if s.get("interval_achieved") else f"- / none in {s['iterations']} it")
                plan = ["-", "-", "-", got, "-", "-", "-"]
            lines.append(f"| {rate} | {mode} | {it:.3f} | {vs_none} | {reps} | " + " | ".join(plan) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="50mbit,200mbit", help="link rates (tc: 100mbit, 1gbit, ...)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default=None, help=f"jobs of {KINDS}, in turn (default: all; agent-dscp only "
                                                   f"with --classes)")
    ap.add_argument("--measured", type=int, default=30, help="iterations measured after the profile")
    scheduling.add_job_args(ap, hidden=128, seq=256)
    ap.add_argument("--min-interval", type=int, default=1,
                    help="schedule.min_interval of the scheduled jobs: a peer copy at most every N iterations")
    ap.add_argument("--snapshot-interval", type=int, default=1, help="snapshot.interval (iterations)")
    ap.add_argument("--shm-mib", type=int, default=512, help="each host's /dev/shm")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--workdir", default="/tmp/megatron-ft/bench-link")
    ap.add_argument("--classes", action="store_true",
                    help="links with traffic classes: the lower-effort DSCP queues behind everything else")
    ap.add_argument("--own-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="each host on a core of its own (default), as separate machines")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="also one job per repetition of N iterations with off, local and pipelined in turn")
    ap.add_argument("--turn", type=int, default=6, help="iterations per turn in the paired job (whole transfers)")
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    args.idle = "network"  # GEMINI: the link's idle spans (the scheduled jobs' schedule.idle)
    args.segment = 2  # scheduling.job_config's compare settings (no modes compared here)
    rates = [r for r in args.rates.split(",") if r]
    if args.kinds is None:
        args.kinds = ",".join(k for k in KINDS if args.classes or k != "agent-dscp")
    args.kinds = [k for k in args.kinds.split(",") if k]
    if [k for k in args.kinds if k not in KINDS]:
        ap.error(f"--kinds: {args.kinds} not among {KINDS}")
    for r in rates:
        rate_bits(r)
    why = unavailable_reason()
    if why:
        print(f"link benchmark: no test bed here: {why}", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()[0]
    rows = []
    for rate in rates:
        rows += measure_rate(rate, args)
    summary = summarize(rows)
    text = table(summary, rates)
    found = verdicts(summary, rates) + paired(rows, rates)
    minutes = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60
    print(text)
    print("\n".join(found))
    if not args.no_docs:
        cmd = "python3 benchmarks/link.py " + " ".join(a for a in sys.argv[1:])
        body = (f"Measured {started:%Y-%m-%d %H:%M} UTC with `{cmd.strip()}` ({minutes:.0f} min) on {os.cpu_count()} cores, "
                f"Linux {platform.release()}, Python {platform.python_version()}; 1-min load average {load0:.1f} at the "
                f"start, {os.getloadavg()[0]:.1f} at the end.\n\n"
                + __doc__.split("\n\n", 1)[1].split("    python3")[0].strip() + "\n\n"
                + ("Links with traffic classes (`--classes`): instead of one token bucket, an HTB tree of the same "
                   "rate and burst whose default class is guaranteed the whole rate, and whose lower class (DSCP 8, "
                   "CS1) borrows what the default class leaves (`megatron_ft.testing.hosts.shaping`).\n\n"
                   if args.classes else "")
                + f"Model: megatron-core GPT, {args.layers_per_stage} layers per stage, hidden {args.hidden}, "
                f"sequence {args.seq}, {args.micro_batches} micro-batches per iteration; R = {args.reserved_mib:g} MiB, "
                f"p = {args.p}, mu = {args.mu}, {args.profile} profiled iterations.\n\n"
                + text + "\n\n" + "\n".join(f"- {v}" for v in found) + "\n")
        write_section(DOCS, HEADING_CLASSES if args.classes else HEADING, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
