"""Where a recovery's time goes: `megatron-ft demo` runs of a trainer crash, all trainers of a
node, a node loss taken over by a warm standby, and a hung trainer, each broken into phases and set
against the same job's cold start (launch -> first completed iteration, measured in the same run).

A hung trainer (``hang``: SIGSTOPped after the iteration, never resumed) is found by the agents' hang
rule, SIGKILLed and recovered like a crash: its *recovery* is the stop -> the first completed
iteration after it, and *hang found* (the stop -> the agents' verdict) is the part of it spent
noticing; the phases after it are a crash's.

Phases of a recovery, for the restarted rank that completes an iteration first (an iteration
needs every rank, so that is when the job trains again); they add up to its recovery time, and the
demo's summary has them under ``recovery_breakdown``:

* ``detect + respawn``: the kill -> the replacement trainer process exists (torchrun notices the
  dead worker, stops the survivors, spawns a new generation; for a node, the standby's launcher,
  agent and torchrun start first);
* ``imports``: process start -> it begins the rendezvous (Python, torch, megatron-core);
* ``rendezvous``: torchrun's rendezvous store and the process group (``init_process_group``);
* ``build``: model-parallel groups, model, optimizer, the checkpointer's connection to its agent;
* ``restore``: the agreement on a step across ranks and the copy from memory (local, or a peer's
  copy rebuilt into the local agent first);
* ``first iteration``: the restore's end -> the first completed iteration.

Every run must end bit-exact at the promised tier (the demo checks both); a run that does not is
reported and left out of the medians. Ratios are taken per run (recovery / that run's cold start),
then their median. Nothing here is a timed assertion; the targets are printed beside the figures.

    python benchmarks/recovery.py --runs 5          # ~15 minutes on 2 cores; writes docs/benchmarks.md
    python benchmarks/recovery.py --runs 5 --scenarios "upstream trainer;upstream all-trainers;upstream node-standby" \
        --section "## Recovery time: upstream Megatron-LM"                  # ~20 minutes
    python benchmarks/recovery.py --runs 5 --scenarios "trainer;hang" --section "## Recovery time: a hung trainer"
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

SCENARIOS = {
    "trainer": ["--fail=trainer"],
    # the same crash restarted by torchrun (warm spares, no fast restart round), side by side
    "trainer, torchrun restart": ["--fail=trainer", "--config={torchrun_config}"],
    # the same crash with warm spares off: the recovery as it was before them, side by side
    "trainer, no spares": ["--fail=trainer", "--config={cold_config}"],
    # the same crash with in-process restart off: every rank's trainer re-forked in the fast round
    "trainer, re-forked": ["--fail=trainer", "--config={refork_config}"],
    "all-trainers": ["--fail=all-trainers"],
    # a trainer SIGSTOPped, never resumed: the hang rule's verdict (SIGKILL), then a crash's recovery
    "hang": ["--fail=hang"],
    "node-standby": ["--fail=node", "--redundancy=replica", "--standby"],
    # the same takeover through torch's c10d rendezvous (launch.rendezvous: c10d), side by side
    "node-standby, c10d": ["--fail=node", "--redundancy=replica", "--standby", "--config={c10d_config}"],
    # upstream Megatron-LM's pretrain_gpt.py with the patch set (--megatron-lm, or the shared archive)
    "upstream trainer": ["--fail=trainer", "--megatron-lm={upstream}"],
    "upstream all-trainers": ["--fail=all-trainers", "--megatron-lm={upstream}"],
    "upstream node-standby": ["--fail=node", "--redundancy=replica", "--standby", "--megatron-lm={upstream}"],
    "upstream trainer, re-forked": ["--fail=trainer", "--megatron-lm={upstream}", "--config={refork_config}"],
}
DEFAULT = ("trainer", "trainer, re-forked", "trainer, torchrun restart", "trainer, no spares", "all-trainers",
           "node-standby")
#: the targets of the recovery-in-seconds work: (ratio to the cold start, seconds on 2 cores)
TARGETS = {"trainer": (0.15, 1.5), "trainer, torchrun restart": None, "trainer, no spares": None,
           "trainer, re-forked": None, "upstream trainer, re-forked": None, "node-standby, c10d": None,
           "all-trainers": (0.25, 3.0), "node-standby": (0.4, 6.0), "upstream trainer": (0.15, 1.5),
           "upstream all-trainers": (0.25, 3.0), "upstream node-standby": (0.4, 6.0),
           "hang": (None, 10.0)}  # no ratio: the detection is hang.floor_s (5 s) whatever the job's start
BASELINES = {"trainer, torchrun restart": "(torchrun's restart)", "trainer, no spares": "(before warm spares)",
             "trainer, re-forked": "(before in-process restart)", "node-standby, c10d": "(torch's rendezvous)",
             "upstream trainer, re-forked": "(before in-process restart)"}
PHASES = ("detect_respawn", "imports", "rendezvous", "build", "restore", "first_iteration")
PHASE_NAMES = {"detect_respawn": "detect + respawn", "imports": "imports", "rendezvous": "rendezvous",
               "build": "build", "restore": "restore", "first_iteration": "first iteration"}


def run_demo(scenario: str, index: int, args: argparse.Namespace) -> dict:
    wd = os.path.join(args.workdir, f"{scenario.replace(', ', '-').replace(' ', '-')}-{index}")
    shape = ("upstream-" if scenario.startswith("upstream") else "") + (
        "replica" if "--redundancy=replica" in SCENARIOS[scenario] else "default")
    ref = os.path.join(args.workdir, "reference-" + shape)
    cmd = [sys.executable, "-m", "megatron_ft.cli", "demo", "--quiet", f"--workdir={wd}", f"--reference-dir={ref}",
           f"--iters={args.iters}", f"--kill-at={args.kill_at}",
           *(a.format(cold_config=args.cold_config, torchrun_config=args.torchrun_config,
                      refork_config=args.refork_config, c10d_config=args.c10d_config, upstream=args.upstream)
             for a in SCENARIOS[scenario])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"ok": False, "why": f"exit {out.returncode}: {(out.stdout + out.stderr)[-400:]}"}
    s = json.loads(lines[-1])
    ok = (out.returncode == 0 and s.get("bitwise_identical") and s.get("tier_ok") and s.get("recovery_seconds")
          and s.get("hang_ok", True) and (scenario != "hang" or s.get("hang_detected_s") is not None))
    return {**s, "ok": bool(ok), "why": "" if ok else f"exit {out.returncode}; problems {s.get('problems')}"}


def fmt(x: float) -> str:
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for scenario, runs in results.items():
        good = [r for r in runs if r["ok"]]
        row = {"scenario": scenario, "runs": len(runs), "good": len(good),
               "failed": [r["why"] for r in runs if not r["ok"]]}
        if good:
            row["tiers"] = sorted({r["recovered_from"] for r in good})
            row["cold"] = statistics.median(r["cold_start_seconds"] for r in good)
            row["recovery"] = statistics.median(r["recovery_seconds"] for r in good)
            row["ratio"] = statistics.median(r["recovery_seconds"] / r["cold_start_seconds"] for r in good)
            row["phases"] = {p: statistics.median(r["recovery_breakdown"].get(p) or 0.0 for r in good) for p in PHASES}
            found = [r["hang_detected_s"] for r in good if r.get("hang_detected_s") is not None]
            row["hang_found"] = statistics.median(found) if found else None
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table; a *hang found* column (the stop -> the verdict) when a row has it."""
    hangs = any(r.get("hang_found") is not None for r in rows)
    head = ("| scenario | runs right | recovered from | cold start | recovery | recovery / cold start | target | "
            + ("hang found | " if hangs else "") + " | ".join(PHASE_NAMES[p] for p in PHASES) + " |")
    lines = [head, "|" + "---|" * (7 + hangs + len(PHASES))]
    for r in rows:
        target = TARGETS[r["scenario"]]
        goal = (BASELINES.get(r["scenario"], "") if target is None else
                (f"<= {target[0]}x, " if target[0] is not None else "") + f"<= {target[1]:g} s")
        if "cold" not in r:
            lines.append(f"| {r['scenario']} | 0 of {r['runs']} | - | - | - | - | {goal} |" + " - |" * (hangs + len(PHASES)))
            continue
        if target is not None:
            met = (target[0] is None or r["ratio"] <= target[0]) and r["recovery"] <= target[1]
            goal += ": met" if met else ": not met"
        found = ((fmt(r["hang_found"]) if r.get("hang_found") is not None else "-") + " | ") if hangs else ""
        lines.append(f"| {r['scenario']} | {r['good']} of {r['runs']} | {', '.join(r['tiers'])} | {fmt(r['cold'])} | "
                     f"{fmt(r['recovery'])} | {r['ratio']:.2f}x | {goal} | {found}"
                     + " | ".join(fmt(r["phases"][p]) for p in PHASES) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scenarios", default=";".join(DEFAULT), help=f"';'-separated subset of {list(SCENARIOS)}")
    p.add_argument("--megatron-lm", dest="upstream", default=None,
                   help="the upstream scenarios' Megatron-LM (a tree or archive; default: MEGATRON_LM_DIR or the "
                        "shared core_v0.16.1 archive)")
    p.add_argument("--section", default="## Recovery time", help="the docs/benchmarks.md section to (re)write")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=6)
    p.add_argument("--timeout", type=float, default=900.0, help="one demo run past this is a failure")
    p.add_argument("--workdir", default="/tmp/megatron-ft/bench-recovery")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args()
    scenarios = args.scenarios.split(";")
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"--scenarios: {bad} not among {list(SCENARIOS)}")
    os.makedirs(args.workdir, exist_ok=True)
    args.cold_config = os.path.join(args.workdir, "no-spares.yaml")
    import yaml

    from megatron_ft import config as ftconfig

    with open(args.cold_config, "w") as f:  # the demo's embedded job, warm spares off
        yaml.safe_dump(ftconfig.replace(ftconfig.load(), launch={"warm_spares": False}).to_dict(), f)
    args.torchrun_config = os.path.join(args.workdir, "torchrun-restart.yaml")
    with open(args.torchrun_config, "w") as f:  # warm spares, no fast restart rounds
        yaml.safe_dump(ftconfig.replace(ftconfig.load(), launch={"fast_restarts": 0}).to_dict(), f)
    args.refork_config = os.path.join(args.workdir, "re-forked.yaml")
    with open(args.refork_config, "w") as f:  # fast restart rounds, every trainer re-forked in them
        yaml.safe_dump(ftconfig.replace(ftconfig.load(), launch={"in_process_restart": False}).to_dict(), f)
    args.c10d_config = os.path.join(args.workdir, "c10d.yaml")
    with open(args.c10d_config, "w") as f:  # torch's c10d rendezvous instead of the node rendezvous
        yaml.safe_dump(ftconfig.replace(ftconfig.load(), launch={"rendezvous": "c10d"}).to_dict(), f)
    if any(s.startswith("upstream") for s in scenarios) and not args.upstream:
        from megatron_ft.testing import megatron_lm

        args.upstream = megatron_lm.source()
        if not args.upstream:
            p.error("the upstream scenarios need --megatron-lm (or MEGATRON_LM_DIR, or the shared archive)")
    t0, load0 = time.time(), os.getloadavg()[0]
    results: dict[str, list[dict]] = {s: [] for s in scenarios}
    for i in range(args.runs):  # scenarios interleaved, so a slow spell of the machine hits them alike
        for s in scenarios:
            r = run_demo(s, i, args)
            results[s].append(r)
            print(f"[recovery] {s} run {i}: {'ok' if r['ok'] else 'FAILED ' + r['why']} "
                  f"recovery {r.get('recovery_seconds')} s, cold start {r.get('cold_start_seconds')} s, "
                  f"{r.get('recovered_from')} step {r.get('resumed_step')}", flush=True)
    rows = summarize(results)
    cmd = "python benchmarks/recovery.py " + shlex.join(sys.argv[1:])
    body = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))} with `{cmd}` "
        f"({(time.time() - t0) / 60:.1f} min) on {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"1-min load average {load0:.1f} at the start and {os.getloadavg()[0]:.1f} at the end; the demo's job "
        f"(TP1 PP2, 2 simulated nodes x 2 ranks, gloo), {args.iters} iterations, the failure after iteration "
        f"{args.kill_at}. Medians of the runs that ended bit-exact at the promised tier; *recovery* = the kill -> "
        f"the first completed iteration after it (the earliest restarted rank); *cold start* = the same job's "
        f"launch -> first completed iteration, started cold (the demo's reference run: no warm spares, no "
        f"snapshots; one per cluster shape in this benchmark run); the phases are the earliest restarted rank's "
        f"and add up to its recovery (see `benchmarks/recovery.py`). *trainer, torchrun restart* is the same "
        f"crash with `launch.fast_restarts: 0` (torchrun restarts every worker, from the warm spares); *trainer, "
        f"no spares* the same with `launch.warm_spares: false`; *re-forked* the same with "
        f"`launch.in_process_restart: false` (every rank's trainer re-forked in the fast round): the recoveries "
        f"before fast restart rounds, before warm spares and before in-process restart, measured beside it."
        + (" *node-standby, c10d* is the same takeover with `launch.rendezvous: c10d` (torch's rendezvous, "
           "which keeps the lost node's torchrun until its keep-alives lapse) instead of the node rendezvous."
           if "node-standby, c10d" in scenarios else "")
        + (" *hang* is a trainer SIGSTOPped after the iteration and never resumed: its *recovery* is the stop -> "
           "the first completed iteration after it, *hang found* the stop -> the agents' hang verdict (then "
           "SIGKILL and a crash's recovery; the verdict is part of *detect + respawn*)." if "hang" in scenarios
           else "")
        + (" The upstream scenarios run Megatron-LM's own `pretrain_gpt.py` with the patch set "
           f"(`{os.path.basename(args.upstream)}`)." if args.upstream else ""), "",
        table(rows)])
    print(body)
    for r in rows:
        for why in r["failed"]:
            print(f"  {r['scenario']}: {why}")
    if not args.no_docs:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _docs import write_section

        write_section(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md"),
                      args.section, body)
    return 0 if all(r["good"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
