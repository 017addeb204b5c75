"""Build script for megatron-ft.

The only compiled piece is a tiny C library (``megatron_ft/_native/fastcopy.c``) that
copies a buffer and computes its checksum in one pass, at memory speed. It is loaded
with ctypes; when it is missing, ``megatron_ft.capture.checksum`` falls back to numpy.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "megatron_ft._native._fastcopy",
            sources=["megatron_ft/_native/fastcopy.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        )
    ],
)
