"""The agents' peer protocol: requests one agent sends another on the peer transport
(:mod:`megatron_ft.transport.wire`, TCP), typed and validated on receipt
(:mod:`megatron_ft.transport.messages`). Contributions travel as the peer byte transport's ``put``
(:mod:`megatron_ft.transport.wire_bytes`); what the agents say about them rides in its ``meta``
(:class:`PutMeta`, validated where it lands).

==========  =====================================================  ==============================
op          request                                                reply
==========  =====================================================  ==============================
put         step, key, src, meta (:class:`PutMeta`) + payload      landed | declined (stale)
announce    node, step (the sender holds its blocks of step)       -
holds       -                                                      primary, blocks, codecs, sizes,
                                                                   complete, pid
get         what (primary | block), step, lo, hi, rank | key       the bytes [lo, hi)
==========  =====================================================  ==============================
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..transport.messages import Bytes, Messages, Node, Rank, Request, Step
from ..transport.wire_bytes import PutBytes


class PutMeta(BaseModel):
    """A contribution's ``meta`` on the peer byte transport: the block's ``kind`` and ``length``, how many
    nodes contribute to it (``expect``), and the exchange's ``sizes`` (rank -> bytes) and RS ``codec``."""
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    kind: Literal["copy", "xor", "rs"]
    length: Bytes  # the block's length
    expect: Annotated[StrictInt, Field(ge=1)]  # contributors to the block
    sizes: dict[str, Bytes] = {}
    codec: Optional[dict] = None


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
PEER_MESSAGES = Messages("peer", {"put": PutBytes, "announce": Announce, "holds": Request, "get": Get})
