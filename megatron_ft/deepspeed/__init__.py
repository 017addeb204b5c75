"""DeepSpeed integration: ``engine.save_checkpoint``/``load_checkpoint`` through megatron-ft's in-memory tier.

    engine, optimizer, _, scheduler = deepspeed.initialize(...)
    from megatron_ft.deepspeed import enable_inmem_ckpt
    enable_inmem_ckpt(engine)                     # every rank, after deepspeed.initialize
    _, client_state = engine.load_checkpoint(ckpt_dir)   # newest verified snapshot, or (None, None)
    ... engine.save_checkpoint(ckpt_dir, client_state={...}) every iteration ...

See ``megatron_ft/deepspeed/engine.py`` and ``docs/deepspeed.md``. Importing this package does not
import DeepSpeed; the names below do, on first use.
"""
from __future__ import annotations

__all__ = ["enable_inmem_ckpt", "InMemoryCheckpointEngine", "DeepSpeedStateAdapter"]


def __getattr__(name: str):
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
