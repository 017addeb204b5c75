"""Nested state structures as JSON plus a list of tensors: the one tree codec of megatron-ft.

Megatron-LM's checkpoint tier hands its manager a state dict of nested dicts, lists and tuples
holding ``ShardedTensor``/``ShardedObject`` entries, tensors, numpy arrays, the run's
``argparse.Namespace``, enums and dtypes; DeepSpeed's ``save_checkpoint`` hands its checkpoint
engine OrderedDicts keyed by parameter ids, ``torch.Size``, tensors and a few of its own objects.
Both are snapshotted the same way: :func:`encode` replaces every tensor (and numpy array) by a
reference into a flat list of tensors - what a snapshot holds in its flat area - and returns the
rest as JSON for the version record; :func:`decode` rebuilds an equal structure from both. No
pickle; nothing is imported or constructed on decode but the classes of :data:`ALLOWED`.

Worked example::

    >>> import argparse, torch
    >>> w = torch.ones(2)
    >>> rec, tensors = encode({"iteration": 7, "args": argparse.Namespace(lr=1e-3), "w": w, 3: (w, None)})
    >>> rec["format"], len(tensors), rec["names"]
    ('megatron-ft/tree', 1, ['state.w'])
    >>> back = decode(rec, tensors)
    >>> back["args"].lr, back[3][0] is back["w"]
    (0.001, True)

Tree (version 1). Plain JSON values stand for themselves, a string-keyed dict is a JSON object
(keys starting with ``$`` force the ``$dict`` form), except:

==========================================  ============================================================
``{"$t": i, "device", "rg", "param"}``      tensor ``i`` of the list (its device type; ``rg``: it
                                            required grad; ``param``: an ``nn.Parameter``). The same
                                            tensor object reached twice is stored once and comes back
                                            as one object
``{"$nd": i, "dtype", "shape"}``            a numpy array (tensor ``i`` holds its bytes)
``{"$np": dtype, "value"}``                 a numpy scalar
``{"$dict": [[k, v], ...]}``                a dict with other keys; ``$odict`` an ``OrderedDict``
``{"$tuple": [...]}``, ``{"$size": [...]}``  a tuple, a ``torch.Size``
``{"$float": "nan"}``, ``{"$dtype": "f"}``  a non-finite float, a ``torch.dtype``
``{"$slice": [a, b, c]}``, ``{"$bytes"}``   a slice, bytes (base64)
``{"$ns": "argparse"|"simple", "attrs"}``   a namespace; inside one, attributes that are not data
                                            (functions, objects) are ``{"$omitted": type}`` and decode
                                            to ``None`` (listed in the record's ``omitted``)
``{"$obj": class, "state"}``                an instance of an allow-listed class (:data:`ALLOWED`),
                                            rebuilt from its fields, ``__dict__`` or enum value
==========================================  ============================================================

Anything else is a :class:`CodecError` naming where it was found. Records of the earlier
formats (``megatron-ft/state-dict`` v1, whose ``$sharded`` and ``$enum`` tags are read through the
same allow-list, and ``megatron-ft-dsdict`` v1 trees) are still decoded.
"""
from __future__ import annotations

import argparse
import base64
import copy as copy_module
import dataclasses
import enum
import importlib
import math
import operator
import types
from collections import OrderedDict
from typing import Any, Callable, Optional

import numpy as np
import torch

FORMAT = "megatron-ft/tree"
VERSION = 1
READS = {(FORMAT, VERSION), ("megatron-ft/state-dict", 1)}

