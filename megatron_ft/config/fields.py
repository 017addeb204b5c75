"""The vocabulary the sections are written in: :class:`ConfigError` and the checks that raise it
(``_fail``, ``_check_int``, ``_check_num``; the planners use them too), the choices (the redundancy
schemes, the schedule modes, ...), the field types that carry their own words of what they allow
(``_int``, ``_num``, ``_choice``, ``Flag``, ``Text``: :class:`Allowed` metadata), and ``_Section``, the
frozen base of every section."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


#: the name callers import it by (``megatron_ft.config``), which tracebacks and worked examples print
ConfigError.__module__ = "megatron_ft.config"


def _fail(path: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: {allowed}")


def _check_int(path: str, value: Any, minimum: int, maximum: Optional[int] = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (
        maximum is not None and value > maximum
    ):
        hi = f" and <= {maximum}" if maximum is not None else ""
        _fail(path, value, f"must be an integer >= {minimum}{hi}")


def _check_num(path: str, value: Any, minimum: float = 0.0, maximum: Optional[float] = None,
               strict: bool = False) -> None:
    """A real number >= minimum (> minimum when ``strict``) and <= maximum."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
            or (value <= minimum if strict else value < minimum) or (maximum is not None and value > maximum)):
        lo = f"> {minimum}" if strict else f">= {minimum}"
        hi = f" and <= {maximum}" if maximum is not None else ""
        _fail(path, value, f"must be a number {lo}{hi}")


AUTO = "auto"

#: the redundancy schemes, defined once (the planners and the simulator use these)
Scheme = Literal["none", "replica", "xor", "rs"]
SCHEMES: tuple[str, ...] = get_args(Scheme)
Transport = Literal["agent", "scheduled"]
Prefer = Literal["newest", "certified"]
Mode = Literal["pipelined", "one-buffer", "naive", "blocking", "bubble", "end"]
Idle = Literal["network", "device", "auto"]
#: compare_modes only: "local" = snapshots, no peer traffic; "off" = no snapshots either
Baseline = Literal["local", "off"]
CompareMode = Literal[get_args(Mode) + get_args(Baseline)]  # type: ignore[valid-type]


class Allowed(str):
    """Annotated metadata: what a field allows, in the words every message uses."""


def _int(minimum: int, maximum: Optional[int] = None) -> Any:
    hi = f" and <= {maximum}" if maximum is not None else ""
    return Annotated[StrictInt, Field(ge=minimum, le=maximum), Allowed(f"must be an integer >= {minimum}{hi}")]


def _num(minimum: float = 0.0, maximum: Optional[float] = None, strict: bool = False) -> Any:
    lo = f"> {minimum}" if strict else f">= {minimum}"
    hi = f" and <= {maximum}" if maximum is not None else ""
    bound = Field(gt=minimum, le=maximum) if strict else Field(ge=minimum, le=maximum)
    return Annotated[StrictFloat, bound, Allowed(f"must be a number {lo}{hi}")]


def _choice(t: Any) -> Any:
    return Annotated[t, Allowed(f"must be one of {', '.join(get_args(t))}")]


Flag = Annotated[StrictBool, Allowed("must be true or false")]
Text = Annotated[StrictStr, Field(min_length=1), Allowed("must be a non-empty string")]


class _Section(BaseModel):
    """A frozen section: unknown keys, wrong types and out-of-range values are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_default=True)
