"""Warm spare trainers: a node's pool of processes that already imported torch and megatron-core
(:mod:`.pool`), and the small worker torchrun starts in their place (:mod:`.worker`)."""
