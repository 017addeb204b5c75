"""The job-wide snapshot agreement at scale: how many messages and how long, per agreed step, from 64 to
2,048 nodes; and (``--trainers``) real trainers with the agents' agreement against the old collective one.

(b) ``--nodes``: a simulated cluster (:mod:`megatron_ft.testing.scale_bed`): N nodes of 1 rank each,
every node's real :class:`~megatron_ft.agent.server.Agent` (its embedded store server, heartbeats,
agreement reports and verdict watch, Unix socket), spread over ``--procs`` worker processes, each
hosting N/P agents in threads; the trainers are light clients speaking the real trainer-agent protocol
(hello, register a 1 KiB layout, then per step begin -> a real version record -> commit). Per agreed
step it measures:

* messages: the root's store requests by op and key (``KVServer.op_counts``): ``set agree/<node>``
  (the reports) and ``watch agreed`` (each answered with the new verdict, then asked again) - a watch
  that ended unchanged after its ``poll_s`` is an idle re-poll, counted apart; and every agent's own
  count of the reports it sent and the verdicts it saw (``JobAgreement.reports_sent``,
  ``verdicts_seen``): one each per node per step is 2 rounds (report, verdict);
* time: from the last trainer's commit to every agent having applied the new agreed step (its
  ``protect`` hook: the moment its ``begin`` may hand the older slot out), p50 and p99 over the steps;
* the bed's own load beside it: the workers' CPU seconds per wall second (2 cores here) and the
  1-minute load average.

Sizing on this machine (pid_max 32,768, 20,000 descriptors and 65,530 mappings per process, 2 cores):
see :mod:`megatron_ft.testing.scale_bed` - the workers' servers wake every 1 s when idle (not 20 times a
second), 512 KiB thread stacks, ``--root-alone`` puts the root in a worker of its own; 2,048 nodes in this
mode are 14,344 threads over 8 workers (``--procs 8``). Heartbeats every ``--heartbeat-s`` (default: 2 s up
to 256 nodes, 5 s above) with a 300 s ``timeout_s``: a long timeout keeps a loaded bed from judging nodes
failed, which this part does not measure (part (c) does).

``--restores K``: then, in the same bed, K restores' job-wide decisions (a node loss's restore
coordination, best case): every light client lists its held steps and asks its agent to ``decide`` the
``intersect`` of them, then the ``min`` of (ok, not refused) twice, under a key all clients share;
messages per node per restore and per decision from the root's ``set red`` / ``watch red`` counts,
rounds from the agents' own counts, the time from the first client's request to the last one's
answer (p50/p99), the bed's load, what is left at the root. The decisions run on the trainer's own
connection after an unmeasured warm-up (``--restore-conn fresh``: a connection per restore, as the
trainer does; see docs/benchmarks.md for why not by default).

(c) ``--health``: the simulated cluster in its health mode (:mod:`megatron_ft.testing.scale_health`):
N nodes' real agents with their store and heartbeats only (``--store embedded``: each agent's own
store server, the root's the job's; ``--store etcd``: a real etcd server the benchmark starts, every
agent's lease and the root's watch), ``--span-s`` seconds healthy: the store's requests per node per
heartbeat period (embedded: the root server's op counts, wire requests apart from the root's own calls
in process; etcd: the agents' clients' count and etcd's own ``grpc_server_started_total``), the
heartbeat round at the root and every agent's beat (p50/p99), false verdicts; then one node's agent
stopped as a lost one (its heartbeats stop and its store server closes, or its lease lapses): the time
until the root's ``failed/<node>``, and until one of 2 waiting standbys (``claim_failed_node``) claimed
it. ``--launch``: before the loss, the launcher side on the same store - a real ``Rendezvous`` per node
(``current``, ``begin``, ``keep_published``, then a new generation: ``after_failure`` on every survivor,
``current`` of the host's restarted launcher, ``begin``) and 2 standbys waiting with no failure; requests
counted where they leave that process. ``--keepers before after``: the warm spares' verdict watch during
one fast restart round's settling window (``health.timeout_s`` + 1 s), 8 keepers per node: each keeper's
``VerdictWatch`` (before) or one ``node_watch.VerdictStream`` per node (after). The fits: requests per node
against N (least squares).

(a) ``--trainers R ...``: ``megatron-ft demo --fail none`` on R ranks (R/2 nodes x 2 ranks, the tiny
model), alternating ``--repeats`` times: in-memory checkpointing off, ``snapshot.agreement: agents``,
``collective``; per-iteration time (its overhead against off) and megatron-ft's world collectives per
snapshot and per iteration from the ranks' ``snapshots`` events.

    python benchmarks/scale.py --nodes 64 256 --steps 5 --restores 10              # ~3 min on 2 cores
    python benchmarks/scale.py --nodes 256 1024 --steps 5 --restores 10 --backlog 4096   # ~6 min
    python benchmarks/scale.py --trainers 4 8 --repeats 2 --iterations 30          # ~12 min
    python benchmarks/scale.py --health --launch --keepers after --nodes 64 256 --span-s 60     # ~6 min
    python benchmarks/scale.py --health --launch --nodes 2048 --span-s 600 --procs 8           # ~13 min
    python benchmarks/scale.py --health --launch --keepers after --store etcd --nodes 64 128 256 512 --span-s 60
    python benchmarks/scale.py --nodes 2048 --steps 5 --restores 10 --procs 8 --root-alone
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_ft.testing.scale_bed import BedError, ScaleBed  # noqa: E402


def bed(nodes: int, steps: int, procs: int, heartbeat_s: float, timeout_s: float, restores: int = 0,
        decisions: int = 3, conns: tuple = ("fresh",), backlog=None, root_alone: bool = False) -> tuple[dict, list[dict]]:
    """The agreement's figures over ``steps`` agreed steps, then (``restores``) each connection kind's
    restore figures in the same bed: ``fresh``, a connection per restore as the trainer's
    ``Checkpointer._decisions`` opens (``role: coordination``), ``trainer``: the trainer's own."""
    b = ScaleBed(nodes, procs=procs, heartbeat_s=heartbeat_s, timeout_s=timeout_s, step_timeout_s=300.0,
                 backlog=backlog, root_alone=root_alone)
    rfigs: list[dict] = []
    try:
        b.start(timeout_s=1800)
        fig = b.run(steps, warmup=2, settle_s=1.0)
        for conn in conns if restores else ():
            try:
                rfigs.append(b.restores(restores, decisions, fresh=conn == "fresh", wait_s=300.0, settle_s=1.0))
            except BedError as e:
                rfigs.append({"nodes": nodes, "procs": procs, "fresh_connection": conn == "fresh",
                              "error": str(e)[:4000]})
    except BedError as e:
        fig = {"nodes": nodes, "procs": procs, "error": str(e)[:4000], **b.started}
    finally:
        closed = b.close()
    fig["teardown"] = closed
    for r in rfigs:
        r["teardown"] = closed
    return fig, rfigs


