"""CPU-only compatibility layer that lets megatron-core train without CUDA.

**CPU ONLY.** Nothing here is used on a machine with CUDA: :func:`install_cpu_compat`
returns ``False`` at once when ``torch.cuda.is_available()`` is true.

megatron-core assumes a CUDA device in a few dozen places. On a CPU-only torch build
(with the gloo backend) a real training loop needs exactly four shims, each one shown
necessary on megatron-core 0.16.1 (a fifth for mixture-of-experts models):

1. ``torch.cuda.current_device()`` returns the CPU device. Pipeline receive buffers,
   the DDP grad/param buffers and several ``torch.empty(..., device=current_device())``
   calls use it; the real function raises without CUDA.
2. ``torch.cuda.synchronize()`` is a no-op. The p2p pipeline code and Megatron's timers
   call it; the real function raises without CUDA.
3. The "CUDA" RNG functions drive :data:`CUDA_GENERATOR`, a CPU generator of its own that stands
   in for the GPU's default generator. Megatron's ``CudaRNGStatesTracker``
   (``tensor_parallel.random``) and ``model_parallel_cuda_manual_seed`` save, seed and restore the
   CUDA generator to give tensor-parallel regions their own dropout stream, and dropout (which the
   mode below routes to :data:`CUDA_GENERATOR`, as CUDA dropout draws from the CUDA generator) then
   sees them. The CPU default generator stays what it is on a GPU machine: weights initialised on
   the CPU, DataLoader seeds. ``torch.manual_seed`` seeds both, as it does with CUDA.
4. One global :class:`torch.overrides.TorchFunctionMode` (:class:`_CudaToCpuMode`) that
   handles the ~55 hard-coded CUDA uses: ``device="cuda"`` (or ``torch.device("cuda")``)
   arguments are mapped to CPU, ``Tensor.cuda()`` returns the tensor itself,
   ``Tensor.to("cuda")`` stays on CPU, and ``Tensor.type()`` reports CPU tensors with the
   ``torch.cuda.`` prefix (e.g. ``'torch.cuda.FloatTensor'``) because the optimizer and
   grad clipping test ``param.type() == 'torch.cuda.FloatTensor'``.

5. (MoE) ``moe_utils.te_general_gemm`` is ``None`` where Transformer Engine is absent: the router's
   GEMM (``RouterGatingLinearFunction``) tests the name, which megatron-core 0.16.1 binds only when TE
   imports, and raises ``NameError`` otherwise; ``None`` selects its torch path.

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

import contextlib
import inspect
import logging
import threading
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence

import torch
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

__all__ = [
    "install_cpu_compat",
    "install_upstream_cpu",
    "bypassed",
    "is_installed",
    "CUDA_GENERATOR",
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


#: The CPU generator that stands in for the CUDA default generator (shim 3): Megatron's "CUDA" RNG
#: state, the tensor-parallel tracker's states and dropout live here, apart from the CPU default
#: generator, exactly as on a GPU. (Sharing one generator made a resume diverge whenever code after
#: the restore, e.g. a DataLoader iterator's seed, drew from the CPU generator.)
CUDA_GENERATOR = torch.Generator()

_DROPOUTS = (torch.nn.functional.dropout, torch.dropout)
#: Random factories that draw from the CUDA generator when asked for a CUDA tensor.
_CUDA_RANDOM_FACTORIES = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
                                    torch.randn_like, torch.randint_like})

# Functions that need more than the ``device=`` keyword mapped.
_SPECIAL_FUNCS = frozenset(
    {
        torch.Tensor.cuda,
        torch.Tensor.type,
        torch.Tensor.to,
        torch.Tensor.backward,
        torch.autograd.backward,
        *_DROPOUTS,
    }
)


def _dropout(func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """Dropout that draws its mask from :data:`CUDA_GENERATOR` (where CUDA dropout draws).
    Same semantics as ATen's: keep with probability ``1 - p``, scale kept values by ``1 / (1 - p)``."""
    if func is torch.dropout:  # torch.dropout(input, p, train)
        names = ("input", "p", "train")
        bound = {**dict(zip(names, args)), **kwargs}
        x, p, training, inplace = bound["input"], bound["p"], bound["train"], False
    else:  # F.dropout(input, p=0.5, training=True, inplace=False)
        names = ("input", "p", "training", "inplace")
        bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(names, args)), **kwargs}
        x, p, training, inplace = bound["input"], bound["p"], bound["training"], bound["inplace"]
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x.mul_(0.0) if inplace else x * 0.0
    noise = torch.empty_like(x).bernoulli_(1.0 - p, generator=CUDA_GENERATOR).div_(1.0 - p)
    return x.mul_(noise) if inplace else x * noise


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
        if func in _DROPOUTS:
            return _dropout(func, args, kwargs)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = CPU_DEVICE
            if func in _CUDA_RANDOM_FACTORIES and kwargs.get("generator") is None:
                kwargs["generator"] = CUDA_GENERATOR
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
    """Shim 3: ``torch.cuda.get_rng_state`` -> state of :data:`CUDA_GENERATOR`."""
    del device
    return CUDA_GENERATOR.get_state()


def _get_rng_state_all() -> list:
    return [CUDA_GENERATOR.get_state()]


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """Shim 3: ``torch.cuda.set_rng_state`` -> set :data:`CUDA_GENERATOR`."""
    del device
    CUDA_GENERATOR.set_state(new_state)


