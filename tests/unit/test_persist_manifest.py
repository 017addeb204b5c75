"""The disk tier's completion records (megatron_ft/agent/persist.py): node markers and the step
manifest decide which persisted steps are complete, a restore reads O(nodes) small files per step
(one with a manifest), never the step's R rank-file entries, and ranks of any width are named."""
import builtins
import json
import os
import threading

import pytest

from megatron_ft.agent import persist
from megatron_ft.capture import snapfile
from megatron_ft.capture.layout import TensorSpec, plan_layout

RUN = "run"


@pytest.fixture(scope="module")
def container():
    """A small CLEAN container (what an agent's slot holds when it persists)."""
    lay = plan_layout([TensorSpec("x", "float32", (100,))], 4096)
    g = snapfile.geometry_for(lay)
    buf = bytearray(g.total)
    snapfile.init_container(buf, lay.to_json(), g)
    snapfile.write_version(buf, 1, {"chunks": ["0"]})
    snapfile.set_state(buf, snapfile.CLEAN)
    return buf


def persist_node(base, step, node, ranks, world_size, buf, real_files=False):
    """What Agent._persist does for one node: every rank's file, then the node's marker."""
    for r in ranks:
        path = persist.rank_file(base, RUN, step, r)
        if real_files:
            persist.write_container(buf, path)
        else:  # the readers never open rank files: an empty one keeps R=512 cheap
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()
    return persist.mark_persisted(base, RUN, step, node, {r: buf for r in ranks}, world_size)


def persist_step(base, step, world_size, nodes, buf, skip_marker_of=None):
    per = world_size // nodes
    for n in range(nodes):
        ranks = range(n * per, (n + 1) * per)
        if n == skip_marker_of:
            for r in ranks:
                os.makedirs(persist.step_dir(base, RUN, step), exist_ok=True)
                open(persist.rank_file(base, RUN, step, r), "wb").close()
        else:
            persist_node(base, step, n, ranks, world_size, buf)


def test_wide_ranks_are_named_listed_marked_and_pruned(tmp_path, container):
    base = str(tmp_path)
    big = [123456, 1_000_000]
    assert os.path.basename(persist.rank_file(base, RUN, 5, 123456)) == "rank_123456.mft"
    assert os.path.basename(persist.rank_file(base, RUN, 5, 7)) == "rank_00007.mft"  # unchanged below 100000
    with pytest.raises(ValueError):
        persist.rank_file(base, RUN, 5, -1)
    for step in (5, 6):
        persist_node(base, step, 3, big, 2_000_000, container, real_files=True)
    assert persist.list_steps(base, RUN) == {5: set(big), 6: set(big)}
    rec = json.load(open(persist.marker_file(base, RUN, 5, 3)))
    assert persist.marker_ranks(rec, RUN, 5) == set(big)
    assert [e["bytes"] for e in rec["ranks"]] == [os.path.getsize(persist.rank_file(base, RUN, 5, r)) for r in big]
    # an old step of them is pruned: files, marker and directory
    removed = persist.prune(base, RUN, big, keep=1)
    assert sorted(removed) == sorted(persist.rank_file(base, RUN, 5, r) for r in big)
    assert not os.path.exists(persist.step_dir(base, RUN, 5))
    assert persist.list_steps(base, RUN) == {6: set(big)}
    # steps past ten digits too
    persist_node(base, 12_345_678_901, 0, [0], 1, container)
    assert persist.complete_steps(base, RUN, 1) == [12_345_678_901]


def test_a_node_marker_missing_leaves_the_step_incomplete(tmp_path, container):
    base = str(tmp_path)
    persist_step(base, 10, 16, 4, container, skip_marker_of=2)
    assert persist.list_steps(base, RUN)[10] == set(range(16))  # every rank's file is there
    assert persist.complete_steps(base, RUN, 16) == []
    assert not os.path.exists(persist.manifest_file(base, RUN, 10))
    # the last node's marker completes the set: that node writes the manifest
    assert persist_node(base, 10, 2, range(8, 12), 16, container)
    man = json.load(open(persist.manifest_file(base, RUN, 10)))
    assert (man["format"], man["version"], man["world_size"], man["nodes"]) == \
        (persist.MANIFEST_FORMAT, 1, 16, [0, 1, 2, 3])
    assert persist.complete_steps(base, RUN, 16) == [10]


def test_complete_steps_newest_first_and_by_manifest_alone(tmp_path, container):
    base = str(tmp_path)
    for step in (3, 9, 6):
        persist_step(base, step, 8, 2, container)
    persist_step(base, 12, 8, 2, container, skip_marker_of=1)  # being written: not complete
    assert persist.complete_steps(base, RUN, 8) == [9, 6, 3]
    assert persist.complete_steps(base, RUN, 4) == [12, 9, 6, 3]  # node 0's marker covers ranks 0..3 of 12
    assert persist.complete_steps(base, RUN, 9) == []
    # the manifest suffices: markers lost after sealing do not unseal the step
    import shutil
    shutil.rmtree(os.path.join(persist.step_dir(base, RUN, 9), persist.NODES_DIR))
    assert persist.complete_steps(base, RUN, 8) == [9, 6, 3]


