"""The read + verify pass of a restore (megatron_ft/trainer/restore_read.py): the readers' contract - the
block reader (native library, disk; a chunk whole into its buffer, or piece by piece), the mapped
reader (native library, a tmpfs slot read through the process's kept mapping of it) and the in-place reader (no native library) each run over the same containers (whole,
truncated, corrupted, of the previous format) and give the same verdicts and bytes - the screen for
NaN and infinities in the native readers' pass (the same verdicts as the value guard's), the choice
of reader, the process's mappings of its slots reused rather than made again, and
Container.load_verified end to end on each path. The device reader's bookkeeping:
tests/integration/test_gpu_path_logic.py (CPU, stubs) and tests/gpu (a GPU)."""
import errno
import mmap
import os

import numpy as np
import pytest
import torch

from megatron_ft.capture import checksum, snapfile
from megatron_ft.trainer import guard, mapped_slots, recovery, restore_plan, restore_read
from megatron_ft.agent import shm
from megatron_ft.capture.layout import plan_layout
from megatron_ft.capture.state import StateTensor

IDENTITY = {"run_id": "t", "rank": 0, "world_size": 1}
PATHS = ["block-buffer", "mapped", "mapped-4k", "in-place"]


@pytest.fixture(autouse=True)
def no_kept_mappings():
    """Every test starts and ends with no slot mapped by this process (as a fresh one)."""
    mapped_slots.release_slot_mappings()
    yield
    mapped_slots.release_slot_mappings()


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
    "block-chunks": lambda plan, fd: restore_read.BlockReader(plan, fd, 1 << 20),  # a chunk per pread
    "mapped": lambda plan, fd: restore_read.MappedReader(plan, fd, 4096),
    "in-place": lambda plan, fd: restore_read.InPlaceReader(plan, fd),
}
NATIVE = {"block-buffer", "block-chunks", "mapped"}
#: the readers that copy, sum and screen a whole chunk in one native call
FUSED = {"block-chunks", "mapped"}


def read_with(kind, path, dst, screened=None):
    """The read plan of the container at ``path`` into ``dst``, run with reader ``kind``: None, or the
    error it raised (the verdict). ``screened`` (a dict) gets what the reader screened in its pass."""
    if (kind in NATIVE or not isinstance(kind, str)) and not checksum.HAVE_NATIVE:
        pytest.skip("native library not built")
    cont = recovery.Container(str(path))
    try:
        cont.check_identity(IDENTITY, 1)
        views = {n: StateTensor(n, t).saved_view().reshape(-1) for n, t in dst.items()}
        plan = restore_read.plan_reads(cont.path, cont.layout, cont.version["chunks"], cont.version["checksum"],
                                       cont.header.geometry.data_off, views)
        reader = (READERS[kind] if isinstance(kind, str) else kind)(plan, cont.fd)
        restore_read.read_verified(plan, reader)
        if screened is not None:
            screened.update(reader.screened())
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


@pytest.mark.parametrize("backing, native, chosen", [
    ("huge", True, "MappedReader"), ("small", True, "MappedReader"), ("disk", True, "BlockReader"),
    ("huge", False, "InPlaceReader"), ("small", False, "InPlaceReader"), ("disk", False, "InPlaceReader")])
def test_the_reader_is_chosen_by_the_medium(tmp_path, monkeypatch, backing, native, chosen):
    """Once per restore: the process's mapping for a slot on a tmpfs (huge or 4 KiB pages), blocks for
    disk, in place without the native library (CPU destinations: no device reader)."""
    if native and not checksum.HAVE_NATIVE:
        pytest.skip("native library not built")
    monkeypatch.setattr(restore_read, "STREAMING_RESTORE", native)
    monkeypatch.setattr(recovery.shm, "backing_of", lambda directory: shm.HUGE if backing == "huge" else shm.SMALL)
    monkeypatch.setattr(shm, "is_tmpfs", lambda directory: backing != "disk")
    src = make_tensors()
    lay, g = write_container(tmp_path / "s.mft", src)
    cont = recovery.Container(str(tmp_path / "s.mft"))
    try:
        assert cont.medium == {"huge": restore_read.HUGE_TMPFS, "small": restore_read.TMPFS,
                               "disk": restore_read.FILE}[backing]
        views = {n: torch.zeros_like(t).reshape(-1) for n, t in src.items()}
        plan = restore_read.plan_reads(cont.path, lay, cont.version["chunks"], cont.version["checksum"], g.data_off, views)
        reader = restore_read.choose_reader(plan, cont.fd, cont.medium, lambda d: None, cont.marks)
        try:
            assert type(reader).__name__ == chosen
        finally:
            reader.close()
    finally:
        cont.close()


