"""The read + verify pass of a restore (megatron_ft/trainer/restore_read.py): the readers' contract - the
block reader (native library, 4 KiB-page memory or disk), the mapped reader (native library, huge-page
tmpfs) and the in-place reader (no native library) each run over the same containers (whole,
truncated, corrupted, of the previous format) and give the same verdicts and bytes - the choice of
reader, and Container.load_verified end to end on each path. The device reader's bookkeeping:
tests/integration/test_gpu_path_logic.py (CPU, stubs) and tests/gpu (a GPU)."""
import mmap
import os

import numpy as np
import pytest
import torch

from megatron_ft.capture import checksum, snapfile
from megatron_ft.trainer import recovery, restore_read
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
    """Through the restore's own entry: Container.load_verified (the reader chosen for the container)."""
    cont = recovery.Container(path)
    try:
        if expect_mapped is not None:
            assert cont.mapped == expect_mapped
        cont.check_identity(IDENTITY, 1)
        cont.load_verified({n: StateTensor(n, t) for n, t in dst.items()})
    finally:
        cont.close()


#: every CPU reader, made directly (the contract below holds each to the same verdicts and bytes)
READERS = {
    "block-buffer": lambda plan, fd: restore_read.BlockReader(plan, fd, 4096),  # pieces span several blocks
    "mapped": lambda plan, fd: restore_read.MappedReader(plan, fd),
    "in-place": lambda plan, fd: restore_read.InPlaceReader(plan, fd),
}
NATIVE = {"block-buffer", "mapped"}


def read_with(kind, path, dst):
    """The read plan of the container at ``path`` into ``dst``, run with reader ``kind``: None, or the
    error it raised (the verdict)."""
    if kind in NATIVE and not checksum.HAVE_NATIVE:
        pytest.skip("native library not built")
    cont = recovery.Container(str(path))
    try:
        cont.check_identity(IDENTITY, 1)
        views = {n: StateTensor(n, t).saved_view().reshape(-1) for n, t in dst.items()}
        plan = restore_read.plan_reads(cont.path, cont.layout, cont.version["chunks"], cont.version["checksum"],
                                       cont.header.geometry.data_off, views)
        restore_read.read_verified(plan, READERS[kind](plan, cont.fd))
        return None
    except snapfile.SnapshotFormatError as e:
        return str(e)
    finally:
        cont.close()


def containers(tmp_path):
    """The contract's containers: whole, truncated, corrupted in four places, and one of the previous
    format (its own, weaker checksum) whole and corrupted; each with the error it must be refused with
    (None: read whole)."""
    src = make_tensors()
    out = []
    lay, g = write_container(tmp_path / "whole.mft", src)
    out.append(("whole", tmp_path / "whole.mft", None))
    write_container(tmp_path / "short.mft", src)
    os.truncate(tmp_path / "short.mft", g.data_off + lay.data_nbytes - 100)
    out.append(("truncated", tmp_path / "short.mft", "ends early"))
    e = lay.by_name()
    for where, pos in {"first": 0, "later-block": e["big"].offset + 3 * 4096 + 17,
                       "misaligned": e["misaligned"].offset + 40000, "last": e["tiny"].offset + 7}.items():
        path = tmp_path / f"flip-{where}.mft"
        write_container(path, src)
        flip(path, g.data_off + pos)
        out.append((f"flipped {where}", path, f"chunk {pos // lay.chunk_size} checksum mismatch"))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(snapfile, "FORMAT_VERSION", 1)
        write_container(tmp_path / "v1.mft", src, algorithm="fl64x4-v1")
        _, g1 = write_container(tmp_path / "v1-flip.mft", src, algorithm="fl64x4-v1")
    flip(tmp_path / "v1-flip.mft", g1.data_off + 100)
    out += [("format 1", tmp_path / "v1.mft", None), ("format 1, flipped", tmp_path / "v1-flip.mft", "chunk 0 checksum mismatch")]
    return src, out


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("kind", list(READERS))
def test_every_reader_keeps_the_contract(tmp_path, kind):
    """The readers' contract: the same containers give every reader the same verdicts - whole ones read
    bit-exact, a truncated one refused ("ends early", before a mapping could SIGBUS), a flipped byte refused
    naming its chunk - and the same bytes."""
    src, cases = containers(tmp_path)
    for name, path, refused in cases:
        dst = {n: torch.zeros_like(t) for n, t in src.items()}
        dst["misaligned"] = torch.zeros(src["misaligned"].numel() + 1, dtype=torch.uint8)[1:]
        verdict = read_with(kind, path, dst)
        if refused is None:
            assert verdict is None, (name, verdict)
            for n in src:
                assert torch.equal(src[n], dst[n]), (name, n)
        else:
            assert verdict is not None and refused in verdict, (name, verdict)


