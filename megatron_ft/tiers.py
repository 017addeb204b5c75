"""Which recovery tier each failure must end in: the promise, as data (no I/O).

A restore reports the tier it reached (``recovered_from``): ``local_memory`` (the node's own agent),
``peer_memory`` (a whole copy from the redundancy group), ``decoded`` (XOR / Reed-Solomon from the
survivors), ``disk`` (the newest persisted step) or ``none`` (a fresh start). A bit-exact result
cannot tell a recovery from memory from a deterministic restart at step 0, so every demo, test and
chaos trial checks the tier against :func:`promised`.

========================================  ==========================================
failure                                   must resume from
========================================  ==========================================
trainer, all trainers of a node, agent    local_memory
(restarted), agent then trainer, launcher,
a hung trainer (found and ended)
a committed slot corrupted on one node    local_memory (the older clean version), or
                                          peer_memory / decoded where a copy exists
a whole node, with replica                peer_memory
a whole node, with xor or rs, or two      decoded (peer_memory where a whole copy exists)
nodes of one group with rs m = 2
more nodes than the scheme tolerates,     disk (the newest step persisted whole before
or a node with no redundancy              the failure)
any of these again during the recovery    the same tier as the first
========================================  ==========================================

``beyond_tolerance`` comes from the redundancy plan (``RedundancyPlan.survives(lost nodes)``).
"""
from __future__ import annotations

#: reached tiers, best first; peer_memory and decoded are equally good (both from the group)
RANK = {"local_memory": 3, "peer_memory": 2, "decoded": 2, "disk": 1, "none": 0}

LOCAL_FAILURES = ("trainer", "hang", "all-trainers", "agent", "agent-then-trainer", "launcher", "corrupt")
NODE_FAILURES = ("node", "node0")


def promised(failure: str, scheme: str, beyond_tolerance: bool = False) -> str:
    """The lowest tier ``failure`` may end in under redundancy ``scheme`` (none|replica|xor|rs)."""
    if failure in LOCAL_FAILURES:
        # a corrupted slot may also be served whole or decoded by the group: both count as memory
        return "peer_memory" if failure == "corrupt" and scheme != "none" else "local_memory"
    if failure in NODE_FAILURES:
        if scheme == "none" or beyond_tolerance:
            return "disk"
        return "peer_memory" if scheme == "replica" else "decoded"
    raise ValueError(f"failure {failure!r} is not one of {list(LOCAL_FAILURES + NODE_FAILURES)}")


def lowest(reached: str) -> str:
    """The worst tier of a combined report such as ``decoded+peer_memory``."""
    parts = [p for p in reached.split("+") if p] or ["none"]
    for p in parts:
        if p not in RANK:
            raise ValueError(f"tier {p!r} is not one of {list(RANK)}")
    return min(parts, key=lambda p: RANK[p])


def meets(reached: str, promise: str) -> bool:
    """Whether the tier reached is at least the promised one."""
    return RANK[lowest(reached)] >= RANK[promise]