@pytest.mark.skipif(not checksum.HAVE_NATIVE, reason="native library not built")
def test_a_slot_is_mapped_once_per_process(tmp_path, monkeypatch):
    """The restore reads through the mapping the engine keeps (no page-table work again), and a fresh
    process's restore leaves its mapping to the engine; a re-created slot file is mapped anew and the
    old mapping dropped."""
    maps = []
    real = mapped_slots.shm.open_segment
    monkeypatch.setattr(mapped_slots.shm, "open_segment", lambda path: maps.append(path) or real(path))
    src = make_tensors()
    path = str(tmp_path / "s.mft")
    write_container(path, src)
    cont = recovery.Container(path)
    try:  # a reader that reads no chunk through it (a plan whose pieces go to a device) maps nothing
        plan = restore_read.plan_reads(cont.path, cont.layout, cont.version["chunks"], cont.version["checksum"],
                                       cont.header.geometry.data_off, {n: torch.zeros_like(t).reshape(-1)
                                                                       for n, t in src.items()})
        restore_read.cpu_reader(plan, cont.fd, restore_read.TMPFS).close()
    finally:
        cont.close()
    assert maps == [] and mapped_slots.kept_paths() == []
    engine_slots = mapped_slots.slot_mappings([path])  # the engine's registration
    for _ in range(2):  # two restores: no mapping made by either
        dst = {n: torch.zeros_like(t) for n, t in src.items()}
        cont = recovery.Container(path)
        try:
            views = {n: t.reshape(-1) for n, t in dst.items()}
            plan = restore_read.plan_reads(cont.path, cont.layout, cont.version["chunks"], cont.version["checksum"],
                                           cont.header.geometry.data_off, views)
            reader = restore_read.cpu_reader(plan, cont.fd, restore_read.TMPFS)
            assert isinstance(reader, restore_read.MappedReader)
            restore_read.read_verified(plan, reader)
        finally:
            cont.close()
        assert all(torch.equal(src[n], dst[n]) for n in src)
    assert maps == [path] and mapped_slots.kept_paths() == [path]
    os.unlink(path)
    write_container(path, src)  # the agent re-created the slot: a new file under the same path
    assert mapped_slots.slot_mapping(path) is not engine_slots[0]
    assert maps == [path, path] and mapped_slots.kept_paths() == [path]


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
    monkeypatch.setattr(shm, "is_tmpfs", lambda directory: path == "mapped-4k")
    return path


@pytest.mark.parametrize("read_path", PATHS, indirect=True)
def test_restore_is_bit_exact(tmp_path, read_path):
    src = make_tensors()
    write_container(tmp_path / "s.mft", src)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    dst["misaligned"] = torch.zeros(src["misaligned"].numel() + 1, dtype=torch.uint8)[1:]
    load(tmp_path / "s.mft", dst, expect_mapped=read_path.startswith("mapped"))
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

    monkeypatch.setattr(mapped_slots.shm, "open_segment", no_map)
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


