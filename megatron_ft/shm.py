"""Shared-memory segments: files in a tmpfs directory (``/dev/shm``), mapped with mmap.

The agent creates and owns the segments; trainers map them to write snapshots and to read
them back on restore. Segments are allocated and pre-faulted once (first touch of a tmpfs
page runs ~10x slower than writing a touched one) and reused for every later snapshot.
``posix_fallocate`` reserves the pages up front, so a /dev/shm that is too small fails at
creation with a clear message instead of SIGBUS in the middle of a snapshot.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SharedMemoryError(RuntimeError):
    pass


def shm_free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


@dataclass
class Segment:
    path: str
    size: int
    mm: mmap.mmap

    @property
    def array(self) -> np.ndarray:
        return np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # a numpy/torch view still exists; the mapping goes away with the process
            pass


def create(path: str, size: int, budget: Optional[int] = None) -> Segment:
    """Create (or re-create) a segment of ``size`` bytes, reserve and pre-fault its pages.

    ``budget``: bytes the caller may still allocate under its configured limit (None: no limit)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise SharedMemoryError(f"shared-memory directory {directory!r} does not exist")
    if budget is not None and size > budget:
        raise SharedMemoryError(
            f"shared memory too small: segment {os.path.basename(path)} needs {size / 2**20:.1f} MiB but only "
            f"{budget / 2**20:.1f} MiB of the agent's budget is left; raise agent.shm_limit_mib "
            f"(or set it to 0 to use all of {directory})")
    free = shm_free_bytes(directory)
    if size > free:
        raise SharedMemoryError(
            f"shared memory too small: segment {os.path.basename(path)} needs {size / 2**20:.1f} MiB but "
            f"{directory} has {free / 2**20:.1f} MiB free; enlarge it (e.g. docker --shm-size, or "
            f"`mount -o remount,size=... {directory}`) or point agent.shm_dir at a larger tmpfs"
        )
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.unlink(path)
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise SharedMemoryError(
                    f"shared memory too small: could not reserve {size / 2**20:.1f} MiB in {directory} "
                    f"({shm_free_bytes(directory) / 2**20:.1f} MiB free)"
                ) from None
            raise
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)
    return Segment(path, size, mm)


def open_segment(path: str, writable: bool = True, populate: bool = True) -> Segment:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise SharedMemoryError(f"segment {path} is empty")
        flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=prot)
    finally:
        os.close(fd)
    return Segment(path, size, mm)


def segment_name(run_id: str, node: int, rank: int, slot: int) -> str:
    return f"mft.{run_id}.n{node}.r{rank}.s{slot}"


_NAME_RE = re.compile(r"mft\.(?P<run>[A-Za-z0-9_.-]+)\.n(?P<node>\d+)\.r(?P<rank>\d+)\.s(?P<slot>\d+)$")


def parse_segment_name(name: str) -> Optional[tuple[str, int, int, int]]:
    m = _NAME_RE.match(name)
    if not m:
        return None
    return m["run"], int(m["node"]), int(m["rank"]), int(m["slot"])


def list_segments(shm_dir: str, run_id: str, node: int) -> list[tuple[int, int, str]]:
    """(rank, slot, path) of the segments a node's agent owns for ``run_id``."""
    out = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    for name in names:
        p = parse_segment_name(name)
        if p and p[0] == run_id and p[1] == node:
            out.append((p[2], p[3], os.path.join(shm_dir, name)))
    return sorted(out)
