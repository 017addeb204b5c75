"""Erasure codecs for peer-memory redundancy.

Shards are equal-length, caller-preallocated ``numpy.uint8`` arrays; indices ``0..k-1`` are
data, ``k..k+m-1`` parity::

    from megatron_ft.redundancy.codecs import get_codec

    codec = get_codec("rs", k=4, m=2)              # rs-isal if ISA-L is found, else rs-numpy
    codec.encode(data_shards, parity_buffers)      # in place, no copies
    record["codec"] = codec.descriptor.to_json()   # store with the snapshot version

    dec = get_codec(record["codec"])               # exactly the codec that wrote the parity
    dec.decode({0: d0, 2: d2, 4: p4, 5: p5}, erased=[1, 3], out={1: buf1, 3: buf3})

Codecs: ``xor`` (:class:`XorCodec`, m=1, REFT's RAIM5), ``rs-isal`` (:class:`IsalRSCodec`,
Cauchy Reed-Solomon on ISA-L through ctypes) and ``rs-numpy`` (:class:`BitmatrixRSCodec`,
XOR-only Cauchy bit-matrix code). ``rs-isal`` and ``rs-numpy`` are not byte-compatible; a
decoder refuses a descriptor that is not its own (:class:`CodecMismatchError`).
"""
from .base import (RS_MAX_K, RS_MAX_M, XOR_MAX_K, Codec, CodecBufferError, CodecDecodeError, CodecDescriptor,
                   CodecDescriptorError, CodecError, CodecMismatchError, CodecParameterError, CodecUnavailableError)
from . import gf256
from .bitmatrix import BitmatrixRSCodec
from .factory import CODEC_NAMES, codec_status, get_codec
from .isal import IsalLibrary, IsalRSCodec, isal_available, load_isal
from .xor import XorCodec

__all__ = [
    "Codec", "CodecDescriptor", "get_codec", "codec_status", "CODEC_NAMES",
    "XorCodec", "IsalRSCodec", "BitmatrixRSCodec", "IsalLibrary", "load_isal", "isal_available",
    "CodecError", "CodecParameterError", "CodecBufferError", "CodecDecodeError", "CodecUnavailableError",
    "CodecDescriptorError", "CodecMismatchError", "RS_MAX_K", "RS_MAX_M", "XOR_MAX_K",
]
