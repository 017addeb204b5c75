"""The hang kinds of the chaos harness and what they stand on, without processes: the kinds in the
campaign plan and their demo arguments, the classification of hang verdicts (expected in the hang kinds,
false anywhere else), the hang fault actions (``stop-<point>``, ``stall-<point>``, step ``*``) and the
demo's arguments and configuration for them."""
from __future__ import annotations

import argparse
import json
import os
import signal

import pytest

from megatron_ft import config as ftconfig
from megatron_ft import faultpoints
from megatron_ft.testing import chaos, demo, faults
from megatron_ft.rank_files import find_rank_file

NEW = ("hang", "hang-in-restore", "stop-in-restore", "slow-trainer", "agent-pause")


def test_the_new_kinds_are_drawn_by_the_default_plan():
    allowed = [k for k, v in chaos.KINDS.items() if not v.get("config_only")]
    assert set(NEW) <= set(allowed)
    drawn = {chaos.draw(5, i, allowed).kind for i in range(len(allowed))}  # one shuffled cycle: each kind once
    assert set(NEW) <= drawn
    for k in NEW:
        t = chaos.draw(5, 0, [k])
        assert 3 <= t.kill_at <= t.iters - 3


def test_their_demo_arguments():
    args = {k: chaos.Trial(0, 1, k, 4, 0.01, 12).demo_args() for k in NEW}
    assert args["hang"][:3] == ["--fail=hang", "--kill-at=4", "--iters=12"] and "--kill-delay=0.0100" in args["hang"]
    assert "--fail=hang-in-restore" in args["hang-in-restore"]
    assert not any(a.startswith("--restore-hang") for a in args["hang-in-restore"])  # the demo's default: stall
    assert "--restore-hang=stop" in args["stop-in-restore"]
    assert "--fail=slow" in args["slow-trainer"] and "--fail=agent-pause" in args["agent-pause"]
    # the slow trainer runs long enough to be slowed for most of its 15 s (its own reference run)
    assert chaos.draw(5, 0, ["slow-trainer"]).iters == 48 and chaos.Trial(0, 1, "slow-trainer", 4, 0, 48).shape != "default"
    assert set(demo.PAUSE_OUTCOMES.values()) >= set(chaos.PAUSE_RIGHT)
    assert not any(a.startswith("--kill-point") for k in NEW for a in args[k])
    # every one of them parses as the demo's arguments
    p = argparse.ArgumentParser()
    demo.add_parser(p.add_subparsers())
    for k in NEW:
        assert p.parse_args(["demo", *args[k]]).fail == chaos.KINDS[k]["fail"]


def _trial(kind):
    return chaos.Trial(0, 1, kind, 5, 0.01, 12)


LOCAL = {"bitwise_identical": True, "recovered_from": "local_memory", "promised_tier": "local_memory", "problems": [],
         "hang_ok": True}
VERDICT = {"rank": 3, "phase": "restore", "quiet_s": 15.1, "bound_s": 5.0, "iteration_p99_s": 0.1}
CLEAN = {"bitwise_identical": True, "recovered_from": "none", "promised_tier": None, "problems": [], "hang_ok": True,
         "hang_verdicts": [], "restarted_ranks": []}


@pytest.mark.parametrize("kind,rc,summary,want", [
    ("hang", 0, {**LOCAL, "hang_verdicts": [VERDICT]}, ("right", "")),
    ("hang-in-restore", 0, {**LOCAL, "hang_verdicts": [VERDICT]}, ("right", "")),
    # no verdict (the job recovered some other way), two verdicts, or one on the wrong rank: wrong
    ("hang", 0, {**LOCAL, "hang_verdicts": []}, ("wrong", "hang verdicts on [], want 1 on the victim")),
    ("stop-in-restore", 0, {**LOCAL, "hang_verdicts": [VERDICT, VERDICT]},
     ("wrong", "hang verdicts on [3, 3], want 1 on the victim")),
    ("hang", 1, {**LOCAL, "hang_verdicts": [{**VERDICT, "rank": 0}], "hang_ok": False},
     ("wrong", "hang verdicts on [0], want 1 on the victim")),
    # a hang verdict in any other kind is false
    ("trainer", 1, {**LOCAL, "hang_verdicts": [VERDICT], "hang_ok": False},
     ("wrong", f"false hang verdict: {[VERDICT]}")),
    # no failure: right only when the job trained through - no verdict, no restart, nothing recovered
    ("slow-trainer", 0, CLEAN, ("right", "")),
    # a paused agent: no verdict and the job trains through, or the node judged lost and its ranks recovered
    ("agent-pause", 0, {**CLEAN, "agent_pause_outcome": "trained through"}, ("right", "trained through")),
    ("agent-pause", 0, {**CLEAN, "agent_pause_outcome": "node recovered"}, ("right", "node recovered")),
    ("agent-pause", 1, {**CLEAN, "agent_pause_outcome": "verdict without recovery",
                        "false_verdicts": ["node 1 (missed heartbeats for 5.0 s; node0's log)"]},
     ("wrong", f"agent pause: verdict without recovery ({['node 1 (missed heartbeats for 5.0 s; node0' + chr(39) + 's log)']})")),
    ("agent-pause", 1, {**CLEAN, "agent_pause_outcome": "restart without verdict"},
     ("wrong", "agent pause: restart without verdict ([])")),
    ("slow-trainer", 1, {**CLEAN, "hang_verdicts": [VERDICT], "hang_ok": False},
     ("wrong", f"false hang verdict: {[VERDICT]}")),
    ("slow-trainer", 1, {**CLEAN, "restarted_ranks": [3]}, ("wrong", "restarted without a failure: rank(s) [3]")),
    ("slow-trainer", 0, {**CLEAN, "recovered_from": "local_memory"},
     ("wrong", "recovered from local_memory without a failure")),
    ("slow-trainer", 1, {**CLEAN, "false_verdicts": ["node 1 (missed heartbeats for 5.2 s)"]},
     ("wrong", "false verdict: ['node 1 (missed heartbeats for 5.2 s)']")),
    ("slow-trainer", 1, {**CLEAN, "bitwise_identical": False, "problems": ["loss differs"]},
     ("wrong", "mismatch: ['loss differs']")),
])
def test_hang_verdicts_are_classified(kind, rc, summary, want):
    assert chaos.classify(_trial(kind), rc, summary, [], "") == want


