"""An explicit, versioned encoding of Megatron (sharded) state dicts: JSON plus a list of tensors.

Megatron-LM's local checkpoint tier hands its manager a state dict of nested dicts, lists and
tuples holding ``ShardedTensor``/``ShardedObject`` entries, plain tensors, numpy arrays, the
``argparse.Namespace`` of the run, RNG states, enums and dtypes. The NVRx manager pickles the
structure; megatron-ft may not (no pickle across processes). :func:`encode` turns the structure
into JSON-able data in which every tensor (and numpy array) is replaced by a reference into a
flat list of tensors - exactly what a snapshot holds: tensors in the flat area, JSON in the
version record. :func:`decode` is the inverse, given the tensors back.

Worked example::

    >>> import argparse, torch
    >>> sd = {"iteration": 7, "args": argparse.Namespace(lr=1e-3, dtype=torch.bfloat16),
    ...       "w": torch.ones(2), 3: (1.5, None)}
    >>> rec, tensors = encode(sd)
    >>> rec["format"], len(tensors)
    ('megatron-ft/state-dict', 1)
    >>> back = decode(rec, tensors)
    >>> back["args"].dtype, back[3], torch.equal(back["w"], sd["w"])
    (torch.bfloat16, (1.5, None), True)

Tagged values (every dict is encoded as ``{"$dict": [[key, value], ...]}`` so key types and order
survive): ``$tuple``, ``$float`` (nan/inf), ``$t`` (tensor index and device), ``$nd`` (numpy
array: index of its raw bytes, dtype, shape), ``$np`` (numpy scalar), ``$dtype``, ``$size``,
``$slice``, ``$bytes`` (base64), ``$ns`` (argparse/SimpleNamespace), ``$enum`` (an
``enum.Enum`` member by class path and name; decoding imports the module and refuses anything
that is not an Enum), ``$sharded`` (a megatron ``ShardedTensor``/``ShardedObject``: its fields,
data included, encoded recursively). Inside the run's ``args`` namespace, attributes that are not
data (functions, objects) are recorded as ``$omitted`` (type and repr) and decode to ``None``;
anywhere else they are an error naming the path, since silently dropping training state is wrong.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import importlib
import math
import types
from typing import Any, Optional

import numpy as np
import torch

FORMAT = "megatron-ft/state-dict"
VERSION = 1


class CodecError(ValueError):
    """A value that this encoding cannot represent, or a record it cannot read."""


def _sharded_classes() -> dict[str, type]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    return {"ShardedTensor": ShardedTensor, "ShardedObject": ShardedObject}


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self.omitted: list[str] = []
        self._sharded = _sharded_classes()

    def tensor(self, t: torch.Tensor, path: str) -> dict:
        self.tensors.append(t.detach())
        self.names.append(path)
        return {"$t": len(self.tensors) - 1, "device": t.device.type}

    def enc(self, v: Any, path: str, lenient: bool = False) -> Any:
        if v is None or type(v) in (bool, int, str):
            return v
        if type(v) is float:
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if isinstance(v, np.ndarray):
            raw = torch.from_numpy(np.ascontiguousarray(v).reshape(-1).view(np.uint8).copy())
            ref = self.tensor(raw, path)
            return {"$nd": ref["$t"], "dtype": v.dtype.str, "shape": list(v.shape)}
        if isinstance(v, np.generic):
            return {"$np": v.dtype.str, "value": self.enc(v.item(), path)}
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Size):
            return {"$size": list(v)}
        if isinstance(v, enum.Enum):  # before int: IntEnum members are ints
            cls = type(v)
            return {"$enum": f"{cls.__module__}:{cls.__qualname__}", "name": v.name}
        if isinstance(v, (bool, int, str)):  # subclasses that are not enums
            return str(v) if isinstance(v, str) else int(v)
        if isinstance(v, float):
            return self.enc(float(v), path)
        if isinstance(v, tuple):
            return {"$tuple": [self.enc(x, f"{path}[{i}]", lenient) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.enc(x, f"{path}[{i}]", lenient) for i, x in enumerate(v)]
        if isinstance(v, dict):
            return {"$dict": [[self.enc(k, f"{path}<key>"), self.enc(x, f"{path}.{k}", lenient)]
                              for k, x in v.items()]}
        if isinstance(v, slice):
            return {"$slice": [self.enc(v.start, path), self.enc(v.stop, path), self.enc(v.step, path)]}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, (argparse.Namespace, types.SimpleNamespace)):
            kind = "argparse" if isinstance(v, argparse.Namespace) else "simple"
            return {"$ns": kind, "attrs": self.enc(dict(vars(v)), path, lenient=True)}
        name = type(v).__name__
        if name in self._sharded and isinstance(v, self._sharded[name]):
            fields = {f.name: self.enc(getattr(v, f.name), f"{path}.{f.name}", lenient)
                      for f in dataclasses.fields(v)}
            return {"$sharded": name, "fields": fields}
        if lenient:
            self.omitted.append(path)
            return {"$omitted": f"{type(v).__module__}.{type(v).__qualname__}", "repr": repr(v)[:200]}
        raise CodecError(f"{path}: a value of type {type(v).__module__}.{type(v).__qualname__} cannot be "
                         f"stored in an in-memory checkpoint; allowed: None, bool, int, float, str, bytes, list, "
                         f"tuple, dict, slice, torch.Tensor, torch.dtype, numpy arrays and scalars, enums, "
                         f"argparse/SimpleNamespace, ShardedTensor, ShardedObject")


def encode(state_dict: Any) -> tuple[dict, list[torch.Tensor]]:
    """``state_dict`` -> (JSON-able record, tensors it references). Tensors are not copied.

    The record's ``names`` list gives each tensor's path in the structure (for layout names and
    error messages); ``omitted`` lists ``args`` attributes that were not data."""
    e = _Encoder()
    body = e.enc(state_dict, "state_dict")
    return {"format": FORMAT, "version": VERSION, "body": body, "names": e.names, "omitted": e.omitted}, e.tensors


def tensor_specs(record: dict) -> list[dict]:
    """For each referenced tensor: its path and device type (what a loader must allocate where)."""
    devices: dict[int, str] = {}

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if "$t" in v:
                devices[v["$t"]] = v["device"]
            elif "$nd" in v:
                devices[v["$nd"]] = "cpu"
            else:
                for x in v.values():
                    walk(x)

    walk(record["body"])
    return [{"name": n, "device": devices.get(i, "cpu")} for i, n in enumerate(record["names"])]


def decode(record: dict, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the structure :func:`encode` saw, with ``tensors`` in place of the references."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CodecError(f"not a {FORMAT} record (format={record.get('format') if isinstance(record, dict) else None!r})")
    if record.get("version") != VERSION:
        raise CodecError(f"{FORMAT} version {record.get('version')!r} is not supported; this build reads {VERSION}")
    if len(tensors) != len(record["names"]):
        raise CodecError(f"record references {len(record['names'])} tensors, {len(tensors)} were given")
    sharded = _sharded_classes()

    def dec(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict) or len(v) == 0:
            raise CodecError(f"malformed value {v!r}")
        if "$dict" in v:
            return {dec(k): dec(x) for k, x in v["$dict"]}
        if "$tuple" in v:
            return tuple(dec(x) for x in v["$tuple"])
        if "$t" in v:
            return tensors[v["$t"]]
        if "$float" in v:
            return float(v["$float"])
        if "$nd" in v:
            raw = tensors[v["$nd"]].cpu().numpy()
            return raw.view(np.dtype(v["dtype"])).reshape(v["shape"]).copy()
        if "$np" in v:
            return np.dtype(v["$np"]).type(dec(v["value"]))
        if "$dtype" in v:
            dt = getattr(torch, v["$dtype"], None)
            if not isinstance(dt, torch.dtype):
                raise CodecError(f"unknown torch dtype {v['$dtype']!r}")
            return dt
        if "$size" in v:
            return torch.Size(v["$size"])
        if "$slice" in v:
            return slice(*(dec(x) for x in v["$slice"]))
        if "$bytes" in v:
            return base64.b64decode(v["$bytes"])
        if "$ns" in v:
            attrs = dec(v["attrs"])
            return argparse.Namespace(**attrs) if v["$ns"] == "argparse" else types.SimpleNamespace(**attrs)
        if "$enum" in v:
            return _enum_member(v["$enum"], v["name"])
        if "$omitted" in v:
            return None
        if "$sharded" in v:
            cls = sharded.get(v["$sharded"])
            if cls is None:
                raise CodecError(f"unknown sharded class {v['$sharded']!r}; allowed: {sorted(sharded)}")
            return cls(**{k: dec(x) for k, x in v["fields"].items()})
        raise CodecError(f"unknown tag in {sorted(v)[:3]}")

    return dec(record["body"])


def _enum_member(path: str, name: str) -> enum.Enum:
    module, _, qual = path.partition(":")
    obj: Optional[Any] = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
        raise CodecError(f"{path} is not an enum class")
    return obj[name]