def test_the_readers_give_the_same_verdicts(tmp_path):
    """Word for word: what one reader says of a container, every other says."""
    src, cases = containers(tmp_path)
    kinds = [k for k in READERS if k not in NATIVE or checksum.HAVE_NATIVE]
    for name, path, _ in cases:
        said = {k: read_with(k, path, {n: torch.zeros_like(t) for n, t in src.items()}) for k in kinds}
        assert len(set(said.values())) == 1, (name, said)


@pytest.mark.parametrize("backing, native, chosen", [("huge", True, "MappedReader"), ("small", True, "BlockReader"),
                                                     ("huge", False, "InPlaceReader"), ("small", False, "InPlaceReader")])
def test_the_reader_is_chosen_by_the_medium(tmp_path, monkeypatch, backing, native, chosen):
    """Once per restore: the mapping for a huge-page slot, blocks for 4 KiB pages or disk, in place
    without the native library (CPU destinations: no device reader)."""
    if native and not checksum.HAVE_NATIVE:
        pytest.skip("native library not built")
    monkeypatch.setattr(restore_read, "STREAMING_RESTORE", native)
    monkeypatch.setattr(recovery.shm, "backing_of", lambda directory: shm.HUGE if backing == "huge" else shm.SMALL)
    src = make_tensors()
    lay, g = write_container(tmp_path / "s.mft", src)
    cont = recovery.Container(str(tmp_path / "s.mft"))
    try:
        views = {n: torch.zeros_like(t).reshape(-1) for n, t in src.items()}
        plan = restore_read.plan_reads(cont.path, lay, cont.version["chunks"], cont.version["checksum"], g.data_off, views)
        reader = restore_read.choose_reader(plan, cont.fd, cont.mapped, lambda d: None, cont.marks)
        try:
            assert type(reader).__name__ == chosen
        finally:
            reader.close()
    finally:
        cont.close()


@pytest.fixture
def read_path(request, monkeypatch):
    """Selects the read path Container.load_verified takes. "mapped" is chosen for a huge-page tmpfs;
    here the container's directory is declared one (the mapping code is the same on any file; a real
    huge-page mount: tests/integration/test_huge_pages.py)."""
    path = request.param
    if path != "in-place" and not checksum.HAVE_NATIVE:
        pytest.skip("native library not built")
    monkeypatch.setattr(restore_read, "STREAMING_RESTORE", path != "in-place")
    monkeypatch.setattr(restore_read, "READ_BLOCK", 4096)  # pieces span several read blocks
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


@pytest.mark.parametrize("read_path", ["mapped"], indirect=True)
def test_a_slot_that_cannot_be_mapped_is_read_with_pread(tmp_path, read_path, monkeypatch):
    """A failed mmap (e.g. no address space left) is not the snapshot's fault: the restore reads
    it with pread instead of rejecting (and invalidating) a good copy."""
    src = make_tensors()
    write_container(tmp_path / "s.mft", src)

    def no_map(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(restore_read.mmap, "mmap", no_map)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    load(tmp_path / "s.mft", dst, expect_mapped=True)
    for n in src:
        assert torch.equal(src[n], dst[n]), n


@pytest.mark.parametrize("cores, local_ranks, threads", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 8, 2), (64, 1, 4),
                                                         (1, 1, 1), (8, 0, 4)])
def test_restore_threads_share_the_cores_among_the_node_s_ranks(cores, local_ranks, threads):
    """Every rank of a node restores at once: each takes its share of the cores (1..4 threads)."""
    assert restore_read.restore_threads(cores, local_ranks) == threads


@pytest.mark.parametrize("cores, local_ranks, threads", [(16, 1, 8), (16, 8, 2), (128, 8, 8), (2, 1, 2)])
def test_a_gpu_rank_uses_up_to_eight_host_threads(cores, local_ranks, threads):
    """GPU path: the host threads that read or sum blocks beside the copy engine (its share, at most 8)."""
    assert restore_read.restore_threads(cores, local_ranks, restore_read.MAX_GPU_HOST_THREADS) == threads