def _manual_seed(seed: int) -> None:
    """Shim 3: ``torch.cuda.manual_seed`` / ``manual_seed_all`` -> seed :data:`CUDA_GENERATOR`
    (``torch.manual_seed`` calls ``torch.cuda.manual_seed_all``, so it seeds both, as on a GPU)."""
    CUDA_GENERATOR.manual_seed(int(seed))


def _megatron_get_cuda_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """Shim 3: replacement for ``tensor_parallel.random._get_cuda_rng_state``."""
    del device, clone  # get_state() already returns a fresh copy
    if graph_safe:
        raise RuntimeError("CUDA-graph-safe RNG states are not supported on CPU")
    return CUDA_GENERATOR.get_state()


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
    CUDA_GENERATOR.set_state(new_state)


def _moe_without_te() -> None:
    """Shim 5: the names megatron-core's MoE code uses unconditionally but binds only with Transformer
    Engine, bound to ``None`` (its "no TE" value) where they are missing."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


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


def bypassed() -> ContextManager[Any]:
    """A context in which torch calls skip this layer's mode - for megatron-ft's own bookkeeping on tensors
    (reading shapes, strides and storages, encoding a state dict), which never asks for a CUDA device.
    Every torch call otherwise passes through the mode's Python handler (a state dict's encoding: 0.83 ms
    instead of 0.60 ms). A no-op where the layer is not installed (never with CUDA)."""
    return torch._C.DisableTorchFunction() if _installed else contextlib.nullcontext()


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
            namespace.manual_seed_all = _manual_seed  # type: ignore[attr-defined]
            namespace.get_rng_state_all = _get_rng_state_all  # type: ignore[attr-defined]
        mcore_random._get_cuda_rng_state = _megatron_get_cuda_rng_state
        mcore_random._set_cuda_rng_state = _megatron_set_cuda_rng_state
        logging.getLogger(mcore_random.__name__).addFilter(_DropForkWarning())

        # Shim 5 (MoE): megatron-core 0.16.1's router GEMM tests ``te_general_gemm is not None``, a name
        # its moe_utils binds only when Transformer Engine imports (NameError without TE, which never
        # runs on CPU): None selects its own torch.mm path.
        _moe_without_te()

        # Shim 4: push the mode and leave it on the stack for the life of the process.
        _mode = _CudaToCpuMode()
        _mode.__enter__()

        _installed = True
        return True


def cpu_config_overrides(params_dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """``TransformerConfig`` keyword arguments a CPU run needs. CPU ONLY.

    fp32 (or, asked for, bf16) parameters and pipeline communication - never fp16, whose loss
    scaler needs CUDA - and every fused kernel off (the fused kernels need CUDA, apex or
    Transformer Engine). Apply these last, after the user's settings:
    ``TransformerConfig(**user_kwargs, **cpu_config_overrides())``.

    >>> cpu_config_overrides(torch.bfloat16)["bf16"], cpu_config_overrides()["params_dtype"]
    (True, torch.float32)
    """
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype {params_dtype} on CPU: allowed are torch.float32 and torch.bfloat16")
    return {
        "fp16": False,
        "bf16": params_dtype == torch.bfloat16,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
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


# --------------------------------------------------------------------------------------
# What megatron.training (upstream Megatron-LM) needs beyond megatron-core
# --------------------------------------------------------------------------------------
class _HostStream:
    """Stands in for ``torch.cuda.Stream`` / ``torch.cuda.current_stream()``: on CPU every operation
    is synchronous, so waiting and synchronising do nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> "_HostEvent":
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_HostStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _HostEvent:
    """Stands in for ``torch.cuda.Event``: records the host time (``elapsed_time`` in ms)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        self._t: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        import time

        del stream
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


_DEFAULT_STREAM = _HostStream()
_upstream_installed = False


def install_upstream_cpu() -> bool:
    """:func:`install_cpu_compat` plus what upstream ``megatron.training`` calls. CPU ONLY.

    ``torch.cuda.device_count()`` is 1 (``initialize_megatron`` creates the model-parallel groups and
    the tensor-parallel RNG tracker only when it sees a device), ``set_device`` / ``set_stream`` /
    ``empty_cache`` do nothing, and ``Stream``, ``Event``, ``current_stream``, ``default_stream`` and
    ``stream`` are host stand-ins. Returns ``False`` and changes nothing when CUDA is available.
    """
    global _upstream_installed
    if not install_cpu_compat():
        return False
    with _lock:
        if _upstream_installed:
            return True
        cuda = torch.cuda
        cuda.device_count = lambda: 1  # type: ignore[assignment]
        cuda.set_device = lambda device: None  # type: ignore[assignment]
        cuda.set_stream = lambda stream: None  # type: ignore[assignment]
        cuda.empty_cache = lambda: None  # type: ignore[assignment]
        cuda.Stream = _HostStream  # type: ignore[assignment,misc]
        cuda.Event = _HostEvent  # type: ignore[assignment,misc]
        cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
        cuda.default_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
        cuda.stream = lambda stream=None: stream if stream is not None else _DEFAULT_STREAM  # type: ignore[assignment]
        _upstream_installed = True
        return True
