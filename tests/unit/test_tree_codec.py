"""The one tree codec (megatron_ft.capture.tree) with Megatron's and DeepSpeed's real state
structures: exact round trips through strict JSON, shared tensors stored once, the allow-list of
classes a record may name, and records of the earlier formats still read."""
from __future__ import annotations

import argparse
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch

from megatron_ft.capture import rng, tree


def through_json(record):
    return json.loads(json.dumps(record, allow_nan=False))  # strict JSON survives


def test_megatron_state_dict_round_trip_is_exact_and_pickle_free():
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.transformer.enums import AttnBackend

    w = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    st = ShardedTensor.from_rank_offsets("decoder.w", w, (0, 0, 2), replica_id=(0, 1, 0))
    obj = ShardedObject("rng_state", [{"np": np.random.get_state(), "t": torch.get_rng_state()}], (1, 1), (0, 0))
    sd = {"args": argparse.Namespace(lr=3e-4, dtype=torch.bfloat16, be=AttnBackend.flash, fn=print,
                                     nan=float("nan")),
          "sharded": {"w": st, "o": obj, 0: (1, None, b"\x00\xff"), "s": slice(0, 5)}, "np": np.float32(0.5)}
    rec, tensors = tree.encode(sd, "state_dict")
    back = tree.decode(through_json(rec), [t.clone() for t in tensors])
    ns = back["args"]
    assert (ns.lr, ns.dtype, ns.be, ns.fn) == (3e-4, torch.bfloat16, AttnBackend.flash, None)
    assert rec["omitted"] == ["state_dict.args.fn"] and ns.nan != ns.nan
    bst = back["sharded"]["w"]
    assert isinstance(bst, ShardedTensor) and torch.equal(bst.data.view(torch.int16), w.view(torch.int16))
    assert (bst.global_shape, bst.global_offset, bst.replica_id) == (st.global_shape, st.global_offset, st.replica_id)
    keys = back["sharded"]["o"].data[0]["np"][1]
    assert keys.dtype == np.uint32 and (keys == np.random.get_state()[1]).all()
    assert back["sharded"][0] == (1, None, b"\x00\xff") and back["sharded"]["s"] == slice(0, 5)
    assert type(back["np"]) is np.float32


def test_deepspeed_checkpoint_round_trip_stores_shared_tensors_once():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    shared = torch.arange(6, dtype=torch.float32)
    sd = {
        "module": OrderedDict([("w", torch.randn(3, 2)), ("b", torch.zeros(0))]),
        "optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": shared}},
                                 "param_groups": [{"params": [0], "betas": (0.9, 0.999), "lr": 1e-3}],
                                 "loss_scaler": LossScaler(1.0),
                                 "dyn": DynamicLossScaler(2.0 ** 8, 1000, 1.0, 2, True, raise_error_at_min_scale=False),
                                 "zero_stage": ZeroStageEnum.gradients,
                                 "slices": [{"w": fragment_address(numel=6, start=0)}],
                                 "again": shared},
        "param_shapes": [OrderedDict([("w", torch.Size([3, 2]))])],
        "odd": {"$t": "not a tensor", 1.5: float("inf"), (1, 2): float("nan"), "dt": torch.bfloat16},
        "p": torch.nn.Parameter(torch.ones(2)),
        "none": None, "flag": True, "ds_version": "0.19.8",
    }
    rec, tensors = tree.encode(sd)
    back = tree.decode(through_json(rec), [t.detach().clone() for t in tensors])
    assert len(tensors) == 5  # "again" is the same tensor object as exp_avg: stored once
    assert rec["names"][3] == "state.optimizer_state_dict.state.0.exp_avg"
    opt = back["optimizer_state_dict"]
    assert opt["again"] is opt["state"][0]["exp_avg"]
    assert type(back["module"]) is OrderedDict and list(back["module"]) == ["w", "b"]
    assert torch.equal(back["module"]["w"], sd["module"]["w"])
    assert opt["param_groups"][0]["betas"] == (0.9, 0.999)
    assert opt["zero_stage"] is ZeroStageEnum.gradients
    assert opt["slices"][0]["w"] == fragment_address(numel=6, start=0)
    assert vars(opt["dyn"]) == vars(sd["optimizer_state_dict"]["dyn"])
    assert isinstance(back["param_shapes"][0]["w"], torch.Size)
    odd = back["odd"]
    assert odd["$t"] == "not a tensor" and odd[1.5] == float("inf") and odd[(1, 2)] != odd[(1, 2)]
    assert odd["dt"] is torch.bfloat16
    assert 0 in opt["state"]  # int keys stay ints
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].requires_grad


