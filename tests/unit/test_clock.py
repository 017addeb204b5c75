"""One clock for deadlines (megatron_ft/clock.py): the runtime sleeps only through it, counts no
deadline on the wall clock, and the snapshot engine's wait - the training thread's one wait for its
own copy - is bounded and names what it waited for. Read from the source, like test_import_graph."""
from __future__ import annotations

import ast
import os
import threading

import pytest
import torch

from conftest import REPO
from megatron_ft import clock
from megatron_ft.capture.state import LaterCapture, StateTensor
from megatron_ft.trainer.snapshot import SnapshotEngine

PKG = os.path.join(REPO, "megatron_ft")


def runtime_sources():
    """(relative path, parsed source) of every module of the runtime: not the harness (testing/)."""
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "testing")]
        for f in filenames:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, REPO), ast.parse(open(path).read(), path)


def is_call(node, module: str, name: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
            and isinstance(node.func.value, ast.Name) and node.func.value.id == module)


def test_the_runtime_sleeps_only_through_the_clock():
    """Every wait holds a Deadline (clock.Deadline.pause, clock.wait_until) or is a deliberate pause
    (clock.pause): no time.sleep of its own anywhere but in megatron_ft/clock.py."""
    found = [f"{path}:{node.lineno}" for path, tree in runtime_sources() if not path.endswith("megatron_ft/clock.py")
             for node in ast.walk(tree) if is_call(node, "time", "sleep")]
    assert not found, f"time.sleep outside megatron_ft/clock.py: {found}"


def test_no_deadline_is_counted_on_the_wall_clock():
    """``time.time() + x`` (a deadline) and ``time.time()`` compared with something (a deadline's test)
    are wall-clock deadlines: they end early or late when the clock is set. Timestamps for other
    processes and hosts (``time.time()`` alone, or an age ``time.time() - stamp``) are fine."""
    found = []
    for path, tree in runtime_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and (
                    is_call(node.left, "time", "time") or is_call(node.right, "time", "time")):
                found.append(f"{path}:{node.lineno} (time.time() + ...)")
            if isinstance(node, ast.Compare) and any(is_call(x, "time", "time") for x in [node.left, *node.comparators]):
                found.append(f"{path}:{node.lineno} (time.time() compared)")
    assert not found, f"deadlines on the wall clock: {found}"


def test_a_deadline_names_what_it_waited_for_and_is_woken_early():
    stop = threading.Event()
    d = clock.Deadline(30.0, "the peers' answers")
    threading.Timer(0.05, stop.set).start()
    assert d.pause(30.0, stop) is False  # woken by the event, long before the deadline
    assert not d.expired()
    with pytest.raises(TimeoutError, match=r"the peers' answers: not within 0.01 s \(stopped\)"):
        clock.wait_until(lambda: None, 0.01, "the peers' answers", wake=stop)


def test_the_snapshot_engine_s_wait_is_bounded_and_says_where_its_worker_is():
    """A worker held inside a step's encoding (a stand-in for any call that does not return): the
    training thread's wait ends after its bound with the step and the worker's phase named, and the
    worker, once released, finishes the job (no agent here: the snapshot fails on its own, logged)."""
    release = threading.Event()

    def encode():
        release.wait(30)
        return [StateTensor("w", torch.zeros(4))], {}

    engine = SnapshotEngine(None, 3, {"run_id": "t"}, 1 << 20)
    try:
        engine.snapshot_later(7, LaterCapture(encode))
        with pytest.raises(TimeoutError, match=r"rank 3: the snapshot of step 7 did not finish within 0.2 s "
                                               r"\(its worker is encoding step 7's state\)"):
            engine.wait(0.2)
        release.set()
        stats = engine.wait(30)
        assert stats is not None and stats.step == 7 and stats.error, stats
    finally:
        release.set()
        engine.close()
