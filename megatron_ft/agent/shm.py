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
from typing import Callable, Optional

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


# ---------------------------------------------------------------------------------- page size
# A tmpfs mounted with ``huge=always`` (or ``within_size``) backs files with 2 MiB pages. On this
# kind of machine that makes a restore's read ~2.5x cheaper in CPU (no per-4-KiB-page work in the
# kernel), mapping a populated 1 GiB slot ~100x cheaper (512x fewer page-table entries) and the
# first touch of a new slot cheaper. ``megatron-ft shm-mount DIR --size S`` mounts one (root).
HUGE, ADVISE, SMALL = "huge", "advise", "small"
_THP_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _mount_of(path: str, mounts: str) -> Optional[tuple[str, str, list[str]]]:
    """(mount point, fs type, options) of the mount holding ``path`` (longest matching mount point)."""
    best = None
    for line in mounts.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        point = f[1].replace("\\040", " ")
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best[0]):
                best = (point, f[2], f[3].split(","))
    return best


def page_backing(directory: str, mounts: Optional[str] = None, thp_shmem: Optional[str] = None) -> str:
    """How a tmpfs directory backs its files: ``huge`` (2 MiB pages for every file), ``advise``
    (only mappings that ask, madvise) or ``small`` (4 KiB pages; also: not a tmpfs, or unknown).

    ``mounts`` (``/proc/mounts`` text) and ``thp_shmem`` (the ``shmem_enabled`` line, whose
    ``[choice]`` is the setting; ``force``/``deny`` override every tmpfs) are read from the
    system when not given."""
    try:
        if mounts is None:
            with open("/proc/mounts", encoding="utf-8") as f:
                mounts = f.read()
        if thp_shmem is None:
            with open(_THP_SHMEM, encoding="utf-8") as f:
                thp_shmem = f.read()
    except OSError:
        mounts, thp_shmem = mounts or "", thp_shmem or ""
    chosen = re.search(r"\[(\w[\w_]*)\]", thp_shmem)
    override = chosen.group(1) if chosen else ""
    m = _mount_of(os.path.realpath(directory), mounts)
    if m is None or m[1] != "tmpfs":
        return SMALL
    if override == "deny":
        return SMALL
    if override == "force":
        return HUGE
    huge = next((o.split("=", 1)[1] for o in m[2] if o.startswith("huge=")), "never")
    return {"always": HUGE, "within_size": HUGE, "advise": ADVISE}.get(huge, SMALL)


_CLASSIFIED: dict[tuple[str, int], tuple[str, bool]] = {}


def _classified(directory: str) -> tuple[str, bool]:
    """(:func:`page_backing`, whether it is a tmpfs) of ``directory``, read from the system once per process
    and mount: keyed by the directory and its device (a tmpfs mounted there later is another device). A
    restore asks for every container it opens, before its first copy. A change of ``shmem_enabled`` while
    the process runs is not seen (it decides only how a restore reads the slot: speed, not what is read)."""
    try:
        key = (directory, os.stat(directory).st_dev)
    except OSError:
        return SMALL, False
    found = _CLASSIFIED.get(key)
    if found is None:
        try:
            with open("/proc/mounts", encoding="utf-8") as f:
                mounts = f.read()
        except OSError:
            mounts = ""
        mount = _mount_of(os.path.realpath(directory), mounts)
        found = _CLASSIFIED[key] = (page_backing(directory, mounts), mount is not None and mount[1] == "tmpfs")
    return found


def backing_of(directory: str) -> str:
    """:func:`page_backing` of ``directory``, once per process and mount (:func:`_classified`)."""
    return _classified(directory)[0]


def is_tmpfs(directory: str) -> bool:
    """Whether ``directory`` is on a tmpfs, once per process and mount (:func:`_classified`)."""
    return _classified(directory)[1]


_SIZE_RE = re.compile(r"^[1-9][0-9]*[kKmMgG%]?$")
HUGE_MODES = ("always", "within_size", "advise")


def backing_note(directory: str) -> str:
    """What the agent's log says of ``directory``'s pages (and, with 4 KiB ones, how to get huge pages)."""
    if page_backing(directory) == HUGE:
        return f"shared memory in {directory} (2 MiB pages)"
    return (f"shared memory in {directory} (4 KiB pages; a huge-page tmpfs maps a slot ~100x faster, which a "
            f"fresh trainer's restore pays once: "
            f"`megatron-ft shm-mount DIR --size S` (root), then agent.shm_dir: DIR)")


def mount_command(directory: str, size: str, huge: str = "always") -> list[str]:
    """``mount`` argv for a tmpfs at ``directory`` of ``size`` (tmpfs syntax: bytes, or k/m/g
    suffix, or % of RAM) with ``huge`` pages; bad values raise ValueError naming them."""
    if not _SIZE_RE.match(size or ""):
        raise ValueError(f"size {size!r} is not a tmpfs size: a positive number with an optional k, m, g or % "
                         f"suffix (e.g. 20g or 80%)")
    if huge not in HUGE_MODES:
        raise ValueError(f"huge {huge!r} is not one of {list(HUGE_MODES)}")
    if not os.path.isabs(directory):
        raise ValueError(f"directory {directory!r} must be an absolute path")
    return ["mount", "-t", "tmpfs", "-o", f"size={size},huge={huge},mode=1777", "megatron-ft-shm", directory]


