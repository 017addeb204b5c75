"""No ceiling on ranks: every name and key that carries a rank or a node works at ranks above 100,000
(123,456 and 999,999 here) - the per-rank run files (one directory per node), the persisted files, the
shared-memory segments, the agent's socket and the coordination store's keys (one per node, none per
rank)."""
from __future__ import annotations

import ast
import json
import os

import pytest

from conftest import REPO
from megatron_ft import rank_files
from megatron_ft.agent import persist, shm
from megatron_ft.agent.agreement import REPORT_KEY
from megatron_ft.agent.protocol import MAX_SOCKET_PATH, socket_path
from megatron_ft.health import wire_store
from megatron_ft.health.hang import STALL_KEY
from megatron_ft.testing import demo, faults
from megatron_ft.trainer.checkpointer import _EventLog

BIG = (99_999, 123_456, 999_999)
RUN_ID = "r" * 64  # the longest run id the configuration allows
PER_NODE = 8


def test_rank_paths_are_per_node_unpadded_and_list_in_numeric_order(tmp_path):
    base = str(tmp_path / "events")
    for r in (*BIG, 7):
        path = rank_files.rank_path(base, r, ".jsonl", r // PER_NODE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
    flat = os.path.join(base, "rank1000000.jsonl")  # the flat layout of earlier versions still reads
    open(flat, "w").close()
    open(os.path.join(base, "rank12.jsonl.tmp"), "w").close()  # not a rank file
    assert rank_files.rank_path(base, 999_999, ".jsonl", 124_999) == os.path.join(base, "node124999",
                                                                                   "rank999999.jsonl")
    assert [r for r, _ in rank_files.rank_files(base, ".jsonl")] == [7, 99_999, 123_456, 999_999, 1_000_000]
    assert sorted(os.listdir(base)) == ["node0", "node12499", "node124999", "node15432", "rank1000000.jsonl",
                                        "rank12.jsonl.tmp"]  # a directory per node, not a file per rank
    assert rank_files.find_rank_file(base, 123_456, ".jsonl") == rank_files.rank_path(base, 123_456, ".jsonl", 15_432)
    assert rank_files.find_rank_file(base, 1_000_000, ".jsonl") == flat
    assert rank_files.find_rank_file(base, 5, ".jsonl") is None
    assert len(rank_files.all_files(base, ".jsonl")) == 5
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match=f"rank={bad!r} is invalid"):
            rank_files.rank_path(base, bad, ".jsonl", 0)
    with pytest.raises(ValueError, match="node=-2 is invalid"):
        rank_files.node_dir(base, -2)


def test_process_node_comes_from_the_launcher_then_torchrun():
    assert rank_files.process_node(999_999, {"MFT_NODE_RANK": "124999", "GROUP_RANK": "3"}) == 124_999
    assert rank_files.process_node(999_999, {"GROUP_RANK": "3"}) == 3
    assert rank_files.process_node(999_999, {"LOCAL_WORLD_SIZE": "8"}) == 124_999
    assert rank_files.process_node(999_999, {}) == 0
    with pytest.raises(ValueError, match="MFT_NODE_RANK='x' is invalid"):
        rank_files.process_node(0, {"MFT_NODE_RANK": "x"})


