"""GEMINI's Algorithm 1 (SOSP '23, section 4): which nodes form the replica groups, pure. The one
definition both the recoverability model (:mod:`megatron_ft.policy.recoverability`) and the planner
(:mod:`megatron_ft.redundancy.gemini`, which re-exports it) use; it sits in the policy layer because
the planner imports the policy, never the other way round."""
from __future__ import annotations


def placement_strategy(n: int, m: int) -> tuple[tuple[tuple[int, ...], ...], str]:
    """Algorithm 1, line by line, with 0-based node ids: ``(groups, "group" | "mixed")``. Raises
    ValueError unless ``1 <= m <= n`` (both ints).

    >>> placement_strategy(4, 2)
    (((0, 1), (2, 3)), 'group')
    >>> placement_strategy(5, 2)
    (((0, 1), (2, 3, 4)), 'mixed')
    """
    if not isinstance(m, int) or not isinstance(n, int) or m < 1 or n < m:
        raise ValueError(f"GEMINI placement needs 1 <= m <= N, got N={n!r} nodes and m={m!r} replicas")
    g = n // m
    groups = [[m * i + j for j in range(m)] for i in range(g)]
    strategy = "group"
    if n % m:
        strategy = "mixed"
        groups[-1].extend(range(g * m, n))  # add the remaining machines to the last group
    return tuple(tuple(x) for x in groups), strategy