def test_a_class_outside_the_allow_list_is_refused():
    import enum

    class Opaque:
        pass

    class Color(enum.Enum):  # an enum of no allowed package
        RED = 1

    with pytest.raises(tree.CodecError, match=r"state\.x\.y: a value of type .*Opaque cannot be stored"):
        tree.encode({"x": {"y": Opaque()}})
    with pytest.raises(tree.CodecError, match=r"state\.c: enum .*Color is not allowed"):
        tree.encode({"c": Color.RED})
    body = {"$obj": "os:system", "state": "echo owned"}
    for bad in (body, {"$obj": "posixpath:join", "state": {}}, {"$enum": "os:system", "name": "x"},
                {"$obj": "megatron.core.parallel_state:initialize_model_parallel", "state": 1},  # not an enum
                {"$sharded": "Popen", "fields": {}}):
        with pytest.raises(tree.CodecError, match="is not allowed"):
            tree.decode({"format": tree.FORMAT, "version": tree.VERSION, "names": [], "body": {"x": bad}}, [])


def test_records_are_versioned_and_checked():
    with pytest.raises(tree.CodecError, match=r"\('megatron-ft/tree', 9\) cannot be read"):
        tree.decode({"format": tree.FORMAT, "version": 9, "body": None, "names": []}, [])
    with pytest.raises(tree.CodecError, match="references 1 tensors, 0 were given"):
        tree.decode({"format": tree.FORMAT, "version": 1, "body": {"$t": 0}, "names": ["w"]}, [])
    with pytest.raises(tree.CodecError, match="unknown tag"):
        tree.decode({"format": tree.FORMAT, "version": 1, "body": {"$weird": 1}, "names": []}, [])


def test_records_of_the_earlier_state_dict_format_are_read():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.enums import AttnBackend

    w = torch.arange(4, dtype=torch.float32)
    old = {"format": "megatron-ft/state-dict", "version": 1, "names": ["state_dict.w"], "omitted": [],
           "body": {"$dict": [["be", {"$enum": "megatron.core.transformer.enums:AttnBackend", "name": "flash"}],
                              ["w", {"$sharded": "ShardedTensor", "fields": {
                                  "key": "w", "data": {"$t": 0, "device": "cpu"}, "dtype": {"$dtype": "float32"},
                                  "local_shape": {"$tuple": [4]}, "global_shape": {"$tuple": [4]},
                                  "global_offset": {"$tuple": [0]}, "axis_fragmentations": {"$tuple": [1]}}}]]}}
    back = tree.decode(old, [w])
    assert back["be"] is AttnBackend.flash
    assert isinstance(back["w"], ShardedTensor) and back["w"].data is w and back["w"].global_shape == (4,)


def test_owned_copies_counters_and_strided_views_only():
    big = torch.arange(10.0)
    assert tree.owned(big).data_ptr() == big.data_ptr()
    step = torch.tensor(3.0)
    assert tree.owned(step).data_ptr() != step.data_ptr()
    view = big.reshape(2, 5).t()
    assert tree.owned(view).is_contiguous()


def test_rng_capture_and_restore_put_every_generator_back():
    import random

    tensors, record = rng.capture(cuda=lambda: False)
    assert [n for n, _ in tensors] == ["rng.cpu"]
    record = through_json(record)
    expect = (torch.rand(3), random.random(), np.random.rand())
    rng.restore(dict(tensors), record)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expect[0], got[0]) and expect[1:] == got[1:]


