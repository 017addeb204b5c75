"""Where Megatron puts every rank: its node, its (tensor, data, pipeline) coordinates, its sharding group.

Assumptions (checked by ``tests/unit/test_placement.py`` against megatron-core's own ``RankGenerator``):

* ``megatron_ft launch`` gives node ``n`` the global ranks ``n * ranks_per_node ...
  (n + 1) * ranks_per_node - 1`` (``node_rank * nproc_per_node + local_rank``).
* megatron-core's default rank order ``order="tp-cp-ep-dp-pp"`` (``initialize_model_parallel``,
  as ``scripts/pretrain_gpt.py`` calls it) with context and expert parallelism of 1 (megatron-ft's
  config has neither), so tensor rank varies fastest, then data, then pipeline::

      rank = tp + TP * dp + TP * DP * pp

* A *sharding group* (REFT section 4.1, "the same PP stage across all DP paths") is the set of
  data-parallel replicas of one (pipeline stage, tensor rank): ``{tp + TP*dp + TP*DP*pp : dp}``.
  Its members hold same-shaped state (1/DP of the same parameters, the matching optimizer shard),
  so XOR-ing them wastes no padding.

Worked example, 16 nodes x 8 GPUs, TP 8, PP 2, hence DP = 128 / 16 = 8::

    rank 77 = 5 + 8*1 + 64*1        -> tp 5, dp 1, pp 1, on node 77 // 8 = 9
    sharding group of rank 77        -> pp 1, tp 5: ranks 69, 77, 85, ..., 125 on nodes 8, 9, ..., 15

With the local CPU default (2 nodes x 2 ranks, TP 1, PP 2, DP 2), rank 1 is tp 0, dp 1, pp 0 on node
0, and its sharding group {0, 1} lives entirely on node 0: no parity inside it can survive the loss
of node 0 (see :func:`megatron_ft.redundancy.reft.xor_parity_groups` for what happens then).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``ranks_per_node`` ranks split into TP x DP x PP (DP is what is left)."""

    nodes: int
    ranks_per_node: int
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "tensor", "pipeline"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= 1")
        if self.world_size % (self.tensor * self.pipeline):
            raise ValueError(f"tensor*pipeline={self.tensor * self.pipeline} does not divide the world size "
                             f"nodes*ranks_per_node={self.world_size}")

    @classmethod
    def from_config(cls, cfg) -> "Topology":
        """The topology of a :class:`megatron_ft.config.FTConfig`."""
        return cls(cfg.cluster.nodes, cfg.cluster.ranks_per_node, cfg.parallel.tensor, cfg.parallel.pipeline)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.pipeline)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp, dp, pp)`` of a rank. ``Topology(16, 8, 8, 2).coords(77) == (5, 1, 1)``."""
        tp = rank % self.tensor
        dp = (rank // self.tensor) % self.data
        pp = rank // (self.tensor * self.data)
        return tp, dp, pp

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tensor * (dp + self.data * pp)

    def sharding_group(self, rank: int) -> int:
        """Index ``pp * TP + tp`` of the rank's sharding group (its DP replicas)."""
        tp, _, pp = self.coords(rank)
        return pp * self.tensor + tp

    def sharding_group_ranks(self, group: int) -> tuple[int, ...]:
        """The ranks of sharding group ``pp * TP + tp``, in dp order (megatron's data-parallel group)."""
        pp, tp = divmod(group, self.tensor)
        return tuple(self.rank_of(tp, dp, pp) for dp in range(self.data))

    def describe(self) -> str:
        t, d = self.tensor, self.data
        return (f"rank = tp + {t}*dp + {t * d}*pp (megatron-core order tp-cp-ep-dp-pp, cp = ep = 1); "
                f"node = rank // {self.ranks_per_node}")
