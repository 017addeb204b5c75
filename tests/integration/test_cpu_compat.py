"""Tests of the CPU-only megatron-core shims (megatron_ft.megatron.cpu_compat).

The shims change process-global state (torch.cuda functions, a torch-function mode), so
they are exercised in fresh interpreters, never in the pytest process. To pay the
megatron-core import (several seconds) only once, the checks that need the shims
installed are collected below and run together in one subprocess (``installed_results``);
each test then asserts on its own check's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Dict

import pytest
import torch

from megatron_ft.megatron import cpu_compat

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU shims are only installed without CUDA"
)

# name -> code run after install_cpu_compat(); it sets ``result`` (compared by the test).
_CHECKS: Dict[str, str] = {}


def _check(name: str, body: str) -> None:
    _CHECKS[name] = textwrap.dedent(body)


_RUNNER = """
import json, sys, traceback, warnings
warnings.simplefilter("ignore")
import torch
from megatron_ft.megatron.cpu_compat import install_cpu_compat
assert install_cpu_compat() is True
checks = json.loads(sys.stdin.read())
results = {}
for name, body in checks.items():
    scope = {"torch": torch}
    try:
        exec(body, scope)
        results[name] = scope.get("result")
    except BaseException:
        results[name] = "ERROR: " + traceback.format_exc()
