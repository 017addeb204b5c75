"""CPU-only compatibility layer that lets megatron-core train without CUDA.

**CPU ONLY.** Nothing here is used on a machine with CUDA: :func:`install_cpu_compat`
returns ``False`` at once when ``torch.cuda.is_available()`` is true.

megatron-core assumes a CUDA device in a few dozen places. On a CPU-only torch build
(with the gloo backend) a real training loop needs exactly four shims, each one shown
necessary on megatron-core 0.16.1:

1. ``torch.cuda.current_device()`` returns the CPU device. Pipeline receive buffers,
   the DDP grad/param buffers and several ``torch.empty(..., device=current_device())``
   calls use it; the real function raises without CUDA.
2. ``torch.cuda.synchronize()`` is a no-op. The p2p pipeline code and Megatron's timers
   call it; the real function raises without CUDA.
3. The "CUDA" RNG functions drive the CPU default generator. Megatron's
   ``CudaRNGStatesTracker`` (``tensor_parallel.random``) and
   ``model_parallel_cuda_manual_seed`` save, seed and restore the CUDA generator to give
   tensor-parallel regions their own dropout stream. On CPU, dropout draws from
   ``torch.default_generator``, so that is the generator the tracker must switch for
   ``fork()`` to have any effect. ``get_cuda_rng_tracker().get_states()/set_states()``
   then hold CPU generator states (``torch.ByteTensor``), which checkpointing saves and
   restores as they are. Consequence: the "default CUDA RNG state" and the CPU RNG state
   are one and the same on CPU.
4. One global :class:`torch.overrides.TorchFunctionMode` (:class:`_CudaToCpuMode`) that
   handles the ~55 hard-coded CUDA uses: ``device="cuda"`` (or ``torch.device("cuda")``)
   arguments are mapped to CPU, ``Tensor.cuda()`` returns the tensor itself,
   ``Tensor.to("cuda")`` stays on CPU, and ``Tensor.type()`` reports CPU tensors with the
   ``torch.cuda.`` prefix (e.g. ``'torch.cuda.FloatTensor'``) because the optimizer and
   grad clipping test ``param.type() == 'torch.cuda.FloatTensor'``.

The mode is pushed on the torch-function mode stack of the thread that calls
:func:`install_cpu_compat` (call it from the main thread before building the model) and
stays there. Backward passes started with ``Tensor.backward``/``torch.autograd.backward``
are re-run through the autograd engine with the mode active, so backward hooks (DDP grad
hooks, tensor-parallel ``autograd.Function.backward``) see it too. Plain threads started
by user code do not inherit the mode: do not run megatron-core code that needs it there.
The mode costs one Python call per torch call (a few microseconds each).

:func:`cpu_config_overrides` returns the ``TransformerConfig`` keyword arguments that a
CPU run needs (fp32 everywhere, no fused kernels).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

__all__ = [
    "install_cpu_compat",
    "is_installed",
    "cpu_config_overrides",
    "CPU_DEVICE",
]

#: The device every CUDA request is mapped to.
CPU_DEVICE = torch.device("cpu")

_lock = threading.Lock()
_installed = False
_mode: Optional["_CudaToCpuMode"] = None

# Message logged by CudaRNGStatesTracker.fork() when the CPU RNG state changed inside a
# forked region. With shim 3 the "CUDA" generator *is* the CPU generator, so this is
# expected (dropout inside fork() advances it) and would otherwise be logged on every
# microbatch.
_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


# --------------------------------------------------------------------------------------
# Shim 4: the torch-function mode
# --------------------------------------------------------------------------------------
def _is_cuda_device(device: Any) -> bool:
    """True for ``"cuda"``, ``"cuda:N"`` and ``torch.device("cuda"[, N])``."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


def _cuda_type_name(name: str) -> str:
    """``'torch.FloatTensor'`` -> ``'torch.cuda.FloatTensor'`` (other names unchanged)."""
    if name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch."):]
    return name


def _cpu_type_arg(dtype: Any) -> Any:
    """``Tensor.type`` argument naming a CUDA tensor type -> the CPU type's name."""
    if isinstance(dtype, type) and dtype.__module__ == "torch.cuda":
        dtype = f"torch.cuda.{dtype.__name__}"
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        return "torch." + dtype[len("torch.cuda."):]
    return dtype


