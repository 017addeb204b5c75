"""Container.load_verified: the read + verify pass of a restore, on its three read paths: block
buffer + streaming copy (native library, 4 KiB-page memory or disk), straight from a mapping of the
slot (native library, huge-page tmpfs) and straight into the tensors + numpy-compatible sum (no
native library)."""
import mmap
import os

import numpy as np
import pytest
import torch

from megatron_ft.capture import checksum, snapfile
from megatron_ft.trainer import recovery
from megatron_ft.agent import shm
from megatron_ft.capture.layout import plan_layout
from megatron_ft.capture.state import StateTensor

IDENTITY = {"run_id": "t", "rank": 0, "world_size": 1}
PATHS = ["block-buffer", "mapped", "in-place"]


def make_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (70000 + 1,), dtype=torch.uint8, generator=g)
    return {
        "big": torch.randn(9000, generator=g),  # several chunks, several read blocks
        "odd": torch.randint(0, 1 << 30, (333,), dtype=torch.int64, generator=g),
        "misaligned": raw[1:],  # data_ptr not 16-byte aligned: the copy falls back to normal stores
        "tiny": torch.tensor([3.5], dtype=torch.float64),
        "empty": torch.empty(0),
    }


def write_container(path, tensors, chunk=8192, algorithm=checksum.ALGORITHM):
    specs = [StateTensor(n, t).spec() for n, t in tensors.items()]
    lay = plan_layout(specs, chunk, IDENTITY)
    g = snapfile.geometry_for(lay)
    with open(path, "wb") as f:
        f.truncate(g.total)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), g.total)
    snapfile.init_container(mm, lay.to_json(), g)
    area = np.frombuffer(mm, np.uint8, count=lay.data_nbytes, offset=g.data_off)
    names = [e.spec.name for e in lay.entries]
    sums = []
    for i, pieces in enumerate(lay.all_pieces()):
        lo, hi = lay.chunk_bounds(i)
        cs = checksum.ChunkSum(hi - lo, area[lo:hi], algorithm=algorithm)
        for p in pieces:
            cs.write(p.dst_offset - lo, tensors[names[p.entry_index]].reshape(-1).view(torch.uint8)[p.src_start:p.src_end])
        sums.append(cs.finish())
    del area, cs
    snapfile.write_version(mm, 1, {"chunks": [f"{s:016x}" for s in sums], "checksum": algorithm,
                                   "extra": {}, "identity": IDENTITY})
    snapfile.set_state(mm, snapfile.CLEAN)
    mm.close()
    return lay, g


def load(path, dst, expect_mapped=None):
    cont = recovery.Container(path)
    try:
        if expect_mapped is not None:
            assert cont.mapped == expect_mapped
        cont.check_identity(IDENTITY, 1)
        cont.load_verified({n: StateTensor(n, t) for n, t in dst.items()})
    finally:
        cont.close()


@pytest.fixture
def read_path(request, monkeypatch):
    """Selects the read path. "mapped" is chosen for a huge-page tmpfs; here the container's
    directory is declared one (the mapping code is the same on any file; a real huge-page mount is
    tested in test_huge_page_tmpfs_restore_reads_the_mapping)."""
    path = request.param
    if path != "in-place" and not checksum.HAVE_NATIVE:
        pytest.skip("native library not built")
    monkeypatch.setattr(recovery, "STREAMING_RESTORE", path != "in-place")
    monkeypatch.setattr(recovery, "READ_BLOCK", 4096)  # pieces span several read blocks
    backing = shm.HUGE if path == "mapped" else shm.SMALL
    monkeypatch.setattr(recovery.shm, "backing_of", lambda directory: backing)
    return path


@pytest.mark.parametrize("read_path", PATHS, indirect=True)
def test_restore_is_bit_exact(tmp_path, read_path):
    src = make_tensors()
    write_container(tmp_path / "s.mft", src)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    dst["misaligned"] = torch.zeros(src["misaligned"].numel() + 1, dtype=torch.uint8)[1:]
    load(tmp_path / "s.mft", dst, expect_mapped=read_path == "mapped")
    for n in src:
        assert torch.equal(src[n], dst[n]), n


