#!/usr/bin/env python3
"""Checkpoint-traffic scheduling modes side by side (GEMINI figure 16, BAFT section 4).

For each pipeline depth (``--pp``, one rank per simulated node, TP1 DP1, GEMINI replicas m = 2 on a
ring of nodes: each stage's node holds the next one's copy) it trains the same megatron-core GPT on
CPU once per mode and reports, from the same window of iterations (after the profile):

* ``none``: megatron-ft off (no snapshot, no traffic), a separate job;
* ``off``: the same inside the compared job (``schedule.compare_modes``: no snapshot and no traffic
  for its segments) - the same-job baseline the targets use;
* ``local``: in-memory snapshots every iteration, no peer traffic;
* the scheduled transport's modes (``redundancy.transport: scheduled``, ``schedule.mode``):
  ``blocking``, ``naive``, ``one-buffer``, ``pipelined``, ``bubble`` (BAFT) and ``end``.

Per mode: median iteration time and its overhead over ``none``, ``off`` and ``local`` (what the
traffic adds), the profiled idle time per iteration (``--idle``: network idle spans, or the rank's
waits - pipeline bubbles - which are the only free CPU time when the same cores compute and move
the bytes), the planned traffic time per iteration, the
idle time left, the sender's buffer memory (vs R), the planned and the achieved checkpoint interval
(iterations per checkpoint completed in the group), and the time training waited for the transport.

    python3 benchmarks/scheduling.py                    # PP=2 and PP=4, every mode, docs/benchmarks.md
    python3 benchmarks/scheduling.py --pp 2 --modes none,local,pipelined --no-docs

Runs ``--rounds`` rounds, each over every mode in turn (the machine is noisy: a mode's figure is the
median of its rounds), and writes the table, the command and the timeline PNG of a pipelined run
(``megatron-ft timeline``: profiled iterations with the planned and actual chunks) to docs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_ft import config as ftconfig  # noqa: E402
from megatron_ft import rank_files  # noqa: E402
from megatron_ft.testing import demo, helpers  # noqa: E402

ALL_MODES = ["none", "off", "local", "blocking", "naive", "one-buffer", "pipelined", "bubble", "end"]
# none: a separate job without megatron-ft; the others rotate inside one job (schedule.compare_modes)
OVERHEAD_MAX = 0.03  # pipelined over no checkpointing, where the idle time exceeds the traffic
RATIO_MAX = 0.5  # pipelined overhead / blocking overhead
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
IMG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "img", "scheduling-timeline.png")


def add_job_args(ap: argparse.ArgumentParser, hidden: int, seq: int) -> None:
    """The flags :func:`job_config` and :func:`train_args` read besides the caller's own: the model
    (``hidden`` and ``seq`` its defaults), its micro-batches, and the schedule's settings."""
    ap.add_argument("--profile", type=int, default=6, help="profiled iterations (schedule.profile_iterations)")
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--layers-per-stage", type=int, default=2)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--p", type=int, default=4, help="sub-buffers")
    ap.add_argument("--reserved-mib", type=float, default=16.0, help="R")
    ap.add_argument("--mu", type=float, default=0.9)


def job_config(pp: int, kind: str, workdir: str, args: argparse.Namespace, modes: list[str],
               min_interval: int = 1) -> ftconfig.FTConfig:
    cfg = ftconfig.replace(
        ftconfig.load(None), run_id=f"bsched-{pp}-{kind}-{os.getpid()}",
        cluster={"nodes": pp, "ranks_per_node": 1}, parallel={"tensor": 1, "pipeline": pp},
        persist={"interval": 0, "dir": os.path.join(workdir, "persist"), "on_failure": False},
    )
    cfg = helpers.with_free_ports(cfg)
    if kind != "none":
        cfg = ftconfig.replace(cfg, redundancy={"scheme": "replica", "replicas": 2, "transport": "scheduled"},
                               schedule={"mode": "pipelined", "profile_iterations": args.profile, "sub_buffers": args.p,
                                         "reserved_mib": args.reserved_mib, "mu": args.mu, "idle": args.idle,
                                         "compare_modes": modes, "compare_iterations": args.segment,
                                         "min_interval": min_interval})
    return cfg