def test_a_step_from_before_the_markers_is_incomplete(tmp_path):
    base = str(tmp_path)
    for r in range(4):  # rank files only, as an older version wrote them
        os.makedirs(persist.step_dir(base, RUN, 2), exist_ok=True)
        open(persist.rank_file(base, RUN, 2, r), "wb").close()
    assert persist.list_steps(base, RUN) == {2: {0, 1, 2, 3}}
    assert persist.complete_steps(base, RUN, 4) == []
    persist.prune(base, RUN, range(4), keep=0)  # and is still pruned, directory and all
    assert not os.path.exists(persist.step_dir(base, RUN, 2))


GARBAGE = {
    "empty": b"",
    "torn": None,  # the first half of a real marker
    "binary": bytes(range(256)) * 4,
    "not an object": b"[1, 2, 3]",
    "other version": lambda m: dict(m, version=2),
    "other step": lambda m: dict(m, step=11),
    "other run": lambda m: dict(m, run_id="other"),
    "other format": lambda m: dict(m, format=persist.MANIFEST_FORMAT),
    "node mismatch": lambda m: dict(m, node=7),
    "rank as text": lambda m: dict(m, ranks=[dict(m["ranks"][0], rank="4")] + m["ranks"][1:]),
    "negative rank": lambda m: dict(m, ranks=[dict(m["ranks"][0], rank=-1)] + m["ranks"][1:]),
    "bool rank": lambda m: dict(m, ranks=[dict(m["ranks"][0], rank=True)] + m["ranks"][1:]),
    "bad crc": lambda m: dict(m, ranks=[dict(m["ranks"][0], record_crc32=5)] + m["ranks"][1:]),
    "ranks not a list": lambda m: dict(m, ranks={"4": 1}),
    "deeply nested": b"[" * 100000 + b"]" * 100000,
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_a_torn_or_garbage_marker_is_ignored(tmp_path, container, kind):
    base = str(tmp_path)
    persist_step(base, 10, 8, 2, container, skip_marker_of=1)
    good = persist.node_marker(RUN, 10, 1, {r: (4096, 1) for r in range(4, 8)})
    bad = GARBAGE[kind]
    raw = (json.dumps(good).encode()[:60] if bad is None else
           json.dumps(bad(good)).encode() if callable(bad) else bad)
    with open(persist.marker_file(base, RUN, 10, 1), "wb") as f:
        f.write(raw)
    assert persist.complete_steps(base, RUN, 8) == []
    assert not persist.seal(base, RUN, 10, 8)  # nor does a writer seal the step on it
    # a garbage manifest is ignored the same way: the step is as complete as its markers say
    with open(persist.manifest_file(base, RUN, 10), "wb") as f:
        f.write(raw if kind != "other format" else json.dumps(dict(good, world_size=8)).encode())
    assert persist.complete_steps(base, RUN, 8) == []
    persist.mark_persisted(base, RUN, 10, 1, {r: container for r in range(4, 8)}, 8)
    assert persist.complete_steps(base, RUN, 8) == [10]


def test_a_marker_that_is_a_directory_or_unreadable_is_ignored(tmp_path, container):
    base = str(tmp_path)
    persist_step(base, 10, 8, 2, container, skip_marker_of=1)
    os.makedirs(persist.marker_file(base, RUN, 10, 1))
    os.makedirs(persist.manifest_file(base, RUN, 10))
    assert persist.complete_steps(base, RUN, 8) == []
    os.makedirs(os.path.join(persist.run_dir(base, RUN), "step_0000000011"))
    open(os.path.join(persist.step_dir(base, RUN, 11), persist.NODES_DIR), "wb").close()  # a file, not a dir
    assert persist.complete_steps(base, RUN, 8) == []


def test_exactly_one_manifest_writer_wins(tmp_path, container):
    base = str(tmp_path)
    persist_step(base, 4, 8, 2, container)
    path = persist.manifest_file(base, RUN, 4)
    before = open(path, "rb").read()
    assert not persist._write_record(path, {"other": 1}, exclusive=True)  # exists: nothing written
    assert open(path, "rb").read() == before
    # racing sealers: every one reports the step sealed, one manifest, no temporary left behind
    os.unlink(path)
    results, start = [], threading.Barrier(8)

    def sealer():
        start.wait()
        results.append(persist.seal(base, RUN, 4, 8))
    threads = [threading.Thread(target=sealer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    assert os.listdir(persist.step_dir(base, RUN, 4)).count(persist.MANIFEST) == 1
    assert not [f for f in os.listdir(persist.step_dir(base, RUN, 4)) if ".tmp." in f]
    assert persist.manifest_world(json.load(open(path)), RUN, 4) == 8


def test_prune_removes_the_manifest_first_then_markers_files_and_directory(tmp_path, container):
    base = str(tmp_path)
    for step in (1, 2, 3):
        persist_step(base, step, 8, 2, container)
    assert persist.complete_steps(base, RUN, 8) == [3, 2, 1]
    persist.prune(base, RUN, range(0, 4), keep=2, protect=3)  # node 0
    d = persist.step_dir(base, RUN, 1)
    assert not os.path.exists(persist.manifest_file(base, RUN, 1))
    assert not os.path.exists(persist.marker_file(base, RUN, 1, 0))
    assert os.path.exists(persist.marker_file(base, RUN, 1, 1))
    assert persist.complete_steps(base, RUN, 8) == [3, 2]  # step 1 stopped being complete at once
    assert os.path.isdir(d)  # node 1's files are still there
    # a refused file (renamed *.corrupt) still makes the step node 1's to prune
    p = persist.rank_file(base, RUN, 1, 5)
    os.replace(p, p + ".corrupt")
    persist.prune(base, RUN, range(4, 8), keep=2)  # node 1: the last marker goes, the directory with it
    assert not os.path.exists(d)
    assert persist.complete_steps(base, RUN, 8) == [3, 2]


class FsCounter:
    """Counts the restore path's filesystem reads: directory listings (and the entries they return)
    and file opens."""

    def __init__(self, monkeypatch):
        self.listings = self.entries = self.opens = 0
        real_listdir, real_scandir, real_open = os.listdir, os.scandir, builtins.open

        def listdir(path="."):
            out = real_listdir(path)
            self.listings += 1
            self.entries += len(out)
            return out

        counter = self

        class Scandir:
            def __init__(self, path="."):
                self.it = real_scandir(path)
                counter.listings += 1

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.it.close()

            def __iter__(self):
                for e in self.it:
                    counter.entries += 1
                    yield e

        def open_(*a, **k):
            self.opens += 1
            return real_open(*a, **k)
        monkeypatch.setattr(os, "listdir", listdir)
        monkeypatch.setattr(os, "scandir", Scandir)
        monkeypatch.setattr(builtins, "open", open_)

    def counts(self):
        return self.listings, self.entries, self.opens


def restore_reads(tmp_path, monkeypatch, container, world_size, nodes=8, steps=(2, 4, 6), unsealed=8):
    base = str(tmp_path / f"w{world_size}")
    for s in steps:
        persist_step(base, s, world_size, nodes, container)
    persist_step(base, unsealed, world_size, nodes, container, skip_marker_of=nodes - 1)
    with monkeypatch.context() as m:
        fs = FsCounter(m)
        assert persist.complete_steps(base, RUN, world_size) == sorted(steps, reverse=True)
        return fs.counts()


def test_restore_reads_per_step_do_not_grow_with_the_world(tmp_path, monkeypatch, container):
    small = restore_reads(tmp_path, monkeypatch, container, 64)
    large = restore_reads(tmp_path, monkeypatch, container, 512)
    assert small == large
    listings, entries, opens = large
    # one listing of the run directory (4 steps), then per step an open of its manifest (4, one
    # missing); the step without a manifest: its nodes/ directory (7 markers) and each marker
    assert (listings, entries, opens) == (2, 4 + 7, 4 + 7)


def test_sealed_steps_cost_one_read_each(tmp_path, monkeypatch, container):
    base = str(tmp_path)
    for s in range(1, 6):
        persist_step(base, s, 256, 8, container)
    with monkeypatch.context() as m:
        fs = FsCounter(m)
        assert persist.complete_steps(base, RUN, 256) == [5, 4, 3, 2, 1]
        assert fs.counts() == (1, 5, 5)


def test_only_the_node_that_can_complete_the_set_reads_the_markers(tmp_path, monkeypatch, container):
    base = str(tmp_path)
    opens = []
    with monkeypatch.context() as m:
        real_open = builtins.open
        m.setattr(builtins, "open", lambda *a, **k: (opens.append(a[0]), real_open(*a, **k))[1])
        for n in range(8):
            opens.clear()
            sealed = persist_node(base, 3, n, range(n * 4, n * 4 + 4), 32, container)
            markers_read = [p for p in opens if str(p).endswith(".json") and persist.NODES_DIR in str(p)]
            assert (sealed, len(markers_read)) == ((False, 0) if n < 7 else (True, 8)), n
    assert persist.complete_steps(base, RUN, 32) == [3]


def test_nodes_of_unequal_rank_counts_complete_the_step_by_their_markers(tmp_path, container):
    base = str(tmp_path)
    persist_node(base, 3, 0, range(0, 8), 12, container)
    assert not persist_node(base, 3, 1, range(8, 12), 12, container)  # 4 ranks: it expects 3 markers
    assert persist.complete_steps(base, RUN, 12) == [3]  # complete all the same, by its 2 markers
