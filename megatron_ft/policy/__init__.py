"""Failure-aware policy: the papers' models as pure, tested functions.

One module per idea (each docstring works an example by hand):

* :mod:`.wasted`          - wasted time per failure, GEMINI eq. 1 and constraint 2
* :mod:`.survival`        - Weibull survival of nodes and jobs, REFT eq. 1-3
* :mod:`.recoverability`  - P(recover from memory | k simultaneous failures) for replica (GEMINI
  Algorithm 1 / Corollary 1), XOR (REFT RAIM5) and k+m coding (ECHECK eq. 1-2): exact counts,
  exhaustive enumeration, Monte Carlo
* :mod:`.intervals`       - optimal snapshot / persist intervals, REFT eq. 4-11, Young, Daly, and
  the exact goodput of periodic checkpointing
* :mod:`.runtime`         - ``interval: auto``: measure, decide, log (used by the checkpointer)
* :mod:`.simulate`        - ``megatron-ft simulate``: event-driven goodput simulation

See docs/policy.md.
"""
