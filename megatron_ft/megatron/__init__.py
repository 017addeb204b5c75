"""megatron-core integration of megatron_ft.

``cpu_compat`` holds the CPU-only shims that let megatron-core train without CUDA; ``hooks`` wraps
megatron-core's pipeline P2P, timers, grad/param sync and optimizer step from outside (records and
schedule-point callbacks); ``profiling`` is the training-loop side of
``--inmem-ckpt-profile-iterations``.
"""
