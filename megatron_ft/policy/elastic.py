"""Going on at fewer data-parallel replicas: which sizes a job fits after losing nodes, which old ranks a new
rank restores from, and why a job cannot shrink at all (pure; no I/O).

A job of ``nodes`` x ``ranks_per_node`` ranks at tensor x pipeline parallelism TP x PP runs DP = world /
(TP x PP) data-parallel replicas. Losing nodes with no standby or replacement leaves ``nodes'`` nodes; the
job goes on with TP x PP unchanged at DP' = nodes' x ranks_per_node / (TP x PP) where that is a whole
number, at least ``min_data_parallel``, a multiple of the expert parallelism EP, and the global batch
stays whole: it must be a multiple of DP' x the micro-batch (each rank's micro-batches per step scale
with DP'). :func:`shrink_sizes` lists the sizes that fit; :func:`elastic_refusal` says, before the job
trains, why losing one node would leave none.

Ranks are numbered as Megatron-LM numbers them (``tp-cp-ep-dp-pp``, context and expert parallelism
folded in): rank = tp + TP x (dp + DP x pp) (:func:`coordinates`, :func:`rank_of`). A rank at DP'
restores from the old data-parallel replicas of its own (tp, pp) (:func:`replicas_of`): those whose
slices overlap its new one, and replica 0 (RNG streams, step counters).

Worked example: 3 nodes x 2 ranks, TP1 PP2 (DP3), global batch 12, micro-batch 2. Losing a node leaves
4 ranks, DP2 (12 = 2 x 2 x 3); losing two leaves DP1.

>>> shrink_sizes(3, 2, 1, 2, global_batch=12, micro_batch=2)
{2: 2, 1: 1}
>>> shrink_sizes(3, 2, 1, 2, global_batch=12, micro_batch=2, min_data_parallel=2)
{2: 2}
>>> print(elastic_refusal(3, 2, 1, 2, global_batch=18, micro_batch=2))
losing one node leaves 4 ranks at TP1 x PP2: DP 2, and the global batch 18 is not a multiple of DP 2 x micro-batch 2 = 4
>>> [coordinates(r, 1, 2, 3) for r in (0, 2, 3, 5)]   # (tp, dp, pp)
[(0, 0, 0), (0, 2, 0), (0, 0, 1), (0, 2, 1)]
>>> replicas_of(3, 1, 2, old_dp=3, new_dp=2)   # new rank 3 = stage 1's replica 1 of 2
[3, 4, 5]
"""
from __future__ import annotations

from typing import Optional


def coordinates(rank: int, tensor: int, pipeline: int, data: int) -> tuple[int, int, int]:
    """(tp, dp, pp) of ``rank`` in a world of ``tensor`` x ``data`` x ``pipeline`` ranks (Megatron-LM's order)."""
    if not 0 <= rank < tensor * pipeline * data:
        raise ValueError(f"rank {rank} is outside a world of TP{tensor} x DP{data} x PP{pipeline}")
    return rank % tensor, (rank // tensor) % data, rank // (tensor * data)


def rank_of(tp: int, dp: int, pp: int, tensor: int, data: int) -> int:
    """The rank at (tp, dp, pp) (inverse of :func:`coordinates`)."""
    return tp + tensor * (dp + data * pp)


def _why_not(ranks: int, tensor: int, pipeline: int, expert: int, global_batch: Optional[int],
             micro_batch: Optional[int], min_data_parallel: int) -> Optional[str]:
    """Why ``ranks`` ranks cannot run the job (None: they can)."""
    mp = tensor * pipeline
    if ranks % mp:
        return f"{ranks} ranks are not a multiple of TP{tensor} x PP{pipeline} = {mp}"
    dp = ranks // mp
    if dp < max(1, min_data_parallel):
        return f"DP {dp} is below cluster.elastic.min_data_parallel={min_data_parallel}"
    if dp % expert:
        return f"DP {dp} is not a multiple of the expert parallelism {expert}"
    if global_batch is not None and micro_batch is not None and global_batch % (dp * micro_batch):
        return (f"DP {dp}, and the global batch {global_batch} is not a multiple of DP {dp} x micro-batch "
                f"{micro_batch} = {dp * micro_batch}")
    return None


def shrink_sizes(nodes: int, ranks_per_node: int, tensor: int, pipeline: int, expert: int = 1,
                 global_batch: Optional[int] = None, micro_batch: Optional[int] = None,
                 min_data_parallel: int = 1) -> dict[int, int]:
    """``{nodes': DP'}`` for every smaller node count the job fits at (largest first); the global batch is
    checked where both it and the micro-batch are given."""
    out = {}
    for n in range(nodes - 1, 0, -1):
        if _why_not(n * ranks_per_node, tensor, pipeline, expert, global_batch, micro_batch, min_data_parallel) is None:
            out[n] = n * ranks_per_node // (tensor * pipeline)
    return out


def elastic_refusal(nodes: int, ranks_per_node: int, tensor: int, pipeline: int, expert: int = 1,
                    global_batch: Optional[int] = None, micro_batch: Optional[int] = None,
                    min_data_parallel: int = 1) -> Optional[str]:
    """Why a job with elastic shrinking on could not go on after losing one node (None: it could)."""
    if nodes < 2:
        return "a job of one node has no node to lose and go on without"
    ranks = (nodes - 1) * ranks_per_node
    why = _why_not(ranks, tensor, pipeline, expert, global_batch, micro_batch, min_data_parallel)
    return None if why is None else f"losing one node leaves {ranks} ranks at TP{tensor} x PP{pipeline}: {why}"


def replicas_of(new_rank: int, tensor: int, pipeline: int, old_dp: int, new_dp: int) -> list[int]:
    """The old ranks (at ``old_dp``) of ``new_rank``'s tensor and pipeline coordinate (at ``new_dp``): the
    data-parallel replicas whose shards its own are cut from, replica 0 first. Which of them it reads is
    known only from their extents records - megatron-core pads each bucket to a multiple of the
    data-parallel size, which moves the cuts by up to a slice - so the re-slicing plan
    (:func:`megatron_ft.redundancy.reslice.plan_reslice`) names the ones with bytes to give."""
    tp, _, pp = coordinates(new_rank, tensor, pipeline, new_dp)
    return [rank_of(tp, d, pp, tensor, old_dp) for d in range(old_dp)]
