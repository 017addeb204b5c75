"""Capture: what a rank's state is, as explicit data - the process's random-number state
(:mod:`.rng`) and nested state structures as JSON plus a list of tensors (:mod:`.tree`)."""
