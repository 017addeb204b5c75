"""Where Megatron puts every rank: its node, its (tensor, data, pipeline) coordinates, its sharding group.

Assumptions (checked by ``tests/unit/test_placement.py`` against megatron-core's own ``RankGenerator``):

* ``megatron_ft launch`` gives node ``n`` the global ranks ``n * ranks_per_node ...
  (n + 1) * ranks_per_node - 1`` (``node_rank * nproc_per_node + local_rank``).
* megatron-core's default rank order ``order="tp-cp-ep-dp-pp"`` (``initialize_model_parallel``,
  as ``scripts/pretrain_gpt.py`` calls it) with context parallelism of 1 (megatron-ft's config has
  none), so tensor rank varies fastest, then data, then pipeline::

      rank = tp + TP * dp + TP * DP * pp

* A mixture-of-experts job (``expert`` = EP > 1, expert tensor parallelism ETP equal to TP) lays the
  same ranks out a second time for its experts (megatron-core's expert rank generator, same order):
  expert-tensor rank fastest, then the expert-parallel rank, then the expert-data-parallel rank::

      rank = etp + TP * ep + TP * EP * edp + TP * DP * pp        (EDP = DP / EP)

  An expert's parameters and its optimizer state live on the EDP ranks of one ``(pp, ep, etp)`` only:
  its *expert sharding group*. Each rank's snapshot holds 1/DP of its dense buckets and 1/EDP of its
  experts' (``megatron_ft/megatron/state.py``); a node loss is recoverable for experts exactly when it
  is for the rank's whole snapshot, since redundancy protects each rank's snapshot as one piece of
  bytes whatever it holds - with EDP = 1 an expert exists once in the job, and only the redundancy
  holds a second copy.

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

from ..policy.elastic import coordinates, rank_of


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``ranks_per_node`` ranks split into TP x DP x PP (DP is what is left)."""

    nodes: int
    ranks_per_node: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1  # EP (a dense model: 1)

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "tensor", "pipeline", "expert"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= 1")
        if self.world_size % (self.tensor * self.pipeline):
            raise ValueError(f"tensor*pipeline={self.tensor * self.pipeline} does not divide the world size "
                             f"nodes*ranks_per_node={self.world_size}")
        if self.data % self.expert:
            raise ValueError(f"expert={self.expert} does not divide the data-parallel size {self.data}: "
                             f"EP must divide DP (expert tensor parallelism equal to tensor)")

    @classmethod
    def from_config(cls, cfg) -> "Topology":
        """The topology of a :class:`megatron_ft.config.FTConfig`."""
        return cls(cfg.cluster.nodes, cfg.cluster.ranks_per_node, cfg.parallel.tensor, cfg.parallel.pipeline,
                   cfg.parallel.expert)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.pipeline)

    @property
    def expert_data(self) -> int:
        """EDP: the ranks holding each expert's shard, DP x TP / (EP x ETP) = DP / EP."""
        return self.data // self.expert

    def expert_coords(self, rank: int) -> tuple[int, int, int, int]:
        """``(etp, ep, edp, pp)`` of a rank in the experts' layout.
        ``Topology(2, 2, 1, 1, 2).expert_coords(3) == (0, 1, 1, 0)``."""
        etp = rank % self.tensor
        ep = (rank // self.tensor) % self.expert
        edp = (rank // (self.tensor * self.expert)) % self.expert_data
        pp = rank // (self.tensor * self.data)
        return etp, ep, edp, pp

    def expert_sharding_group_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks that hold the same experts as ``rank`` (its expert-data-parallel group, in edp order):
        each saves 1/EDP of their expert buckets."""
        etp, ep, _, pp = self.expert_coords(rank)
        base = etp + self.tensor * ep + self.tensor * self.data * pp
        return tuple(base + self.tensor * self.expert * e for e in range(self.expert_data))

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp, dp, pp)`` of a rank (Megatron-LM's order: :func:`megatron_ft.policy.elastic.coordinates`).
        ``Topology(16, 8, 8, 2).coords(77) == (5, 1, 1)``."""
        return coordinates(rank, self.tensor, self.pipeline, self.data)

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return rank_of(tp, dp, pp, self.tensor, self.data)

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
        if self.expert == 1:
            return (f"rank = tp + {t}*dp + {t * d}*pp (megatron-core order tp-cp-ep-dp-pp, cp = ep = 1); "
                    f"node = rank // {self.ranks_per_node}")
        return (f"rank = tp + {t}*dp + {t * d}*pp = etp + {t}*ep + {t * self.expert}*edp + {t * d}*pp "
                f"(megatron-core order tp-cp-ep-dp-pp, cp = 1, EP {self.expert}, EDP {self.expert_data}); "
                f"node = rank // {self.ranks_per_node}")
