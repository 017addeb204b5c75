"""The GPU restore's reader (:class:`DeviceReader`; CUDA only - its bookkeeping is tested on CPU with
stubs, ``tests/integration/test_gpu_path_logic.py``): copies queued from a page-locked slot, or through
pinned blocks, summed on the device once they have landed; the restore's CPU tensors through the CPU reader
it wraps. Chosen by :func:`.restore_read.choose_reader`."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

from ..capture import checksum
from . import device_staging
from .restore_plan import (GPU_READ_BLOCK, MAX_GPU_HOST_THREADS, ChunkRead, PieceRead, ReadPlan, Reader,
                           pread_into)

log = logging.getLogger("megatron_ft.trainer.restore_read")


class DeviceReader(Reader):
    """GPU destinations (CUDA only). A chunk with a piece on a device, under the lanes checksum: its
    device pieces' copies queued - straight from the container page-locked in this process
    (``locked``), else through the stagings' pinned blocks, filled from ``cpu``'s mapping or by
    ``pread`` - and summed on the device, its host pieces read and summed on the host; the lanes combined
    in :meth:`settle`, after every copy has landed. A chunk of an older checksum: every piece read and
    summed on the host, device pieces copied after. A chunk with no device piece: ``cpu``'s.
    ``marks`` (the container's) get ``queued`` / ``landed``: when every copy was queued / had landed."""

    workers_cap = MAX_GPU_HOST_THREADS

    def __init__(self, plan: ReadPlan, fd: int, cpu: Reader, devices: list,
                 locked: Optional["device_staging.PageLockedFile"], marks: dict):
        super().__init__(plan, fd)
        self.cpu, self.marks, self.locked = cpu, marks, locked
        self.src = getattr(cpu, "src", None)
        # made on the caller's thread: see RestoreStagings' ordering rule
        self.stagings = device_staging.RestoreStagings(GPU_READ_BLOCK, devices)
        self.page_locked = torch.from_numpy(locked.array) if locked is not None else None
        self.on_device_sums = plan.algorithm == checksum.ALGORITHM
        self.later: dict[int, list] = {}  # chunk -> [(offset in the chunk, lanes or a _Landed)], for settle()
        self._finished = False

    def read_chunk(self, c: ChunkRead) -> Optional[str]:
        on_device = [device_staging.on_device(p.dst) for p in c.pieces]
        if not any(on_device):
            return self.cpu.read_chunk(c)
        if self.on_device_sums:
            parts = []
            for p, dev in zip(c.pieces, on_device):
                if dev:
                    parts.append((p.chunk_offset, self._upload(p)))
                else:
                    pread_into(self.fd, p.dst, p.file_offset)
                    parts.append((p.chunk_offset, checksum.host_lanes(p.dst)))
            self.later[c.index] = parts
            return None
        chunk = checksum.ChunkSum(c.nbytes, algorithm=self.plan.algorithm)
        for p, dev in zip(c.pieces, on_device):
            if dev:  # an older checksum: read and summed on the host, then copied
                part = torch.empty(p.nbytes, dtype=torch.uint8)
                pread_into(self.fd, part, p.file_offset)
                chunk.add(p.chunk_offset, part)
                p.dst.copy_(part)
            else:
                self.read_piece(chunk, p)
        return self.plan.verdict(c, chunk.finish())

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        self.cpu.read_piece(chunk, p)

    def threads(self) -> int:
        """Straight from a page-locked slot a thread only queues copies: one is enough (and no pool)."""
        return 1 if self.page_locked is not None else super().threads()

    def _upload(self, p: PieceRead):
        """A device piece's copies queued; its lanes (summed as it lands), or a :class:`_Landed` to sum
        with the other pieces copied straight from the page-locked slot, after every copy."""
        stage = self.stagings.here(p.dst.device)
        part, at = p.dst, p.file_offset
        if self.locked is not None and self.locked.wait_range(at, at + part.numel()):
            for lo, hi in self.locked.pieces(at, at + part.numel()):  # each copy inside one page-locked range
                stage.upload_page_locked(self.page_locked[lo:hi], part[lo - at: hi - at])
            return _Landed(part)
        for off in range(0, part.numel(), GPU_READ_BLOCK):
            k, block = stage.block()
            n = min(GPU_READ_BLOCK, part.numel() - off)
            if self.src is not None:
                np.copyto(block[:n].numpy(), self.src[at + off: at + off + n])
            else:
                pread_into(self.fd, block[:n], at + off)
            stage.upload(k, part[off: off + n])
        return stage.lanes(part)

    def settle(self, after_copies: Optional[Callable[[], None]]) -> list[Optional[str]]:
        self.marks["queued"] = time.perf_counter()
        landed = [x for parts in self.later.values() for _, x in parts if isinstance(x, _Landed)]
        with self.stagings.after_copies():  # launched while the copies are in flight
            sum_landed(landed)
            if after_copies is not None:
                after_copies()
        self._finish()
        later = sorted(self.later.items())  # the device lanes to the host in one copy, then combined
        device_parts = [lanes for _, parts in later for _, lanes in parts if not isinstance(lanes, list)]
        lanes = [x.lanes if isinstance(x, _Landed) else x for x in device_parts]
        on_host = iter(torch.stack(lanes).cpu().tolist() if lanes else [])
        out: list[Optional[str]] = []
        for i, parts in later:
            c = self.plan.chunks[i]
            host = [(off, lanes if isinstance(lanes, list) else next(on_host)) for off, lanes in parts]
            out.append(self.plan.verdict(c, checksum.combine_lanes(c.nbytes, host)))
        return out

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.stagings.finish()  # every device copy done before the blocks or the mapping go
            self.marks["landed"] = time.perf_counter()

    def close(self) -> None:
        try:
            self._finish()
        finally:
            self.cpu.close()


class _Landed:
    """GPU path: a piece copied straight from a page-locked slot into ``part`` (device bytes); its
    ``lanes`` are summed after every copy has landed, with the restore's other such pieces in one launch."""
    __slots__ = ("part", "lanes")

    def __init__(self, part: torch.Tensor):
        self.part, self.lanes = part, None


def sum_landed(landed: list[_Landed]) -> None:
    """Fill in the lanes of ``landed`` pieces (their copies complete), one batched call per device."""
    by_device: dict[torch.device, list[_Landed]] = {}
    for x in landed:
        by_device.setdefault(x.part.device, []).append(x)
    for device, xs in by_device.items():
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            out = torch.empty(len(xs), 16, dtype=torch.int64, device=device)
            checksum.pieces_lanes([x.part for x in xs], out)
        for x, row in zip(xs, out):
            x.lanes = row


