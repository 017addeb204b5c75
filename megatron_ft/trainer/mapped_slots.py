"""The agent's slots as this process maps them: each slot file mapped once, for its snapshots and its restores.

Mapping a slot is kernel work per page at both ends of the mapping's life. On a 4 KiB-page tmpfs
(the default ``/dev/shm``) populating the page tables of 256 MiB took 16-24 ms and unmapping them
8-13 ms on the 2-core test machine, where copying the same bytes took 19 ms (``benchmarks/slot_mapping.py``). So a process maps each
slot file once and keeps the mapping:

* the snapshot engine's registration takes its slots' mappings from here (:func:`slot_mappings`):
  a kept one is reused, any other is mapped (shared, read-write, populated) and kept;
* a restore from the node's memory reads through :func:`slot_mapping`. After an in-process restart or
  a rollback, that is the mapping the engine wrote through, with no page-table work at all. In a fresh
  process the slot is mapped and populated once, read, and left to the engine, which writes its
  snapshots through it (before, the restore mapped and unmapped it and the engine mapped it again);
* :func:`release_slot_mappings` unmaps them all (as if the process were new).

An engine's ``close()`` leaves its mappings kept, so the next attempt's restore after an in-process
restart finds them. Keyed by the file's (device, inode) and size: a file the agent re-created or
resized under the same path is another key. A kept mapping whose path no longer names its file (the
agent removed or re-created it) is unmapped by the next :func:`slot_mappings` or :func:`slot_mapping`
call, so a process holds the memory of a removed slot no longer than that. (A persisted container whose
directory is a tmpfs is read the same way; a file this process may not open for writing is read with
``pread`` instead, said once by the reader.)

Contract: both calls run on the training thread while no snapshot of this process is in flight (the
engine's registration, a restore), since they may unmap a stale mapping. Thread-safe otherwise: one
lock guards the table and is never held while mapping. This module owns every mapping it hands out;
callers hold views only while they read or write, and never close a :class:`~megatron_ft.agent.shm.Segment`
they got here.

Worked example: a restore maps a slot, and the engine's registration then reuses that mapping.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> path = os.path.join(d, "slot0")
>>> with open(path, "wb") as f:
...     _ = f.write(bytes(8192))
>>> restored = slot_mapping(path)          # a fresh process's restore: mapped and kept
>>> slot_mappings([path])[0] is restored   # the engine's registration: the same mapping
True
>>> os.unlink(path); os.rmdir(d)
>>> slot_mappings([]) == [] and kept_paths() == []   # a stale mapping goes at the next call
True
"""
from __future__ import annotations

import os
import threading
from typing import Iterable, Optional

from ..agent import shm

_Key = tuple[int, int, int]  # (device, inode, size) of a slot file

_KEPT: dict[_Key, shm.Segment] = {}
_GUARD = threading.Lock()


def _key_of(path: str) -> Optional[_Key]:
    """(device, inode, size) of the file at ``path``, or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def _drop_stale() -> None:
    """Unmap every kept mapping whose path no longer names the file it maps (removed, re-created, resized)."""
    with _GUARD:
        kept = list(_KEPT.items())
    stale = [k for k, seg in kept if _key_of(seg.path) != k]  # (the stat calls outside the lock)
    with _GUARD:
        gone = [seg for seg in (_KEPT.pop(k, None) for k in stale) if seg is not None]
    for seg in gone:
        seg.close()


def _mapping(path: str, key: Optional[_Key] = None) -> shm.Segment:
    """The kept mapping of the file ``path`` names (or, given ``key``, of that file only), else a new one, kept."""
    key = _key_of(path) if key is None else key
    with _GUARD:
        seg = _KEPT.get(key) if key is not None else None
    if seg is not None:
        return seg
    seg = shm.open_segment(path)  # shared, read-write, populated; SharedMemoryError / OSError: the caller's
    if key is None or _key_of(path) != key or seg.size != key[2]:
        seg.close()
        raise FileNotFoundError(f"{path}: the slot file changed while it was mapped (the agent re-created it)")
    with _GUARD:
        kept = _KEPT.setdefault(key, seg)
    if kept is not seg:  # (another thread mapped it meanwhile)
        seg.close()
    return kept


def slot_mapping(path: str, fd: Optional[int] = None) -> shm.Segment:
    """The process's mapping of the slot file at ``path``: the kept one, else mapped (shared, read-write,
    populated) and kept. Given ``fd`` (a restore's open container), the file it has open and no other:
    ``FileNotFoundError`` if ``path`` names another file by then. Stale mappings are unmapped first.
    Raises what mapping raises (:class:`~megatron_ft.agent.shm.SharedMemoryError` for an empty file,
    ``OSError``)."""
    _drop_stale()
    if fd is None:
        return _mapping(path)
    st = os.fstat(fd)
    return _mapping(path, (st.st_dev, st.st_ino, st.st_size))


def slot_mappings(paths: Iterable[str]) -> list[shm.Segment]:
    """The mappings of ``paths`` in order (an engine's registration), each kept or mapped and kept; stale
    mappings are unmapped first. Mappings of other live files stay (another engine of this process)."""
    _drop_stale()
    return [_mapping(p) for p in paths]


def kept_paths() -> list[str]:
    """The paths of the slot files this process keeps mapped (for checks and reports)."""
    with _GUARD:
        return sorted(seg.path for seg in _KEPT.values())


def release_slot_mappings() -> None:
    """Unmap every kept mapping (as if the process were new). Only while no snapshot engine is writing and
    no restore is reading; a mapping some view still exports stays until that view goes."""
    with _GUARD:
        gone = list(_KEPT.values())
        _KEPT.clear()
    for seg in gone:
        seg.close()
