"""Typed requests for the wire (:mod:`.wire`): one model per operation, validated where a request
is received, so a malformed or mistyped request is refused with the operation, the field, its value
and what is allowed - before any handler code runs.

A protocol is a :class:`Messages` table (``op`` -> model). Fields are strict: an ``int`` field
takes a JSON integer, not a string or a float; unknown fields are refused. The wire's own fields
(``v``, ``nbytes``, ``wait_s``, ``run_id``) are accepted by every model and checked by the wire.

    >>> class Begin(Request):
    ...     rank: Rank
    ...     step: Step
    >>> table = Messages("agent", {"begin": Begin})
    >>> table.parse({"v": 1, "op": "begin", "rank": 0, "step": 3}).step
    3
    >>> table.parse({"v": 1, "op": "begin", "rank": 0, "step": "3"})
    Traceback (most recent call last):
    ...
    ValueError: agent op 'begin': step='3' is invalid: Input should be a valid integer
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from .wire import WIRE_VERSION

Rank = Annotated[StrictInt, Field(ge=0)]
Step = Annotated[StrictInt, Field(ge=-1)]  # -1: none (a fresh start)
Node = Annotated[StrictInt, Field(ge=0)]
Bytes = Annotated[StrictInt, Field(ge=0)]


class Request(BaseModel):
    """Fields every request may carry: the wire's (``v``, ``nbytes``, ``wait_s``) and the run's.
    A sender builds the model and sends :meth:`fields` (the wire adds ``v`` and ``nbytes``)."""
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    v: StrictInt = WIRE_VERSION
    op: StrictStr
    nbytes: Bytes = 0
    wait_s: Optional[Annotated[float, Field(ge=0, strict=False)]] = None
    run_id: Optional[StrictStr] = None

    def fields(self) -> dict:
        """The keyword arguments of :meth:`.wire.Client.request` for this request."""
        return self.model_dump(exclude={"v", "nbytes"}, exclude_none=True)


class Messages:
    """The operations of one protocol (``name`` appears in every refusal)."""

    def __init__(self, name: str, ops: dict[str, type[Request]]):
        self.name, self.ops = name, dict(ops)

    def parse(self, msg: dict) -> Request:
        op = msg.get("op")
        model = self.ops.get(op) if isinstance(op, str) else None
        if model is None:
            raise ValueError(f"{self.name} op {op!r} is unknown; allowed: {sorted(self.ops)}")
        return validated(model, msg, f"{self.name} op {op!r}")


def validated(model: type[BaseModel], data: dict, what: str) -> Any:
    """``data`` as ``model``, or ValueError naming ``what``, the field, its value and what is allowed.

    >>> class Meta(BaseModel):
    ...     kind: Literal["copy", "xor"]
    >>> validated(Meta, {"kind": "rs"}, "put meta")
    Traceback (most recent call last):
    ...
    ValueError: put meta: kind='rs' is invalid: Input should be 'copy' or 'xor'
    """
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "request"
        value = data.get(str(err["loc"][0])) if err["loc"] and isinstance(data, dict) else data
        if err["type"] == "missing":
            raise ValueError(f"{what}: field {field!r} is missing") from None
        if err["type"] == "extra_forbidden":
            raise ValueError(f"{what}: field {field!r} is not one of {sorted(model.model_fields)}") from None
        raise ValueError(f"{what}: {field}={value!r} is invalid: {err['msg']}") from None