def test_allow_listed_dataclasses_encode_as_their_field_dicts_would():
    """The dataclass fast path (no type tests per field; tuples of scalars, exact tensors and flattened
    ranges inline) writes exactly the record the general walk writes for the same fields as a dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    flat = torch.arange(8, dtype=torch.float32)
    param = torch.nn.Parameter(torch.ones(2, 2))
    sts = [ShardedTensor.from_rank_offsets(k, t, (0, 0, 1)) for k, t in
           (("w", torch.ones(4, 2)), ("p", param), ("f", flat), ("g", flat))]
    sts[0].replica_id = (0, 1, 0)
    sts[2].flattened_range, sts[3].flattened_range = slice(8, 16), slice(0, 8.0)  # as older releases' optimizers
    fast, fast_tensors = tree.encode(sts, "s")
    fields = [{f: getattr(st, f) for f in tree._FIELDS_OF_ALLOWED[ShardedTensor][1]} for st in sts]
    general, general_tensors = tree.encode(fields, "s")
    for f, g in zip(fast["body"], general["body"]):
        assert f == {"$obj": "ShardedTensor", "state": g}
    assert [n.replace("].", "].<ShardedTensor>.") for n in general["names"]] == fast["names"] == [
        "s[0].<ShardedTensor>.data", "s[1].<ShardedTensor>.data", "s[2].<ShardedTensor>.data"]
    assert all(a is b for a, b in zip(fast_tensors, general_tensors))
    rec, tensors = tree.encode(sts[:2], "s")  # this release refuses to build one with a flattened range
    back = tree.decode(through_json(rec), tensors)
    assert back[0].replica_id == (0, 1, 0) and isinstance(back[1].data, torch.nn.Parameter)


def test_upstream_restore_targets_are_allocated_where_each_tensor_was_saved(monkeypatch):
    """Megatron-LM's checkpoint tier rebuilds its state dict from new tensors: those saved from a GPU
    are allocated on the current device, so that the restore copies them there through its pinned,
    device-verified path (not into pageable host memory and then across). On CPU the record's device
    field is edited; which device the allocation lands on is a GPU machine's check."""
    from megatron_ft.capture.layout import plan_layout
    from megatron_ft.megatron import local_manager

    sd = {"w": torch.ones(3, 2), "b": torch.zeros(4), "step": torch.tensor(5)}
    record, tensors = tree.encode(sd, "state_dict")
    for node in record["body"]["w"], record["body"]["b"]:
        assert node["device"] == "cpu"
    record["body"]["w"]["device"] = "cuda"  # as a GPU job's record says
    adapter = local_manager._StateDictAdapter()
    specs = [local_manager.StateTensor(local_manager.tensor_name(i, p), t).spec()
             for i, (p, t) in enumerate(zip(record["names"], tensors))]
    layout = plan_layout(specs, 1 << 10)
    asked = {}

    def fresh(layout, on_device=()):
        asked["on_device"] = set(on_device)
        return {e.spec.name: torch.empty(e.spec.shape) for e in layout.entries}

    monkeypatch.setattr(local_manager, "fresh_targets", fresh)
    targets = adapter.targets(layout, {"state_dict": through_json(record)})
    assert asked["on_device"] == {local_manager.tensor_name(record["names"].index("state_dict.w"), "state_dict.w")}
    assert set(targets) == {s.name for s in specs}


