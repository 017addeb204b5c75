"""Pieces of a chunk summed apart (on a GPU: ``tensor_lanes``; on the host: ``host_lanes``) and combined
(``combine_lanes``) give exactly the checksum the copy path writes (``ChunkSum``), padding and all."""
import numpy as np
import pytest
import torch

from megatron_ft.capture import checksum


def chunk_with_pieces(rng, sizes, gap=32):
    """A chunk assembled from pieces at 32-byte aligned offsets, zero bytes between them."""
    pieces, off = [], 0
    for n in sizes:
        pieces.append((off, rng.integers(0, 256, n, dtype=np.uint8)))
        off = -(-(off + n) // 32) * 32 + gap
    nbytes = off - gap + 5  # the chunk may end past the last piece
    chunk = np.zeros(nbytes, np.uint8)
    for o, b in pieces:
        chunk[o: o + b.size] = b
    return chunk, pieces


def written_checksum(chunk, pieces):
    cs = checksum.ChunkSum(chunk.size, np.zeros_like(chunk))
    for o, b in pieces:
        cs.write(o, b)
    return cs.finish()


@pytest.mark.parametrize("sizes", [[1], [64, 7, 1000], [5, 3, 33, 96, 4096], [(32 << 20) + 12, 40]])
def test_pieces_summed_apart_combine_to_the_written_checksum(sizes):
    rng = np.random.default_rng(len(sizes))
    chunk, pieces = chunk_with_pieces(rng, sizes)
    want = written_checksum(chunk, pieces)
    assert want == checksum.checksum(chunk)
    by_tensor = [(o, checksum.tensor_lanes(torch.from_numpy(b)).tolist()) for o, b in pieces]
    by_host = [(o, checksum.host_lanes(b)) for o, b in pieces]
    mixed = [by_tensor[i] if i % 2 else by_host[i] for i in range(len(pieces))]
    for parts in (by_tensor, by_host, mixed, list(reversed(mixed))):
        assert checksum.combine_lanes(chunk.size, parts) == want


def test_lanes_of_a_tensor_that_is_not_word_aligned():
    raw = torch.from_numpy(np.random.default_rng(1).integers(0, 256, 1001, dtype=np.uint8))
    piece = raw[3:]  # storage offset 3: summed from an aligned copy
    assert checksum.combine_lanes(piece.numel(), [(0, checksum.tensor_lanes(piece).tolist())]) == \
        checksum.checksum(piece.numpy())


def test_host_lanes_without_the_native_library(monkeypatch):
    b = np.random.default_rng(2).integers(0, 256, 777, dtype=np.uint8)
    native = checksum.host_lanes(b)
    monkeypatch.setattr(checksum, "_LIB", None)
    assert checksum.host_lanes(b) == native


def test_a_flipped_bit_in_one_piece_changes_the_combined_checksum():
    rng = np.random.default_rng(3)
    chunk, pieces = chunk_with_pieces(rng, [100, 200])
    want = written_checksum(chunk, pieces)
    o, b = pieces[1]
    bad = b.copy()
    bad[17] ^= 0x10
    parts = [(pieces[0][0], checksum.tensor_lanes(torch.from_numpy(pieces[0][1])).tolist()),
             (o, checksum.tensor_lanes(torch.from_numpy(bad)).tolist())]
    assert checksum.combine_lanes(chunk.size, parts) != want


def test_a_misaligned_piece_is_refused():
    with pytest.raises(ValueError, match="not 32-byte aligned"):
        checksum.combine_lanes(100, [(8, [0] * 16)])
