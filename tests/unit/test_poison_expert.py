"""The poisoned expert shard (``poison-expert-after-commit``, megatron_ft.testing.faults.poison_expert): NaN
written into a MoE rank's expert tensor of a real snapshot container, checksums recomputed, so the
container still verifies and only the guard's finiteness check can tell - and it names that tensor."""
import pytest
import torch

from megatron_ft.capture.state import StateTensor
from megatron_ft.testing import faults
from megatron_ft.trainer import guard, recovery

from test_restore_read import IDENTITY, write_container

# a MoE rank's snapshot as megatron_ft.megatron.state names it: dense and expert bucket slices, the
# chained optimizer's dense (o0) and expert (o1) parts, the router's buffer, an RNG state
MOE = {
    "model.c0.b0.k0.param_data": torch.randn(3000),
    "model.c0.e0.k0.param_data": torch.randn(2000),
    "model.c0.buffer.decoder.layers.0.mlp.router.expert_bias": torch.zeros(4),
    "optim.o0.g0.p0.exp_avg": torch.randn(500),
    "optim.o1.g0.p0.exp_avg": torch.randn(500),
    "optim.o1.g0.p0.step": torch.tensor(3.0),
    "rng.cpu": torch.randint(0, 255, (64,), dtype=torch.uint8),
}


def restored(path, tensors):
    dst = {n: torch.empty_like(t) for n, t in tensors.items()}
    cont = recovery.Container(path)
    try:
        cont.check_identity(IDENTITY, 1)
        cont.load_verified({n: StateTensor(n, t) for n, t in dst.items()})  # raises on a checksum mismatch
    finally:
        cont.close()
    return dst


def test_the_expert_shard_is_poisoned_the_snapshot_verifies_and_only_the_guard_refuses_it(tmp_path):
    path = str(tmp_path / "slot")
    write_container(path, MOE, chunk=4096)
    assert faults.poison_expert(path) == ["model.c0.e0.k0.param_data"]
    out = restored(path, MOE)
    assert torch.isnan(out["model.c0.e0.k0.param_data"]).all()
    for name, t in MOE.items():  # nothing else changed: dense buckets, both optimizer parts, the router's bias
        if name != "model.c0.e0.k0.param_data":
            assert torch.equal(out[name], t), name
    assert guard.non_finite(out) == ["model.c0.e0.k0.param_data"]


def test_without_an_expert_bucket_the_expert_optimizer_state_is_poisoned_and_a_dense_snapshot_refused(tmp_path):
    # a rank whose expert parameters sit in the optimizer (no expert bucket in its snapshot)
    names = [n for n in MOE if not n.startswith("model.c0.e0")]
    assert faults.expert_tensors(names) == []  # optim.o1 counts only beside an expert bucket
    assert faults.expert_tensors(list(MOE)) == ["model.c0.e0.k0.param_data", "optim.o1.g0.p0.exp_avg",
                                                "optim.o1.g0.p0.step"]
    # upstream Megatron-LM's state dict (the tree codec's names): its experts' tensors, not the router's bias
    upstream = ["sd.00003.sharded.model.decoder.layers.0.mlp.router.expert_bias._ShardedTensor_.data",
                "sd.00004.sharded.model.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight._Sha"]
    assert faults.expert_tensors(upstream) == upstream[1:]
    path = str(tmp_path / "dense")
    write_container(path, {"model.c0.b0.k0.param_data": torch.randn(100)})
    with pytest.raises(ValueError, match=r"dense: no expert tensor to poison \(not a mixture-of-experts"):
        faults.poison_expert(path)


def test_the_fault_action_parses_and_fires_after_commit():
    f = faults.parse("poison-expert-after-commit:4:3")
    assert (f.point, f.step, f.ranks) == ("after-commit", 4, frozenset({3}))
    assert "poison-expert-after-commit" in faults.REWRITES