def test_megatron_padding_is_restored_but_not_judged_by_its_values(tmp_path):
    """megatron-core's distributed optimizer (``dp_reshardable``) puts the gaps between parameters in
    a bucket into its state dict as ``torch.empty`` tensors marked ``padding``: uninitialised bytes
    that may hold NaN patterns, discarded by a load. A snapshot keeps their bytes, but a restore must
    not refuse a version for them (a rollback of a sound version); the real state is still judged."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    from megatron_ft.capture.layout import plan_layout
    from megatron_ft.megatron import local_manager

    exp_avg, gap = torch.ones(4), torch.full((2,), float("nan"))
    bucket = [{"exp_avg": ShardedTensor.from_rank_offsets("b.exp_avg", exp_avg, (0, 0, 1)),
               "padding": LocalNonpersistentObject(False)},
              {"exp_avg": ShardedTensor.from_rank_offsets("b.gap", gap, (0, 0, 1)),
               "padding": LocalNonpersistentObject(True)}]
    sharded = {"optimizer": {"param_state": {0: bucket}}, "model": {"w": torch.zeros(3)}}
    assert local_manager.padding_tensor_ids(sharded) == {id(gap)}
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:  # megatron-core's preprocessing asks the default group (one rank here)
        tasd, _ = local_manager.InMemoryTensorAwareStateDict.from_state_dict(sharded, algo="atomic")
    finally:
        dist.destroy_process_group()
    assert tasd.padding_ids == {id(gap)}
    adapter = local_manager._StateDictAdapter()
    adapter.state_dict, adapter.iteration = tasd, 7
    tensors, extra = adapter.capture()
    [pad_name] = [t.name for t in tensors if torch.equal(t.tensor.isnan(), torch.ones(2, dtype=torch.bool))]
    layout = plan_layout([t.spec() for t in tensors], 1 << 10)
    targets = adapter.targets(layout, through_json(extra))
    assert [n for n, t in targets.items() if not t.values_checked] == [pad_name]
    assert all(t.values_checked for n, t in targets.items() if n != pad_name)


def test_a_frozen_state_encodes_as_the_state_did_when_frozen_whatever_changes_after():
    """What the snapshot worker encodes after ``save()`` returned (Megatron-LM's adapter): changes
    training makes to the original right after - the run's arguments, a list in them, a dict, an
    object's field, a numpy array - do not reach the frozen copy; each tensor is taken once."""
    from collections import defaultdict, namedtuple

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.transformer.enums import AttnBackend

    w, step = torch.arange(6.0).reshape(2, 3), torch.tensor(3.0)
    Pair = namedtuple("Pair", "a b")
    args = argparse.Namespace(lr=3e-4, paths=["a", "b"], be=AttnBackend.flash, fn=print, shape=torch.Size([2, 3]))
    state = {"args": args, "iteration": 7,
             "w": ShardedTensor.from_rank_offsets("w", w, (0, 0, 2), replica_id=(0, 1, 0)),
             "rng": ShardedObject("rng", [{"np": np.arange(4, dtype=np.uint32), "t": step}], (1,), (0,)),
             "groups": [{"params": [0, 1], "betas": (0.9, 0.999), "lr": 1e-3}],
             "od": OrderedDict(a=[1]), "dd": defaultdict(list, b=[2]), "pair": Pair([3], step),
             "scaler": LossScaler(1.0), "buf": bytearray(b"\x01"), "mixed": (1, [2]), "again": w}
    before, tensors_before = tree.encode(state, "sd")
    taken = []
    frozen = tree.freeze(state, lambda t: taken.append(t) or t)
    assert [id(t) for t in taken] == [id(w), id(step)]  # each tensor object once
    args.lr, args.paths[0], args.be = 1.0, "x", AttnBackend.local
    state["iteration"] = 8
    state["w"].global_offset = (9, 9)
    state["rng"].data[0]["np"][:] = 0
    state["groups"][0]["params"].append(2)
    state["od"]["a"].append(0)
    state["dd"]["b"].append(0)
    state["pair"].a.append(0)
    state["scaler"].cur_scale = 2.0
    state["buf"][0] = 9
    state["mixed"][1].append(0)
    after, tensors_after = tree.encode(frozen, "sd")
    assert after == before
    assert [t is u for t, u in zip(tensors_after, tensors_before)] == [True, False, True]  # the numpy array: copied
    assert tree.encode(state, "sd")[0] != before  # the changes are real: the original encodes differently
    clones = tree.freeze(state, torch.clone)
    _, tensors = tree.encode(clones, "sd")
    assert tensors[0] is not w and torch.equal(tensors[0], w) and clones["again"] is clones["w"].data
