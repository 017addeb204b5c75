"""Where a recovery's time goes: `megatron-ft demo` runs of a trainer crash, all trainers of a
node, and a node loss taken over by a warm standby, each broken into phases and set against the
same job's cold start (launch -> first completed iteration, measured in the same run).

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
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SCENARIOS = {
    "trainer": ["--fail=trainer"],
    "all-trainers": ["--fail=all-trainers"],
    "node-standby": ["--fail=node", "--redundancy=replica", "--standby"],
}
#: the targets of the recovery-in-seconds work: (ratio to the cold start, seconds on 2 cores)
TARGETS = {"trainer": (0.15, 1.5), "all-trainers": (0.25, 3.0), "node-standby": (0.4, 6.0)}
PHASES = ("detect_respawn", "imports", "rendezvous", "build", "restore", "first_iteration")
PHASE_NAMES = {"detect_respawn": "detect + respawn", "imports": "imports", "rendezvous": "rendezvous",
               "build": "build", "restore": "restore", "first_iteration": "first iteration"}


def run_demo(scenario: str, index: int, args: argparse.Namespace) -> dict:
    wd = os.path.join(args.workdir, f"{scenario}-{index}")
    ref = os.path.join(args.workdir, "reference-" + ("replica" if "--redundancy=replica" in SCENARIOS[scenario]
                                                     else "default"))
    cmd = [sys.executable, "-m", "megatron_ft.cli", "demo", "--quiet", f"--workdir={wd}", f"--reference-dir={ref}",
           f"--iters={args.iters}", f"--kill-at={args.kill_at}", *SCENARIOS[scenario]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"ok": False, "why": f"exit {out.returncode}: {(out.stdout + out.stderr)[-400:]}"}
    s = json.loads(lines[-1])
    ok = out.returncode == 0 and s.get("bitwise_identical") and s.get("tier_ok") and s.get("recovery_seconds")
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
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| scenario | runs right | recovered from | cold start | recovery | recovery / cold start | target | "
            + " | ".join(PHASE_NAMES[p] for p in PHASES) + " |")
    lines = [head, "|" + "---|" * (7 + len(PHASES))]
    for r in rows:
        ratio_t, sec_t = TARGETS[r["scenario"]]
        if "cold" not in r:
            lines.append(f"| {r['scenario']} | 0 of {r['runs']} | - | - | - | - | <= {ratio_t}x, <= {sec_t:g} s |"
                         + " - |" * len(PHASES))
            continue
        met = r["ratio"] <= ratio_t and r["recovery"] <= sec_t
        lines.append(f"| {r['scenario']} | {r['good']} of {r['runs']} | {', '.join(r['tiers'])} | {fmt(r['cold'])} | "
                     f"{fmt(r['recovery'])} | {r['ratio']:.2f}x | <= {ratio_t}x, <= {sec_t:g} s: "
                     f"{'met' if met else 'not met'} | "
                     + " | ".join(fmt(r["phases"][p]) for p in PHASES) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {list(SCENARIOS)}")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=6)
    p.add_argument("--timeout", type=float, default=900.0, help="one demo run past this is a failure")
    p.add_argument("--workdir", default="/tmp/megatron-ft/bench-recovery")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args()
    scenarios = args.scenarios.split(",")
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"--scenarios: {bad} not among {list(SCENARIOS)}")
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
    cmd = "python benchmarks/recovery.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))} with `{cmd}` "
        f"({(time.time() - t0) / 60:.1f} min) on {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"1-min load average {load0:.1f} at the start and {os.getloadavg()[0]:.1f} at the end; the demo's job "
        f"(TP1 PP2, 2 simulated nodes x 2 ranks, gloo), {args.iters} iterations, the failure after iteration "
        f"{args.kill_at}. Medians of the runs that ended bit-exact at the promised tier; *recovery* = the kill -> "
        f"the first completed iteration after it (the earliest restarted rank); *cold start* = the same run's "
        f"launch -> its first completed iteration; the phases are that earliest rank's and add up to its "
        f"recovery (see `benchmarks/recovery.py`).", "", table(rows)])
    print(body)
    for r in rows:
        for why in r["failed"]:
            print(f"  {r['scenario']}: {why}")
    if not args.no_docs:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _docs import write_section

        write_section(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md"),
                      "## Recovery time", body)
    return 0 if all(r["good"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
