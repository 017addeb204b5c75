"""Page-locking the agent's slot files for the GPU path (a part of :mod:`megatron_ft.trainer.device_staging`,
which re-exports its names): a host range registered with CUDA (:class:`HostRegistration`), a slot file
mapped and page-locked whole or range by range (:class:`PageLockedFile`), and the process's own slots,
page-locked once and kept across snapshot engines (:func:`page_lock_files`, :func:`page_locked_file`,
:func:`page_lock_while_copying`, :func:`release_page_locked`). Used only when state tensors live on a
CUDA device. Its settings (:data:`LOCK_RANGE`, :data:`LOCK_ALIGN`, :data:`LOCK_WAIT_S`) are this module's:
set here, they take effect."""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

log = logging.getLogger("megatron_ft.trainer.device_staging")  # one logger for the GPU path's records


def _cudart_ok(err) -> bool:
    return int(getattr(err, "value", err)) == 0


def made_current(device: Optional[torch.device]):
    """``device`` made the calling thread's current CUDA device (a new thread's is device 0: a CUDA call
    there would create a context on another rank's GPU), or nothing where ``device`` is None."""
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


class HostRegistration:
    """A host address range page-locked for the GPU (``cudaHostRegister``; with unified addressing,
    portable to every context) until :meth:`close`, made and released with ``device`` current.

    Not thread-safe; its owner (a :class:`PageLockedFile`) closes it before the memory is unmapped."""

    def __init__(self, address: int, nbytes: int, device: Optional[torch.device] = None):
        self.address, self.nbytes, self.device = address, nbytes, device
        with made_current(device):
            err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        self.ok = _cudart_ok(err)
        self.error = "" if self.ok else str(err)

    def close(self) -> None:
        if self.ok:
            with made_current(self.device):
                torch.cuda.cudart().cudaHostUnregister(self.address)
            self.ok = False


# ---- the slots this process has page-locked, once, for its snapshots and its restores --------------------
# A page-locked range belongs to one mapping in one process. The process keeps its own mapping of each
# slot file, page-locked once, across snapshot engines: after an in-process restart the restore copies
# straight from it and the next engine's snapshots reuse it (page-locking 16 GiB took 1-1.4 s on the
# H200). Keyed by the file's (device, inode); the entry's mapping keeps the inode alive, so a file the
# agent re-creates is a new key. An entry goes when an engine page-locks a set of slots without it (a
# new layout) or with :func:`release_page_locked`; otherwise with the process.


#: a fresh process's restore page-locks its slot in ranges of this size, several at a time, and copies
#: each range as soon as it is locked (:class:`PageLockedFile` with ``threads``)
LOCK_RANGE = 256 << 20
#: ... each range a whole number of these (a huge page: the ranges of one mapping never share a page)
LOCK_ALIGN = 2 << 20
#: how long a restore waits for one range to be page-locked before it reads that range through bounce blocks
LOCK_WAIT_S = 60.0