#: The only classes a record may name: tag -> (module, class, how it is rebuilt: its dataclass
#: "fields", its "dict" (``__dict__``) or its "enum" value). Adding one is a format change,
#: reviewed like code.
ALLOWED: dict[str, tuple[str, str, str]] = {
    "ShardedTensor": ("megatron.core.dist_checkpointing.mapping", "ShardedTensor", "fields"),
    "ShardedObject": ("megatron.core.dist_checkpointing.mapping", "ShardedObject", "fields"),
    "LossScaler": ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "dict"),
    "DynamicLossScaler": ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", "dict"),
    "fragment_address": ("deepspeed.utils.tensor_fragment", "fragment_address", "fields"),
    "ZeroStageEnum": ("deepspeed.runtime.zero.config", "ZeroStageEnum", "enum"),
}
#: Enum classes of these packages are allowed by name too (Megatron's run arguments hold a
#: changing set of them: ``ModelType``, ``AttnBackend``, ...); they are rebuilt only if the named
#: class is an ``enum.Enum``.
ALLOWED_ENUM_PACKAGES = ("megatron.core.", "megatron.training.", "deepspeed.")


class CodecError(ValueError):
    """A value this encoding cannot represent, or a record it cannot (or may not) read."""


_TAG_OF_CLASS = {(module, name): tag for tag, (module, name, _) in ALLOWED.items()}


def _tag_of(value: Any) -> Optional[str]:
    cls = type(value)
    tag = _TAG_OF_CLASS.get((cls.__module__, cls.__name__))
    if tag is not None:
        return tag
    if isinstance(value, enum.Enum) and cls.__module__.startswith(ALLOWED_ENUM_PACKAGES):
        return f"{cls.__module__}:{cls.__qualname__}"
    return None


def _resolve(tag: str) -> tuple[type, str]:
    """The class a record names, if the allow-list has it; :class:`CodecError` otherwise."""
    if tag in ALLOWED:
        module, name, how = ALLOWED[tag]
        return getattr(importlib.import_module(module), name), how
    module, _, qual = tag.partition(":")
    if qual and module.startswith(ALLOWED_ENUM_PACKAGES):
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            return obj, "enum"
    raise CodecError(f"class {tag!r} is not allowed in a {FORMAT} record; allowed: {sorted(ALLOWED)} and enums "
                     f"of {list(ALLOWED_ENUM_PACKAGES)}")


def owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor as a snapshot takes it: detached and contiguous; a 0-dim tensor (a counter such as
    Adam's step, updated in place) is copied so that the snapshot owns its value."""
    t = t.detach()
    if t.dim() == 0 or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


#: values that stand for themselves in a tree (``float`` only when finite)
_PLAIN = frozenset({type(None), bool, int, str})


def _plain_items(v: "list | tuple") -> Optional[list]:
    """``v``'s items as a list when every one stands for itself (exact ``None``, ``bool``,
    ``int``, ``str``, finite ``float``), else None: long runs of scalars (a Python RNG state's 625
    ints, Megatron's list arguments) skip the per-item walk.

    >>> _plain_items((1, "a", None, 2.5)), _plain_items([1, float("nan")]), _plain_items([1, (2,)])
    ([1, 'a', None, 2.5], None, None)
    """
    kinds = set(map(type, v))
    if kinds <= _PLAIN:
        return list(v)
    if kinds <= _PLAIN | {float} and all(map(math.isfinite, (x for x in v if type(x) is float))):
        return list(v)
    return None


_DOLLAR = operator.methodcaller("startswith", "$")


def _json_keys(v: dict) -> bool:
    """Every key a ``str`` not starting with ``$`` (the dict is then a JSON object in the tree).

    >>> _json_keys({"a": 1}), _json_keys({}), _json_keys({"$t": 1}), _json_keys({1: 2})
    (True, True, False, False)
    """
    return set(map(type, v)) <= {str} and not any(map(_DOLLAR, v))


#: A place in the structure being encoded: the root's name, or ``(parent, separator, key)`` -
#: built without formatting, since only a tensor's name, an omitted value or an error needs the text.
Path = Any


def path_text(path: Path) -> str:
    """``path`` as text: ``path_text((("state", ".", "w"), "[", 2))`` -> ``'state.w[2]'``."""
    parts = []
    while type(path) is tuple:
        path, sep, key = path
        parts.append(f"{sep}{key}]" if sep == "[" else f"{sep}{key}")
    parts.append(str(path))
    return "".join(reversed(parts))


class Encoder:
    """Collects tensors while turning one or more structures into trees (shared tensors once)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []  # each tensor's path where it was first reached
        self.omitted: list[str] = []
        self._index: dict[int, int] = {}  # id(tensor) -> index (kept alive in self.tensors)

    def _tensor(self, t: torch.Tensor, path: Path) -> int:
        i = self._index.get(id(t))
        if i is None:
            i = self._index[id(t)] = len(self.tensors)
            self.tensors.append(t)
            self.names.append(path_text(path))
        return i

    def encode(self, v: Any, path: Path = "state", lenient: bool = False) -> Any:
        cls = type(v)
        if cls in _PLAIN:
            return v
        if cls is float:
            return v if math.isfinite(v) else {"$float": repr(v)}
        if cls is dict and _json_keys(v):  # the common containers first, by exact type
            return self._object(v, path, lenient)
        if cls is list or cls is tuple:
            items = _plain_items(v)
            if items is None:
                items = [self.encode(x, (path, "[", i), lenient) for i, x in enumerate(v)]
            return items if cls is list else {"$tuple": items}
        if cls is torch.dtype:
            return {"$dtype": str(v).removeprefix("torch.")}
        how = _FIELDS_OF_ALLOWED.get(cls)
        if how is not None:  # an allow-listed dataclass (ShardedTensor, ...): its fields, no dict built
            tag, names = how
            return {"$obj": tag, "state": self._fields(v, names, (path, ".", f"<{tag}>"), lenient)}
        if isinstance(v, torch.Tensor):
            node: dict = {"$t": self._tensor(v, path), "device": v.device.type}
            if v.requires_grad:
                node["rg"] = True
            if isinstance(v, torch.nn.Parameter):
                node["param"] = True
            return node
        if isinstance(v, np.ndarray):
            raw = torch.from_numpy(np.ascontiguousarray(v).reshape(-1).view(np.uint8).copy())
            return {"$nd": self._tensor(raw, path), "dtype": v.dtype.str, "shape": list(v.shape)}
        if isinstance(v, np.generic):
            return {"$np": v.dtype.str, "value": self.encode(v.item(), path)}
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Size):
            return {"$size": [int(x) for x in v]}
        tag = _tag_of(v)  # before int/str: IntEnum members are ints
        if tag is not None:
            how = ALLOWED[tag][2] if tag in ALLOWED else "enum"
            if how == "enum":
                return {"$obj": tag, "state": self.encode(v.value, (path, ".", "value"))}
            if how == "fields":
                _remember_fields(cls, tag)  # the fast path above from now on
                return self.encode(v, path, lenient)
            return {"$obj": tag, "state": self.encode(dict(vars(v)), (path, ".", f"<{tag}>"), lenient)}
        if isinstance(v, enum.Enum):
            if lenient:
                return self._omit(v, path)
            raise CodecError(f"{path_text(path)}: enum {type(v).__module__}.{type(v).__qualname__} is not allowed; "
                             f"allowed: {sorted(ALLOWED)} and enums of {list(ALLOWED_ENUM_PACKAGES)} "
                             f"(megatron_ft.capture.tree.ALLOWED)")
        if isinstance(v, (bool, int)):  # subclasses that are not enums
            return int(v)
        if isinstance(v, str):
            return str(v)
        if isinstance(v, float):
            return self.encode(float(v), path)
        if isinstance(v, (tuple, list)):
            items = _plain_items(v)
            if items is None:
                items = [self.encode(x, (path, "[", i), lenient) for i, x in enumerate(v)]
            return {"$tuple": items} if isinstance(v, tuple) else items
        if isinstance(v, dict):
            if type(v) is dict and _json_keys(v):
                return self._object(v, path, lenient)
            pairs = [[self.encode(k, (path, ".", "<key>")), self.encode(x, (path, ".", k), lenient)]
                     for k, x in v.items()]
            return {"$odict" if isinstance(v, OrderedDict) else "$dict": pairs}
        if isinstance(v, slice):
            return {"$slice": [self.encode(v.start, path), self.encode(v.stop, path), self.encode(v.step, path)]}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, (argparse.Namespace, types.SimpleNamespace)):
            kind = "argparse" if isinstance(v, argparse.Namespace) else "simple"
            return {"$ns": kind, "attrs": self.encode(dict(vars(v)), path, lenient=True)}
        if lenient:
            return self._omit(v, path)
        raise CodecError(f"{path_text(path)}: a value of type {type(v).__module__}.{type(v).__qualname__} cannot be "
                         f"stored in a snapshot (no pickle); allowed: None, bool, int, float, str, bytes, list, tuple, "
                         f"dict, slice, torch.Tensor/dtype/Size, numpy arrays and scalars, namespaces, and the classes "
                         f"of megatron_ft.capture.tree.ALLOWED")

    def _object(self, v: dict, path: Path, lenient: bool) -> dict:
        """A dict whose keys are JSON object keys (:func:`_json_keys`) as a JSON object."""
        plain = _PLAIN  # a scalar value stands for itself: no call, no path
        return {k: x if type(x) in plain else self.encode(x, (path, ".", k), lenient) for k, x in v.items()}

    def _fields(self, v: Any, names: tuple[str, ...], path: Path, lenient: bool) -> dict:
        """A dataclass's fields as a JSON object (field names are identifiers: no key check)."""
        plain = _PLAIN
        out = {}
        for k in names:
            x = getattr(v, k)
            cls = type(x)
            if cls in plain:
                out[k] = x
            elif cls is tuple and (items := _plain_items(x)) is not None:  # shapes, offsets, replica ids
                out[k] = {"$tuple": items}
            elif cls is torch.Tensor:  # exactly a tensor: no subclass (Parameter) to tell apart
                node = {"$t": self._tensor(x, (path, ".", k)), "device": x.device.type}
                if x.requires_grad:
                    node["rg"] = True
                out[k] = node
            elif cls is slice and type(x.start) in plain and type(x.stop) in plain and type(x.step) in plain:
                out[k] = {"$slice": [x.start, x.stop, x.step]}  # a flattened range
            else:
                out[k] = self.encode(x, (path, ".", k), lenient)
        return out

    def _omit(self, v: Any, path: Path) -> dict:
        self.omitted.append(path_text(path))
        return {"$omitted": f"{type(v).__module__}.{type(v).__qualname__}", "repr": repr(v)[:200]}

    def record(self, body: Any) -> dict:
        """The versioned record of an encoded ``body``."""
        return {"format": FORMAT, "version": VERSION, "body": body, "names": list(self.names),
                "omitted": list(self.omitted)}


#: allow-listed dataclasses met so far -> (tag, field names): encoded without the type tests
_FIELDS_OF_ALLOWED: dict[type, tuple[str, tuple[str, ...]]] = {}


def _remember_fields(cls: type, tag: str) -> None:
    """Note allow-listed dataclass ``cls`` (tagged ``tag``) and its field names, for the encoder's and
    the freezer's fast path."""
    _FIELDS_OF_ALLOWED[cls] = (tag, tuple(f.name for f in dataclasses.fields(cls)))


def encode(state: Any, path: str = "state") -> tuple[dict, list[torch.Tensor]]:
    """``state`` -> (record, the tensors it references, not copied). The record's ``names`` give
    each tensor's path (for layout names and messages); ``omitted`` the namespace attributes that
    were not data."""
    e = Encoder()
    return e.record(e.encode(state, path)), e.tensors


#: values that never change once made: a frozen structure shares them with the original
_IMMUTABLE = frozenset({type(None), bool, int, str, float, complex, bytes, torch.dtype, torch.Size, slice, range})


def freeze(state: Any, take: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of ``state`` that later changes to ``state`` do not reach, for :func:`encode` to encode
    afterwards (on another thread): every dict, list, tuple holding one, namespace and allow-listed
    object copied, every numpy array copied, every tensor replaced by ``take(tensor)`` (called once
    per tensor object: a tensor reached twice is the same result twice), and immutable values -
    numbers, strings, enums, dtypes - shared. Anything else is shared as it is (:func:`encode` then
    stores it if it can, or says why). Cheaper than encoding: no output node per scalar, and runs of
    immutable values copied by the C loops of ``dict.copy`` / ``list``. ``take`` decides what a
    snapshot owns: a tensor that changes before the snapshot is copied must be cloned there.

    ``encode(freeze(s, take))`` equals ``encode`` of ``s`` as it was, tensors taken, when frozen:

    >>> import argparse
    >>> args = argparse.Namespace(lr=1e-3, paths=["a"])
    >>> w = torch.zeros(2)
    >>> state = {"args": args, "w": w, "again": w, "steps": [1, 2]}
    >>> frozen = freeze(state, lambda t: t.clone())
    >>> args.lr, args.paths[0], state["steps"][0] = 0.5, "b", 9
    >>> rec, tensors = encode(frozen)
    >>> rec["body"]["args"]["attrs"], rec["body"]["steps"], len(tensors), tensors[0] is w
    ({'lr': 0.001, 'paths': ['a']}, [1, 2], 1, False)
    """
    return _Freezer(take)(state)


class _Freezer:
    """One :func:`freeze`: its walk, and the tensors it took (held, so their ids stay unique)."""

    def __init__(self, take: Callable[[torch.Tensor], torch.Tensor]):
        self.take = take
        self.taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(tensor) -> (tensor, taken)

    def __call__(self, v: Any) -> Any:
        cls = type(v)
        if cls in _IMMUTABLE:
            return v
        if cls is dict:
            return self._dict(v)
        if cls is list:
            return self._list(v)
        if cls is tuple:
            return v if _IMMUTABLE.issuperset(map(type, v)) else tuple(map(self, v))
        how = _FIELDS_OF_ALLOWED.get(cls)
        if how is not None:  # an allow-listed dataclass (ShardedTensor, ...): a copy, fields frozen
            return self._object(v, how[1])
        if isinstance(v, torch.Tensor):
            got = self.taken.get(id(v))
            if got is None:
                got = self.taken[id(v)] = (v, self.take(v))
            return got[1]
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, (enum.Enum, np.generic, torch.dtype, torch.Size, bytes, str, int, float)):
            return v  # immutable (subclasses included; an IntEnum member is an int)
        if isinstance(v, OrderedDict):
            return OrderedDict((k, self(x)) for k, x in v.items())
        if isinstance(v, dict):
            out = copy_module.copy(v)  # keeps the class (a defaultdict its factory)
            for k, x in v.items():
                out[k] = self(x)
            return out
        if isinstance(v, (list, tuple)):  # subclasses: encode stores them as a list / a tuple
            return list(map(self, v)) if isinstance(v, list) else tuple(map(self, v))
        if isinstance(v, bytearray):
            return bytes(v)
        if isinstance(v, (argparse.Namespace, types.SimpleNamespace)):
            ns = cls.__new__(cls)
            ns.__dict__.update(self._dict(vars(v)))
            return ns
        tag = _tag_of(v)
        if tag is not None and tag in ALLOWED:
            if ALLOWED[tag][2] == "fields":
                _remember_fields(cls, tag)
                return self(v)
            out = copy_module.copy(v)
            out.__dict__.update(self._dict(vars(v)))
            return out
        return v  # an enum, or a value encode stores as it is or refuses

    def _dict(self, v: dict) -> dict:
        if _IMMUTABLE.issuperset(map(type, v.values())):
            return v.copy()
        imm = _IMMUTABLE
        return {k: x if type(x) in imm else self(x) for k, x in v.items()}

    def _list(self, v: list) -> list:
        if _IMMUTABLE.issuperset(map(type, v)):
            return list(v)
        imm = _IMMUTABLE
        return [x if type(x) in imm else self(x) for x in v]

    def _object(self, v: Any, names: tuple[str, ...]) -> Any:
        """A copy of dataclass ``v`` with its fields ``names`` frozen (tuples of immutable values,
        such as shapes and offsets, shared)."""
        if hasattr(v, "__dict__"):
            out = object.__new__(type(v))
            out.__dict__.update(v.__dict__)
        else:  # __slots__
            out = copy_module.copy(v)
        imm = _IMMUTABLE
        for k in names:
            x = getattr(v, k)
            cls = type(x)
            if cls in imm or (cls is tuple and imm.issuperset(map(type, x))):
                continue
            object.__setattr__(out, k, self(x))
        return out


def tensor_specs(record: dict) -> list[dict]:
    """For each referenced tensor: its path and device type (what a loader allocates where)."""
    devices: dict[int, str] = {}

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if "$t" in v:
                devices[v["$t"]] = v.get("device", "cpu")
            elif "$nd" not in v:
                for x in v.values():
                    walk(x)

    walk(record["body"])
    return [{"name": n, "device": devices.get(i, "cpu")} for i, n in enumerate(record["names"])]


def check(record: Any, tensors: int) -> None:
    """Refuse a record this build cannot read, or one that references another number of tensors."""
    if not isinstance(record, dict) or (record.get("format"), record.get("version")) not in READS:
        got = (record.get("format"), record.get("version")) if isinstance(record, dict) else None
        raise CodecError(f"record {got!r} cannot be read; this build reads {sorted(READS)}")
    if len(record["names"]) != tensors:
        raise CodecError(f"record references {len(record['names'])} tensors, {tensors} were given")


def decode(record: dict, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the structure :func:`encode` saw, with ``tensors`` in place of the references."""
    check(record, len(tensors))
    return decode_tree(record["body"], tensors)


def decode_tree(tree: Any, tensors: list[torch.Tensor],
                fix: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Any:
    """Rebuild one tree; tensor ``i`` is ``tensors[i]`` (through ``fix`` if given, e.g. a device
    move). Each tensor index is rebuilt once, so shared tensors stay shared."""
    made: dict[int, torch.Tensor] = {}

    def tensor(i: Any, node: dict) -> torch.Tensor:
        if i not in made:
            if not isinstance(i, int) or not 0 <= i < len(tensors):
                raise CodecError(f"tensor index {i!r} out of range (0..{len(tensors) - 1})")
            t = tensors[i] if fix is None else fix(tensors[i])
            if node.get("param"):
                t = torch.nn.Parameter(t, requires_grad=bool(node.get("rg")))
            elif node.get("rg") and t.is_floating_point():
                t.requires_grad_(True)
            made[i] = t
        return made[i]

    def obj(tag: str, state: Any) -> Any:
        cls, how = _resolve(tag)
        if how == "enum":
            return cls(state)
        if how == "fields":
            return cls(**state)
        out = cls.__new__(cls)
        out.__dict__.update(state)
        return out

    def dec(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            raise CodecError(f"malformed value {v!r:.200}")
        if "$t" in v:
            return tensor(v["$t"], v)
        if "$dict" in v:
            return {dec(k): dec(x) for k, x in v["$dict"]}
        if "$odict" in v:
            return OrderedDict((dec(k), dec(x)) for k, x in v["$odict"])
        if "$tuple" in v:
            return tuple(dec(x) for x in v["$tuple"])
        if "$obj" in v:
            return obj(v["$obj"], dec(v["state"]))
        if "$nd" in v:
            raw = tensors[v["$nd"]].cpu().numpy()
            return raw.view(np.dtype(v["dtype"])).reshape(v["shape"]).copy()
        if "$np" in v:
            return np.dtype(v["$np"]).type(dec(v["value"]))
        if "$float" in v:
            return float(v["$float"])
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
        if "$omitted" in v:
            return None
        if "$sharded" in v:  # megatron-ft/state-dict v1
            return obj(v["$sharded"], {k: dec(x) for k, x in v["fields"].items()})
        if "$enum" in v:  # megatron-ft/state-dict v1: a member by class path and name
            cls, _ = _resolve(v["$enum"])
            return cls[v["name"]]
        if any(k.startswith("$") for k in v):
            raise CodecError(f"unknown tag in {sorted(v)[:3]}")
        return {k: dec(x) for k, x in v.items()}

    return dec(tree)
