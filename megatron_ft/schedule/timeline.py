"""``megatron-ft timeline RUN_DIR``: the profiled timelines as a Chrome trace and a PNG, with the
GEMINI checkpoint plan computed from them laid over.

Reads ``RUN_DIR/profile/node*/rank*.json`` (:mod:`.profiler`), summarises each rank
(:func:`.profiler.summarize_rank`: network idle spans and reserved bubbles with their variance),
plans each rank's checkpoint traffic with GEMINI Algorithm 2 over its averaged idle spans
(:func:`.gemini.fitting_interval`: the fewest iterations without interference) and writes to
``--out`` (default ``RUN_DIR/timeline``):

* ``trace.json`` - Chrome trace / Perfetto (``chrome://tracing``, https://ui.perfetto.dev): one
  process per rank, one thread per kind (compute, send, recv, collective, optimizer, phase), plus
  tracks for the averaged idle spans and bubbles, the planned checkpoint chunks and the checkpoint
  chunks actually sent (events of kind ``ckpt``, when a profile has them); ranks share one time
  axis (``clock.wall_at_origin``);
* ``timeline.png`` - the same for ``--show`` iterations after the warm-up, one panel per rank
  (needs matplotlib: ``pip install 'megatron-ft[plot]'``; without it only the JSON is written);
* ``summary.json`` - per rank the summary and the plan (chunks, transfer time, interval).

Runs of the scheduled transport (``redundancy.transport: scheduled``) also have
``RUN_DIR/transport/node*/rank*.json``: their profiles go on for a few iterations with checkpoint traffic
after the planned ones, and those iterations are drawn with the schedule the transport ran (planned
chunks, each as long as the plan's link says) and the chunks it actually sent (``ckpt``).

Plan inputs (runs without a transport file): ``--ckpt-bytes`` (default: each rank's measured snapshot size), GEMINI's m
(``--replicas``), R and p (``--reserved-bytes``, ``--sub-buffers``), mu, and the link
(``--bandwidth``, default: the fastest P2P transfer observed; ``--alpha-s``). Plan iteration k is
drawn over the k-th shown iteration.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from .. import rank_files
from ..config import ConfigError
from ..policy.simulate import plot_available
from ..redundancy.report import parse_bytes
from .gemini import GeminiPlan, fitting_interval
from .profiler import (DEFAULT_MIN_SPAN_S, TRANSPORT_FORMAT, TRANSPORT_VERSION, RankSummary, estimate_link,
                       load_profiles, summarize_rank)
from .spans import LinkModel

TRACKS = ("compute", "send", "recv", "collective", "optimizer", "phase", "idle (avg)", "bubble (avg)",
          "ckpt planned", "ckpt")
TID = {name: i + 1 for i, name in enumerate(TRACKS)}
COLORS = {"compute": "tab:blue", "send": "tab:orange", "recv": "tab:red", "collective": "tab:purple",
          "optimizer": "tab:green", "phase": "0.8", "idle (avg)": "tab:cyan", "bubble (avg)": "tab:olive",
          "ckpt planned": "tab:pink", "ckpt": "tab:brown"}
PNG_ROWS = ("compute", "send", "recv", "collective", "optimizer", "idle (avg)", "bubble (avg)", "ckpt planned",
            "ckpt")


def _shown(prof: dict, summary: RankSummary, show: int) -> list[dict]:
    warm = {i for i, why in summary.dropped if why == "warm-up"}
    return [it for it in prof["iterations"] if it["iteration"] not in warm][:show]


def plan_rank(summary: RankSummary, ckpt_bytes: int, args: argparse.Namespace) -> Optional[GeminiPlan]:
    spans = summary.summary.idle_spans
    if not spans:
        return None
    return fitting_interval(spans, ckpt_bytes, args.replicas, args.reserved_bytes, args.sub_buffers, summary.link,
                            args.mu, args.max_iterations)


def load_transport(run_dir: str, rank: int) -> Optional[dict]:
    """``rank``'s ``RUN_DIR/transport/node<N>/rank<R>.json`` (or the flat layout's), None if absent."""
    path = rank_files.find_rank_file(os.path.join(run_dir, "transport"), rank, ".json")
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        tr = json.load(f)
    if tr.get("format") != TRANSPORT_FORMAT or tr.get("version") != TRANSPORT_VERSION:
        raise ConfigError(f"{path}: not a {TRANSPORT_FORMAT} v{TRANSPORT_VERSION} file")
    return tr


def transport_segments(prof: dict, tr: dict, its: Sequence[dict]) -> list[tuple]:
    """The schedule the transport ran, over the profiled iterations that carried it."""
    out: list[tuple] = []
    sch, plan = tr["schedule"], tr.get("plan", {})
    first, n, bw = plan.get("planned_at_step"), sch["interval_iterations"], plan.get("link_bandwidth")
    if first is None or not bw:
        return out
    wall = prof["clock"]["wall_at_origin"]
    for it in its:
        if it["iteration"] < first:
            continue
        k = (it["iteration"] - first) % n
        t0 = wall + it["start"]
        for copy, iteration, at, offset, size, buf in sch["sends"]:
            if iteration == k:
                start = t0 + at if at is not None else wall + it["end"]
                out.append(("ckpt planned", f"copy {copy} [{offset}, {offset + size})", start, start + size / bw,
                            {"bytes": size, "sub_buffer": buf, "plan_iteration": k, "mode": sch["mode"]}))
    return out


def rank_segments(prof: dict, summary: RankSummary, plan: Optional[GeminiPlan], show: Optional[int],
                  tr: Optional[dict] = None) -> list[tuple]:
    """``(track, name, start, end, args)`` per drawn box, seconds on the rank's wall clock."""
    wall = prof["clock"]["wall_at_origin"]
    out = []
    if tr is not None:  # the last iterations: the end of the profile and the ones with traffic
        its = prof["iterations"] if show is None else prof["iterations"][-show:]
        out += transport_segments(prof, tr, its)
    else:
        its = prof["iterations"] if show is None else _shown(prof, summary, show)
    shown = _shown(prof, summary, len(prof["iterations"]))
    for it in its:
        t0 = wall + it["start"]
        out.append(("iteration", f"iteration {it['iteration']}", t0, wall + it["end"], {}))
        for e in it["events"]:
            out.append((e["kind"], e["name"], t0 + e["start"], t0 + e["end"],
                        {"bytes": e["bytes"], "src": e["src"], "iteration": it["iteration"]}))
    for it in (its if tr is not None else shown[:len(its) if show is not None else len(shown)]):
        t0 = wall + it["start"]
        for track, spans in (("idle (avg)", summary.summary.idle_spans), ("bubble (avg)", summary.summary.bubbles)):
            for k, s in enumerate(spans):
                out.append((track, f"{track.split()[0]} {k}", t0 + s.start, t0 + s.end,
                            {"length_ms": 1e3 * s.length, "stddev_ms": 1e3 * s.variance ** 0.5}))
    if plan is not None:
        for c in plan.chunks:
            if c.iteration < len(shown):
                t0 = wall + shown[c.iteration]["start"]
                out.append(("ckpt planned", f"copy {c.copy} [{c.offset}, {c.offset + c.size})", t0 + c.start,
                            t0 + c.end, {"bytes": c.size, "span": c.span, "sub_buffer": c.buffer,
                                         "plan_iteration": c.iteration}))
    return out


