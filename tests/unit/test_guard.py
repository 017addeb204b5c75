"""The guard's value check: every non-finite value found, no finite state refused."""
import pytest
import torch

from megatron_ft.trainer import guard


@pytest.fixture(params=["blocks", "fused"])
def reads(request, monkeypatch):
    """How the screen reads tensors: in blocks (the CPU's way) or by the fused multi-tensor reduction (a
    CUDA device's; its CPU implementation gives the same verdicts here)."""
    if request.param == "fused":
        monkeypatch.setattr(guard, "_fusable", lambda flat: flat.is_floating_point() and guard._FUSED["usable"])
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_bad_value_anywhere_in_a_large_tensor_is_found(dtype, reads, monkeypatch):
    monkeypatch.setattr(guard, "BLOCK_ELEMENTS", 1000)  # many blocks: the bad one in the middle of one
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(10_000).to(dtype)
        t[4321] = bad
        assert guard.non_finite({"ok": torch.ones(3, dtype=dtype), "t": t}) == ["t"], bad


def test_finite_values_too_large_to_sum_are_not_refused(reads):
    big = torch.full((8,), 3e38)  # their sum overflows to inf: the screen must not decide alone
    assert not torch.isfinite(big.sum())
    assert guard.non_finite({"big": big, "mixed": torch.tensor([3e38, -3e38, 3e38]),
                             "half": torch.full((100,), 6e4, dtype=torch.float16)}) == []


def test_a_fused_reduction_this_torch_lacks_falls_back_to_blocks_once(monkeypatch, caplog):
    monkeypatch.setattr(guard, "_fusable", lambda flat: flat.is_floating_point() and guard._FUSED["usable"])
    monkeypatch.setitem(guard._FUSED, "usable", True)
    calls = []

    def missing(flats):
        calls.append(len(flats))
        raise RuntimeError("_foreach_norm: not implemented")

    monkeypatch.setattr(guard, "_norms_finite", missing)
    state = {"w": torch.tensor([1.0, float("nan")]), "b": torch.ones(3)}
    assert guard.non_finite(state) == ["w"] and guard.non_finite(state) == ["w"]
    assert calls == [2] and not guard._FUSED["usable"]
    assert sum("fused reduction failed" in r.getMessage() for r in caplog.records) == 1


def test_integer_and_empty_tensors_are_not_checked():
    assert guard.non_finite({"rng": torch.full((5,), 255, dtype=torch.uint8), "step": torch.tensor(7),
                             "empty": torch.empty(0)}) == []