def health_bed(nodes: int, procs: int, heartbeat_s: float, timeout_s: float, span_s: float, store: str,
               launch: bool, keepers: tuple, per_node: int) -> dict:
    """Part (c): the health figures of one size (see the module); every part's figures, or its error."""
    from megatron_ft.testing import scale_health as sh

    etcd = sh.start_etcd() if store == "etcd" else None
    b = ScaleBed(nodes, procs=procs, heartbeat_s=heartbeat_s, timeout_s=timeout_s, mode="health",
                 store=etcd.url if etcd is not None else "embedded", root_alone=procs > 2)
    out: dict = {"nodes": nodes, "store": store}
    sides = None

    def say(part: str) -> None:  # progress, on stderr
        print(f"# {time.strftime('%H:%M:%S')} {nodes} nodes ({store}): {part} done, load {os.getloadavg()[0]:.1f}: "
              f"{json.dumps(out.get(part))}", file=sys.stderr, flush=True)
    try:
        b.start(timeout_s=1800)
        out["started"] = b.started
        say("started")
        sides = sh.start_sides(b)
        time.sleep(2 * heartbeat_s)  # every heartbeat names its launcher
        out["health"] = sh.health_run(b, span_s, etcd)
        say("health")
        if launch:
            try:
                out["launch"] = sh.launch_run(b, sides)
            except (BedError, RuntimeError) as e:
                out["launch"] = {"nodes": nodes, "error": str(e)[:3000]}
            say("launch")
        for kind in keepers:
            try:
                out.setdefault("keepers", []).append(
                    sh.keepers_run(b, sides, kind, nodes if kind == "after" else min(nodes, 64), per_node))
            except (BedError, RuntimeError) as e:
                out.setdefault("keepers", []).append({"kind": kind, "nodes": nodes, "error": str(e)[:3000]})
            say("keepers")
        out["detect"] = sh.detect(b, sorted({nodes - 1, nodes // 2, nodes // 3} - {0}), sides, standbys=2)
        say("detect")
    except (BedError, RuntimeError, OSError) as e:
        out["error"] = str(e)[:4000]
    finally:
        if sides is not None:
            sh.stop_sides(sides)
        out["teardown"] = b.close()
        if etcd is not None:
            etcd.stop()
    return out


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def health_table(rows: list[dict]) -> str:
    head = ("| nodes | store | store requests / node / period | by family (per node per period) | root in process "
            "/ node / period | root round p50 / p99 ms | agents' beat p50 / p99 ms | false verdicts | detected s "
            "(the first, the last of 3; timeout_s) | standby claimed s | bed CPU (cores) | load 1m | threads |\n|" + "---|" * 13)
    out = [head]
    for r in rows:
        h = r.get("health")
        if h is None:
            out.append(f"| {r['nodes']} | {r['store']} | failed: {r.get('error', '')[:160]} |" + " |" * 10)
            continue
        d = r.get("detect") or {}
        n, per = h["nodes"], h["periods"]
        if h["store"] == "etcd":
            req = (f"{_f(h['etcd_client_requests_per_node_period'], '.3f')} (client), "
                   f"{_f(h['etcd_server_requests_per_node_s'] and h['etcd_server_requests_per_node_s'] * h['heartbeat_s'], '.3f')} (etcd)")
            fams, local = "-", "-"
        else:
            req = _f(h["store_requests_per_node_period"], ".3f")
            fams = ", ".join(f"{k} {v / (n * per):.2f}" for k, v in sorted(h["root_ops"].items())
                             if " " in k and not k.startswith("local") and v / (n * per) >= 0.005)
            loc = sum(v for k, v in h["root_ops"].items() if k.startswith("local ") and k.count(" ") == 1)
            local = f"{loc / (n * per):.2f}"
        out.append(f"| {n} | {h['store']} | {req} | {fams} | {local} | {_f(h['root_round_p50_ms'], '.1f')} / "
                   f"{_f(h['root_round_p99_ms'], '.1f')} | {_f(h['beat_p50_ms'], '.1f')} / {_f(h['beat_p99_ms'], '.1f')} | "
                   f"{h['false_verdicts']} in {h['span_s']:.0f} s | {_f(d.get('detected_min_s'))}, {_f(d.get('detected_s'))} "
                   f"({h['timeout_s']:g}) | "
                   f"{_f(d.get('claimed_s'))} | {h['bed_cpu_cores']:.2f} | {h['loadavg_1m'][1]:.1f} | {h['threads']} |")
    return "\n".join(out)


def launch_table(rows: list[dict]) -> str:
    head = ("| nodes | current / launcher | begin / launcher | keep_published / launcher (per 2 s) | after_failure: "
            "the new host, each other | new generation / launcher (after_failure + begin) | a launcher's own requests / s "
            "while torchrun runs (besides keep_published) | a standby's requests / s (no failure) | a standby's claim: "
            "its requests (2 standbys) | load 1m |\n|" + "---|" * 10)
    out = [head]
    for r in rows:
        la, d = r.get("launch"), r.get("detect") or {}
        if not la or "error" in la:
            out.append(f"| {r['nodes']} | failed: {(la or r).get('error', '')[:160]} |" + " |" * 8)
            continue
        claim = sum(v for k, v in (d.get("standby_ops") or {}).items() if " " not in k and k != "connect")
        out.append(f"| {la['nodes']} | {la['current_per_launcher']:.2f} | {la['begin_per_launcher']:.2f} | "
                   f"{la['keep_published_per_launcher']:.2f} | {la['after_failure_host_requests']}, "
                   f"{_f(la['after_failure_other_per_launcher'])} | {la['generation_requests_per_launcher']:.2f} | "
                   f"{_f(la.get('launcher_idle_requests_per_s'), '.3f')} | {la['standby_requests_per_s']:.2f} | {claim} | "
                   f"{la['loadavg_1m'][1]:.1f} |")
    return "\n".join(out)


def keepers_table(rows: list[dict]) -> str:
    out = ["| nodes | watch | keepers per node | nodes watching | requests / node / round | requests / keeper / round "
           "| window s | verdicts told |", "|" + "---|" * 8]
    for r in rows:
        for k in r.get("keepers", []):
            if "error" in k:
                out.append(f"| {r['nodes']} | {k['kind']} | failed: {k['error'][:160]} |" + " |" * 5)
                continue
            out.append(f"| {r['nodes']} | {k['kind']} | {k['per_node']} | {k['nodes']} | {k['requests_per_node_round']:.2f} | "
                       f"{k['requests_per_keeper_round']:.2f} | {k['window_s']:g} | {k.get('verdicts_told', '-')} |")
    return "\n".join(out)


def fit_line(label: str, xs: list, ys: list, per: str = "per node") -> str:
    """``label``: values ``ys`` (``per`` node, launcher, standby) against N ``xs``: the least-squares line
    and the spread."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len(pts) < 2:
        return f"{label}: fewer than 2 sizes"
    a, b = fit([p[0] for p in pts], [p[1] for p in pts])
    vals = [p[1] for p in pts]
    mean = sum(vals) / len(vals)
    spread = 100 * max(abs(y - mean) for y in vals) / mean if mean else 0.0
    return (f"{label}: {per} = {a:.4g} + {b:.3g} x N (least squares over {len(pts)} sizes, "
            f"{min(p[0] for p in pts)}-{max(p[0] for p in pts)}); {min(vals):.3f}-{max(vals):.3f}, within "
            f"{spread:.1f} % of their mean {mean:.3f}")


def restore_table(rows: list[dict]) -> str:
    head = ("| nodes | connection | msgs / node / restore | msgs / node / decision (set red, watch red) | rounds "
            "| idle re-polls | restore p50 / p99 ms | decision p50 / p99 ms | after the last request p50 ms "
            "| requests' spread p50 ms | same answers | left (contributions, open) | watch conns added "
            "| bed CPU (cores) | load 1m |\n|" + "---|" * 15)
    out = [head]
    for r in rows:
        conn = "fresh" if r.get("fresh_connection") else "trainer's"
        if "error" in r:
            out.append(f"| {r['nodes']} | {conn} | failed: {r['error'][:120]} |" + " |" * 12)
            continue
        out.append(
            f"| {r['nodes']} | {conn} | {r['msgs_per_node_restore']:.3f} | {r['msgs_per_node_decision']:.3f} "
            f"({r['contributions_per_node_decision']:.2f}, {r['result_watches_per_node_decision']:.2f}) | "
            f"{r['rounds']} | {r['idle_repolls']} | {r['restore_p50_ms']:.1f} / {r['restore_p99_ms']:.1f} | "
            f"{r['decision_p50_ms']:.1f} / {r['decision_p99_ms']:.1f} | {r['after_last_request_p50_ms']:.1f} | "
            f"{r['request_spread_p50_ms']:.1f} | {r['same_answers']} | {len(r['left_contributions'])}, "
            f"{len(r['left_open'])} | {r['watch_conns_added']} | {r['bed_cpu_cores']:.2f} | "
            f"{r['loadavg_1m'][1]:.1f} |")
    return "\n".join(out)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def table(rows: list[dict]) -> str:
    head = ("| nodes | procs | msgs / node / step | reports, verdicts seen / node / step | rounds | idle re-polls "
            "| all agents know it: p50 / p99 ms | median agent p50 ms | commit spread p50 ms | bed CPU (cores) "
            "| load 1m | heartbeat msgs/s | threads | start s |\n|" + "---|" * 14)
    out = [head]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['nodes']} | {r['procs']} | failed: {r['error'][:120]} |" + " |" * 11)
            continue
        out.append(
            f"| {r['nodes']} | {r['procs']} | {r['agreement_msgs_per_node_step']:.3f} | "
            f"{r['reports_sent_per_node_step']:.2f}, {r['verdicts_seen_per_node_step']:.2f} | {r['rounds']} | "
            f"{r['idle_repolls']} | {r['all_learnt_p50_ms']:.1f} / {r['all_learnt_p99_ms']:.1f} | "
            f"{r['median_agent_p50_ms']:.1f} | {r['commit_spread_p50_ms']:.1f} | {r['bed_cpu_cores']:.2f} | "
            f"{r['loadavg_1m'][1]:.1f} | {r['heartbeat_msgs_per_s']:.0f} | {r['threads']} | {r['start_s']:.0f} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ part (a)
#: part (a)'s modes: in-memory checkpointing off (the baseline), then the two agreements
MODES = ("off", "agents", "collective")


def trainers_run(ranks: int, mode: str, iterations: int) -> dict:
    """One ``megatron-ft demo --fail none`` of ``ranks`` ranks (R/2 nodes x 2, the tiny model, TP1 PP1,
    nothing persisted) with ``mode``: ``agents`` or ``collective`` (``snapshot.agreement``; a snapshot
    every iteration) or ``off`` (``snapshot.enabled: false``: no in-memory checkpointing, the
    baseline). The median iteration time (every rank's progress records, the first 3 iterations left
    out) and megatron-ft's world collectives from the ranks' ``snapshots`` events."""
    import shutil
    import statistics

    import yaml

    from megatron_ft import config as ftconfig

    with tempfile.TemporaryDirectory(prefix="mftsc-") as tmp:
        nodes = max(1, ranks // 2)
        snap = {"enabled": False} if mode == "off" else {"agreement": mode, "interval": 1}
        cfg = ftconfig.replace(ftconfig.load(), run_id=f"sc{ranks}{mode[:3]}",
                               cluster={"nodes": nodes, "ranks_per_node": ranks // nodes},
                               parallel={"tensor": 1, "pipeline": 1}, snapshot=snap,
                               persist={"interval": 0, "on_failure": False, "dir": os.path.join(tmp, "persist")},
                               agent={"socket_dir": os.path.join(tmp, "s")})
        path = os.path.join(tmp, "job.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg.to_dict(), f)
        work = os.path.join(tmp, "work")
        exe = shutil.which("megatron-ft", path=os.path.dirname(sys.executable)) or shutil.which("megatron-ft")
        cmd = [exe or "megatron-ft", "demo", "--fail", "none", "--config", path, "--iters", str(iterations),
               "--workdir", work, "--quiet"]
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t0
        run_dir = os.path.join(work, "run")

        def records(kind: str) -> list[dict]:
            recs = []
            for p in sorted(glob.glob(os.path.join(run_dir, kind, "rank*.jsonl"))):
                with open(p) as f:
                    recs += [json.loads(ln) for ln in f if ln.strip().startswith("{")]
            return recs

        gaps = []
        by_rank: dict = {}
        for r in records("progress"):
            by_rank.setdefault(r["rank"], []).append(r)
        for recs in by_rank.values():
            recs.sort(key=lambda r: r["iteration"])
            gaps += [b["time"] - a["time"] for a, b in zip(recs[3:], recs[4:])]
        snaps = [e for e in records("events") if e.get("event") == "snapshots"]
        wc = [e.get("world_collectives", {}) for e in snaps]
        taken = sum(int(e.get("taken", 0)) for e in snaps)
        per_snapshot = sum(int(w.get("per_snapshot", 0)) for w in wc)
        per_iteration = sum(int(w.get("per_iteration", 0)) for w in wc)
        iters_seen = sum(len(v) for v in by_rank.values())
        return {"ranks": ranks, "nodes": nodes, "mode": mode, "rc": out.returncode, "wall_s": round(wall, 1),
                "iteration_s": round(statistics.median(gaps), 4) if gaps else None, "iterations": iterations,
                "ranks_reporting": len(by_rank),
                "world_collectives_per_snapshot_total": per_snapshot,
                "world_collectives_per_iteration_total": per_iteration,
                "world_collectives_per_snapshot_per_rank": per_snapshot / taken if taken else None,
                "world_collectives_per_iteration_per_rank": per_iteration / iters_seen if iters_seen else None,
                "at_restore": sum(int(w.get("at_restore", 0)) for w in wc),
                "agent_decisions": sum(int(w.get("agent_decisions", 0)) for w in wc),
                "world_collectives_sample": wc[:1],
                "snapshot_events": len(snaps), "snapshots_taken": taken,
                "skipped_pending_agreement": sum(int(e.get("skipped_pending_agreement", 0)) for e in snaps),
                "stall_median_s": statistics.median([e["stall_median_s"] for e in snaps if e.get("stall_median_s")
                                                     is not None] or [float("nan")]),
                "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                "tail": (out.stdout + out.stderr)[-1500:] if out.returncode else ""}


def trainers_table(trows: list[dict]) -> str:
    """Per ranks and mode: the median over the alternating repeats of each run's median iteration time,
    its overhead against ``off`` (no in-memory checkpointing), the world collectives."""
    import statistics

    out = ["| ranks | mode | iteration s (median of runs) | runs' medians | overhead vs off | snapshot stall s "
           "(median) | world collectives per snapshot per rank | per iteration per rank | snapshots taken "
           "| skipped (pending agreement) | load 1m | rc |", "|" + "---|" * 12]
    for ranks in sorted({t["ranks"] for t in trows}):
        base = [t["iteration_s"] for t in trows if t["ranks"] == ranks and t["mode"] == "off" and t["iteration_s"]]
        b = statistics.median(base) if base else None
        for mode in MODES:
            rs = [t for t in trows if t["ranks"] == ranks and t["mode"] == mode]
            if not rs:
                continue
            its = [t["iteration_s"] for t in rs if t["iteration_s"]]
            m = round(statistics.median(its), 4) if its else None
            over = f"{100 * (m - b) / b:+.1f} %" if m is not None and b and mode != "off" else "-"
            per_snap = [t["world_collectives_per_snapshot_per_rank"] for t in rs
                        if t["world_collectives_per_snapshot_per_rank"] is not None]
            per_it = [t["world_collectives_per_iteration_per_rank"] for t in rs
                      if t["world_collectives_per_iteration_per_rank"] is not None]
            stalls = [t["stall_median_s"] for t in rs if t["stall_median_s"] == t["stall_median_s"]]
            out.append(f"| {ranks} | {mode} | {m if m is not None else '-'} | {', '.join(str(x) for x in its)} | {over} | "
                       f"{statistics.median(stalls) if stalls else float('nan'):.4f} | "
                       f"{max(per_snap) if per_snap else '-'} | {max(per_it) if per_it else '-'} | "
                       f"{sum(t['snapshots_taken'] for t in rs)} | {sum(t['skipped_pending_agreement'] for t in rs)} | "
                       f"{max(t['loadavg_1m'][1] for t in rs):.1f} | {','.join(str(t['rc']) for t in rs)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="*", default=[])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--heartbeat-s", type=float, default=None, help="default: 2 s up to 256 nodes, 5 s above")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--restores", type=int, default=0,
                   help="after the agreed steps: this many restores' job-wide decisions in the same bed")
    p.add_argument("--decisions", type=int, default=3, choices=(3, 4),
                   help="per restore: intersect, min, min (3); with the newest certified step's max first (4)")
    p.add_argument("--restore-conn", nargs="*", default=None, choices=("fresh", "trainer"),
                   help="the decisions' connection: fresh per restore (as Checkpointer._decisions) or the "
                        "trainer's (default: the trainer's; fresh: a new trainer-agent connection and agent "
                        "handler thread per restore; no root connection either way, see docs/benchmarks.md)")
    p.add_argument("--backlog", type=int, default=None,
                   help="diagnostic: the listen backlog of the bed's servers (default: the agents' own, "
                        "wire.LISTEN_BACKLOG)")
    p.add_argument("--root-alone", action="store_true",
                   help="node 0 (the root) alone in worker 0, the other nodes over the other workers (part (c): "
                        "always, with more than 2 workers)")
    p.add_argument("--health", action="store_true", help="part (c): the health scenario at each --nodes")
    p.add_argument("--store", default="embedded", choices=("embedded", "etcd"), help="part (c)'s store")
    p.add_argument("--span-s", type=float, default=60.0, help="part (c): the healthy span measured")
    p.add_argument("--health-heartbeat-s", type=float, default=2.0)
    p.add_argument("--health-timeout-s", type=float, default=10.0)
    p.add_argument("--launch", action="store_true", help="part (c): the launcher side too")
    p.add_argument("--keepers", nargs="*", default=[], choices=("before", "after"),
                   help="part (c): the keepers' verdict watch, per rank (before) or per node (after)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="part (c): keepers per node")
    p.add_argument("--trainers", type=int, nargs="*", default=[])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2, help="part (a): each mode this many times, alternating")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    args = p.parse_args(argv)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cores", flush=True)
    if args.health:
        hrows = []
        for n in args.nodes:
            r = health_bed(n, min(args.procs, n), args.health_heartbeat_s, args.health_timeout_s, args.span_s,
                           args.store, args.launch, tuple(args.keepers), args.ranks_per_node)
            print(json.dumps({"measurement": "health", **r}), flush=True)
            hrows.append(r)
        print(health_table(hrows))
        ok = [r for r in hrows if r.get("health")]
        xs = [r["nodes"] for r in ok]
        if args.store == "etcd":
            print(fit_line("etcd client requests per heartbeat period", xs,
                           [r["health"]["etcd_client_requests_per_node_period"] for r in ok]))
            print(fit_line("etcd server requests per second", xs,
                           [r["health"]["etcd_server_requests_per_node_s"] for r in ok]))
        else:
            print(fit_line("store requests per heartbeat period", xs,
                           [r["health"]["store_requests_per_node_period"] for r in ok]))
        if args.launch:
            print(launch_table(hrows))
            lok = [r for r in hrows if r.get("launch") and "error" not in r["launch"]]
            lx = [r["nodes"] for r in lok]
            for key in ("current_per_launcher", "begin_per_launcher", "generation_requests_per_launcher"):
                print(fit_line(key, lx, [r["launch"][key] for r in lok], "per launcher"))
            print(fit_line("standby_requests_per_s", lx, [r["launch"]["standby_requests_per_s"] for r in lok],
                           "per standby"))
        if args.keepers:
            print(keepers_table(hrows))
        return 0
    rows, rrows = [], []
    for n in args.nodes:
        hb = args.heartbeat_s if args.heartbeat_s is not None else (2.0 if n <= 256 else 5.0)
        conns = tuple(args.restore_conn) if args.restore_conn else ("trainer",)
        r, rr = bed(n, args.steps, min(args.procs, n), hb, args.timeout_s, args.restores, args.decisions, conns,
                    args.backlog, args.root_alone)
        print(json.dumps({"measurement": "agreement", **r}), flush=True)
        rows.append(r)
        for x in rr:
            print(json.dumps({"measurement": "restore", **x}), flush=True)
        rrows += rr
    if rows:
        print(table(rows))
        ok = [r for r in rows if "error" not in r]
        if len(ok) >= 2:
            a, b = fit([r["nodes"] for r in ok], [r["agreement_msgs_per_step"] for r in ok])
            per = [r["agreement_msgs_per_node_step"] for r in ok]
            mean = sum(per) / len(per)
            print(f"messages per agreed step = {a:.2f} + {b:.4f} x nodes (least squares over {len(ok)} sizes); "
                  f"per node: {min(per):.3f}-{max(per):.3f}, within {100 * max(abs(x - mean) for x in per) / mean:.1f} % "
                  f"of their mean {mean:.3f}")
    if rrows:
        print(restore_table(rrows))
        for conn in (True, False):
            ok = [r for r in rrows if "error" not in r and r["fresh_connection"] == conn]
            if len(ok) >= 2:
                a, b = fit([r["nodes"] for r in ok], [r["msgs_per_node_restore"] * r["nodes"] for r in ok])
                per = [r["msgs_per_node_restore"] for r in ok]
                mean = sum(per) / len(per)
                print(f"{'fresh' if conn else 'trainer'} connection: messages per restore = {a:.2f} + {b:.4f} x "
                      f"nodes (least squares over {len(ok)} sizes); per node: {min(per):.3f}-{max(per):.3f}, within "
                      f"{100 * max(abs(x - mean) for x in per) / mean:.1f} % of their mean {mean:.3f}")
    trows = []
    for r in args.trainers:
        for rep in range(args.repeats):  # alternating: off, agents, collective, off, agents, ...
            for mode in args.modes:
                t = trainers_run(r, mode, args.iterations)
                print(json.dumps({"measurement": "trainers", "repeat": rep, **t}), flush=True)
                trows.append(t)
    if trows:
        print(trainers_table(trows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