def chrome_trace(profiles: Sequence[dict], segments: dict[int, list[tuple]], plans: dict) -> dict:
    t_base = min(s[2] for segs in segments.values() for s in segs)
    events = []
    for prof in profiles:
        r, meta = prof["rank"], prof.get("meta", {})
        label = f"rank {r}" + (f" (pp stage {meta['pp_rank']})" if "pp_rank" in meta else "")
        events.append({"ph": "M", "pid": r, "name": "process_name", "args": {"name": label}})
        events.append({"ph": "M", "pid": r, "name": "process_sort_index", "args": {"sort_index": r}})
        for name, tid in list(TID.items()) + [("iteration", 0)]:
            events.append({"ph": "M", "pid": r, "tid": tid, "name": "thread_name", "args": {"name": name}})
            events.append({"ph": "M", "pid": r, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        for track, name, start, end, a in segments[r]:
            events.append({"ph": "X", "pid": r, "tid": TID.get(track, 0), "name": name, "cat": track,
                           "ts": (start - t_base) * 1e6, "dur": max(0.0, end - start) * 1e6, "args": a})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "megatron-ft timeline",
                          "plans": {str(r): _plan_dict(p) for r, p in plans.items()}}}


def _plan_dict(plan: Optional[GeminiPlan]) -> Optional[dict]:
    if plan is None:
        return None
    return {"checkpoint_bytes": plan.checkpoint_bytes, "replicas": plan.replicas, "sub_buffers": plan.sub_buffers,
            "sub_buffer_bytes": plan.sub_buffer_bytes, "mu": plan.mu, "bandwidth": plan.link.bandwidth,
            "alpha_s": plan.link.alpha_s, "chunks": len(plan.chunks), "transfer_s": plan.transfer_s,
            "interval_iterations": plan.interval_iterations, "fits": plan.fits, "overflow_s": plan.overflow_s,
            "stall_s": plan.stall_s,
            "chunk_list": [{"copy": c.copy, "iteration": c.iteration, "span": c.span, "offset": c.offset,
                            "size": c.size, "buffer": c.buffer, "start": c.start, "end": c.end} for c in plan.chunks]}


