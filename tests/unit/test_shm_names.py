"""The files a node's agent holds in shared memory, told apart by name from another run's whose id extends
this one's (megatron_ft/agent/shm.py ``held_by``): run ``a``'s node 1 and run ``a.n1``'s node 0 both name
their files ``mft.a.n1.*``, and cleaning one run's node never removes the other run's slots, blocks or
progress file."""
import os

from megatron_ft.agent import shm
from megatron_ft.health import progress as hp


def touch(d, *names):
    for n in names:
        open(os.path.join(d, n), "wb").close()


def test_cleaning_one_runs_node_leaves_a_run_whose_id_extends_it(tmp_path):
    d = str(tmp_path)
    mine = [shm.segment_name("a", 1, 2, 0), shm.segment_name("a", 1, 3, 1),
            shm.block_segment_name("a", 1, "g0.copy.r0", 5), os.path.basename(hp.board_path(d, "a", 1))]
    theirs = [shm.segment_name("a.n1", 0, 0, 0), shm.block_segment_name("a.n1", 0, "g0.copy.r0", 5),
              os.path.basename(hp.board_path(d, "a.n1", 0)), shm.segment_name("a", 10, 20, 0)]
    touch(d, *mine, *theirs)
    assert all(n.startswith("mft.a.n1") for n in mine + theirs[:3])  # one prefix for both runs
    assert sorted(shm.remove_block_segments(d, "a", 1)) == [mine[2]]
    assert sorted(shm.remove_node_segments(d, "a", 1)) == sorted(mine[:2] + mine[3:])
    assert sorted(os.listdir(d)) == sorted(theirs)
    assert [p for _, _, p in shm.list_segments(d, "a.n1", 0)] == [os.path.join(d, theirs[0])]
    assert sorted(shm.remove_node_segments(d, "a.n1", 0)) == sorted(theirs[:3])
    assert os.listdir(d) == [theirs[3]]  # run a's node 10 is not node 1
