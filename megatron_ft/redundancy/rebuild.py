"""What a lost rank can be rebuilt from, and at which step: pure planning over the survivors'
holdings (plan), apart from the agent code that fetches and decodes the bytes (execute,
:meth:`megatron_ft.agent.peer_rebuild.PeerRebuild.recover`).

*Holdings* are what each surviving group member's agent answers to ``holds``: the steps it holds
clean in its own slots (``primary``, by rank) and the complete steps of each peer block it holds
(``blocks``, by block key)::

    {node: {"primary": {"<rank>": [steps]}, "blocks": {"<block key>": [steps]}, ...}}

Worked example (GEMINI replica, 2 nodes x 1 rank, node 1 lost): node 0 holds its own rank 0 at
steps 5 and 6 and a whole copy of rank 1 at step 5 only (the exchange of 6 had not completed), so
rank 1 can be rebuilt at step 5 from a copy, not at step 6:

>>> from .plan import make_plan
>>> from .topology import Topology
>>> p = make_plan(Topology(2, 1), "replica", replicas=2)
>>> holds = {0: {"primary": {"0": [6, 5]}, "blocks": {"copy.r1": [5]}}}
>>> rebuildable(p, holds, 1, {0: 100, 1: 100})
[{'step': 5, 'source': 'peer_memory'}]
>>> plan_rebuild(p, holds, 1, 6, {0: 100, 1: 100}) is None
True
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from . import exchange as xch
from .plan import RedundancyPlan

Holdings = Mapping[int, Mapping[str, Any]]


def has_primary(h: Mapping[str, Any], rank: int, step: int) -> bool:
    return step in h.get("primary", {}).get(str(rank), [])


def has_block(h: Mapping[str, Any], key: str, step: int) -> bool:
    return step in h.get("blocks", {}).get(key, [])


def whole_at(holds: Holdings, rank: int, step: int) -> Optional[tuple[int, str, Optional[str]]]:
    """(node, "primary" | "block", block key) of a survivor holding ``rank`` whole at ``step``."""
    for n, h in holds.items():
        if has_primary(h, rank, step):
            return n, "primary", None
    for n, h in holds.items():
        if has_block(h, f"{xch.COPY}.r{rank}", step):
            return n, "block", f"{xch.COPY}.r{rank}"
    return None


def plan_rebuild(plan: RedundancyPlan, holds: Holdings, rank: int, step: int,
                 sizes: Mapping[int, int]) -> Optional[tuple[str, Any]]:
    """(source tier, recipe) for rebuilding ``rank`` at ``step`` from ``holds``, cheapest first:
    a whole copy (``peer_memory``), else XOR or Reed-Solomon decoding (``decoded``); None if the
    survivors do not hold enough of ``step``."""
    for rec in xch.recipes(plan, rank, sizes):
        if isinstance(rec, xch.CopyRecipe):
            if rec.block.holder in holds and has_block(holds[rec.block.holder], rec.block.key, step):
                return "peer_memory", rec
        elif isinstance(rec, xch.XorRecipe):
            if all(x.parity.holder in holds and has_block(holds[x.parity.holder], x.parity.key, step)
                   and all(whole_at(holds, p.rank, step) for _, p in x.others) for x in rec.pieces):
                return "decoded", rec
        elif isinstance(rec, xch.RsRecipe):
            avail = sum(1 for j, d in enumerate(rec.data)
                        if j != rec.index and (d is None or whole_at(holds, d[0], step)))
            avail += sum(1 for b in rec.parity if b.holder in holds and has_block(holds[b.holder], b.key, step))
            if avail >= rec.k:
                return "decoded", rec
    return None


def rebuildable(plan: RedundancyPlan, holds: Holdings, rank: int, sizes: Mapping[int, int]) -> list[dict]:
    """Every step ``rank`` can be rebuilt at from ``holds``, newest first, with its source tier."""
    steps: set[int] = set()
    for h in holds.values():
        for lst in h.get("primary", {}).values():
            steps.update(lst)
        for lst in h.get("blocks", {}).values():
            steps.update(lst)
    out = []
    for s in sorted(steps, reverse=True):
        how = plan_rebuild(plan, holds, rank, s, sizes)
        if how is not None:
            out.append({"step": s, "source": how[0]})
    return out
