"""From a cluster file or a mapping to a validated :class:`~megatron_ft.config.job.FTConfig`:
:func:`load` (the embedded default :data:`DEFAULT_CONFIG_PATH` when no file is named), :func:`from_dict`,
:func:`replace`, the YAML loader that refuses a key given twice, the first validation error in the
project's words (the field, the value, what is allowed), and :func:`schema`, the JSON Schema of the file."""
from __future__ import annotations

import os
from typing import Annotated, Any, Mapping, Optional, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from .fields import Allowed, ConfigError
from .job import SECTIONS, FTConfig


def schema() -> dict:
    """The JSON Schema of a cluster file (``megatron-ft config --schema``), for editors and checks."""
    out = FTConfig.model_json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "megatron-ft cluster file"
    return out


def _allowed(loc: tuple) -> Optional[str]:
    """The ``Allowed`` text of the field (or list element) at ``loc``: section, field[, index]."""
    model: Any = FTConfig
    ann: Any = None
    for part in loc:
        if isinstance(part, int):  # an element: the list's element type
            while get_origin(ann) is Annotated:
                ann = get_args(ann)[0]
            args = get_args(ann)
            ann = args[0] if args else None
            continue
        if model is None:
            return None
        info = model.model_fields.get(part)
        if info is None:
            return None
        ann = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        model = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) \
            else None
    while get_origin(ann) is Annotated:
        for meta in get_args(ann)[1:]:
            if isinstance(meta, Allowed):
                return str(meta)
        ann = get_args(ann)[0]
    return None


def _model_at(loc: tuple) -> Any:
    """The section model at ``loc`` (``()``: the whole file; ``("cluster", "elastic")``: a sub-section),
    or None where ``loc`` names a plain field or nothing."""
    model: Any = FTConfig
    for part in loc:
        info = model.model_fields.get(part) if isinstance(part, str) else None
        if info is None or not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)):
            return None
        model = info.annotation
    return model


def _field_names(model: Any) -> set:
    """Every field name of ``model`` and of its sections and sub-sections, at any depth."""
    out = set()
    for name, info in model.model_fields.items():
        out.add(name)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out |= _field_names(info.annotation)
    return out


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _config_error(e: ValidationError, source: str, data: Mapping[str, Any]) -> ConfigError:
    """The first problem of a validation, in the project's words: the field, the value, what is allowed."""
    err = e.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), ConfigError):
        return err["ctx"]["error"]
    if err["type"] == "extra_forbidden" and _model_at(loc[:-1]) is not None:
        section = loc[:-1]
        allowed = sorted(_path(section + (n,)) for n in _model_at(section).model_fields)
        return ConfigError(f"{source}: unknown key(s) {[_path(loc)]}; allowed: {allowed}")
    if loc and _model_at(loc) is not None and err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return ConfigError(f"{source}: {_path(loc)}={err['input']!r} must be a mapping")
    loc = tuple(p for p in loc if isinstance(p, int) or p in _FIELD_NAMES)  # drop union/validator branches
    value = err["input"]
    allowed = _allowed(loc)
    if allowed is None and loc and isinstance(loc[-1], int):  # an element with no words of its own: the list's
        loc = tuple(p for p in loc if not isinstance(p, int))
        allowed, value = _allowed(loc), data.get(loc[0], {}).get(loc[1], value) if len(loc) == 2 else value
    return ConfigError(f"{_path(loc)}={value!r} is invalid: {allowed or err['msg']}")


#: megatron_ft/configs/local-cpu.yaml (the package's configs/, beside this subpackage)
DEFAULT_CONFIG_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "local-cpu.yaml")
_FIELD_NAMES = _field_names(FTConfig)


def from_dict(data: Mapping[str, Any], source: str = "<dict>") -> FTConfig:
    """Build a validated config from a mapping (as loaded from YAML). Unknown keys are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if not (k in SECTIONS and v is None)}  # "cluster:" with nothing under it
    try:
        return FTConfig.model_validate(data)
    except ValidationError as e:
        raise _config_error(e, source, data) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"key {key!r} is given twice (first {seen[key]}); each key may appear once", key_node.start_mark)
            seen[key] = f"line {key_node.start_mark.line + 1}"
        return super().construct_mapping(node, deep=deep)


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def load(path: Optional[str] = None) -> FTConfig:
    """Load a config file (the embedded default ``local-cpu.yaml`` when ``path`` is None)."""
    path = path or DEFAULT_CONFIG_PATH
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = load_yaml(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    return from_dict(data, source=path)


def replace(cfg: FTConfig, **sections: Any) -> FTConfig:
    """Return ``cfg`` with some fields of some sections replaced (validated again)."""
    data = cfg.to_dict()
    for name, changes in sections.items():
        if name == "run_id":
            data["run_id"] = changes
        elif name not in SECTIONS:
            raise ConfigError(f"unknown section {name!r}; allowed: {list(SECTIONS)}")
        else:
            data[name] = {**data[name], **changes}
    return from_dict(data, source="<replace>")