# Functions that need more than the ``device=`` keyword mapped.
_SPECIAL_FUNCS = frozenset(
    {
        torch.Tensor.cuda,
        torch.Tensor.type,
        torch.Tensor.to,
        torch.Tensor.backward,
        torch.autograd.backward,
    }
)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to CPU and disguises CPU tensors as CUDA tensors."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        if func not in _SPECIAL_FUNCS:
            # Fast path: this runs for every torch call in the process.
            if not kwargs:
                return func(*args)
            if not _is_cuda_device(kwargs.get("device")):
                return func(*args, **kwargs)
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        if func is torch.Tensor.cuda:
            # Tensor.cuda(device=None, non_blocking=False, ...) -> the tensor itself.
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and kwargs.get("dtype") is None:
                return _cuda_type_name(func(*args, **kwargs))
            # Tensor.type('torch.cuda.FloatTensor') -> cast to the CPU type.
            if len(args) > 1:
                args = (args[0], _cpu_type_arg(args[1]), *args[2:])
            if "dtype" in kwargs:
                kwargs["dtype"] = _cpu_type_arg(kwargs["dtype"])
            return func(*args, **kwargs)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = CPU_DEVICE
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            # Tensor.to("cuda", ...) / Tensor.to(torch.device("cuda"), ...)
            args = (args[0], CPU_DEVICE, *args[2:])
        return func(*args, **kwargs)

    def _backward(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]
    ) -> Any:
        """Run ``Tensor.backward`` / ``torch.autograd.backward`` with this mode active.

        A mode's handler runs with the mode popped, so a backward pass started from here
        would run every backward hook and custom ``autograd.Function.backward`` (e.g.
        Megatron's tensor-parallel layers and DDP grad hooks) without the shim. Instead,
        call the autograd engine directly with the mode pushed again, as Megatron's own
        ``schedules.custom_backward`` does. Unusual calls (``inputs=``, gradient edges,
        implicit gradients of non-scalars) fall back to the original function.
        """
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        params = bound.arguments
        if func is torch.Tensor.backward:
            tensors, grads = params["self"], params["gradient"]
        else:
            tensors, grads = params["tensors"], params["grad_tensors"]
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if grads is None or isinstance(grads, torch.Tensor):
            grads = (grads,) * len(tensors) if grads is None else (grads,)
        grads = tuple(grads)
        unusual = (
            params.get("inputs") is not None
            or len(grads) != len(tensors)
            or not all(isinstance(t, torch.Tensor) for t in tensors)
            or any(g is None and t.numel() != 1 for t, g in zip(tensors, grads))
        )
        if unusual:
            return func(*args, **kwargs)
        grads = tuple(
            torch.ones_like(t, memory_format=torch.preserve_format) if g is None else g
            for t, g in zip(tensors, grads)
        )
        create_graph = bool(params["create_graph"])
        retain_graph = params["retain_graph"]
        with self:
            Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
                tensors=tensors,
                grad_tensors=grads,
                keep_graph=create_graph if retain_graph is None else bool(retain_graph),
                create_graph=create_graph,
                inputs=(),
                allow_unreachable=True,
                accumulate_grad=True,
            )
        return None


# --------------------------------------------------------------------------------------
# Shims 1-3
# --------------------------------------------------------------------------------------
def _current_device() -> torch.device:
    """Shim 1: replacement for ``torch.cuda.current_device``."""
    return CPU_DEVICE


def _synchronize(device: Any = None) -> None:
    """Shim 2: replacement for ``torch.cuda.synchronize`` (nothing is asynchronous on CPU)."""
    del device


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """Shim 3: ``torch.cuda.get_rng_state`` -> state of the CPU default generator."""
    del device
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """Shim 3: ``torch.cuda.set_rng_state`` -> set the CPU default generator."""
    del device
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    """Shim 3: ``torch.cuda.manual_seed`` -> seed the CPU default generator.

    (Not ``torch.manual_seed``, which itself calls ``torch.cuda.manual_seed_all``.)
    """
    torch.default_generator.manual_seed(int(seed))


def _megatron_get_cuda_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """Shim 3: replacement for ``tensor_parallel.random._get_cuda_rng_state``."""
    del device, clone  # torch.get_rng_state() already returns a fresh copy
    if graph_safe:
        raise RuntimeError("CUDA-graph-safe RNG states are not supported on CPU")
    return torch.get_rng_state()


def _megatron_set_cuda_rng_state(
    new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False
) -> None:
    """Shim 3: replacement for ``tensor_parallel.random._set_cuda_rng_state``.

    The original defers the update through ``torch.cuda._lazy_call``, which on a CPU build
    never runs: the tracker's ``fork()`` would silently not switch generators.
    """
    del device
    if graph_safe:
        raise RuntimeError("CUDA-graph-safe RNG states are not supported on CPU")
    torch.set_rng_state(new_state)


class _DropForkWarning(logging.Filter):
    """Drops the expected ``fork()`` warning (see ``_FORK_WARNING``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _FORK_WARNING not in record.getMessage()


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------
def is_installed() -> bool:
    """Whether :func:`install_cpu_compat` has installed the shims in this process."""
    return _installed


def install_cpu_compat() -> bool:
    """Install the four CPU shims (see the module docstring). CPU ONLY.

    Returns ``False`` and changes nothing when CUDA is available. Otherwise installs the
    shims and returns ``True``. Idempotent: later calls change nothing and return ``True``.
    """
    global _installed, _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _installed:
            return True

        import megatron.core.tensor_parallel.random as mcore_random

        # Shims 1 and 2.
        torch.cuda.current_device = _current_device  # type: ignore[assignment]
        torch.cuda.synchronize = _synchronize  # type: ignore[assignment]

        # Shim 3: torch.cuda.get_rng_state is torch.cuda.random.get_rng_state re-exported,
        # and megatron calls it through both names.
        for namespace in (torch.cuda, torch.cuda.random):
            namespace.get_rng_state = _get_rng_state  # type: ignore[attr-defined]
            namespace.set_rng_state = _set_rng_state  # type: ignore[attr-defined]
            namespace.manual_seed = _manual_seed  # type: ignore[attr-defined]
        mcore_random._get_cuda_rng_state = _megatron_get_cuda_rng_state
        mcore_random._set_cuda_rng_state = _megatron_set_cuda_rng_state
        logging.getLogger(mcore_random.__name__).addFilter(_DropForkWarning())

        # Shim 4: push the mode and leave it on the stack for the life of the process.
        _mode = _CudaToCpuMode()
        _mode.__enter__()

        _installed = True
        return True


def cpu_config_overrides() -> Dict[str, Any]:
    """``TransformerConfig`` keyword arguments a CPU run needs. CPU ONLY.

    fp32 parameters and pipeline communication, and every fused kernel off (the fused
    kernels need CUDA, apex or Transformer Engine). Apply these last, after the user's
    settings: ``TransformerConfig(**user_kwargs, **cpu_config_overrides())``.
    """
    return {
        "fp16": False,
        "bf16": False,
        "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32,
        "use_cpu_initialization": True,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "cross_entropy_loss_fusion": False,
        "sequence_parallel": False,  # needs apex/TE norms
    }
