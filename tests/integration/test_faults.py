"""Fault injection is an object a harness gives the process (megatron_ft.testing.faults), never
something the runtime reads from the environment: the runtime's points are no-ops without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ft import faultpoints
from megatron_ft.testing import faults
from megatron_ft.rank_files import find_rank_file

from conftest import REPO

SCRIPT = """
import sys
from megatron_ft import faultpoints
for step in range(1, 6):
    faultpoints.reached("before-snapshot", step, int(sys.argv[1]))
    print("step", step, flush=True)
"""


def test_a_fault_spec_is_checked_with_a_clear_message():
    assert faults.parse("mid-copy:5:1,3") == faults.Fault("mid-copy", 5, frozenset({1, 3}))
    assert faults.parse("mid-exchange:3") == faults.Fault("mid-exchange", 3, None)
    with pytest.raises(ValueError, match=r"fault 'mid-copy:x:1' is invalid: expected <action>:<step>"):
        faults.parse("mid-copy:x:1")
    with pytest.raises(ValueError, match=r"fault action 'explode' is invalid: allowed \['after-commit'"):
        faults.parse("explode:1:0")


def test_the_runtime_points_do_nothing_without_an_injector(tmp_path, monkeypatch):
    class Recorder:
        def reached(self, point, step, rank, **context):
            calls.append((point, step, rank, context))

    calls: list = []
    faultpoints.install(Recorder())  # an installed injector hears every point, with its context
    try:
        faultpoints.reached("after-commit", 4, 2, size=10)
        faultpoints.reached("mid-exchange", 5)
    finally:
        faultpoints.install(None)
    assert calls == [("after-commit", 4, 2, {"size": 10}), ("mid-exchange", 5, -1, {})]
    # removed again: no point reaches it, and nothing is killed, whatever the environment says
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setenv("MFT_FAULT_INJECT", "before-snapshot:1")
    monkeypatch.setenv("MFT_RUN_DIR", str(tmp_path / "run"))
    for point in faultpoints.POINTS:
        assert faultpoints.reached(point, 1, 0, area=None) is None
    assert len(calls) == 2 and killed == []
    # a training script run without the wrapper passes every point, to the end, and never loads the
    # harness, with a fault for its very step and rank in its environment
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + "print('harness loaded:', 'megatron_ft.testing.faults' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=REPO, MFT_FAULT_INJECT="before-snapshot:3:1")
    out = subprocess.run([sys.executable, str(script), "1"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"step {i}" for i in range(1, 6)] + ["harness loaded: False"], out.stdout
    assert not (tmp_path / "run").exists()  # no fault marker, no event


def test_the_damage_actions_act_on_the_context_before_the_kill(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    area = np.zeros(8, np.uint8)
    path = tmp_path / "slot"
    path.write_bytes(b"x" * 100)
    faults.KillAt(faults.parse("corrupt-after-commit:2:0")).reached("after-commit", 2, 0, area=area, path=str(path),
                                                                   size=100)
    assert area[4] == 0xFF and len(killed) == 1
    faults.KillAt(faults.parse("truncate-after-commit:2")).reached("after-commit", 2, 7, area=area, path=str(path),
                                                                  size=100)
    assert path.stat().st_size == 50 and len(killed) == 2
    faults.KillAt(faults.parse("after-commit:2:0")).reached("after-commit", 1, 0)  # an earlier step
    faults.KillAt(faults.parse("after-commit:2:0")).reached("after-commit", 2, 1)  # another rank
    assert len(killed) == 2
    # a later step fires (the fault's own step never reached the point: its snapshot skipped), once per
    # run where the run directory remembers it
    once = faults.KillAt(faults.parse("after-commit:2:0"), run_dir=str(tmp_path / "run"), node=0)
    once.reached("after-commit", 3, 0)
    once.reached("after-commit", 4, 0)
    assert len(killed) == 3
    killed.pop()
    for action, length in (("truncate-header-after-commit", 100), ("truncate-empty-after-commit", 0)):
        path.write_bytes(b"x" * 8192)
        faults.KillAt(faults.parse(f"{action}:2")).reached("after-commit", 2, 0, area=area, path=str(path), size=8192)
        assert path.stat().st_size == length
    assert len(killed) == 4


def test_a_fault_with_agent_kills_the_nodes_agent_before_the_damage(tmp_path, monkeypatch):
    """``+agent``: the node's agent (a real process here) is SIGKILLed and gone before the slot is cut,
    and the event names it; then the trainer kills itself."""
    import signal
    import time

    assert faults.parse("truncate-empty-after-commit+agent:4:1") == faults.Fault(
        "truncate-empty-after-commit", 4, frozenset({1}), with_agent=True)
    with pytest.raises(ValueError, match=r"fault action 'mid-copy\+agnt' is invalid: .* optionally followed by '\+agent'"):
        faults.parse("mid-copy+agnt:1")
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = tmp_path / "run"
        (run / "node1").mkdir(parents=True)
        (run / "node1" / "agent.pid").write_text(str(agent.pid))
        monkeypatch.setenv("MFT_NODE_RANK", "1")
        path = tmp_path / "slot"
        path.write_bytes(b"x" * 8192)
        real_kill, seen = os.kill, []

        def kill(pid, sig):
            if pid == os.getpid():  # the trainer's own SIGKILL: record, and when the agent was already gone
                seen.append((sig, agent.poll(), path.stat().st_size))
            else:
                real_kill(pid, sig)

        monkeypatch.setattr(faults.os, "kill", kill)
        faults.KillAt(faults.parse("truncate-empty-after-commit+agent:4:1"), str(run)).reached(
            "after-commit", 4, 1, path=str(path), size=8192)
        assert seen == [(signal.SIGKILL, -signal.SIGKILL, 0)]
        event = json.loads(open(find_rank_file(str(run / "events"), 1, ".jsonl")).read())
        assert (event["point"], event["agent_killed"]) == ("truncate-empty-after-commit", agent.pid)
    finally:
        agent.kill()
        agent.wait(timeout=10)


def test_the_wrapper_kills_the_script_once_per_rank_and_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, *faults.wrap([str(script), "1"], "before-snapshot:3:1", str(tmp_path / "run"))]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == -9, first.stderr
    assert first.stdout.split("\n")[:2] == ["step 1", "step 2"] and "step 3" not in first.stdout
    event = json.loads(open(find_rank_file(str(tmp_path / "run" / "events"), 1, ".jsonl")).read())
    assert (event["event"], event["point"], event["step"], event["rank"]) == ("fault", "before-snapshot", 3, 1)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)  # the restarted attempt
    assert second.returncode == 0 and "step 5" in second.stdout
    other_rank = subprocess.run([sys.executable, *faults.wrap([str(script), "0"], "before-snapshot:3:1")],
                                capture_output=True, text=True, env=env, timeout=120)
    assert other_rank.returncode == 0 and "step 5" in other_rank.stdout


def test_the_wrapper_runs_a_module_and_refuses_a_bad_fault(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, *faults.wrap(["-m", "json.tool", "--help"], "mid-exchange:1")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "json.tool" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_ft.testing.faults", "--fault", "nope:1", "--", "x.py"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "fault action 'nope' is invalid" in bad.stderr