def test_event_log_and_fault_markers_of_a_rank_above_100000(tmp_path, monkeypatch):
    monkeypatch.setenv("MFT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("MFT_NODE_RANK", "15432")
    log = _EventLog(123_456, 15_432)
    log.write({"event": "restore", "step": 4})
    log.close()
    path = tmp_path / "events" / "node15432" / "rank123456.jsonl"
    assert json.loads(path.read_text())["rank"] == 123_456
    assert [e["rank"] for e in demo._all_records(str(tmp_path), "events")] == [123_456]
    killer = faults.KillAt(faults.parse("restore:4:999999"), str(tmp_path))
    assert killer._first_time(999_999) and not killer._first_time(999_999)
    assert (tmp_path / "faults" / "node15432" / "rank999999.fired").exists()
    agent = faults.KillAt(faults.parse("mid-exchange:4"), str(tmp_path), node=124_999)  # the agent: rank -1
    assert agent._first_time(-1) and (tmp_path / "faults" / "node124999" / "agent.fired").exists()
    assert faults._agent_node(["-m", "megatron_ft.agent", "--config", "c", "--node", "124999"]) == 124_999


def test_persisted_file_names_round_trip_and_sort_by_rank(tmp_path):
    names = [os.path.basename(persist.rank_file(str(tmp_path), "run", 3, r)) for r in (*BIG, 12)]
    assert names == ["rank_99999.mft", "rank_123456.mft", "rank_999999.mft", "rank_00012.mft"]
    ranks = [int(persist._RANK_RE.match(n).group(1)) for n in names]
    assert ranks == [*BIG, 12]
    assert sorted(ranks) == [12, *BIG]  # readers order by the parsed number (names alone would mis-sort)
    marker = os.path.basename(persist.marker_file(str(tmp_path), "run", 3, 124_999))
    assert int(persist._NODE_RE.match(marker).group(1)) == 124_999


def test_segment_and_socket_names_stay_under_their_limits():
    name = shm.segment_name(RUN_ID, 124_999, 999_999, 3)
    assert len(name) < 100 and shm.parse_segment_name(name) == (RUN_ID, 124_999, 999_999, 3)
    block = shm.block_segment_name(RUN_ID, 124_999, "copy.r999999", 10**12)
    assert len(block.encode()) <= shm.MAX_NAME and shm.parse_segment_name(block) is None
    with pytest.raises(ValueError, match=r"has 3\d\d bytes, file names allow 255"):
        shm.block_segment_name(RUN_ID, 0, "k" * 300, 1)
    with pytest.raises(ValueError, match="rank=-1 is invalid"):
        shm.segment_name(RUN_ID, 0, -1, 0)
    path = socket_path("/tmp/megatron-ft/sockets", RUN_ID, 999_999)  # the default directory, node 999,999
    assert len(path.encode()) <= MAX_SOCKET_PATH
    with pytest.raises(ValueError, match="agent.socket_dir='/tmp/a-much-longer-socket-directory' is too long"):
        socket_path("/tmp/a-much-longer-socket-directory", RUN_ID, 999_999)


def test_the_store_keys_of_the_node_of_rank_999999_are_accepted():
    node = 999_999 // PER_NODE
    m = wire_store._Map()
    keys = [f"mft/{RUN_ID}/{k}{node}" for k in ("size/", "addr/", "hb/", REPORT_KEY, STALL_KEY)]
    for k in keys:
        m.apply(wire_store.STORE_MESSAGES.parse({"op": "set", "key": k, "value": "v"}), "")
    assert [m.apply(wire_store.STORE_MESSAGES.parse({"op": "get", "key": k}), "")["value"] for k in keys] == ["v"] * 5


#: the store operations of the agents' and the trainers' store clients
STORE_CALLS = {"publish", "set", "get", "compare_set", "watch", "add", "delete"}


def _rank_keyed_store_calls(path: str) -> list[str]:
    """``store.<op>(f"...{...rank...}...")`` calls of ``path``: a store key per rank."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.JoinedStr)
                and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_CALLS
                and "store" in ast.unparse(node.func.value)):
            names = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[0]) if isinstance(n, ast.Attribute)}
            if any("rank" in n for n in names):
                out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_coordination_store_key_is_per_rank(tmp_path):
    found = []
    for sub in ("agent", "trainer", "health", "spares", "megatron"):
        d = os.path.join(REPO, "megatron_ft", sub)
        found += [c for f in sorted(os.listdir(d)) if f.endswith(".py")
                  for c in _rank_keyed_store_calls(os.path.join(d, f))]
    assert not found, found
    probe = tmp_path / "probe.py"  # the check finds one where there is one
    probe.write_text('def f(self, rank):\n    self.store.set(f"size/{rank}", "1")\n    self.store.set(f"size/{self.node}", "1")\n')
    assert [c.split(": ", 1)[1] for c in _rank_keyed_store_calls(str(probe))] == ["self.store.set(f'size/{rank}', '1')"]