print("@@RESULTS@@" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def installed_results() -> Dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(_CHECKS),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"runner failed:\n{proc.stdout}\n{proc.stderr}"
    marker = proc.stdout.rindex("@@RESULTS@@")
    return json.loads(proc.stdout[marker + len("@@RESULTS@@"):])


def test_not_installed_on_import_and_noop_with_cuda() -> None:
    code = textwrap.dedent(
        """
        import warnings; warnings.simplefilter('ignore')
        import torch
        from megatron_ft.megatron import cpu_compat
        before = torch.cuda.current_device
        assert not cpu_compat.is_installed()
        torch.cuda.is_available = lambda: True   # pretend a GPU
        assert cpu_compat.install_cpu_compat() is False
        assert not cpu_compat.is_installed()
        assert torch.cuda.current_device is before
        assert torch._C._len_torch_function_stack() == 0
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


_check(
    "current_device_and_synchronize",
    """
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.synchronize() is None
    assert torch.cuda.synchronize(0) is None
    result = torch.empty(3, device=torch.cuda.current_device()).device.type
    """,
)


def test_current_device_and_synchronize(installed_results: Dict[str, object]) -> None:
    assert installed_results["current_device_and_synchronize"] == "cpu"


_check(
    "mode_maps_cuda_devices_to_cpu",
    """
    x = torch.zeros(2)
    result = [
        torch.zeros(2, device="cuda").device.type,
        torch.ones(2, device="cuda:0").device.type,
        torch.empty(2, device=torch.device("cuda", 0)).device.type,
        torch.tensor([1.0], device="cuda").device.type,
        torch.arange(3, device="cuda").device.type,
        x.to("cuda").device.type,
        x.to(torch.device("cuda")).device.type,
        x.to(device="cuda", dtype=torch.float64).device.type,
        x.new_zeros(3, device="cuda").device.type,
        x.cuda() is x,
        x.cuda(0, non_blocking=True) is x,
        torch.zeros(2, device="cpu").device.type,
    ]
    """,
)


def test_mode_maps_cuda_devices_to_cpu(installed_results: Dict[str, object]) -> None:
    assert installed_results["mode_maps_cuda_devices_to_cpu"] == ["cpu"] * 9 + [True, True, "cpu"]


_check(
    "mode_type_names",
    """
    result = [
        torch.zeros(1).type(),
        torch.zeros(1, dtype=torch.bfloat16).type(),
        torch.zeros(1, dtype=torch.float16).type(),
        str(torch.zeros(1).type("torch.cuda.HalfTensor").dtype),
        str(torch.zeros(1).type(dtype="torch.cuda.DoubleTensor").dtype),
        torch.zeros(1).type("torch.cuda.HalfTensor").device.type,
    ]
    """,
)


_check(
    "bypassed_bookkeeping",
    """
    import argparse
    from megatron_ft.capture import tree
    from megatron_ft.megatron import cpu_compat
    mode = cpu_compat._mode
    calls = []
    handler = type(mode).__torch_function__
    type(mode).__torch_function__ = lambda self, *a, **k: calls.append(1) or handler(self, *a, **k)
    w = torch.ones(3, 2)
    state = {"args": argparse.Namespace(lr=1e-3, dims=[1, 2]), "w": w, "t": w.t(), "step": torch.tensor(4)}
    plain = tree.encode(state)[0]
    through_mode = len(calls)
    calls.clear()
    with cpu_compat.bypassed():
        bypassed = tree.encode(state)[0]
        storage = w.untyped_storage().data_ptr() == w.data_ptr()
    skipped = len(calls)
    after = torch.zeros(1, device="cuda").device.type  # the mode maps CUDA again after the bypass
    type(mode).__torch_function__ = handler
    result = [plain == bypassed, through_mode > 0, skipped, storage, after]
    """,
)


def test_bookkeeping_bypasses_the_mode_and_encodes_the_same(installed_results: Dict[str, object]) -> None:
    """megatron-ft's capture reads tensors' metadata under ``bypassed()``: the mode's Python handler
    is not called there, the record is the same as through the mode, and the mode is back after."""
    assert installed_results["bypassed_bookkeeping"] == [True, True, 0, True, "cpu"]


def test_mode_type_names(installed_results: Dict[str, object]) -> None:
    assert installed_results["mode_type_names"] == [
        "torch.cuda.FloatTensor",
        "torch.cuda.BFloat16Tensor",
        "torch.cuda.HalfTensor",
        "torch.float16",
        "torch.float64",
        "cpu",
    ]


_check(
    "mode_active_inside_backward",
    """
    seen = []
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2
        @staticmethod
        def backward(ctx, g):
            seen.append(torch.zeros(1, device="cuda").device.type)
            return g * 2
    x = torch.ones(3, requires_grad=True)
    F.apply(x).sum().backward()
    torch.autograd.backward(F.apply(x), grad_tensors=torch.ones(3))
    y = F.apply(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    result = [seen, x.grad.tolist()]
    """,
)


def test_mode_active_inside_backward(installed_results: Dict[str, object]) -> None:
    """Backward hooks and autograd.Function.backward see the mode too."""
    assert installed_results["mode_active_inside_backward"] == [["cpu"] * 4, [8.0, 8.0, 8.0]]


_check(
    "cuda_rng_functions_drive_their_own_generator",
    """
    ones = torch.ones(256)
    drop = lambda: torch.nn.functional.dropout(ones, 0.5)
    torch.cuda.manual_seed(7)
    a = drop()
    torch.manual_seed(7)  # seeds the CPU generator and the CUDA stand-in, as with CUDA
    b = drop()
    s = torch.cuda.get_rng_state()
    torch.rand(100)  # the CPU default generator (e.g. a DataLoader seed) ...
    cpu_draw_leaves_cuda = torch.equal(torch.cuda.get_rng_state(), s)  # ... leaves the CUDA one alone
    c = drop()
    torch.cuda.set_rng_state(s)
    replay = torch.equal(drop(), c)
    torch.cuda.random.set_rng_state(s)
    replay2 = torch.equal(torch.nn.Dropout(0.5)(ones), c)  # the module form too
    cpu = torch.get_rng_state()
    torch.rand(3, device="cuda")  # a "CUDA" random tensor draws from the CUDA stand-in
    cuda_factory = torch.equal(torch.get_rng_state(), cpu) and not torch.equal(torch.cuda.get_rng_state(), s)
    kept = drop()
    scaled = bool(((kept == 0) | (kept == 2.0)).all()) and 0 < int((kept == 0).sum()) < 256
    result = [torch.equal(a, b), cpu_draw_leaves_cuda, replay, replay2, cuda_factory, scaled,
              torch.equal(torch.nn.functional.dropout(ones, 0.5, training=False), ones)]
    """,
)


def test_cuda_rng_functions_drive_their_own_generator(installed_results: Dict[str, object]) -> None:
    """The CUDA RNG stand-in is a generator of its own: dropout draws from it and nothing that draws
    from the CPU default generator after a restore (a DataLoader's seed) shifts dropout."""
    assert installed_results["cuda_rng_functions_drive_their_own_generator"] == [True] * 7


_check(
    "megatron_rng_tracker",
    """
    import logging
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom
    records = []
    class H(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())
    logging.getLogger(mrandom.__name__).addHandler(H())

    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    assert set(states) >= {"model-parallel-rng", "data-parallel-rng"}, states.keys()
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in states.values())

    # fork() switches the generator that CPU dropout uses, then restores the default one.
    torch.manual_seed(1)
    plain = torch.nn.functional.dropout(torch.ones(64), 0.5)
    outside_ref = torch.rand(3)
    torch.manual_seed(1)
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    with tracker.fork():
        in_fork = torch.nn.functional.dropout(torch.ones(64), 0.5)
    default_untouched = torch.equal(
        torch.nn.functional.dropout(torch.ones(64), 0.5), plain
    ) and torch.equal(torch.rand(3), outside_ref)
    advanced = not torch.equal(tracker.get_states()["model-parallel-rng"],
                               saved["model-parallel-rng"])
    fork_differs = not torch.equal(in_fork, plain)

    # set_states() rewinds the tracker: the same dropout mask again.
    tracker.set_states({k: v.clone() for k, v in saved.items()})
    with tracker.fork():
        again = torch.nn.functional.dropout(torch.ones(64), 0.5)
    warned = any("CPU RNG state changed" in m for m in records)
    result = [default_untouched, advanced, fork_differs, torch.equal(in_fork, again), warned]
    """,
)


def test_megatron_rng_tracker_fork_get_and_set_states(
    installed_results: Dict[str, object],
) -> None:
    # [default generator untouched by fork, tracker state advanced, fork used another
    #  stream, set_states replays it, no "CPU RNG state changed" warning]
    assert installed_results["megatron_rng_tracker"] == [True, True, True, True, False]


_check(
    "install_is_idempotent",
    """
    import logging
    from megatron_ft.megatron import cpu_compat
    import megatron.core.tensor_parallel.random as mrandom
    depth = torch._C._len_torch_function_stack()
    fns = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,
           mrandom._set_cuda_rng_state)
    n_filters = len(logging.getLogger(mrandom.__name__).filters)
    again = [cpu_compat.install_cpu_compat(), cpu_compat.install_cpu_compat()]
    result = [
        again,
        depth,
        torch._C._len_torch_function_stack(),
        fns == (torch.cuda.current_device, torch.cuda.synchronize,
                torch.cuda.get_rng_state, mrandom._set_cuda_rng_state),
        n_filters,
        len(logging.getLogger(mrandom.__name__).filters),
        cpu_compat.is_installed(),
    ]
    """,
)


def test_install_is_idempotent(installed_results: Dict[str, object]) -> None:
    # [return values, mode stack depth before/after, patched functions unchanged,
    #  log filters before/after, is_installed]
    assert installed_results["install_is_idempotent"] == [[True, True], 1, 1, True, 1, 1, True]


def test_cpu_config_overrides_build_a_transformer_config() -> None:
    overrides = cpu_compat.cpu_config_overrides()
    assert overrides["params_dtype"] is torch.float32
    assert overrides["pipeline_dtype"] is torch.float32
    assert not overrides["fp16"] and not overrides["bf16"]
    for key in (
        "bias_activation_fusion",
        "masked_softmax_fusion",
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "persist_layer_norm",
    ):
        assert overrides[key] is False, key
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, **overrides
    )
    assert config.pipeline_dtype is torch.float32
    assert config.bias_dropout_fusion is False
