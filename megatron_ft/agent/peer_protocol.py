"""The agents' peer protocol: requests one agent sends another on the peer transport
(:mod:`megatron_ft.transport.wire`, TCP), typed and validated on receipt
(:mod:`megatron_ft.transport.messages`).

==========  =====================================================  ==============================
op          request                                                reply
==========  =====================================================  ==============================
put         key, kind, step, length, src, expect, meta + payload   - | ignored (stale or refused)
announce    node, step (the sender holds its blocks of step)       -
holds       -                                                      primary, blocks, codecs, sizes,
                                                                   complete, pid
get         what (primary | block), step, lo, hi, rank | key       the bytes [lo, hi)
==========  =====================================================  ==============================
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, StrictInt, StrictStr

from ..transport.messages import Bytes, Messages, Node, Rank, Request, Step


class Put(Request):
    """A contribution to block ``key`` of ``step`` (``nbytes`` of payload follow the frame)."""
    key: StrictStr
    kind: Literal["copy", "xor", "rs"]
    step: Step
    length: Bytes  # the block's length
    src: Node
    expect: Annotated[StrictInt, Field(ge=1)]  # contributors to the block
    meta: dict  # {"sizes": {rank: bytes}, "codec": descriptor or None}


class Announce(Request):
    """``node`` holds every block the plan gives it for ``step``."""
    node: Node
    step: Step


class Get(Request):
    """Bytes [lo, hi) of a clean primary (``rank``) or a complete block (``key``) of ``step``."""
    what: Literal["primary", "block"]
    step: Step
    lo: Bytes
    hi: Bytes
    rank: Optional[Rank] = None
    key: Optional[StrictStr] = None


#: the agents' peer protocol (requests from the group's agents on the peer transport)
PEER_MESSAGES = Messages("peer", {"put": Put, "announce": Announce, "holds": Request, "get": Get})
