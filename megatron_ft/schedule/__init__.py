"""Checkpoint-traffic planners: where in an iteration the snapshot's bytes go over
the network so that they do not slow training. Pure functions, no processes, no torch.

* :mod:`.spans`  - idle spans, recorded events, the alpha-beta link model; network idle spans
  (GEMINI section 5.4) and reserved pipeline bubbles (BAFT section 4.2.2) from a profiled
  iteration, and their mean and variance across iterations
* :mod:`.gemini` - GEMINI Algorithm 2: chunks of at most R/p bytes fitted into mu times each idle
  span, the last span unbounded
* :mod:`.baft`   - BAFT Algorithm 1 (bubbles shared with the previous stage, spilling into later
  iterations) and Algorithm 2 (per bubble, the layers that fill it best, by dynamic programming)
* :mod:`.link_gate` - when a chunk may take the link while training runs: right after one of
  training's network calls, within mu of the shortest idle span the profile saw after that call
  (a state machine fed with the calls' times, and the windows and chunk sizes from a profile)
* :mod:`.profiler` - per-rank timelines of the first W iterations (the records come from
  :mod:`megatron_ft.megatron.hooks`), the profile file, their summary into idle spans and bubbles
* :mod:`.timeline` - ``megatron-ft timeline``: Chrome trace and PNG with the GEMINI plan laid over

See docs/scheduling.md.
"""