def test_a_hang_fault_parses_with_any_step():
    assert "restore" in faultpoints.POINTS
    assert faults.parse("stop-restore:*:3") == faults.Fault("stop-restore", None, frozenset({3}))
    assert faults.parse("stall-restore:7") == faults.Fault("stall-restore", 7, None)
    assert faults.parse("stop-restore:*:3").hang == "stop-" and faults.parse("stall-mid-copy:2").hang == "stall-"
    assert faults.parse("restore:*:1").hang is None and faults.parse("restore:*:1").point == "restore"
    with pytest.raises(ValueError, match=r"fault 'stop-restore:any:1' is invalid: .* \(step an integer or '\*'\)"):
        faults.parse("stop-restore:any:1")
    with pytest.raises(ValueError, match=r"fault action 'freeze-restore' is invalid: allowed \[.*'stall-restore'"):
        faults.parse("freeze-restore:1")
    with pytest.raises(ValueError, match=r"fault action 'stop-after-commit\+agent' is invalid: a hang .* takes no"):
        faults.parse("stop-after-commit+agent:3:1")


def test_stop_fires_once_at_any_step_and_returns_when_continued(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    inj = faults.KillAt(faults.parse("stop-restore:*:3"), str(tmp_path))
    inj.reached("restore", 5, 2)  # another rank
    inj.reached("mid-copy", 5, 3)  # another point
    assert sent == []
    inj.reached("restore", 5, 3)
    assert sent == [(os.getpid(), signal.SIGSTOP)]  # not a kill; returns once continued
    inj.reached("restore", 9, 3)  # its next life restores again: fired already
    assert sent == [(os.getpid(), signal.SIGSTOP)]
    ev = [json.loads(x) for x in open(find_rank_file(str(tmp_path / "events"), 3, ".jsonl")).read().splitlines()]
    assert [(e["event"], e["point"], e["step"], e["rank"]) for e in ev] == [("fault", "stop-restore", 5, 3)]


def test_stall_sleeps_for_good_instead_of_dying(tmp_path, monkeypatch):
    class Woken(Exception):
        pass

    sleeps, sent = [], []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 3:
            raise Woken

    monkeypatch.setattr(faults.time, "sleep", sleep)
    with pytest.raises(Woken):
        faults.KillAt(faults.parse("stall-restore:*"), str(tmp_path)).reached("restore", 4, 1)
    assert len(sleeps) == 3 and sent == []  # never killed, never stopped: it just never returns


def _demo_args(*argv):
    p = argparse.ArgumentParser()
    demo.add_parser(p.add_subparsers())
    return p.parse_args(["demo", *argv])


def test_the_demo_victims_and_config_of_the_new_scenarios():
    cfg = ftconfig.load()
    for fail in ("hang", "hang-in-restore", "slow"):
        assert demo.choose_victims(_demo_args(f"--fail={fail}"), cfg) == ([3], [])
    assert demo.choose_victims(_demo_args("--fail=agent-pause"), cfg) == ([2, 3], [])
    # only hang-in-restore runs with the small restore allowance; the others keep the shipped defaults
    small = demo.demo_config(_demo_args("--fail=hang-in-restore"), "/tmp/x").hang
    assert (small.restore_s, small.first_s) == (demo.RESTORE_HANG_LIMITS["restore_s"],
                                                demo.RESTORE_HANG_LIMITS["first_s"])
    assert small.restore_s < cfg.hang.restore_s and small.first_s / 2 <= small.restore_s
    for fail in ("hang", "slow", "trainer"):
        assert demo.demo_config(_demo_args(f"--fail={fail}"), "/tmp/x").hang == cfg.hang


@pytest.mark.parametrize("argv,message", [
    (["--fail=slow", "--slow-stop=0.6", "--slow-period=0.6"], r"--slow-stop=0.6 is invalid with --slow-period=0.6"),
    (["--fail=slow", "--slow-stop=0"], r"--slow-stop=0.0 is invalid"),
    (["--fail=agent-pause", "--pause-seconds=0"], r"--pause-seconds=0.0: both must be > 0"),
    (["--fail=hang-in-restore", "--kill-point=mid-copy"],
     r"--kill-point=mid-copy is invalid with --fail=hang-in-restore"),
])
def test_the_demo_refuses_bad_arguments_of_the_new_scenarios(argv, message):
    with pytest.raises(ftconfig.ConfigError, match=message):
        demo.main(_demo_args(*argv))