def train_args(pp: int, iters: int, args: argparse.Namespace) -> list[str]:
    return ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", str(pp),
            "--train-iters", str(iters), "--log-interval", str(iters),
            "--num-layers", str(args.layers_per_stage * pp), "--hidden-size", str(args.hidden),
            "--num-attention-heads", "4", "--seq-length", str(args.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(args.micro_batches), "--hidden-dropout", "0", "--attention-dropout", "0"]


def iteration_times(run_dir: str, first: int) -> list[float]:
    recs = helpers.read_jsonl(os.path.join(run_dir, "progress", "rank0.jsonl"))
    t = {r["iteration"]: r["time"] for r in recs}
    return [t[i] - t[i - 1] for i in sorted(t) if i > first and i - 1 in t]


def run_job(pp: int, kind: str, iters: int, args: argparse.Namespace, modes: list[str], tag: str,
            min_interval: int = 1) -> str:
    run_dir = os.path.join(args.workdir, f"pp{pp}-{kind}-{tag}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = job_config(pp, kind, args.workdir, args, modes, min_interval)
    log_path = run_dir + ".log"
    p = demo.launch_job(cfg, run_dir, train_args(pp, iters, args), inmem=kind != "none", log_path=log_path)
    demo.wait_job(p, args.timeout, f"PP={pp} {kind}", log_path)
    return run_dir


def transport_records(run_dir: str) -> dict[int, dict]:
    """Every rank's transport file of a job (``transport/node*/rank*.json``), by rank."""
    out = {}
    for _, f in rank_files.rank_files(os.path.join(run_dir, "transport"), ".json"):
        with open(f) as fh:
            t = json.load(fh)
        out[t["rank"]] = t
    return out


def mode_results(run_dir: str, pp: int, args: argparse.Namespace, suffix: str = "") -> list[dict]:
    """Per mode of a compare job: its iterations (the first of each segment left out: it finishes the
    previous mode's transfer), schedule and transfers."""
    tr = transport_records(run_dir)
    t0 = tr[0]
    turns: dict[str, list[list[float]]] = {}  # per mode, per turn: its iterations (the k-th turns are neighbours)
    prev = None
    agreed_before = None
    for rec in t0["iteration_s"]:
        it, label, secs, agreed = rec if len(rec) == 4 else (*rec, None)
        if label != prev:
            turns.setdefault(label, []).append([])
        else:
            turns[label][-1].append(secs)
            if label == "off" and agreed is not None and agreed != agreed_before:
                raise RuntimeError(f"{run_dir}: a snapshot (step {agreed}) was taken in an 'off' segment "
                                   f"(iteration {it}): the baseline is not snapshot-free")
        prev, agreed_before = label, agreed
    out = []
    for mode, mode_turns in turns.items():
        times = [secs for turn in mode_turns for secs in turn]
        if not times:
            continue
        r = {"pp": pp, "mode": mode + (suffix if mode not in ("local", "off") else ""),
             "iteration_s": statistics.mean(times),
             "iterations": len(times), "turns": [statistics.mean(t) for t in mode_turns if t],
             "run_dir": run_dir}
        scheds = [t["plan"]["schedules"].get(mode) for t in tr.values()]
        if all(scheds):
            idle = [sum(b - a for a, b in t["plan"]["spans"]) for t in tr.values()]
            transfer = [s["planned_transfer_s"] / s["interval_iterations"] for s in scheds]
            spent = sum(1 for rec in t0["iteration_s"] if rec[1] == mode)
            sent = [sum(1 for x in t["transfers"] if x["mode"] == mode and x["bytes"] > 0) for t in tr.values()]
            r.update({
                "interval_planned": max(s["interval_iterations"] for s in scheds),
                "interval_achieved": spent / min(sent) if min(sent) else None,
                "memory_bytes": max(s["memory_bytes"] for s in scheds),
                "idle_s": min(idle), "transfer_s": max(transfer),
                "idle_left_s": min(i - x for i, x in zip(idle, transfer)),
                "stall_s": max(t["stall_by_mode"].get(mode, 0.0) for t in tr.values()) / max(1, spent),
                "container_bytes": max(t["plan"]["nbytes"] for t in tr.values()),
                "fits": all(s["fits"] for s in scheds),
                "idle_source": "/".join(sorted({t["plan"].get("idle", "network") for t in tr.values()})),
                "bandwidth": min(t["plan"]["link_bandwidth"] for t in tr.values())})
        out.append(r)
    return out


def summarize(results: list[dict]) -> dict[tuple[int, str], dict]:
    by: dict[tuple[int, str], list[dict]] = {}
    for r in results:
        by.setdefault((r["pp"], r["mode"]), []).append(r)
    out = {}
    for key, rs in by.items():
        med = dict(rs[0])
        med["iteration_s"] = statistics.median(r["iteration_s"] for r in rs)
        med["rounds"] = [round(r["iteration_s"], 4) for r in rs]
        med["turns_by_round"] = [r.get("turns", []) for r in rs]
        out[key] = med
    return out


def _job_suffix(mode: str) -> str:
    """'' for the main job's rows, ' /N' for the amortized job's ("pipelined /4", "off (/4 job)")."""
    if "(/" in mode:
        return " /" + mode.split("(/")[1].split()[0]
    return " /" + mode.split(" /")[1] if " /" in mode else ""


def _baseline_row(summary: dict, pp: int, name: str, suffix: str) -> dict:
    """The row of a job's baseline (``off`` / ``local``): "off" in the main job, "off (/4 job)" in the
    amortized one; {} when the job has none."""
    return summary.get((pp, f"{name} (/{suffix[2:]} job)" if suffix else name), {})


def _baseline(summary: dict, pp: int, name: str, suffix: str) -> Optional[float]:
    return _baseline_row(summary, pp, name, suffix).get("iteration_s")


def paired_overhead(mode: dict, base: dict) -> Optional[float]:
    """Median over the job's turns of (mode's turn k / baseline's turn k - 1): each turn is compared
    with its neighbour in the rotation, so slow drift of the machine cancels and outlier turns do
    not move the result (the means in the table are kept next to it)."""
    pairs = [a / b - 1 for mt, bt in zip(mode.get("turns_by_round", []), base.get("turns_by_round", []))
             for a, b in zip(mt, bt)]
    return statistics.median(pairs) if pairs else None


def table(summary: dict, pps: list[int], modes: list[str], reserved: int) -> str:
    lines = ["| PP | mode | iteration (s) | vs none (own job) | vs off | vs off, paired | vs local | idle | "
             "idle/it (s) | traffic/it (s) | idle left (s) | buffers (MiB, R = %.0f) | interval planned / achieved | "
             "training waited/it (s) |" % (reserved / 2**20),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pp in pps:
        base = summary.get((pp, "none"), {}).get("iteration_s")
        extra = [m for (q, m) in summary if q == pp and m not in modes]  # the amortized job's rows
        for m in modes + extra:
            r = summary.get((pp, m))
            if r is None:
                continue
            suffix = _job_suffix(m)
            it = r["iteration_s"]
            vs = (lambda b: f"{(it / b - 1) * 100:+.1f} %" if b else "-")
            off = _baseline_row(summary, pp, "off", suffix)
            paired = paired_overhead(r, off) if off and m != off.get("mode") else None
            row = [str(pp), m, f"{it:.3f}", vs(base), vs(off.get("iteration_s")),
                   f"{paired * 100:+.1f} %" if paired is not None else "-",
                   vs(_baseline(summary, pp, "local", suffix))]
            if "interval_planned" in r:
                ach = r["interval_achieved"]
                row += [r["idle_source"], f"{r['idle_s']:.3f}", f"{r['transfer_s']:.3f}", f"{r['idle_left_s']:.3f}",
                        f"{r['memory_bytes'] / 2**20:.2f}",
                        f"{r['interval_planned']} / {ach:.2f}" if ach else f"{r['interval_planned']} / -",
                        f"{r['stall_s']:.4f}"]
            else:
                row += ["-"] * 7
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def findings(summary: dict, pps: list[int], reserved: int) -> list[str]:
    """The issue's targets per job: pipelined overhead <= 0.5 x blocking's, and <= 3 % over no
    checkpointing where the profiled idle time exceeds the traffic time, both over the same job's
    ``off`` segments, turn by turn (:func:`paired_overhead`; over ``none``, a separate job, by the
    means when the job has no ``off``); buffer memory <= R."""
    out = []
    suffixes = sorted({_job_suffix(m) for (q, m) in summary if q in pps})
    for pp in pps:
        for suffix in suffixes:
            g = lambda m: summary.get((pp, m + suffix), {})  # noqa: E731
            blk, pip = g("blocking"), g("pipelined")
            off = _baseline_row(summary, pp, "off", suffix)
            none = summary.get((pp, "none"), {})
            job = f"PP={pp}{' (schedule.min_interval ' + suffix[2:] + ')' if suffix else ''}"
            if not (blk and pip and (off or none)):
                continue
            if off:
                name, op, ob = "off, paired turns", paired_overhead(pip, off), paired_overhead(blk, off)
                means = (f"; by the means: pipelined {(pip['iteration_s'] / off['iteration_s'] - 1) * 100:+.1f} %, "
                         f"blocking {(blk['iteration_s'] / off['iteration_s'] - 1) * 100:+.1f} %")
            else:
                name, means = "none (own job), means", ""
                op, ob = (pip["iteration_s"] / none["iteration_s"] - 1), (blk["iteration_s"] / none["iteration_s"] - 1)
            ratio = op / ob if ob and ob > 0 else float("nan")
            verdict = "PASS" if ob and ob > 0 and ratio <= RATIO_MAX else "FAIL"
            out.append(f"{job}: overhead over `{name}`: pipelined {op * 100:+.1f} % vs blocking {ob * 100:+.1f} %: "
                       f"ratio {ratio:.2f} (target <= {RATIO_MAX}: {verdict}){means}")
            local = _baseline(summary, pp, "local", suffix)
            if local:
                out.append(f"{job}: what the traffic adds over local snapshots (means): pipelined "
                           f"{(pip['iteration_s'] / local - 1) * 100:+.1f} % vs blocking "
                           f"{(blk['iteration_s'] / local - 1) * 100:+.1f} %")
            if "idle_s" in pip:
                line = (f"{job}: profiled idle ({pip['idle_source']}) {pip['idle_s']:.3f} s/it vs planned traffic "
                        f"{pip['transfer_s']:.3f} s/it (container {pip['container_bytes'] / 2**20:.1f} MiB per rank, "
                        f"planning link {pip['bandwidth'] / 2**20:.0f} MiB/s)")
                if pip["idle_source"].startswith("network (no free"):  # asked for device, none free
                    line += (": the host has no core to spare while a rank waits (more training ranks than cores), "
                             "so no idle time is free of compute here: the 3 % target does not apply")
                elif pip["idle_s"] >= pip["transfer_s"]:
                    line += (f": idle exceeds traffic, pipelined {op * 100:+.1f} % over `{name}` (target <= "
                             f"{OVERHEAD_MAX * 100:.0f} %: {'PASS' if op <= OVERHEAD_MAX else 'FAIL'})")
                else:
                    line += ": idle does not exceed traffic, the 3 % target does not apply"
                out.append(line)
                mem = max(summary[(pp, m)]["memory_bytes"] for (q, m) in summary
                          if q == pp and "memory_bytes" in summary[(pp, m)] and m.split()[0] != "naive")
                out.append(f"{job}: largest buffer memory of the modes but naive {mem / 2**20:.2f} MiB "
                           f"(R = {reserved / 2**20:.0f} MiB: {'PASS' if mem <= reserved else 'FAIL'})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", default="2,4", help="pipeline depths (one rank per node)")
    ap.add_argument("--modes", default=",".join(ALL_MODES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--segment", type=int, default=4, help="iterations per mode before the next (compare_iterations)")
    ap.add_argument("--cycles", type=int, default=2, help="times each mode comes round in a job")
    add_job_args(ap, hidden=384, seq=64)
    ap.add_argument("--amortize", type=int, default=4,
                    help="also a job with schedule.min_interval N: local, blocking, pipelined (0/1: none)")
    ap.add_argument("--idle", default="network", choices=["network", "device", "auto"],
                    help="schedule.idle: the spans the pipelined modes fill (device: the pipeline bubbles)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--workdir", default="/tmp/megatron-ft/bench-scheduling")
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    pps = [int(x) for x in args.pp.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        ap.error(f"--modes: {bad} not in {ALL_MODES}")
    os.makedirs(args.workdir, exist_ok=True)
    scheduled = [m for m in modes if m != "none"]
    # a mode whose transfer spans n > --segment iterations runs n (rounded up) per turn: some slack
    iters = args.profile + 1 + (len(scheduled) * args.segment + 12) * args.cycles
    results = []
    for rnd in range(args.rounds):
        for pp in pps:
            if "none" in modes:
                t0 = time.time()
                d = run_job(pp, "none", iters, args, [], str(rnd))
                r = {"pp": pp, "mode": "none", "iteration_s": statistics.mean(iteration_times(d, args.profile + 1)),
                     "run_dir": d}
                results.append(r)
                print(f"[round {rnd}] PP={pp} none: {r['iteration_s']:.3f} s/it ({time.time() - t0:.0f} s)", flush=True)
            if scheduled:
                t0 = time.time()
                d = run_job(pp, "compare", iters, args, scheduled, str(rnd))
                for r in mode_results(d, pp, args):
                    results.append(r)
                    print(f"[round {rnd}] PP={pp} {r['mode']:10s} {r['iteration_s']:.3f} s/it "
                          f"({r['iterations']} its)", flush=True)
                print(f"[round {rnd}] PP={pp} compare job: {time.time() - t0:.0f} s", flush=True)
            if args.amortize > 1:
                t0 = time.time()
                am = ["off", "local", "blocking", "pipelined"]
                d = run_job(pp, f"every{args.amortize}", args.profile + 1 + (4 * args.segment + 12) * args.cycles,
                            args, am, str(rnd), args.amortize)
                for r in mode_results(d, pp, args, f" /{args.amortize}"):
                    if r["mode"] in ("local", "off"):
                        r["mode"] = f"{r['mode']} (/{args.amortize} job)"
                    results.append(r)
                    print(f"[round {rnd}] PP={pp} {r['mode']:10s} {r['iteration_s']:.3f} s/it "
                          f"({r['iterations']} its)", flush=True)
                print(f"[round {rnd}] PP={pp} amortized job: {time.time() - t0:.0f} s", flush=True)
    summary = summarize(results)
    text = table(summary, pps, modes, int(args.reserved_mib * 2**20))
    notes = findings(summary, pps, int(args.reserved_mib * 2**20))
    print(text)
    for n in notes:
        print(" -", n)
    with open(os.path.join(args.workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if not args.no_docs:
        from _docs import write_section

        img = ""
        pip = summary.get((pps[0], "pipelined"))
        if pip:
            out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "timeline", pip["run_dir"], "--out",
                                  os.path.join(args.workdir, "timeline")], capture_output=True, text=True)
            png = os.path.join(args.workdir, "timeline", "timeline.png")
            if out.returncode != 0 or not os.path.exists(png):
                why = (out.stderr.strip().splitlines() or ["no PNG written"])[-1]
                print(f"[bench] no timeline PNG ({why}); `pip install 'megatron-ft[plot]'` for matplotlib",
                      file=sys.stderr)
            else:
                shutil.copy(png, IMG)
                img = (f"\n![PP={pps[0]} pipelined: profiled iterations, planned and actual chunks]"
                       f"(img/{os.path.basename(IMG)})\n")
        cmd = "python3 benchmarks/scheduling.py " + " ".join(sys.argv[1:])
        body = (f"`{cmd.strip()}` ({time.strftime('%Y-%m-%d')}, this 2-core CPU machine; model: hidden "
                f"{args.hidden}, {args.layers_per_stage} layers per stage, seq {args.seq}, {args.micro_batches} "
                f"micro-batches; the first {args.profile} iterations profiled, then the modes in turn, "
                f"{args.segment} iterations each, {args.cycles} times round, in one job (the first iteration of "
                f"each turn left out); `off` = segments of the same job without snapshots or traffic, `none` = a "
                f"separate job without megatron-ft; pipelined modes fill the `{args.idle}` idle spans "
                f"(`schedule.idle`); iteration time = mean over the turns; "
                f"median of {args.rounds} round(s)):\n\n"
                + text + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n" + img)
        write_section(DOCS, "## Scheduling checkpoint traffic", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
