"""Job-wide decisions through the agents instead of world collectives (pure: no I/O, no locks).

A restore needs a handful of decisions every rank must share: the steps every rank holds, whether
every rank loaded a candidate, whether some rank's guard refused it. Made as world collectives they
cost each a latency-bound pass over every rank; made here they cost two messages per node:

1. each trainer hands its values to its node's agent, which combines its local ranks' values
   (:func:`combine`) once all of them have;
2. the agent sends the node's combination to the root (the store key ``red/<key>/<node>``);
3. the root absorbs each contribution as it arrives (:class:`Accumulator`, in the store's map,
   deleting the contribution's key) and, with every node's, sets the result (``red/<key>``);
4. every agent watching that key answers its waiting trainers.

``how``: ``min`` and ``max`` (element-wise over equal-length integer lists), ``intersect`` (the
integers every contributor listed, ascending). A key names one decision of one restore: the restore's
identifier (the same on every rank) and the decision's number in it.

>>> combine("intersect", [[5, 4, 3], [4, 3, 1]]), combine("min", [[1, 0], [1, 1]]), combine("max", [[3], [7]])
([3, 4], [1, 0], [7])
>>> acc = Accumulator(nodes=2)
>>> acc.add("r1/0", 0, "min", [1, 1])
>>> acc.add("r1/0", 1, "min", [1, 0])
[1, 0]
>>> acc.add("r1/0", 1, "min", [1, 0]) is None   # a contribution sent again after the result: ignored
True
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Optional

FORMAT = 1
PREFIX = "red/"
HOWS = ("min", "max", "intersect")
#: a decision's key: letters, digits, ``.``, ``_``, ``-`` and ``/``, at most this long
KEY_RE = re.compile(r"^[A-Za-z0-9._/-]{1,200}$")
#: results the root keeps (older ones are deleted as new decisions finish)
KEEP_RESULTS = 256
#: decisions the root keeps open at most: one that can never finish (a node lost while it was being
#: made: its restore fails and the next restore decides under new keys) is dropped, oldest first
OPEN_MAX = 64


def combine(how: str, values: list[list[int]]) -> list[int]:
    """The combination of ``values`` (ValueError naming what is allowed)."""
    if how not in HOWS:
        raise ValueError(f"reduction {how!r}: allowed {list(HOWS)}")
    if not values:
        raise ValueError("nothing to combine")
    if how == "intersect":
        common = set(values[0])
        for v in values[1:]:
            common &= set(v)
        return sorted(common)
    if len({len(v) for v in values}) != 1:
        raise ValueError(f"{how} of lists of different lengths {sorted({len(v) for v in values})}")
    pick = min if how == "min" else max
    return [pick(col) for col in zip(*values)]


def encode(how: str, values: list[int]) -> str:
    return json.dumps({"v": FORMAT, "how": how, "values": values}, separators=(",", ":"))


def decode(text: str) -> tuple[str, list[int]]:
    """``(how, values)`` of a contribution or result; ValueError if it is not one this version reads."""
    rec = json.loads(text)
    if not isinstance(rec, dict) or rec.get("v") != FORMAT or rec.get("how") not in HOWS:
        raise ValueError(f"not a reduction record of format {FORMAT}: {text[:200]!r}")
    values = rec.get("values")
    if not isinstance(values, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        raise ValueError(f"reduction values must be integers: {text[:200]!r}")
    return rec["how"], values


class Accumulator:
    """The root's running combinations, one per open decision: O(1) per contribution (besides the
    values' length), never a scan of the nodes. Not thread-safe: the store's map lock serialises it."""

    def __init__(self, nodes: int):
        self.nodes = nodes
        self._open: dict[str, tuple[str, set[int], list[int]]] = {}  # key -> (how, nodes seen, running)
        self._done: "OrderedDict[str, None]" = OrderedDict()
        self.finished_dropped: list[str] = []  # results to delete (older than KEEP_RESULTS), taken by the caller

    def add(self, key: str, node: int, how: str, values: list[int]) -> Optional[list[int]]:
        """Node ``node``'s contribution to ``key``; the result once every node's is in, else None."""
        if key in self._done:
            return None
        how_was, seen, running = self._open.get(key, (how, set(), []))
        if how_was != how:
            raise ValueError(f"decision {key!r}: node {node} combines by {how!r}, others by {how_was!r}")
        if node in seen:
            return None
        running = combine(how, [values] if not seen else [running, values])
        seen.add(node)
        if len(seen) < self.nodes:
            self._open[key] = (how, seen, running)
            while len(self._open) > OPEN_MAX:
                del self._open[next(iter(self._open))]
            return None
        self._open.pop(key, None)
        self._done[key] = None
        while len(self._done) > KEEP_RESULTS:
            old, _ = self._done.popitem(last=False)
            self.finished_dropped.append(old)
        return running
