"""megatron-core integration of megatron_ft.

``cpu_compat`` holds the CPU-only shims that let megatron-core train without CUDA.
"""
