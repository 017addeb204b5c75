"""The bytes side of the re-slicing (megatron_ft/trainer/reslice_read.py), over container files written by
megatron_ft/trainer/snapshot_file.py: a parameter sharded over three old ranks, read back at two - each new
rank's slice bit-identical, each reading only the old ranks it needs; a missing old rank refused by name
before a byte is written; a corrupt container refused by its checksums; a dtype that differs refused; an
entry read straight into its destination (``direct``)."""
import pytest
import torch

from megatron_ft.capture import snapfile
from megatron_ft.capture.state import StateTensor
from megatron_ft.redundancy.reslice import Extent
from megatron_ft.trainer.recovery import Container
from megatron_ft.trainer.reslice_read import read_resliced
from megatron_ft.trainer.snapshot_file import write_snapshot_file

FULL = torch.arange(30, dtype=torch.float32) * 1.5  # parameter "w": 30 elements, DP 3 slices of 10


@pytest.fixture
def dp3(tmp_path):
    """Three old ranks' containers, each its slice of ``w`` and a replicated ``rng.cpu``."""
    for r in range(3):
        write_snapshot_file(str(tmp_path / f"r{r}"), 4,
                            [StateTensor("slice", FULL[10 * r: 10 * r + 10].clone()),
                             StateTensor("rng.cpu", torch.full((4,), r, dtype=torch.uint8))],
                            {"extents": {"slice": [[0, "w", 10 * r, 10]]}}, {"rank": r}, chunk_size=64)
    return tmp_path


def open_all(d, ranks=(0, 1, 2)):
    return {r: Container(str(d / f"r{r}")) for r in ranks}


@pytest.mark.parametrize("new_rank, reads", [(0, [0, 1]), (1, [1, 2])])
def test_each_new_slice_is_cut_from_the_old_slices_it_overlaps(dp3, new_rank, reads):
    sources = open_all(dp3)
    try:
        dst = torch.zeros(15)
        done = read_resliced(sources, {"slice": dst}, [Extent("slice", 0, "w", 15 * new_rank, 15)])
    finally:
        for c in sources.values():
            c.close()
    assert torch.equal(dst, FULL[15 * new_rank: 15 * new_rank + 15])
    assert done.containers == reads and done.elements == 15 and done.copies == 2


def test_replica_state_is_read_straight_from_replica_0(dp3):
    sources = open_all(dp3)
    try:
        rng = torch.zeros(4, dtype=torch.uint8)
        read_resliced(sources, {"slice": torch.zeros(15)}, [Extent("slice", 0, "w", 15, 15)],
                      {0: {"rng.cpu": StateTensor("rng.cpu", rng)}})
    finally:
        for c in sources.values():
            c.close()
    assert rng.tolist() == [0, 0, 0, 0]


def test_a_missing_old_rank_is_refused_before_a_byte_is_written(dp3):
    sources = open_all(dp3, (0, 1))
    dst = torch.full((15,), -1.0)
    try:
        with pytest.raises(ValueError, match=r"no source holds elements \[20, 30\) of parameter 'w'"):
            read_resliced(sources, {"slice": dst}, [Extent("slice", 0, "w", 15, 15)])
    finally:
        for c in sources.values():
            c.close()
    assert (dst == -1).all()


def test_a_corrupt_container_is_refused_by_its_checksums(dp3):
    path = dp3 / "r2"
    data = bytearray(path.read_bytes())
    data[snapfile.read_header(bytes(data)).geometry.data_off + 3] ^= 0x40
    path.write_bytes(bytes(data))
    sources = open_all(dp3)
    try:
        with pytest.raises(snapfile.SnapshotFormatError, match="chunk 0"):
            read_resliced(sources, {"slice": torch.zeros(15)}, [Extent("slice", 0, "w", 15, 15)])
    finally:
        for c in sources.values():
            c.close()


def test_a_dtype_that_differs_is_refused(dp3):
    sources = open_all(dp3)
    try:
        with pytest.raises(ValueError, match="is torch.float32, the destination slice is torch.float64"):
            read_resliced(sources, {"slice": torch.zeros(15, dtype=torch.float64)}, [Extent("slice", 0, "w", 0, 15)])
    finally:
        for c in sources.values():
            c.close()
