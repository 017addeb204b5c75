"""Upstream Megatron-LM's local-checkpoint load at another data-parallel size, from the old ranks' snapshot
containers (megatron_ft/megatron/resharded_state_dict.py): real megatron-core sharded tensors and objects,
real containers on disk, no process group."""
import os

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron_ft.capture import tree as treecodec
from megatron_ft.capture.state import StateTensor
from megatron_ft.megatron.local_manager import tensor_name
from megatron_ft.megatron.resharded_state_dict import ReshardedStateDict, fill, overlap
from megatron_ft.trainer.recovery import Container
from megatron_ft.trainer.snapshot_file import write_snapshot_file

BUCKET = torch.arange(10, dtype=torch.float32) * 1.5  # a bucket's unpadded global optimizer state
WEIGHT = torch.arange(24, dtype=torch.float32).reshape(6, 4)  # a parameter, replicated over data parallel


def bucket_shard(rank: int, dp: int, data: bool = True) -> ShardedTensor:
    """Rank ``rank``'s part of the bucket at data-parallel size ``dp`` (padded to a multiple of dp, the
    padding never saved), as the distributed optimizer's dp_reshardable state cuts it."""
    local = -(-10 // dp)
    lo, hi = rank * local, min(10, (rank + 1) * local)
    return ShardedTensor("optimizer.bucket.exp_avg", BUCKET[lo:hi].clone() if data else torch.zeros(hi - lo),
                         torch.float32, (hi - lo,), (10,), (lo,), None, replica_id=(0, 0, 0))


def weight_shard(rank: int, data: bool) -> ShardedTensor:
    """The parameter as every data-parallel rank has it (replica_id its rank); ``data``: this rank saved it."""
    return ShardedTensor("model.weight", WEIGHT.clone() if data else None, torch.float32, (6, 4), (6, 4), (0, 0),
                         None, replica_id=(0, 0, rank))


def rng(rank: int) -> ShardedObject:
    return ShardedObject("rng_state", {"stream": torch.full((2,), float(rank))}, (1, 1), (0, 0), replica_id=rank)


def old_tree(rank: int, dp: int) -> dict:
    return {"common": {"iteration": 7, "args": {"data_parallel_size": dp}},
            "sharded": {"model": {"weight": weight_shard(rank, data=rank == 1)},
                        "optimizer": {"state": bucket_shard(rank, dp)}, "rng_state": rng(rank)}}


def write_container(path: str, tree: dict) -> None:
    record, tensors = treecodec.encode(tree, "state_dict")
    write_snapshot_file(path, 7, [StateTensor(tensor_name(i, p), t) for i, (p, t) in enumerate(zip(record["names"],
                                                                                                  tensors))],
                        {"state_dict": record, "iteration": 7}, {"run_id": "old"})


def refuse(e: Exception):
    raise AssertionError(f"refused: {e}")


def wanted_at(rank: int, dp: int) -> list:
    return [weight_shard(rank, data=True), bucket_shard(rank, dp, data=False), rng(rank)]


@pytest.mark.parametrize("old_dp,new_dp", [(2, 3), (3, 2), (3, 1)])
def test_fill_cuts_the_old_shards_by_their_global_coordinates(old_dp, new_dp):
    trees = [old_tree(r, old_dp) for r in range(old_dp)]
    for rank in range(new_dp):
        filled, counts = fill(wanted_at(rank, new_dp), iter(trees))
        by_key = {x.key: x for x in filled}
        assert torch.equal(by_key["model.weight"].data, WEIGHT)
        want = bucket_shard(rank, new_dp)
        assert torch.equal(by_key["optimizer.bucket.exp_avg"].data, want.data)
        # every rank takes data-parallel replica 0's RNG streams (what a torch_dist checkpoint stores)
        assert torch.equal(by_key["rng_state"].data["stream"], torch.zeros(2))
        assert counts["tensors"] == 2 and counts["objects"] == 1


def test_fill_refuses_what_no_old_rank_holds():
    trees = [old_tree(0, 2)]  # old rank 1 (the weight's saver and the bucket's second half) is missing
    with pytest.raises(ValueError, match=r"model.weight at \(0, 0\): the old ranks hold 0 of its 24 elements"):
        fill(wanted_at(0, 1), iter(trees))
    with pytest.raises(ValueError, match="no old rank holds it"):
        fill([ShardedObject("other", 1, (1,), (0,), replica_id=0)], iter(trees))


def test_fill_refuses_other_buckets():
    old = {"common": {}, "sharded": {"n": ShardedObject("optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded",
                                                       [10], (1,), (0,), replica_id=(0, 0, 0))}}
    wanted = ShardedObject("optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded", [12], (1,), (0,),
                           replica_id=(0, 0, 1))
    with pytest.raises(ValueError, match=r"hold \[10\] elements at the old data-parallel size and \[12\]"):
        fill([wanted], iter([old]))


def test_overlap_of_a_prepended_axis():
    # a layer's weight (prepended axis: the layer) meets the global tensor's second layer only
    assert overlap(((1, 0), (1, 4)), ((0, 0), (3, 4))) == ((slice(0, 1), slice(0, 4)), (slice(1, 2), slice(0, 4)))


def test_to_state_dict_from_containers(tmp_path):
    paths = {}
    for r in range(3):
        paths[r] = os.path.join(tmp_path, f"old{r}")
        write_container(paths[r], old_tree(r, 3))
    told = []
    sources = {r: Container(p) for r, p in paths.items()}
    sd = ReshardedStateDict.of(sources, tensor_name, told.append, refuse)
    assert sd.to_state_dict(None)["iteration"] == 7  # Megatron's first ask: the common part only
    request = {"model": {"weight": weight_shard(1, data=True)}, "optimizer": {"state": bucket_shard(1, 2, data=False)},
               "rng_state": rng(1)}
    out = sd.to_state_dict(request, algo="fully_parallel", parallelization_group=None)
    assert out["iteration"] == 7 and out["args"]["data_parallel_size"] == 3
    assert torch.equal(out["model"]["weight"], WEIGHT)
    assert torch.equal(out["optimizer"]["state"], BUCKET[5:10])
    assert torch.equal(out["rng_state"]["stream"], torch.zeros(2))
    assert told and told[0]["tensors"] == 2 and told[0]["elements"] == 24 + 5


def test_to_state_dict_refuses_what_the_old_ranks_cannot_answer(tmp_path):
    """The old ranks hold another data-parallel size's buckets: refused (the job ends), nothing returned."""
    path = os.path.join(tmp_path, "old0")
    tree = old_tree(0, 1)
    tree["sharded"]["n"] = ShardedObject("o.per_bucket_numel_unpadded", [10], (1,), (0,), replica_id=0)
    write_container(path, tree)
    refused = []

    def note(e):
        refused.append(str(e))
        raise SystemExit(2)

    sd = ReshardedStateDict.of({0: Container(path)}, tensor_name, lambda counts: None, note)
    with pytest.raises(SystemExit):
        sd.to_state_dict({"n": ShardedObject("o.per_bucket_numel_unpadded", [12], (1,), (0,), replica_id=0)})
    assert refused and "[10] elements at the old data-parallel size and [12]" in refused[0]


def test_a_torn_container_is_never_read(tmp_path):
    path = os.path.join(tmp_path, "old0")
    write_container(path, old_tree(0, 1))
    c = Container(path)
    with open(path, "r+b") as f:  # one byte of the flat area flipped
        f.seek(c.layout.entries[-1].offset + c.header.geometry.data_off)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(Exception, match="checksum|corrupt|mismatch"):
        ReshardedStateDict.of({0: c}, tensor_name, lambda counts: None, refuse)
    c.close()


def cuts(n: int, pieces: int, gen: torch.Generator) -> list[tuple[int, int]]:
    edges = sorted(torch.randperm(n - 1, generator=gen)[:pieces - 1].add(1).tolist())
    return list(zip([0, *edges], [*edges, n]))


@pytest.mark.parametrize("seed", range(5))
def test_fill_many_pieces_of_one_key_cut_differently(seed):
    """A bucket as the distributed optimizer cuts it: one key, many shards (a parameter's slice or padding
    each), cut one way by the old ranks and another by the new one; and a layered weight (a prepended axis,
    one shard per layer)."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(97, generator=gen)
    layers = torch.randn(5, 3, 2, generator=gen)

    def piece(lo, hi, data=True):
        return ShardedTensor("bucket", flat[lo:hi].clone() if data else None, torch.float32, (hi - lo,), (97,), (lo,),
                             None)

    def layer(i, data=True):
        return ShardedTensor("layers.w", layers[i].clone() if data else None, torch.float32, (3, 2), (5, 3, 2),
                             (i, 0, 0), None, prepend_axis_num=1)

    old_cuts = cuts(97, 11, gen)
    old = [{"sharded": [piece(a, b) for a, b in old_cuts[r::3]] + [layer(i) for i in range(5) if i % 3 == r]}
           for r in range(3)]
    wanted = [piece(a, b, data=False) for a, b in cuts(97, 7, gen)] + [layer(i, data=False) for i in (1, 4)]
    filled, counts = fill(wanted, iter(old))
    for x in filled:
        if x.key == "bucket":
            assert torch.equal(x.data, flat[x.global_offset[0]: x.global_offset[0] + x.local_shape[0]])
        else:
            assert torch.equal(x.data, layers[x.global_offset[0]])
    assert counts["elements"] == 97 + 2 * 6