def write_png(profiles: Sequence[dict], segments: dict[int, list[tuple]], plans: dict, path: str,
              titles: Optional[dict] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_base = min(s[2] for segs in segments.values() for s in segs)
    fig, axes = plt.subplots(len(profiles), 1, figsize=(15, 1.0 + 2.6 * len(profiles)), squeeze=False, sharex=True)
    for ax, prof in zip(axes[:, 0], profiles):
        r = prof["rank"]
        rows = {name: i for i, name in enumerate(reversed(PNG_ROWS))}
        for track, _, start, end, _a in segments[r]:
            x0, w = 1e3 * (start - t_base), 1e3 * (end - start)
            if track == "iteration":
                ax.axvline(x0, color="0.4", lw=0.8, ls="--")
            elif track in rows:
                ax.broken_barh([(x0, max(w, 0.05))], (rows[track] - 0.4, 0.8), facecolors=COLORS[track],
                               edgecolors="white" if track.startswith("ckpt") else "none", linewidth=0.3)
        ax.set_yticks(list(rows.values()), list(rows.keys()), fontsize=8)
        plan = plans.get(r)
        meta = prof.get("meta", {})
        title = f"rank {r}" + (f", pipeline stage {meta['pp_rank']}" if "pp_rank" in meta else "")
        if plan is not None:
            title += (f" - GEMINI plan: {plan.checkpoint_bytes / 2**20:.2f} MiB x {plan.remote_copies} copies in "
                      f"{len(plan.chunks)} chunks, {1e3 * plan.transfer_s:.1f} ms of transfer at "
                      f"{plan.link.bandwidth / 2**20:.0f} MiB/s, a checkpoint every "
                      f"{plan.interval_iterations} iteration(s){'' if plan.fits else ', stalls'}")
        if titles and r in titles:
            title += " - " + titles[r]
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms (ranks on one wall-clock axis; dashed: iteration starts)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("timeline", help="profiled timelines (--inmem-ckpt-profile-iterations) as a Chrome trace "
                                        "and a PNG, with the GEMINI checkpoint plan laid over")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (its profile/node*/rank*.json) or the profile dir")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/timeline)")
    p.add_argument("--ckpt-bytes", type=parse_bytes, default=None,
                   help="checkpoint bytes per rank for the plan (e.g. 64MiB; default: each rank's measured snapshot)")
    p.add_argument("--replicas", type=int, default=2, help="GEMINI m: copies in all, m - 1 over the network (2)")
    p.add_argument("--reserved-bytes", type=parse_bytes, default=parse_bytes("64MiB"),
                   help="GEMINI R, the reserved buffer (64MiB)")
    p.add_argument("--sub-buffers", type=int, default=4, help="GEMINI p: chunks are at most R/p bytes (4)")
    p.add_argument("--mu", type=float, default=0.9, help="fraction of each idle span the plan may use (0.9)")
    p.add_argument("--max-iterations", type=int, default=64,
                   help="spread a checkpoint over at most this many iterations (64)")
    p.add_argument("--bandwidth", type=parse_bytes, default=None,
                   help="link bytes/s (default: the fastest P2P transfer in the profiles)")
    p.add_argument("--alpha-s", type=float, default=0.0, help="start-up seconds per transfer (0)")
    p.add_argument("--min-span-ms", type=float, default=1e3 * DEFAULT_MIN_SPAN_S,
                   help="ignore idle spans and bubbles shorter than this (1.0)")
    p.add_argument("--warmup", type=int, default=1, help="profiled iterations left out of the summary (1)")
    p.add_argument("--show", type=int, default=3, help="iterations drawn in the PNG (3)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    profiles = load_profiles(args.run_dir)
    out = args.out or os.path.join(args.run_dir, "timeline")
    os.makedirs(out, exist_ok=True)
    shared_link = (LinkModel(float(args.bandwidth), args.alpha_s) if args.bandwidth
                   else LinkModel(estimate_link(profiles).bandwidth, args.alpha_s))
    summaries, plans, full, shown, report, titles = {}, {}, {}, {}, {}, {}
    for prof in profiles:
        r = prof["rank"]
        s = summaries[r] = summarize_rank(prof, shared_link, args.min_span_ms / 1e3, args.warmup)
        tr = load_transport(args.run_dir, r)
        size = args.ckpt_bytes if args.ckpt_bytes is not None else prof.get("snapshot_bytes")
        if size is None and tr is not None:
            size = tr.get("plan", {}).get("nbytes")
        if size is None:
            raise ConfigError(f"rank {r}: the profile has no snapshot_bytes; give --ckpt-bytes")
        plans[r] = plan_rank(s, int(size), args) if tr is None else None
        full[r] = rank_segments(prof, s, plans[r], None, tr)
        shown[r] = rank_segments(prof, s, plans[r], args.show, tr)
        if tr is not None:
            sch = tr["schedule"]
            titles[r] = (f"scheduled transport, mode {sch['mode']}: {len(sch['sends'])} chunks in "
                         f"{sch['buffers']} x {sch['buffer_bytes'] / 2**20:.2f} MiB buffers, a checkpoint every "
                         f"{sch['interval_iterations']} iteration(s)")
        report[r] = {"summary": s.to_dict(), "plan": _plan_dict(plans[r])}
        p = plans[r]
        sm = s.summary
        print(f"rank {r}: iteration {1e3 * sm.iteration_s:.1f} ms (sd {1e3 * sm.iteration_variance ** 0.5:.1f}), "
              f"{len(sm.idle_spans)} network idle spans ({1e3 * sum(x.length for x in sm.idle_spans):.1f} ms), "
              f"{len(sm.bubbles)} bubbles ({1e3 * sum(x.length for x in sm.bubbles):.1f} ms); "
              + (f"plan: {size} B x {p.remote_copies} in {len(p.chunks)} chunks, "
                 f"{1e3 * p.transfer_s:.2f} ms, every {p.interval_iterations} iteration(s)"
                 f"{'' if p.fits else f', stall {1e3 * p.stall_s:.2f} ms'}" if p is not None else titles.get(r, "no idle span: no plan")))
    trace_path = os.path.join(out, "trace.json")
    with open(trace_path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(profiles, full, plans), f)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({str(r): v for r, v in report.items()}, f, indent=1)
    print(f"wrote {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")
    ok, why = plot_available()
    if ok:
        png = os.path.join(out, "timeline.png")
        write_png(profiles, shown, plans, png, titles)
        print(f"wrote {png}")
    else:
        print(f"no PNG: {why}; wrote only the JSON", file=sys.stderr)
    return 0
