"""GPU only: the fl32x8 checksum lanes of device bytes, every piece of a snapshot in one Triton launch.

:func:`megatron_ft.capture.checksum.tensor_lanes` defines the lanes (per lane ``l`` of the 32-byte
rows, mod 2^64: ``a_l = sum_r w[r, l]`` and ``c_l = sum_r r * w[r, l]``). Written with torch
reductions they cost four reads of every word and a handful of kernels per 64 MiB; here every
program reads its share of the rows once (32-bit words, zero-extended to 64 bits) and writes its 16
partial lanes, which one reduction adds up (integer addition mod 2^64 is associative: the result does
not depend on the grid or the order). :func:`segment_row_lanes` sums many pieces - anywhere in the
device's memory - in one launch: under a training load every launch waits until the matrix kernels
leave SMs free, so a snapshot's sums must be one launch, not hundreds (docs/gpu.md has the figures).

It takes whole 32-byte rows (the caller sums a tail of under 32 bytes). :data:`AVAILABLE` is False
where Triton is not installed (CPU-only builds of torch) or its kernel failed; callers then use the
torch reductions.

``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (numpy): the CPU tests compare it with the
reference there; only a GPU can check its speed and the compiled code's arithmetic.
"""
from __future__ import annotations

import numpy as np
import torch

try:  # Triton comes with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: whether :func:`segment_row_lanes` can run (Triton importable; a compile failure turns it off, logged)
AVAILABLE = triton is not None
#: rows (32 bytes each) one program sums: 1 MiB per program; 16 GiB is 16,384 programs
ROWS_PER_PROGRAM = 32768
#: rows loaded per step of a program (a 256 x 8 tile of 32-bit words, 8 KiB)
TILE_ROWS = 256

if triton is not None:
    @triton.jit
    def _segment_lanes_kernel(base_ptr, table_ptr, partial_ptr, programs,
                              ROWS_PER_PROGRAM: tl.constexpr, TILE_ROWS: tl.constexpr):
        # table (int64): per program, [its segment's offset from base in words, the segment's rows,
        # its first row]; the programs of one segment are consecutive
        pid = tl.program_id(0).to(tl.int64)
        offset = tl.load(table_ptr + pid)
        rows = tl.load(table_ptr + programs + pid)
        first = tl.load(table_ptr + 2 * programs + pid)
        lane = tl.arange(0, 8)
        tile = tl.arange(0, TILE_ROWS).to(tl.int64)
        a = tl.zeros([8], dtype=tl.uint64)
        c = tl.zeros([8], dtype=tl.uint64)
        for step in range(0, ROWS_PER_PROGRAM, TILE_ROWS):
            row = first + step + tile
            inside = row < rows
            w = tl.load(base_ptr + offset + (row[:, None] * 8 + lane[None, :]), mask=inside[:, None], other=0)
            w = w.to(tl.uint32, bitcast=True).to(tl.uint64)
            a += tl.sum(w, axis=0)
            c += tl.sum(w * row.to(tl.uint64)[:, None], axis=0)
        tl.store(partial_ptr + pid * 16 + lane, a.to(tl.int64, bitcast=True))
        tl.store(partial_ptr + pid * 16 + 8 + lane, c.to(tl.int64, bitcast=True))


def segment_row_lanes(segments: list, out: torch.Tensor) -> torch.Tensor:
    """The 16 lanes (a0..a7, c0..c7, int64, mod 2^64; rows counted from each segment's first) of many
    segments in one launch: ``segments`` are contiguous int32 tensors of shape (rows, 8) on one device
    (anywhere in its memory, 4-byte aligned); row k of ``out`` ((n, 16) int64, same device) receives
    segment k's lanes. Temporaries: 128 bytes per MiB summed. Four launches whatever the number of segments (the table's
    copy, the kernel, two to add the programs' partials into ``out``); asynchronous on the current stream.
    The kernel addresses every segment from the first one's pointer (an offset in words, negative too)."""
    assert triton is not None, "segment_row_lanes needs Triton"
    out.zero_()
    if not segments:
        return out
    device = segments[0].device
    for s in segments:
        if s.dim() != 2 or s.shape[1] != 8 or s.dtype != torch.int32 or not s.is_contiguous() or s.device != device:
            raise ValueError(f"segment_row_lanes takes contiguous int32 rows of 8 words on {device}, "
                             f"not {s.dtype} {tuple(s.shape)} on {s.device}")
    base = segments[0]
    rows = np.array([s.shape[0] for s in segments], dtype=np.int64)
    counts = -(-rows // ROWS_PER_PROGRAM)  # programs per segment
    programs = int(counts.sum())
    if programs == 0:
        return out
    owner = np.repeat(np.arange(len(segments), dtype=np.int64), counts)
    firsts = (np.arange(programs, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * ROWS_PER_PROGRAM
    offsets = np.array([(s.data_ptr() - base.data_ptr()) // 4 for s in segments], dtype=np.int64)
    table = torch.from_numpy(np.concatenate([offsets[owner], rows[owner], firsts]))
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    partial = torch.empty(programs, 16, dtype=torch.int64, device=device)
    _segment_lanes_kernel[(programs,)](base, table, partial, programs, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
                                       TILE_ROWS=TILE_ROWS)
    index = torch.from_numpy(owner)
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    out.index_add_(0, index, partial)
    return out
