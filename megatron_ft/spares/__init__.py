"""Warm spare trainers: a node's pool of processes that already imported torch and megatron-core
(:mod:`.pool`), and the small worker torchrun starts in their place (:mod:`.worker`).

A module imported in the pool whose import did something *per process* (read the environment,
rewrote ``sys.argv``) registers it with :func:`for_each_trainer`: a trainer forked from the pool
inherits the module already imported, so its import does nothing, and the keeper runs the
registered functions in the trainer instead, once its environment, working directory and
``sys.argv`` are the worker's and before the script runs.
"""
from __future__ import annotations

from typing import Callable

_per_trainer: list[Callable[[], None]] = []


def for_each_trainer(fn: Callable[[], None]) -> None:
    """Run ``fn`` in every trainer forked from this process from now on (idempotent per function)."""
    if fn not in _per_trainer:
        _per_trainer.append(fn)


def run_per_trainer() -> None:
    """In a forked trainer, before its script: the functions of :func:`for_each_trainer`, in order."""
    for fn in list(_per_trainer):
        fn()
