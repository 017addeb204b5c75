"""Layout planning, container format and checksums (pure units)."""
import numpy as np
import pytest
import torch

from megatron_ft.capture import checksum, snapfile
from megatron_ft.capture.layout import Layout, ShardSpec, TensorSpec, plan_layout, shard_bounds


def test_worked_example_from_docstring():
    lay = plan_layout([TensorSpec("a", "float32", (1000,)), TensorSpec("b", "int64", (3,))], 4096)
    assert [(e.spec.name, e.offset) for e in lay.entries] == [("a", 0), ("b", 4032)]
    assert lay.data_nbytes == 4056 and lay.num_chunks == 1
    lay2 = plan_layout([TensorSpec("a", "float32", (1000,)), TensorSpec("b", "int64", (3,))], 2048)
    assert lay2.num_chunks == 2
    assert [(p.entry_index, p.src_start, p.src_end, p.dst_offset) for p in lay2.pieces(1)] == [
        (0, 2048, 4000, 2048), (1, 0, 24, 4032)]


def test_pieces_cover_every_byte_exactly_once():
    rng = np.random.default_rng(0)
    specs = [TensorSpec(f"t{i}", "float32", (int(n),)) for i, n in enumerate(rng.integers(0, 5000, 30))]
    lay = plan_layout(specs, 4096)
    covered = {i: 0 for i in range(len(specs))}
    for c in range(lay.num_chunks):
        lo, hi = lay.chunk_bounds(c)
        for p in lay.pieces(c):
            assert lo <= p.dst_offset < hi and p.dst_offset + (p.src_end - p.src_start) <= hi
            covered[p.entry_index] += p.src_end - p.src_start
    assert covered == {i: s.nbytes for i, s in enumerate(specs)}


def test_offsets_aligned_and_names_unique():
    lay = plan_layout([TensorSpec("a", "uint8", (3,)), TensorSpec("b", "bfloat16", (5,))], 128)
    assert all(e.offset % 64 == 0 for e in lay.entries)
    with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
        plan_layout([TensorSpec("a", "uint8", (3,)), TensorSpec("a", "uint8", (3,))], 128)
    with pytest.raises(ValueError, match="chunk_size=100"):
        plan_layout([], 100)
    with pytest.raises(ValueError, match="unknown dtype name 'complex32'"):
        plan_layout([TensorSpec("a", "complex32", (3,))], 128)


def test_shard_bounds_partition():
    for n in (0, 1, 7, 10, 4096):
        for count in (1, 2, 3, 4):
            parts = [shard_bounds(n, i, count) for i in range(count)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(parts[i][1] == parts[i + 1][0] for i in range(count - 1))


def test_layout_json_roundtrip_and_tamper_detection():
    lay = plan_layout([TensorSpec("x", "float32", (4, 4), ShardSpec(1, 2, 32))], 256, {"rank": 3})
    back = Layout.from_json(lay.to_json())
    assert back == lay and back.identity == {"rank": 3}
    tampered = lay.to_json().replace(b'"offset":0', b'"offset":64')
    with pytest.raises(ValueError, match="fingerprint"):
        Layout.from_json(tampered)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 4096, 100003])
def test_native_checksum_matches_numpy_reference(n):
    a = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    b = np.zeros_like(a)
    assert checksum.copy_checksum(b, a) == checksum.checksum_numpy(a)
    assert np.array_equal(a, b)


def test_checksum_detects_single_bit_flip_and_swaps():
    a = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    base = checksum.checksum(a)
    flipped = a.copy()
    flipped[12345] ^= 0x10
    assert checksum.checksum(flipped) != base
    words = a.view(np.uint64).copy()
    words[[3, 7]] = words[[7, 3]]  # same multiset of words, different order
    assert checksum.checksum(words.view(np.uint8)) != base


def test_checksum_accepts_torch_tensors_of_any_dtype():
    t = torch.arange(100, dtype=torch.bfloat16)
    assert checksum.checksum(t) == checksum.checksum_numpy(t.view(torch.uint8).numpy())


def test_container_header_and_records():
    lay = plan_layout([TensorSpec("x", "float32", (100,))], 4096)
    g = snapfile.geometry_for(lay)
    buf = bytearray(g.total)
    snapfile.init_container(buf, lay.to_json(), g)
    hdr = snapfile.read_header(buf)
    assert hdr.state == snapfile.EMPTY and snapfile.read_layout(buf) == lay
    with pytest.raises(snapfile.SnapshotFormatError, match="torn"):
        snapfile.read_version(buf)
    snapfile.write_version(buf, 7, {"chunks": ["0"]})
    snapfile.set_state(buf, snapfile.CLEAN)
    hdr = snapfile.read_header(buf)
    assert (hdr.state, hdr.step) == (snapfile.CLEAN, 7)
    assert snapfile.read_version(buf)["step"] == 7
    buf[hdr.geometry.version_off + 3] ^= 1  # corrupt the record
    with pytest.raises(snapfile.SnapshotFormatError):
        snapfile.read_version(buf)
    bad = bytearray(buf)
    bad[0:8] = b"NOTASNAP"
    with pytest.raises(snapfile.SnapshotFormatError, match="magic"):
        snapfile.read_header(bad)


def test_all_pieces_equals_per_chunk_pieces():
    rng = np.random.default_rng(3)
    specs = [TensorSpec(f"t{i}", "float32", (int(n),)) for i, n in enumerate(rng.integers(0, 3000, 40))]
    for chunk in (64, 1024, 4096, 1 << 20):
        lay = plan_layout(specs, chunk)
        assert lay.all_pieces() == [lay.pieces(i) for i in range(lay.num_chunks)]


def test_streaming_chunk_checksum_equals_checksum_of_the_assembled_chunk():
    """Streaming checksum over pieces + zero padding == checksum of the finished chunk bytes."""
    rng = np.random.default_rng(5)
    specs = [TensorSpec(f"t{i}", "uint8", (int(n),)) for i, n in enumerate(rng.integers(0, 700, 25))]
    lay = plan_layout(specs, 1024)
    data = [rng.integers(0, 256, s.numel, dtype=np.uint8) for s in specs]
    area = np.zeros(lay.data_nbytes, np.uint8)
    for i, pieces in enumerate(lay.all_pieces()):
        lo, hi = lay.chunk_bounds(i)
        w = checksum.ChunkSum(hi - lo, area[lo:hi])
        r = checksum.ChunkSum(hi - lo)
        for p in pieces:
            w.write(p.dst_offset - lo, data[p.entry_index][p.src_start:p.src_end])
            r.add(p.dst_offset - lo, data[p.entry_index][p.src_start:p.src_end])
        assert w.finish() == checksum.checksum_numpy(area[lo:hi]) == r.finish(), i
    for e, d in zip(lay.entries, data):
        assert np.array_equal(area[e.offset:e.offset + e.spec.nbytes], d)
