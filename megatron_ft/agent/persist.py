"""Persisted snapshots on disk: the same container bytes as in shared memory, written atomically.

Directory layout::

    <persist.dir>/<run_id>/step_0000000120/rank_00003.mft

Each rank file is written to a temporary name, fsynced, renamed, and the directory fsynced, so
a file either exists whole or not at all. A step is *complete* when every rank of the world
has its file; restore still verifies every chunk checksum. Each agent writes its own ranks and
keeps the newest ``persist.keep`` steps of them.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Iterable, Optional

import numpy as np

from ..capture import checksum, snapfile  # imported with the agent: its first persist must not pay for imports

_STEP_RE = re.compile(r"step_(\d{10})$")
_RANK_RE = re.compile(r"rank_(\d{5})\.mft$")
_WRITE_BLOCK = 64 << 20


def run_dir(base: str, run_id: str) -> str:
    return os.path.join(base, run_id)


def step_dir(base: str, run_id: str, step: int) -> str:
    return os.path.join(base, run_id, f"step_{step:010d}")


def rank_file(base: str, run_id: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(base, run_id, step), f"rank_{rank:05d}.mft")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_container(buf, path: str) -> int:
    """Atomically write the used part of a CLEAN container (header, records, data) to ``path``."""
    hdr = snapfile.read_header(buf)
    if hdr.state != snapfile.CLEAN:
        raise ValueError(f"refusing to persist a {snapfile.STATE_NAMES[hdr.state]} container")
    end = hdr.geometry.data_off + hdr.geometry.data_len
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(buf)
        for off in range(0, end, _WRITE_BLOCK):
            chunk = view[off: min(end, off + _WRITE_BLOCK)]
            written = 0
            while written < len(chunk):
                written += os.write(fd, chunk[written:])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    return end


def verify_container(buf) -> None:
    """Raise :class:`~megatron_ft.capture.snapfile.SnapshotFormatError` unless ``buf`` holds a CLEAN
    container whose record is well formed and every chunk matches its checksum."""
    hdr = snapfile.read_header(buf)
    if hdr.state != snapfile.CLEAN:
        raise snapfile.SnapshotFormatError(f"container is {snapfile.STATE_NAMES[hdr.state]}, not clean")
    layout = snapfile.read_layout(buf, hdr)
    version = snapfile.read_version(buf, hdr)
    sums = version.get("chunks", [])
    if version.get("checksum") not in checksum.READS or len(sums) != layout.num_chunks:
        raise snapfile.SnapshotFormatError(f"record has {len(sums)} {version.get('checksum')} checksums for "
                                           f"{layout.num_chunks} chunks")
    data_off = hdr.geometry.data_off
    if len(buf) < data_off + layout.data_nbytes:
        raise snapfile.SnapshotFormatError(f"container ends early ({len(buf)} bytes, needs "
                                           f"{data_off + layout.data_nbytes})")
    for i in range(layout.num_chunks):
        lo, hi = layout.chunk_bounds(i)
        got = checksum.checksum(np.frombuffer(buf, np.uint8, hi - lo, data_off + lo), version["checksum"])
        if f"{got:016x}" != sums[i]:
            raise snapfile.SnapshotFormatError(f"chunk {i} checksum mismatch (stored {sums[i]}, computed {got:016x})")


def list_steps(base: str, run_id: str) -> dict[int, set[int]]:
    """step -> set of ranks that have a (whole) file for it."""
    out: dict[int, set[int]] = {}
    root = run_dir(base, run_id)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        m = _STEP_RE.match(name)
        if not m:
            continue
        ranks = set()
        for f in os.listdir(os.path.join(root, name)):
            r = _RANK_RE.match(f)
            if r:
                ranks.add(int(r.group(1)))
        out[int(m.group(1))] = ranks
    return out


def complete_steps(base: str, run_id: str, world_size: int) -> list[int]:
    """Steps for which every rank 0..world_size-1 has a file, newest first."""
    want = set(range(world_size))
    return sorted((s for s, ranks in list_steps(base, run_id).items() if want <= ranks), reverse=True)


def prune(base: str, run_id: str, ranks: Iterable[int], keep: int, protect: Optional[int] = None) -> list[str]:
    """Delete the files of ``ranks`` for all but the newest ``keep`` steps (never ``protect``)."""
    removed = []
    ranks = set(ranks)
    steps = list_steps(base, run_id)
    mine = sorted((s for s, rs in steps.items() if rs & ranks), reverse=True)
    for s in mine[keep:]:
        if s == protect:
            continue
        for r in ranks & steps[s]:
            p = rank_file(base, run_id, s, r)
            try:
                os.unlink(p)
                removed.append(p)
            except FileNotFoundError:
                pass
        d = step_dir(base, run_id, s)
        try:
            if not any(_RANK_RE.match(f) for f in os.listdir(d)):
                shutil.rmtree(d, ignore_errors=True)
        except FileNotFoundError:
            pass
    return removed
