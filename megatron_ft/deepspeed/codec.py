"""DeepSpeed checkpoint dicts as tensors + a JSON tree (no pickle): the ``megatron-ft-dsdict`` format.

``engine.save_checkpoint()`` hands its checkpoint engine nested Python structures: dicts (some
keyed by int parameter ids), OrderedDicts, lists, tuples, ``torch.Size``, tensors, and a few
DeepSpeed objects (``LossScaler``, ``fragment_address``, ``ZeroStageEnum``). :func:`encode`
splits such a structure into a list of tensors (the snapshot's flat area) and a JSON tree that
names them by index; :func:`decode` rebuilds an equal structure from the tree and the tensors.

Tree encoding (version 1). Plain JSON values stand for themselves, except:

=================================  ======================================================
``{"$t": i}``                      tensor ``i`` (``"rg": true`` if it required grad,
                                   ``"param": true`` for an ``nn.Parameter``)
``{"$dict": [[k, v], ...]}``       a dict whose keys are not all plain strings
``{"$odict": [[k, v], ...]}``      an ``OrderedDict``
``{"$tuple": [...]}``              a tuple; ``{"$size": [...]}`` a ``torch.Size``
``{"$float": "nan"|"inf"|"-inf"}`` a non-finite float
``{"$dtype": "float32"}``          a ``torch.dtype``
``{"$obj": name, "state": tree}``  an instance of an allow-listed class (:data:`CLASSES`),
                                   rebuilt from its ``__dict__`` (dataclass fields); nothing else is
                                   ever imported or constructed
=================================  ======================================================

A string-keyed dict whose keys start with ``$`` is written as ``$dict`` so it cannot be mistaken
for a tag. The same tensor object reached twice is stored once and comes back as one object.
Anything else raises :class:`TypeError` naming where it was found.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import math
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

FORMAT = "megatron-ft-dsdict"
VERSION = 1

# name in the tree -> (module, attribute, kind); kind "object": __dict__, "dataclass": fields, "enum": value.
# Only these classes are ever rebuilt on load; adding one is a format change reviewed like code.
CLASSES: dict[str, tuple[str, str, str]] = {
    "LossScaler": ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "object"),
    "DynamicLossScaler": ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", "object"),
    "fragment_address": ("deepspeed.utils.tensor_fragment", "fragment_address", "dataclass"),
    "ZeroStageEnum": ("deepspeed.runtime.zero.config", "ZeroStageEnum", "enum"),
}


def _class_name(value: Any) -> Optional[str]:
    cls = type(value)
    for name, (module, attr, _) in CLASSES.items():
        if cls.__name__ == attr and cls.__module__ == module:
            return name
    return None


def _resolve(name: str) -> tuple[type, str]:
    if name not in CLASSES:
        raise ValueError(f"class {name!r} is not allowed in a {FORMAT} tree (allowed: {sorted(CLASSES)})")
    module, attr, kind = CLASSES[name]
    return getattr(importlib.import_module(module), attr), kind


class Encoder:
    """Collects tensors while turning one or more structures into JSON trees."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(tensor) -> index (the tensors are kept alive in self.tensors)

    def encode(self, value: Any, where: str = "state") -> Any:
        if isinstance(value, torch.Tensor):
            i = self._index.get(id(value))
            if i is None:
                i = self._index[id(value)] = len(self.tensors)
                self.tensors.append(value)
            node: dict = {"$t": i}
            if value.requires_grad:
                node["rg"] = True
            if isinstance(value, torch.nn.Parameter):
                node["param"] = True
            return node
        name = _class_name(value)
        if name is not None:
            kind = CLASSES[name][2]
            if kind == "enum":
                return {"$obj": name, "state": self.encode(value.value, f"{where}.value")}
            state = ({f.name: getattr(value, f.name) for f in dataclasses.fields(value)} if kind == "dataclass"
                     else vars(value))
            return {"$obj": name, "state": self.encode(dict(state), f"{where}.<{name}>")}
        if isinstance(value, enum.Enum):
            raise TypeError(f"{where}: enum {type(value).__module__}.{type(value).__qualname__} is not allow-listed "
                            f"in megatron_ft.deepspeed.codec.CLASSES")
        if value is None or isinstance(value, (bool, str)) or type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, torch.dtype):
            return {"$dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.Size):
            return {"$size": [int(v) for v in value]}
        if type(value) is tuple:
            return {"$tuple": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if type(value) is list:
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if type(value) is OrderedDict:
            return {"$odict": [[self.encode(k, f"{where}.<key>"), self.encode(v, f"{where}.{k}")]
                               for k, v in value.items()]}
        if type(value) is dict:
            if all(type(k) is str and not k.startswith("$") for k in value):
                return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
            return {"$dict": [[self.encode(k, f"{where}.<key>"), self.encode(v, f"{where}.{k}")]
                              for k, v in value.items()]}
        raise TypeError(f"{where}: value of type {type(value).__module__}.{type(value).__qualname__} cannot be "
                        f"stored in a {FORMAT} snapshot (no pickle); allow-list it in "
                        f"megatron_ft.deepspeed.codec.CLASSES with an explicit encoding")


def decode(tree: Any, tensors: list[torch.Tensor], fix: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Any:
    """Rebuild the structure of ``tree``; tensor ``i`` is ``tensors[i]`` (through ``fix`` if given,
    e.g. a device move). Each tensor index is rebuilt once, so shared tensors stay shared."""
    made: dict[int, torch.Tensor] = {}

    def tensor(node: dict) -> torch.Tensor:
        i = node["$t"]
        if i not in made:
            if not isinstance(i, int) or not 0 <= i < len(tensors):
                raise ValueError(f"{FORMAT}: tensor index {i!r} out of range (0..{len(tensors) - 1})")
            t = tensors[i] if fix is None else fix(tensors[i])
            if node.get("param"):
                t = torch.nn.Parameter(t, requires_grad=bool(node.get("rg")))
            elif node.get("rg") and t.is_floating_point():
                t.requires_grad_(True)
            made[i] = t
        return made[i]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$t" in node:
            return tensor(node)
        if "$dict" in node:
            return {walk(k): walk(v) for k, v in node["$dict"]}
        if "$odict" in node:
            return OrderedDict((walk(k), walk(v)) for k, v in node["$odict"])
        if "$tuple" in node:
            return tuple(walk(v) for v in node["$tuple"])
        if "$size" in node:
            return torch.Size(node["$size"])
        if "$float" in node:
            return float(node["$float"])
        if "$dtype" in node:
            dt = getattr(torch, node["$dtype"], None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"{FORMAT}: unknown dtype {node['$dtype']!r}")
            return dt
        if "$obj" in node:
            cls, kind = _resolve(node["$obj"])
            state = walk(node["state"])
            if kind == "enum":
                return cls(state)
            if kind == "dataclass":
                return cls(**state)
            obj = cls.__new__(cls)
            obj.__dict__.update(state)
            return obj
        return {k: walk(v) for k, v in node.items()}

    return walk(tree)
