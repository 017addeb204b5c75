"""The snapshot container: one format for an agent's shared-memory slot and a persisted file.

::

    [0, 4096)                    header (struct below, little-endian)
    [layout_off, +layout_len)    layout record (JSON, megatron_ft.capture.layout), fixed per run
    [version_off, +version_cap)  version record (JSON): step, chunk checksums, non-tensor state
    [data_off, +data_len)        the flat data area described by the layout (4096-aligned)

Header fields: magic ``MFTSNAP1``, format version, state (EMPTY / WRITING / CLEAN), step,
offsets and lengths of the three regions, and CRC32s of the two JSON records. Only the agent
flips ``state`` to CLEAN, and only after the writer has finished every chunk and the version
record, so a torn write can never look clean; the chunk checksums catch corruption after that.
No pickle: JSON and raw bytes only.
"""
from __future__ import annotations

import functools
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Optional

from .layout import Layout

MAGIC = b"MFTSNAP1"
#: the version record names the chunk checksum (capture/checksum.py READS): format 3 writes fl32x8-v1;
#: formats 2 (fl64x4-v2) and 1 (fl64x4-v1) are still read
FORMAT_VERSION = 3
READS = (1, 2, 3)
HEADER_SIZE = 4096
VERSION_FORMAT = "megatron-ft-version"

EMPTY, WRITING, CLEAN = 0, 1, 2
STATE_NAMES = {EMPTY: "empty", WRITING: "writing", CLEAN: "clean"}

# magic, format_version, state, step, layout_off, layout_len, layout_crc, version_off, version_cap,
# version_len, version_crc, data_off, data_len
_HDR = struct.Struct("<8sIIqQQIQQQIQQ")
STATE_OFFSET = 12  # byte offset of the 'state' field (u32)


class SnapshotFormatError(ValueError):
    """The container is torn, corrupt, or not what the reader expected."""


def _align(n: int, a: int = 4096) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Geometry:
    """Region offsets of a container for a given layout."""

    layout_off: int
    layout_len: int
    version_off: int
    version_cap: int
    data_off: int
    data_len: int

    @property
    def total(self) -> int:
        return self.data_off + _align(max(self.data_len, 1))


def geometry_for(layout: Layout, layout_json: Optional[bytes] = None) -> Geometry:
    lj = layout_json if layout_json is not None else layout.to_json()
    layout_off = HEADER_SIZE
    version_off = _align(layout_off + len(lj))
    # chunk checksums (~21 chars each) + non-tensor state (RNG, scheduler, param groups)
    version_cap = _align((1 << 20) + 32 * layout.num_chunks)
    data_off = version_off + version_cap
    return Geometry(layout_off, len(lj), version_off, version_cap, data_off, layout.data_nbytes)


@dataclass(frozen=True)
class Header:
    state: int
    step: int
    geometry: Geometry
    layout_crc: int
    version_len: int
    version_crc: int

    def pack(self) -> bytes:
        g = self.geometry
        return _HDR.pack(MAGIC, FORMAT_VERSION, self.state, self.step, g.layout_off, g.layout_len,
                         self.layout_crc, g.version_off, g.version_cap, self.version_len, self.version_crc,
                         g.data_off, g.data_len)


def read_header(buf: Any) -> Header:
    raw = bytes(buf[: _HDR.size])
    if len(raw) < _HDR.size:
        raise SnapshotFormatError("container shorter than its header")
    (magic, fmt, state, step, l_off, l_len, l_crc, v_off, v_cap, v_len, v_crc, d_off, d_len) = _HDR.unpack(raw)
    if magic != MAGIC:
        raise SnapshotFormatError(f"bad magic {magic!r}: not a megatron-ft snapshot")
    if fmt not in READS:
        raise SnapshotFormatError(f"snapshot format version {fmt} is not supported (this build reads {READS})")
    if state not in STATE_NAMES:
        raise SnapshotFormatError(f"bad state {state}")
    return Header(state, step, Geometry(l_off, l_len, v_off, v_cap, d_off, d_len), l_crc, v_len, v_crc)


def init_container(buf: Any, layout_json: bytes, geometry: Geometry) -> None:
    """Write an EMPTY header and the layout record into a fresh container."""
    buf[geometry.layout_off: geometry.layout_off + len(layout_json)] = layout_json
    hdr = Header(EMPTY, -1, geometry, zlib.crc32(layout_json), 0, 0)
    buf[: _HDR.size] = hdr.pack()


def set_state(buf: Any, state: int) -> None:
    buf[STATE_OFFSET: STATE_OFFSET + 4] = struct.pack("<I", state)


def write_version(buf: Any, step: int, record: dict) -> None:
    """Write the version record and the step into the header (state is left as it is)."""
    hdr = read_header(buf)
    raw = json.dumps({"format": VERSION_FORMAT, "version": 1, "step": step, **record},
                     separators=(",", ":")).encode()
    g = hdr.geometry
    if len(raw) > g.version_cap:
        raise SnapshotFormatError(
            f"version record is {len(raw)} bytes but the container reserves {g.version_cap}: "
            f"too much non-tensor state"
        )
    buf[g.version_off: g.version_off + len(raw)] = raw
    new = Header(hdr.state, step, g, hdr.layout_crc, len(raw), zlib.crc32(raw))
    buf[: _HDR.size] = new.pack()


def read_layout(buf: Any, hdr: Optional[Header] = None) -> Layout:
    hdr = hdr or read_header(buf)
    g = hdr.geometry
    raw = bytes(buf[g.layout_off: g.layout_off + g.layout_len])
    if zlib.crc32(raw) != hdr.layout_crc:
        raise SnapshotFormatError("layout record checksum mismatch")
    return _parsed_layout(raw)


@functools.lru_cache(maxsize=8)
def _parsed_layout(raw: bytes) -> Layout:
    """``raw`` parsed (and its fingerprint checked) once per process for the same bytes: a rank's layout
    is the same in every snapshot, and a restore spent part of its time before the first copy parsing it
    again (docs/benchmarks.md, "the restore's own work before its first copy"). :class:`Layout` is
    frozen, so one object serves every caller; a few layouts are kept (a process restores its own rank,
    a rebuild its peers')."""
    try:
        return Layout.from_json(raw)
    except (ValueError, KeyError) as e:
        raise SnapshotFormatError(f"layout record unreadable: {e}") from None


def read_version(buf: Any, hdr: Optional[Header] = None) -> dict:
    hdr = hdr or read_header(buf)
    g = hdr.geometry
    raw = bytes(buf[g.version_off: g.version_off + hdr.version_len])
    if hdr.version_len == 0 or zlib.crc32(raw) != hdr.version_crc:
        raise SnapshotFormatError("version record missing or checksum mismatch (torn snapshot)")
    rec = json.loads(raw)
    if rec.get("format") != VERSION_FORMAT or rec.get("step") != hdr.step:
        raise SnapshotFormatError(f"version record does not match header step {hdr.step}")
    return rec