# ------------------------------------------------------------------------ the screen in the read's pass
def poisoned_tensors():
    """Floating-point tensors of every dtype a snapshot holds, some holding a NaN or an infinity (at the
    start, the end, in a later chunk, in an odd-sized tail), some only extreme finite values; integers whose
    bits read as a float NaN (not screened: not floating point). Returns (tensors, which must be refused)."""
    g = torch.Generator().manual_seed(7)
    t = {}
    t["f32_nan_first"] = torch.randn(5000, generator=g)
    t["f32_nan_first"][0] = float("nan")
    t["f32_inf_last"] = torch.randn(4099, generator=g)
    t["f32_inf_last"][-1] = float("inf")
    t["f64_ninf_later_chunk"] = torch.randn(3000, dtype=torch.float64, generator=g)
    t["f64_ninf_later_chunk"][2500] = float("-inf")
    t["f16_nan"] = torch.randn(7001, generator=g).half()
    t["f16_nan"][3333] = float("nan")
    t["bf16_inf"] = torch.randn(513, generator=g).bfloat16()
    t["bf16_inf"][511] = float("inf")
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        fi = torch.finfo(dtype)  # the largest, the smallest normal, a subnormal, -0: all finite
        t[f"{dtype}_extremes".replace("torch.", "")] = torch.tensor([fi.max, -fi.max, fi.tiny, fi.tiny / 4, -0.0] * 41,
                                                                     dtype=dtype)
    t["i32_nan_bits"] = torch.full((999,), 0x7FC00000, dtype=torch.int32)
    t["u8_all_ones"] = torch.full((77,), 0xFF, dtype=torch.uint8)
    refused = {n for n in t if t[n].is_floating_point() and "extremes" not in n}
    return t, refused


def raw(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("kind", sorted(FUSED))
def test_the_fused_pass_screens_for_nan_and_infinities_as_the_guard_does(tmp_path, kind):
    """A native reader that copies a whole chunk in one call checks every floating-point piece for NaN and
    infinities in the same pass: its verdict per tensor is the value guard's, integers are not screened,
    and the bytes arrive bit-exact (the checksum says nothing of values: the container verifies)."""
    src, refused = poisoned_tensors()
    write_container(tmp_path / "p.mft", src)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    screened: dict = {}
    assert read_with(kind, tmp_path / "p.mft", dst, screened) is None
    for n in src:
        assert torch.equal(raw(src[n]), raw(dst[n])), n
    floats = {n for n, t in src.items() if t.is_floating_point()}
    assert set(screened) == floats
    assert {n for n, ok in screened.items() if not ok} == refused == set(guard.non_finite(dst))


@pytest.mark.parametrize("kind", sorted(set(READERS) - FUSED))
def test_the_other_readers_leave_the_screen_to_the_guard(tmp_path, kind):
    src, _ = poisoned_tensors()
    write_container(tmp_path / "p.mft", src)
    screened: dict = {}
    assert read_with(kind, tmp_path / "p.mft", {n: torch.zeros_like(t) for n, t in src.items()}, screened) is None
    assert screened == {}


@pytest.mark.parametrize("read_path", PATHS, indirect=True)
def test_the_guard_reads_again_only_what_the_pass_did_not_screen(tmp_path, read_path, monkeypatch):
    """Restorer's value check after the read: the guard (ValueScreen) gets only the checked tensors the read
    did not screen in its pass, and the verdict names every refused tensor either way - but not one whose
    values are not checked (``values_checked=False``)."""
    src, refused = poisoned_tensors()
    write_container(tmp_path / "p.mft", src)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    unchecked = "f32_inf_last"
    targets = {n: StateTensor(n, t, values_checked=n != unchecked) for n, t in dst.items()}
    given = []
    real_init = guard.ValueScreen.__init__

    def screen(self, tensors):
        given.append(set(tensors))
        real_init(self, tensors)

    monkeypatch.setattr(guard.ValueScreen, "__init__", screen)
    restorer = recovery.Restorer(0, 1, IDENTITY, "t", str(tmp_path / "persist"), None)
    cont = recovery.Container(str(tmp_path / "p.mft"))
    try:
        cont.check_identity(IDENTITY, 1)
        rejected: list = []
        ok, bad = restorer._load_checked("local", recovery.Candidate(1, cont.path, "local_memory"), cont, targets,
                                         rejected, {})
    finally:
        cont.close()
    assert not ok and set(bad) == refused - {unchecked}
    assert bad == [n for n in src if n in set(bad)]  # in the state's order
    fused = read_path.startswith("mapped")  # (the fixture's 4 KiB block: piece by piece, unscreened)
    ints = {"i32_nan_bits", "u8_all_ones"}  # (the guard skips them itself)
    assert given == [ints if fused else set(src) - {unchecked}]
    for n in src:  # the bytes are in place either way
        assert torch.equal(raw(src[n]), raw(dst[n])), n
