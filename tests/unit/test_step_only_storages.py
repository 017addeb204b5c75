"""The storages a snapshot may copy in the background: computed again when the optimizer's state
changes shape, never stale in the unsafe direction."""
import torch

from megatron_ft.megatron.state import StepOnlyStorages


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_adam_moments_join_the_set_after_the_first_step_and_a_load_replaces_them():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    stable = StepOnlyStorages([model], opt)
    buffer = torch.zeros(3)  # something the state dict holds that no step writes

    before = set(stable())
    assert {_ptr(p) for p in model.parameters()} <= before and _ptr(buffer) not in before

    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert len(moments) == 4 and all(_ptr(m) in stable() for m in moments)
    assert not any(_ptr(s["step"]) in stable() for s in opt.state.values())  # 0-dim: copied when taken

    saved = opt.state_dict()
    opt.load_state_dict({"state": {k: {n: v.clone() for n, v in s.items()} for k, s in saved["state"].items()},
                         "param_groups": saved["param_groups"]})
    reloaded = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert all(_ptr(m) in stable() for m in reloaded)
    assert not any(_ptr(m) in stable() for m in moments)  # the replaced moments are no longer step-only


def test_unchanged_state_is_not_walked_again():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stable = StepOnlyStorages([model], opt)
    first = stable()
    assert stable() is first
    model.weight.data = torch.zeros(3, 4)  # a parameter given new storage, optimizer state unchanged
    # the cached set still holds (and keeps alive) the old storage; the new one is copied when taken
    assert _ptr(model.weight) not in stable()
