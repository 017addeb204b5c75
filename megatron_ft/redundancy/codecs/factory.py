"""``get_codec``: build a codec by name for encoding, or from a recorded descriptor for decoding."""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional, Union

from .base import (Codec, CodecDescriptor, CodecDescriptorError, CodecMismatchError, CodecParameterError,
                   DescriptorLike)
from .bitmatrix import DEFAULT_PACKET_BYTES, BitmatrixRSCodec
from .isal import INSTALL_HINT, IsalRSCodec, load_isal
from .xor import XorCodec

log = logging.getLogger("megatron_ft.redundancy.codecs")

#: names accepted by :func:`get_codec`
CODEC_NAMES = ("xor", "rs", "rs-isal", "rs-numpy")


def _is_descriptor(spec: Any) -> bool:
    return isinstance(spec, (CodecDescriptor, Mapping)) or (
        isinstance(spec, str) and spec.lstrip().startswith("{"))


def get_codec(spec: Union[str, DescriptorLike], k: Optional[int] = None, m: Optional[int] = None, *,
              threads: int = 1, packet_bytes: Optional[int] = None) -> Codec:
    """Return a codec.

    ``spec`` is either a name or a recorded descriptor (:class:`CodecDescriptor`, its dict, or
    its JSON).

    By name (for encoding a new version):
      * ``"xor"``: XOR parity, ``m`` must be 1 (default 1);
      * ``"rs"``: Reed-Solomon, ISA-L (``"rs-isal"``) when the library is found, otherwise the
        numpy bit-matrix code (``"rs-numpy"``) with a logged warning saying why;
      * ``"rs-isal"``: ISA-L or :class:`CodecUnavailableError` with install instructions;
      * ``"rs-numpy"``: the numpy bit-matrix code (``packet_bytes`` optional).

    From a descriptor (for decoding): the codec that produces exactly the recorded bytes; if
    ``k``/``m`` are given they must agree. An ``rs-isal`` descriptor decodes even without ISA-L,
    on the slow numpy reference coder (same bytes; a warning is logged).
    """
    if _is_descriptor(spec):
        desc = CodecDescriptor.from_any(spec)
        for what, want in (("k", k), ("m", m)):
            if want is not None and want != getattr(desc, what):
                raise CodecMismatchError(
                    f"codec mismatch: the recorded descriptor {desc.short()} has {what}={getattr(desc, what)} "
                    f"but {what}={want} was requested", [(what, getattr(desc, what), want)])
        if desc.name == "xor":
            codec: Codec = XorCodec(desc.k, desc.m, threads=threads)
        elif desc.name == "rs-isal":
            codec = IsalRSCodec(desc.k, desc.m, threads=threads, allow_reference=True)
        elif desc.name == "rs-numpy":
            codec = BitmatrixRSCodec(desc.k, desc.m, threads=threads,
                                     packet_bytes=desc.packet_bytes or DEFAULT_PACKET_BYTES)
        else:
            raise CodecDescriptorError(
                f"the recorded codec {desc.name!r} is unknown to this build (known: xor, rs-isal, rs-numpy); "
                f"cannot decode {desc.short()}")
        codec.check(desc)  # version, matrix fingerprint, layout: everything must match
        return codec

    if not isinstance(spec, str):
        raise CodecParameterError(f"codec must be a name {CODEC_NAMES} or a descriptor, got {spec!r}")
    name = spec.strip().lower()
    if name not in CODEC_NAMES:
        raise CodecParameterError(f"unknown codec {spec!r}; choose one of {', '.join(CODEC_NAMES)}")
    if k is None:
        raise CodecParameterError(f"get_codec({spec!r}) needs k (number of data shards)")
    if packet_bytes is not None and name not in ("rs", "rs-numpy"):
        raise CodecParameterError(f"packet_bytes only applies to the rs-numpy codec, not {name!r}")
    if name == "xor":
        return XorCodec(k, 1 if m is None else m, threads=threads)
    if m is None:
        raise CodecParameterError(f"get_codec({spec!r}) needs m (number of parity shards)")
    if name == "rs-isal":
        return IsalRSCodec(k, m, threads=threads)
    if name == "rs":
        lib, problems = load_isal()
        if lib is not None:
            return IsalRSCodec(k, m, threads=threads)
        codec = BitmatrixRSCodec(k, m, threads=threads, packet_bytes=packet_bytes or DEFAULT_PACKET_BYTES)
        log.warning("ISA-L not found (%s): falling back to the numpy bit-matrix codec 'rs-numpy' (k=%d, m=%d), "
                    "slower than ISA-L and not byte-compatible with 'rs-isal' (the descriptor records which one "
                    "was used). To use ISA-L, %s.", "; ".join(problems), k, m, INSTALL_HINT)
        codec.fallback_reason = "; ".join(problems)  # type: ignore[attr-defined]
        return codec
    return BitmatrixRSCodec(k, m, threads=threads, packet_bytes=packet_bytes or DEFAULT_PACKET_BYTES)


def codec_status() -> Dict[str, str]:
    """One line per codec saying whether (and how) it is available here."""
    lib, problems = load_isal()
    return {
        "xor": "available (numpy)",
        "rs-isal": (f"available (ISA-L {lib.path}, from {lib.source})" if lib is not None else
                    f"not available: {'; '.join(problems)}; decoding recorded rs-isal parity falls back to "
                    f"the slow numpy reference"),
        "rs-numpy": "available (numpy bit-matrix)",
        "rs": "uses " + ("rs-isal" if lib is not None else "rs-numpy (ISA-L missing)"),
    }
