"""A process's random-number state, captured and restored in one place.

Tensors (they go in the snapshot's flat area): ``rng.cpu`` (torch's default generator) and, where
a CUDA generator exists (a GPU, or megatron-ft's CPU stand-in for Megatron), ``rng.cuda``. JSON
(the version record): Python's ``random`` and numpy's global generator. Integrations add their own
generators (Megatron's tensor-parallel tracker) beside these.
"""
from __future__ import annotations

import random
from typing import Callable, Mapping

import numpy as np
import torch

TENSORS = ("rng.cpu", "rng.cuda")


def _has_cuda_generator() -> bool:
    return torch.cuda.is_available()


def capture(cuda: Callable[[], bool] = _has_cuda_generator) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """``([(name, state tensor)], record)`` of this process's generators now. ``cuda()`` says
    whether a CUDA generator is in use (GPU path: its state is copied to host memory)."""
    tensors = [("rng.cpu", torch.get_rng_state())]
    if cuda():
        tensors.append(("rng.cuda", torch.cuda.get_rng_state().cpu()))
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    record = {"python_rng": {"version": version, "internal": list(internal), "gauss": gauss},
              "numpy_rng": {"name": name, "keys": [int(k) for k in keys], "pos": int(pos),
                            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    return tensors, record


def restore(tensors: Mapping[str, torch.Tensor], record: Mapping) -> None:
    """Put back what :func:`capture` returned (``tensors`` by name; a missing ``rng.cuda`` leaves
    the CUDA generator alone)."""
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    py = record["python_rng"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npr = record["numpy_rng"]
    np.random.set_state((npr["name"], np.array(npr["keys"], dtype=np.uint32), npr["pos"], npr["has_gauss"],
                         npr["cached_gaussian"]))
