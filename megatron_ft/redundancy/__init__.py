"""Peer redundancy for the in-memory snapshots: placement and coding plans.

Pure functions, one module per paper (each docstring works an example by hand):

* :mod:`.topology` - Megatron's rank order (tp fastest, then dp, then pp), nodes, sharding groups
* :mod:`.gemini`   - GEMINI Algorithm 1: replica groups of m, the remainder joined into a ring
* :mod:`.reft`     - REFT RAIM5: XOR parity rotating over the nodes of each sharding group
* :mod:`.echeck`   - ECHECK k + m coding: sweep-line data/parity nodes, XOR-reduction targets
* :mod:`.plan`     - :class:`RedundancyPlan`: per node what it holds, bytes, failures survived
* :mod:`.report`   - ``megatron-ft plan --config FILE``
"""
from .plan import SCHEMES, NodeHoldings, NodeMemory, Piece, ParityBlock, RedundancyPlan, make_plan, plan_from_config
from .topology import Topology

__all__ = ["SCHEMES", "NodeHoldings", "NodeMemory", "Piece", "ParityBlock", "RedundancyPlan", "Topology",
           "make_plan", "plan_from_config"]