def mount_huge_tmpfs(directory: str, size: str, huge: str = "always") -> str:
    """Mount a huge-page tmpfs at ``directory`` (created if missing; needs root or CAP_SYS_ADMIN)
    and return its :func:`page_backing`. An existing mount there is left alone and reported."""
    import subprocess

    cmd = mount_command(directory, size, huge)
    here = None
    if os.path.isdir(directory):
        with open("/proc/mounts", encoding="utf-8") as f:
            here = _mount_of(os.path.realpath(directory), f.read())
    if here is not None and here[0] == os.path.realpath(directory):
        raise SharedMemoryError(f"{directory} is already a mount point ({here[1]}, {','.join(here[2])}); "
                                f"unmount it first (umount {directory}) or use it as it is")
    os.makedirs(directory, exist_ok=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SharedMemoryError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()} "
                                f"(mounting needs root or CAP_SYS_ADMIN)")
    return page_backing(directory)


#: the longest file name a segment may have (NAME_MAX of Linux file systems, tmpfs included)
MAX_NAME = 255


def _named(name: str) -> str:
    if len(name.encode()) > MAX_NAME:
        raise ValueError(f"shared-memory segment name {name!r} has {len(name.encode())} bytes, file names "
                         f"allow {MAX_NAME}; use a shorter run_id")
    return name


def segment_name(run_id: str, node: int, rank: int, slot: int) -> str:
    """``mft.<run>.n<node>.r<rank>.s<slot>``: rank ``rank``'s slot on ``node``; decimal without padding,
    any size (a 64-character run id, node and rank 9,999,999: 89 bytes, under :data:`MAX_NAME`).

    >>> parse_segment_name(segment_name("job", 124_999, 999_999, 1))
    ('job', 124999, 999999, 1)
    """
    for what, v in (("node", node), ("rank", rank), ("slot", slot)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{what}={v!r} is invalid: a non-negative integer")
    return _named(f"{node_prefix(run_id, node)}r{rank}.s{slot}")


def block_segment_name(run_id: str, node: int, key: str, serial: int) -> str:
    """A peer block version held by ``node``'s agent. ``serial`` is unique per agent process
    (a counter), so a new version never reuses the file of one that still exists."""
    return _named(f"{node_prefix(run_id, node)}{os.getpid()}.blk.{key}.{serial}")


def import_segment_name(run_id: str, node: int, old_rank: int) -> str:
    """``mft.<run>.n<node>.in<old rank>``: the previous generation's rank ``old_rank``'s container, held for
    node ``node`` of the generation running as ``run_id`` (its trainers restore from it re-sliced).

    >>> import_segment_name("job.e1", 0, 5), bool(held_by("mft.job.e1.n0.in5", "job.e1", 0))
    ('mft.job.e1.n0.in5', True)
    """
    return _named(f"{node_prefix(run_id, node)}in{int(old_rank)}")


def remove_segments(shm_dir: str, which: Callable[[str], bool]) -> list[str]:
    """Unlink every file of ``shm_dir`` whose name ``which`` selects (one already gone is skipped);
    returns the removed names."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if which(name):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def node_prefix(run_id: str, node: int) -> str:
    """What the name of every segment ``node``'s agent holds for run ``run_id`` starts with."""
    return f"mft.{run_id}.n{node}."


#: what follows a node's prefix in the name of a file its agent holds: a slot, a peer block version, the
#: progress file (:func:`megatron_ft.health.progress.board_path`), an old generation's container imported
#: for the node's ranks (:func:`import_segment_name`)
_HELD = re.compile(r"(?:r\d+\.s\d+|(?P<block>\d+\.blk\..+)|progress|in\d+)$")


def held_by(name: str, run_id: str, node: int) -> Optional[re.Match]:
    """Whether the file ``name`` is one that ``node``'s agent holds for run ``run_id`` - never another run's
    whose id extends this one (run ``a``'s node 1 and run ``a.n1``'s node 0 both begin ``mft.a.n1.``).

    >>> bool(held_by("mft.a.n1.r0.s2", "a", 1)), bool(held_by("mft.a.n1.n0.r0.s2", "a", 1))
    (True, False)
    >>> bool(held_by("mft.a.n1.n0.r0.s2", "a.n1", 0)), held_by("mft.a.n1.77.blk.k.3", "a", 1)["block"]
    (True, '77.blk.k.3')
    """
    prefix = node_prefix(run_id, node)
    return _HELD.match(name, len(prefix)) if name.startswith(prefix) else None


def remove_node_segments(shm_dir: str, run_id: str, node: int) -> list[str]:
    """Unlink every file ``node``'s agent held for run ``run_id`` (slots, blocks, the progress file): for
    an agent killed while the job ends, which cannot."""
    return remove_segments(shm_dir, lambda name: held_by(name, run_id, node) is not None)


def remove_block_segments(shm_dir: str, run_id: str, node: int) -> list[str]:
    """Unlink the peer block versions an earlier agent of ``node`` left (it died without shutdown);
    returns the removed paths. Slots are re-adopted; blocks are received again with the next version."""
    return remove_segments(shm_dir, lambda name: bool((m := held_by(name, run_id, node)) and m["block"]))


def intact(seg: Segment) -> bool:
    """Whether the file behind ``seg`` still has the size it was mapped with: reading a mapping
    past the end of a truncated file is SIGBUS, so every reader outside the trainer checks first."""
    try:
        return os.stat(seg.path).st_size >= seg.size
    except OSError:
        return False


def restore_size(path: str, size: int) -> None:
    """Give a truncated segment file its ``size`` back (same inode: every mapping of it is valid
    again) with its pages reserved; it reads zeros past the cut (the caller re-initialises it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


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