def lock_ranges(nbytes: int, span: Optional[int] = None, align: Optional[int] = None) -> list[tuple[int, int]]:
    """Consecutive ranges covering ``[0, nbytes)``, each ``span`` bytes (default :data:`LOCK_RANGE`)
    rounded down to a multiple of ``align`` (default :data:`LOCK_ALIGN`) but the last.

    >>> lock_ranges(10 << 20, 4 << 20)
    [(0, 4194304), (4194304, 8388608), (8388608, 10485760)]
    >>> lock_ranges(3 << 20, 1 << 20)   # a span under one page is one page
    [(0, 2097152), (2097152, 3145728)]
    >>> lock_ranges(0)
    []
    """
    align = LOCK_ALIGN if align is None else align
    span = max(align, (LOCK_RANGE if span is None else span) // align * align)
    return [(lo, min(lo + span, nbytes)) for lo in range(0, nbytes, span)]


class PageLockedFile:
    """One slot file mapped read-write (shared) and page-locked in this process until :meth:`close`.

    Page-locked whole on the calling thread (``threads=0``: the snapshot engine's worker), or in
    :func:`lock_ranges`, ``threads`` at a time on threads of its own, first ranges first (a fresh
    process's restore, which copies each range once :meth:`wait_range` says it is locked, while later
    ranges are still being locked). ``device``: the CUDA device current while page-locking (the rank's).
    Every copy from or into it stays inside one range (:meth:`pieces`). Thread-safe; :meth:`close` waits
    for the ranges being locked at that moment (one ``cudaHostRegister`` call each) and unlocks them."""

    def __init__(self, path: str, threads: int = 0, span: Optional[int] = None, device: Optional[torch.device] = None):
        self.path, self.device = path, device
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mm, np.uint8)
        base, nbytes = self.array.ctypes.data, self.array.nbytes
        self.ranges = lock_ranges(nbytes, span) if threads > 0 else [(0, nbytes)]
        self._span = max(1, self.ranges[0][1] if self.ranges else 1)
        self.registrations: list[Optional[HostRegistration]] = [None] * len(self.ranges)
        self._errors: list[str] = []
        self._locked = [threading.Event() for _ in self.ranges]
        self._guard = threading.Lock()  # registrations, _errors, _closing (never held across a CUDA call)
        self._closing = False
        self._pool: Optional[ThreadPoolExecutor] = None
        if threads <= 0:
            for i in range(len(self.ranges)):
                self._lock(base, i)
        else:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mft-page-lock")
            for i in range(len(self.ranges)):
                self._pool.submit(self._lock, base, i)
            self._pool.shutdown(wait=False)  # its threads end with the last range (close() may cancel the rest)

    def _lock(self, base: int, i: int) -> None:
        lo, hi = self.ranges[i]
        try:
            with self._guard:
                if self._closing:
                    return
            reg = HostRegistration(base + lo, hi - lo, self.device)
            with self._guard:
                if not self._closing:
                    self.registrations[i] = reg
                    if not reg.ok:
                        self._errors.append(reg.error)
                    return
            reg.close()  # closed meanwhile: nothing keeps this range locked
        except Exception as e:  # the range is read through bounce blocks; the error is reported
            with self._guard:
                self._errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._locked[i].set()

    def wait_range(self, lo: int, hi: int, timeout: float = LOCK_WAIT_S) -> bool:
        """Whether bytes ``[lo, hi)`` of the file are page-locked, once every range holding them was
        tried (each wait at most ``timeout`` seconds: False after it)."""
        if hi <= lo:
            return True
        for i in range(lo // self._span, min((hi - 1) // self._span + 1, len(self.ranges))):
            if not self._locked[i].wait(timeout):
                return False
            reg = self.registrations[i]
            if reg is None or not reg.ok:
                return False
        return True

    def pieces(self, lo: int, hi: int, offset: int = 0) -> list[tuple[int, int]]:
        """``[lo, hi)`` - bytes at file offsets ``offset + lo`` to ``offset + hi`` - cut where one
        page-locked range ends and the next begins: a copy that spans two registrations need not be
        taken as page-locked by the driver, so each copy stays inside one.

        >>> f = PageLockedFile.__new__(PageLockedFile); f._span = 100
        >>> f.pieces(50, 120), f.pieces(100, 200), f.pieces(10, 20), f.pieces(0, 50, offset=80)
        ([(50, 100), (100, 120)], [(100, 200)], [(10, 20)], [(0, 20), (20, 50)])
        """
        cuts = range(((lo + offset) // self._span + 1) * self._span - offset, hi, self._span)
        edges = [lo, *cuts, hi]
        return list(zip(edges[:-1], edges[1:]))

    @property
    def done(self) -> bool:
        """Every range tried (without waiting)."""
        return all(e.is_set() for e in self._locked)

    @property
    def ok(self) -> bool:
        """Every range tried and page-locked (without waiting)."""
        return self.done and all(r is not None and r.ok for r in self.registrations)

    @property
    def error(self) -> str:
        """Why a range could not be page-locked ("" if none failed so far)."""
        with self._guard:
            return self._errors[0] if self._errors else ""

    def close(self) -> None:
        """Unlock and unmap (no copy may be in flight from or into it). Ranges not started are not
        locked; one being locked is unlocked by its thread when its call returns."""
        with self._guard:
            self._closing = True
            regs, self.registrations = self.registrations, [None] * len(self.ranges)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for e in self._locked:
            e.set()  # (a range cancelled before it started)
        for reg in regs:
            if reg is not None:
                reg.close()
        self.array = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive: the mapping goes with the process
            pass


_LOCKED: dict[tuple[int, int], PageLockedFile] = {}
_LOCKED_GUARD = threading.Lock()  # _LOCKED only: never held while page-locking or waiting


def _file_key(path: str) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def page_lock_files(paths: Sequence[str], device: Optional[torch.device] = None
                    ) -> tuple[list[Optional[PageLockedFile]], list[str], int]:
    """Each file of ``paths`` mapped and page-locked in this process with ``device`` current (reusing
    earlier entries, also one a restore is still page-locking: waited for); entries for other files are
    released. Returns each file's entry (None where page-locking failed), the reasons of the failures
    and how many files were page-locked now (not reused). The snapshot engine's worker, while no
    restore runs."""
    keys = [_file_key(p) for p in paths]
    with _LOCKED_GUARD:
        stale = [_LOCKED.pop(k) for k in [k for k in _LOCKED if k not in keys]]
        found = [_LOCKED.get(k) if k is not None else None for k in keys]
    for entry in stale:
        entry.close()
    files: list[Optional[PageLockedFile]] = []
    errors: list[str] = []
    fresh = 0
    for path, key, entry in zip(paths, keys, found):
        if entry is not None and not (entry.wait_range(0, entry.array.nbytes) and entry.ok):
            _forget(key, entry)  # a restore's ranges, not all locked: try the whole file once more
            entry = None
        if entry is None:
            try:
                entry = PageLockedFile(path, device=device)
            except OSError as e:
                files.append(None)
                errors.append(f"{path}: {e}")
                continue
            if not entry.ok:
                entry.close()
                files.append(None)
                errors.append(entry.error)
                continue
            fresh += 1
            if key is not None:
                _keep(key, entry)
        files.append(entry)
    return files, errors, fresh


def _keep(key: tuple[int, int], entry: PageLockedFile) -> None:
    """``entry`` kept for the process; an entry it replaces is closed."""
    with _LOCKED_GUARD:
        old = _LOCKED.get(key)
        _LOCKED[key] = entry
    if old is not None and old is not entry:
        old.close()


def forget_page_locked(path: str, entry: PageLockedFile) -> None:
    """``entry`` (the file at ``path``) no longer kept for the process, and closed (no copy in flight)."""
    _forget(_file_key(path), entry)


def _forget(key: Optional[tuple[int, int]], entry: PageLockedFile) -> None:
    """``entry`` no longer kept (if it still is) and closed."""
    with _LOCKED_GUARD:
        if key is not None and _LOCKED.get(key) is entry:
            del _LOCKED[key]
    entry.close()


def page_locked_file(path: str) -> Optional[PageLockedFile]:
    """The file at ``path`` as this process mapped and page-locked it for its snapshots (every range
    locked), or None. Read by a restore on the training thread while no snapshot is in flight."""
    key = _file_key(path)
    with _LOCKED_GUARD:
        entry = _LOCKED.get(key) if key is not None else None
    return entry if entry is not None and entry.ok else None


def release_page_locked() -> None:
    """Unlock and unmap every slot this process page-locked (as if the process were new). Only while no
    snapshot engine is copying and no restore is reading."""
    with _LOCKED_GUARD:
        entries = list(_LOCKED.values())
        _LOCKED.clear()
    for entry in entries:
        entry.close()


def page_lock_while_copying(path: str, threads: int, device: Optional[torch.device] = None
                            ) -> Optional[PageLockedFile]:
    """The slot at ``path`` being page-locked in this process with ``device`` current (the restore's
    destination), range by range on ``threads`` threads (the
    caller copies each range once :meth:`PageLockedFile.wait_range` allows), kept for the process's
    snapshots like the engine's own (:func:`page_lock_files` reuses it); None - nothing kept, the
    caller reads through bounce blocks - when the file cannot be mapped or its first range cannot be
    page-locked (said once). Training thread, while no snapshot is in flight."""
    key = _file_key(path)
    if key is None:
        return None
    try:
        entry = PageLockedFile(path, threads=max(1, threads), device=device)
    except OSError as e:
        _say_once("map", f"could not map {path} to page-lock it for a restore ({e}): reading it through pinned blocks")
        return None
    if not entry.wait_range(0, 1):
        entry.close()
        _say_once("lock", f"could not page-lock {path} for a restore ({entry.error or 'timed out'}): "
                  f"reading it through pinned blocks")
        return None
    _keep(key, entry)
    return entry


_SAID: set[str] = set()


def _say_once(what: str, msg: str) -> None:
    if what not in _SAID:
        _SAID.add(what)
        log.warning("%s", msg)
