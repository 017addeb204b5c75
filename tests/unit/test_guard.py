"""The guard's value check: every non-finite value found, no finite state refused."""
import pytest
import torch

from megatron_ft.trainer import guard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_bad_value_anywhere_in_a_large_tensor_is_found(dtype, monkeypatch):
    monkeypatch.setattr(guard, "BLOCK_ELEMENTS", 1000)  # many blocks: the bad one in the middle of one
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(10_000).to(dtype)
        t[4321] = bad
        assert guard.non_finite({"ok": torch.ones(3, dtype=dtype), "t": t}) == ["t"], bad


def test_finite_values_too_large_to_sum_are_not_refused():
    big = torch.full((8,), 3e38)  # their sum overflows to inf: the screen must not decide alone
    assert not torch.isfinite(big.sum())
    assert guard.non_finite({"big": big, "mixed": torch.tensor([3e38, -3e38, 3e38])}) == []


def test_integer_and_empty_tensors_are_not_checked():
    assert guard.non_finite({"rng": torch.full((5,), 255, dtype=torch.uint8), "step": torch.tensor(7),
                             "empty": torch.empty(0)}) == []