@pytest.mark.parametrize("read_path", PATHS, indirect=True)
@pytest.mark.parametrize("where", ["first", "later-block", "misaligned", "last"])
def test_a_flipped_byte_is_rejected(tmp_path, read_path, where):
    src = make_tensors()
    lay, g = write_container(tmp_path / "s.mft", src)
    e = lay.by_name()
    pos = {"first": 0, "later-block": e["big"].offset + 3 * 4096 + 17,
           "misaligned": e["misaligned"].offset + 40000, "last": e["tiny"].offset + 7}[where]  # last byte of data
    with open(tmp_path / "s.mft", "r+b") as f:
        f.seek(g.data_off + pos)
        b = f.read(1)
        f.seek(g.data_off + pos)
        f.write(bytes([b[0] ^ 0x10]))
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    with pytest.raises(snapfile.SnapshotFormatError, match=f"chunk {pos // lay.chunk_size} checksum mismatch"):
        load(tmp_path / "s.mft", dst)


@pytest.mark.skipif(not checksum.HAVE_NATIVE, reason="native library not built")
@pytest.mark.parametrize("dst_offset", [0, 16, 1, 7])
def test_streaming_copy_matches_checksum(dst_offset):
    rng = np.random.default_rng(1)
    for n in (0, 1, 31, 32, 33, 4096, 100003):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        out = np.zeros(n + 64, np.uint8)
        base = (-out.ctypes.data) % 64 + dst_offset  # dst at a known alignment
        cs = checksum.ChunkSum(n)
        cs.copy_to(0, out[base: base + n], src)
        assert cs.finish() == checksum.checksum_numpy(src)
        assert np.array_equal(out[base: base + n], src)
        assert not out[:base].any() and not out[base + n:].any()


@pytest.mark.parametrize("read_path", PATHS, indirect=True)
def test_a_short_container_is_refused_before_reading(tmp_path, read_path):
    """A slot cut short (a torn file) is an error on every path; through a mapping, reading past
    the end would be SIGBUS, so the size is checked first."""
    src = make_tensors()
    lay, g = write_container(tmp_path / "s.mft", src)
    os.truncate(tmp_path / "s.mft", g.data_off + lay.data_nbytes - 100)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    with pytest.raises(snapfile.SnapshotFormatError, match="ends early"):
        load(tmp_path / "s.mft", dst)


@pytest.mark.parametrize("read_path", ["mapped"], indirect=True)
def test_a_slot_that_cannot_be_mapped_is_read_with_pread(tmp_path, read_path, monkeypatch):
    """A failed mmap (e.g. no address space left) is not the snapshot's fault: the restore reads
    it with pread instead of rejecting (and invalidating) a good copy."""
    src = make_tensors()
    write_container(tmp_path / "s.mft", src)

    def no_map(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(recovery.mmap, "mmap", no_map)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    load(tmp_path / "s.mft", dst, expect_mapped=True)
    for n in src:
        assert torch.equal(src[n], dst[n]), n


@pytest.mark.parametrize("cores, local_ranks, threads", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 8, 2), (64, 1, 4),
                                                         (1, 1, 1), (8, 0, 4)])
def test_restore_threads_share_the_cores_among_the_node_s_ranks(cores, local_ranks, threads):
    """Every rank of a node restores at once: each takes its share of the cores (1..4 threads)."""
    assert recovery.restore_threads(cores, local_ranks) == threads


@pytest.mark.parametrize("cores, local_ranks, threads", [(16, 1, 8), (16, 8, 2), (128, 8, 8), (2, 1, 2)])
def test_a_gpu_rank_uses_up_to_eight_host_threads(cores, local_ranks, threads):
    """GPU path: the host threads that read or sum blocks beside the copy engine (its share, at most 8)."""
    assert recovery.restore_threads(cores, local_ranks, recovery.MAX_GPU_HOST_THREADS) == threads


@pytest.mark.parametrize("read_path", PATHS, indirect=True)
def test_a_snapshot_of_the_previous_format_is_still_verified_and_restored(tmp_path, read_path, monkeypatch):
    """Containers of format version 1 carry fl64x4-v1 chunk sums (the weaker fold): still read,
    verified with their own algorithm, and refused when corrupted."""
    src = make_tensors(5)
    path = str(tmp_path / "v1.mft")
    monkeypatch.setattr(snapfile, "FORMAT_VERSION", 1)
    lay, g = write_container(path, src, algorithm="fl64x4-v1")
    monkeypatch.undo()
    assert snapfile.read_header(open(path, "rb").read(4096)).step == 1
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(12)[8:12], "little") == 1  # the header says format 1
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    load(path, dst)
    assert all(torch.equal(dst[n], src[n]) for n in src)
    with open(path, "r+b") as f:  # one bit of the data area
        f.seek(g.data_off + 100)
        b = f.read(1)[0]
        f.seek(g.data_off + 100)
        f.write(bytes([b ^ 0x80]))
    with pytest.raises(snapfile.SnapshotFormatError, match="checksum mismatch"):
        load(path, {n: torch.zeros_like(t) for n, t in src.items()})
