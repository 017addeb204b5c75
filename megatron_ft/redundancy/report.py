"""``megatron-ft plan``: print a cluster YAML's redundancy plan - who holds what, memory per node,
failures survived per group, and P(recover from memory | k nodes fail at once)."""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from typing import Optional, Sequence

from .. import config as ftconfig
from .echeck import CodingGroup
from .gemini import ReplicaGroup
from .plan import LocalGroup, RedundancyPlan, plan_from_config
from .reft import ParityGroup

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"1GiB"``, ``"512M"``, ``"1.5 GiB"`` -> bytes.

    >>> parse_bytes("2GiB"), parse_bytes("1.5k")
    (2147483648, 1500)
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]i?)?b?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1073741824, 2GiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 10, 11] -> "0-3,8,10-11"``."""
    out, vals = [], sorted(values)
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out) if out else "-"


def _survives_text(g) -> str:
    n = len(g.members)
    if g.tolerance == 0:
        return "survives no node failure"
    if isinstance(g, ReplicaGroup) and g.ring:
        return (f"survives any {g.tolerance} of its {n} nodes failing (ring: lost only when {g.copies} "
                f"ring-consecutive nodes fail)")
    return f"survives any {g.tolerance} of its {n} node{'s' if n > 1 else ''} failing"


def _shape(g) -> tuple:
    if isinstance(g, ReplicaGroup):
        return ("replica", len(g.members), g.ring)
    if isinstance(g, ParityGroup):
        return ("xor", len(g.members), g.same_sharding_group)
    if isinstance(g, CodingGroup):
        return ("rs", g.k, g.m)
    return ("none",)


def _group_title(plan: RedundancyPlan, gi: int) -> str:
    g = plan.groups[gi]
    nodes = fmt_ranges(g.members)
    if isinstance(g, ReplicaGroup):
        kind = f"ring of {len(g.members)}, {g.copies} copies" if g.ring else f"group of {len(g.members)}"
    elif isinstance(g, ParityGroup):
        topo = plan.topology
        sgs = sorted({topo.sharding_group(r) for lane in g.lanes for r in (lane[:1] if g.same_sharding_group else lane)})
        sg = ", ".join(f"pp{s // topo.tensor}/tp{s % topo.tensor}" for s in sgs[:4]) + (", ..." if len(sgs) > 4 else "")
        kind = (f"RAIM5 over {len(g.members)} nodes, {len(g.lanes)} lane(s) = sharding group(s) {sg}"
                if g.same_sharding_group else
                f"RAIM5 over {len(g.members)} nodes, {len(g.lanes)} lane(s) MIXING sharding groups {sg} "
                f"(a sharding group lives on one node: no parity inside it could survive that node)")
    elif isinstance(g, CodingGroup):
        kind = (f"k={g.k} data + m={g.m} parity; data nodes {fmt_ranges(g.data_nodes)} (sweep line), "
                f"parity nodes {fmt_ranges(g.parity_nodes)}")
    else:
        kind = "local only"
    return f"group {gi}: nodes {nodes} ({kind}); {_survives_text(g)}"


def _node_lines(plan: RedundancyPlan, gi: int, max_nodes: int) -> list[str]:
    g = plan.groups[gi]
    topo = plan.topology
    out = []
    members = g.members if len(g.members) <= max_nodes else g.members[:max_nodes - 1]
    for node in members:
        parts = [f"primary ranks {fmt_ranges(topo.ranks_of(node))}"]
        if isinstance(g, ReplicaGroup):
            srcs = g.held(node)[1:]
            parts.append("replicas of " + ", ".join(f"node {s} (ranks {fmt_ranges(topo.ranks_of(s))})" for s in srcs))
        elif isinstance(g, ParityGroup):
            s = g.members.index(node)
            src = g.sources(0, s)
            shown = ", ".join(f"{r}[{p}]" for _, r, p in src[:4]) + (", ..." if len(src) > 4 else "")
            lanes = ("" if len(g.lanes) == 1 else " (likewise lane 1)" if len(g.lanes) == 2
                     else f" (likewise lanes 1-{len(g.lanes) - 1})")
            if g.pieces == 1:
                parts.append(f"parity of stripe {s} per lane = a mirror (n = 2): lane 0 = rank {src[0][1]}{lanes}")
            else:
                parts.append(f"parity of stripe {s} per lane, pieces of 1/{g.pieces} rank: lane 0 = XOR of "
                             f"rank[piece] {shown}{lanes}")
        elif isinstance(g, CodingGroup):
            kind, j = g.role(node)
            if kind == "data":
                copies = [r for r in g.chunk(j) if g.owner(r) != node]
                parts.append(f"data chunk D{j} = ranks {fmt_ranges(g.chunk(j))} (copies of {fmt_ranges(copies)})")
            else:
                i = j
                parts.append(f"parity chunk P{i} ({g.parity_packets} packets, one per reduction group, over ranks "
                             f"{fmt_ranges(g.packets)})")
        out.append(f"  node {node}: " + "; ".join(parts))
    if len(members) < len(g.members):
        out.append(f"  ... nodes {fmt_ranges(g.members[len(members):])} likewise")
    if isinstance(g, CodingGroup):
        rgs = g.reduction_groups()
        k, m = g.k, g.m
        rule = ("k = m (parity i on worker i)" if k == m else
                f"k > m (every floor(k/m) = {k // m}-th worker)" if k > m else "k < m (round robin)")
        local = sum(1 for rg in rgs for i, t in enumerate(rg.targets) if g.owner(t) == g.parity_nodes[i])
        data_moves, parity_moves = g.transfers()
        out.append(f"  XOR reduction: {len(rgs)} reduction groups x m = {len(rgs) * m} reductions, {local} of them on a "
                   f"worker of the parity node itself, the others by the {rule} rule; transfers per encode: "
                   f"{data_moves} data + {parity_moves} parity packets")
        for rg in rgs[:2] + tuple(x for x in rgs[2:] if not any(g.owner(t) == p for t, p in zip(x.targets, g.parity_nodes)))[:1]:
            tgt = ", ".join(f"P{i} on rank {t} (node {g.owner(t)}{'' if g.owner(t) == g.parity_nodes[i] else f' -> {g.parity_nodes[i]}'})"
                            for i, t in enumerate(rg.targets))
            out.append(f"    reduction group {rg.index}: ranks {', '.join(map(str, rg.ranks))}: {tgt}")
    return out


def moe_lines(topo, moe_bytes: Optional[tuple[int, int]] = None) -> list[str]:
    """What a mixture-of-experts rank holds, and which ranks hold the rest of it (pure).

    >>> from megatron_ft.redundancy.topology import Topology
    >>> print("\\n".join(moe_lines(Topology(2, 2, 1, 1, 2), (4 << 20, 8 << 20))))
    mixture of experts: EP 2, EDP 2 (each expert's shard on 2 ranks)
      per rank: dense 1/4 of its stage's dense state (sharded over its 4 data-parallel ranks) = 1.00 MiB,
                experts: 1/2 of the stage's experts, 1/2 of their state (sharded over its 2 expert-data-parallel ranks) = 2.00 MiB
      rank 0: dense with ranks 0, 1, 2, 3; experts with ranks 0, 2 (expert rank 0 of 2)
    """
    tp, dp, ep, edp = topo.tensor, topo.data, topo.expert, topo.expert_data
    dense = f"dense 1/{tp * dp} of its stage's dense state (sharded over its {dp} data-parallel ranks)"
    experts = (f"experts: 1/{ep} of the stage's experts, 1/{edp} of their state (sharded over its {edp} "
               f"expert-data-parallel rank{'s' if edp > 1 else ''})")
    if moe_bytes is not None:
        dense += f" = {fmt_bytes(moe_bytes[0] / (tp * dp))}"
        experts += f" = {fmt_bytes(moe_bytes[1] / (tp * ep * edp))}"
    out = [f"mixture of experts: EP {ep}, EDP {edp} (each expert's shard on {edp} rank{'s' if edp > 1 else ''}"
           + ("; every expert exists once: only the redundancy holds a second copy" if edp == 1 else "") + ")",
           f"  per rank: {dense},", f"            {experts}"]
    dense_group = topo.sharding_group_ranks(topo.sharding_group(0))
    out.append(f"  rank 0: dense with ranks {', '.join(map(str, dense_group))}; experts with ranks "
               f"{', '.join(map(str, topo.expert_sharding_group_ranks(0)))} (expert rank 0 of {ep})")
    return out


def format_plan(plan: RedundancyPlan, state_bytes: Optional[int] = None, max_failures: Optional[int] = None,
                show_groups: int = 3, node_failure_prob: Optional[float] = None, source: str = "",
                max_nodes: int = 8, moe_bytes: Optional[tuple[int, int]] = None) -> str:
    """The text ``megatron-ft plan`` prints. ``moe_bytes``: a MoE job's (dense, expert) snapshot bytes of
    one pipeline stage (all its ranks' parameters and optimizer state), for its per-rank split."""
    topo = plan.topology
    lines = []
    head = f"megatron-ft plan{': ' + source if source else ''}"
    lines.append(head)
    lines.append(f"topology: {topo.nodes} nodes x {topo.ranks_per_node} ranks = {topo.world_size} ranks, "
                 f"TP {topo.tensor} x DP {topo.data} x PP {topo.pipeline}")
    lines.append(f"  {topo.describe()}")
    if topo.expert > 1:
        lines.extend(moe_lines(topo, moe_bytes))
    shapes: dict[tuple, list[int]] = {}
    for gi, g in enumerate(plan.groups):
        shapes.setdefault(_shape(g), []).append(gi)
    lines.append(f"scheme: {plan.label}: {len(plan.groups)} group(s)")
    lines.extend(_holdings_lines(plan, shapes, show_groups, max_nodes))
    lines.append("")
    lines.extend(_memory_lines(plan, state_bytes))
    lines.append("")
    lines.extend(_survived_lines(plan, shapes))
    lines.append("")
    lines.extend(_probability_lines(plan, max_failures, node_failure_prob))
    return "\n".join(lines)


def _holdings_lines(plan: RedundancyPlan, shapes: dict[tuple, list[int]], show_groups: int,
                    max_nodes: int) -> list[str]:
    """The "who holds what" section: the first ``show_groups`` groups and one of every other shape
    (``shapes``: group indices by :func:`_shape`) node by node, the rest summed up in one line;
    a one-line note (without the section's leading blank line) when every group is local only."""
    lines = []
    if not isinstance(plan.groups[0], LocalGroup):
        shown = list(range(min(show_groups, len(plan.groups))))
        for ids in shapes.values():  # at least one group of every shape
            if not any(i in shown for i in ids):
                shown.append(ids[0])
        lines.append("")
        lines.append("who holds what (rank[piece] = piece of that rank's state):")
        for gi in sorted(shown):
            lines.append(_group_title(plan, gi))
            lines.extend(_node_lines(plan, gi, max_nodes))
        rest = [gi for gi in range(len(plan.groups)) if gi not in shown]
        if rest:
            lines.append(f"groups {fmt_ranges(rest)} ({len(rest)} more): the same layouts on their own nodes")
    else:
        lines.append("  every node holds only its own ranks: a lost node is recovered from disk")
    return lines


def _memory_lines(plan: RedundancyPlan, state_bytes: Optional[int]) -> list[str]:
    """The memory section: per node for one snapshot version, in bytes if ``state_bytes`` (one rank's
    state) is given, else in units of one rank's state ``S``."""
    lines = []
    unit = state_bytes if state_bytes is not None else 1
    mem = plan.memory(unit)
    totals = [x.total for x in mem]

    def b(v: float) -> str:
        return fmt_bytes(v) if state_bytes is not None else f"{v:.3g} S"

    what = (f"state {fmt_bytes(state_bytes)} per rank" if state_bytes is not None else
            "S = one rank's state; pass --state-bytes-per-rank N for bytes")
    lines.append(f"memory per node for one snapshot version ({what}):")
    lines.append(f"  min {b(min(totals))}, max {b(max(totals))}, mean {b(sum(totals) / len(totals))}; "
                 f"cluster {b(sum(totals))} = {sum(totals) / max(1, sum(x.primary for x in mem)):.3f} x the snapshots")
    by: dict[tuple, list[int]] = {}
    for x in mem:
        by.setdefault((x.primary, x.redundancy), []).append(x.node)
    for (p, r), nodes in sorted(by.items(), key=lambda kv: kv[1][0]):
        lines.append(f"  nodes {fmt_ranges(nodes)}: {b(p + r)} = own {b(p)} + redundancy {b(r)}")
    if plan.scheme == "rs":
        parity = {n for g in plan.groups for n in g.parity_nodes}
        lean = [x.redundancy if x.node in parity else x.total for x in mem]
        lines.append(f"  (a parity node's own ranks are also in the data chunks; ECHECK keeps only its chunk there: "
                     f"max {b(max(lean))}, mean {b(sum(lean) / len(lean))} per node without that local copy)")
    return lines


def _survived_lines(plan: RedundancyPlan, shapes: dict[tuple, list[int]]) -> list[str]:
    """The section on simultaneous node failures survived: one line per group shape, one for the job."""
    lines = ["simultaneous node failures survived:"]
    for shape, ids in shapes.items():
        g = plan.groups[ids[0]]
        lines.append(f"  {len(ids)} group(s) like group {ids[0]} ({len(g.members)} node{'s' if len(g.members) > 1 else ''}): "
                     f"{_survives_text(g)}")
    lines.append(f"  whole job: any {plan.tolerance()} failure(s) wherever they fall")
    return lines


def _probability_lines(plan: RedundancyPlan, max_failures: Optional[int],
                       node_failure_prob: Optional[float]) -> list[str]:
    """The probabilities section: P(recover from memory | k nodes fail at once) for k = 1 ..
    ``max_failures`` (default 8, at most the node count), and with ``node_failure_prob`` the
    probability that every group recovers when each node fails independently."""
    topo = plan.topology
    lines = []
    kmax = min(topo.nodes, max_failures if max_failures is not None else 8)
    counts = plan.survivable_counts(kmax)
    corollary = plan.scheme == "replica" and topo.nodes % plan.replicas == 0
    lines.append(f"P(recover from memory | k of {topo.nodes} nodes fail at once), exact count of survivable "
                 f"k-sets (megatron_ft.policy.recoverability)" + ("; GEMINI Corollary 1 bound beside it" if corollary else ""))
    for k in range(1, kmax + 1):
        total = math.comb(topo.nodes, k)
        row = f"  k={k:<3d} {counts[k] / total:.6f}   ({counts[k]} of {total} sets)"
        if corollary:
            from ..policy.recoverability import gemini_corollary1
            exact = "exact" if k < 2 * plan.replicas else "lower bound"
            row += f"   Corollary 1: {gemini_corollary1(topo.nodes, plan.replicas, k):.6f} ({exact})"
        lines.append(row)
    if node_failure_prob is not None:
        from ..policy.recoverability import survival_probability
        q = node_failure_prob
        lines.append(f"P(every group recovers) with each node failed independently with probability {q:g} "
                     f"(ECHECK eq. 1-2 over all groups): {survival_probability(plan.policy_placement(), q):.6f}")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the redundancy plan of a cluster YAML: who holds what, memory, "
                                    "failures survived, P(recover from memory)")
    p.add_argument("--config", default=None, help="cluster/job YAML (default: the embedded configs/local-cpu.yaml)")
    p.add_argument("--scheme", choices=["none", "replica", "xor", "rs"], default=None,
                   help="override redundancy.scheme (keeps the file's replicas/group_size/k/m)")
    p.add_argument("--state-bytes-per-rank", type=parse_bytes, default=None, metavar="N",
                   help="snapshot bytes per rank (e.g. 2GiB) to print memory in bytes")
    p.add_argument("--max-failures", type=int, default=8, metavar="K",
                   help="print P(recover) for k = 1..K simultaneous node failures (default 8)")
    p.add_argument("--show-groups", type=int, default=3, metavar="G",
                   help="groups printed node by node (at least one of each shape is printed too)")
    p.add_argument("--moe-bytes-per-stage", default=None, metavar="DENSE,EXPERT",
                   help="a MoE job (parallel.expert > 1): one pipeline stage's dense and expert snapshot bytes "
                        "(e.g. 2GiB,12GiB), to print each rank's dense and expert bytes")
    p.add_argument("--node-failure-prob", type=float, default=None, metavar="Q",
                   help="also print P(all groups recover) when each node is down with probability Q (ECHECK eq. 1-2)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.max_failures < 1:
        raise ftconfig.ConfigError(f"--max-failures={args.max_failures} is invalid: must be >= 1")
    if args.show_groups < 0:
        raise ftconfig.ConfigError(f"--show-groups={args.show_groups} is invalid: must be >= 0")
    q = args.node_failure_prob
    if q is not None and not 0.0 <= q <= 1.0:
        raise ftconfig.ConfigError(f"--node-failure-prob={q} is invalid: must be in [0, 1]")
    moe_bytes = None
    if args.moe_bytes_per_stage is not None:
        parts = args.moe_bytes_per_stage.split(",")
        try:
            if len(parts) != 2:
                raise ValueError(parts)
            moe_bytes = (parse_bytes(parts[0]), parse_bytes(parts[1]))
        except (ValueError, argparse.ArgumentTypeError):
            raise ftconfig.ConfigError(f"--moe-bytes-per-stage={args.moe_bytes_per_stage} is invalid: must be "
                                       f"DENSE,EXPERT byte counts (e.g. 2GiB,12GiB)") from None
    cfg = ftconfig.load(args.config)
    if args.scheme and args.scheme != cfg.redundancy.scheme:
        cfg = ftconfig.replace(cfg, redundancy={"scheme": args.scheme})  # re-validates against the cluster
    t0 = time.perf_counter()
    try:
        plan = plan_from_config(cfg)
    except ValueError as e:
        raise ftconfig.ConfigError(str(e)) from None
    planned = time.perf_counter() - t0
    print(format_plan(plan, args.state_bytes_per_rank, args.max_failures, args.show_groups, q,
                      source=args.config or ftconfig.DEFAULT_CONFIG_PATH, moe_bytes=moe_bytes))
    print(f"(planned in {planned * 1000:.1f} ms)", file=sys.stderr)
    return 0
