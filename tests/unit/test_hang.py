"""The hang rule (pure), the progress file, and the agent's hang watch against real processes: a
trainer stopped or stuck in its own work is killed once every other rank waits; no verdict for
a rank that progresses, for ranks that all work at once, for a paused agent, for a verdict that
went stale."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_ft import config as ftconfig
from megatron_ft.agent.hang_watch import HangWatch, process_state
from megatron_ft.health import hang as rule
from megatron_ft.health import progress as hp

LIM = rule.Limits(k=10.0, floor_s=5.0, ceiling_s=60.0, warmup_iterations=3, first_s=30.0, restore_s=100.0,
                  save_s=1000.0, collective_s=0.0)


def rec(phase, since, steps=10, seq=2, pid=7):
    return hp.Progress(seq=seq, steps=steps, phase=phase, pid=pid, since=since, started=0.0, iter_s=0.1, work_s=0.05)


# ---------------------------------------------------------------------------------------------- the rule
def test_the_bound_follows_the_iteration_times_within_floor_and_ceiling():
    assert rule.bound(LIM, 0.1, 10) == 5.0  # 10 x 0.1 under the floor
    assert rule.bound(LIM, 2.0, 10) == 20.0
    assert rule.bound(LIM, 30.0, 10) == 60.0  # the ceiling
    assert rule.bound(LIM, 0.1, 2) == 30.0  # a trainer's first iterations: first_s
    assert rule.bound(LIM, None, 10) == 30.0  # nothing timed yet


@pytest.mark.parametrize("phase,quiet,want", [
    (hp.WORK, 4.9, "other"), (hp.WORK, 5.1, "hung"),
    (hp.RESTORE, 50.0, "other"), (hp.RESTORE, 101.0, "hung"),
    (hp.SAVE, 500.0, "other"), (hp.SAVE, 1001.0, "hung"),
    (hp.COLLECTIVE, 1.0, "other"), (hp.COLLECTIVE, 2.6, "waiting"), (hp.COLLECTIVE, 1e6, "waiting"),
    (hp.AGENT, 3.0, "waiting"), (hp.RENDEZVOUS, 3.0, "waiting"), (hp.RENDEZVOUS, 901.0, "hung"),
    (hp.START, 800.0, "other"),
    (hp.START, 901.0, "hung"), (hp.DONE, 1e6, "other"),
])
def test_each_phase_is_judged_against_its_own_allowance(phase, quiet, want):
    assert rule.judge(rec(phase, 100.0), 100.0 + quiet, LIM, 0.1, stopped_s=0.0) == want


def test_a_stopped_process_is_hung_in_any_phase_once_stopped_and_quiet_for_the_floor():
    waiting = rec(hp.COLLECTIVE, 100.0)
    assert rule.judge(waiting, 106.0, LIM, 0.1, stopped_s=6.0) == "hung"
    assert rule.judge(waiting, 106.0, LIM, 0.1, stopped_s=0.5) == "waiting"  # a duty cycle's short stop
    assert rule.judge(rec(hp.COLLECTIVE, 105.0), 106.0, LIM, 0.1, stopped_s=6.0) == "other"  # it moved meanwhile


def culprit(rank):
    return rule.Culprit(rank, 100 + rank, 4, "work", 6.0)


def test_the_verdict_needs_every_other_rank_of_the_job_waiting():
    hung = rule.NodeStall(0, 2, (culprit(0),), (1,))
    others = rule.NodeStall(1, 2, (), (2, 3))
    assert rule.decide({0: hung}, 2, 2, 0.0) is None  # node 1 not heard
    assert rule.decide({0: hung, 1: rule.NodeStall(1, 2, (), (2,))}, 2, 2, 0.0) is None  # rank 3 progresses
    v = rule.decide({0: hung, 1: others}, 2, 2, 0.0)
    assert [c.rank for c in v.culprits] == [0] and not v.collective
    # every rank quiet in its own work at once (a long write everywhere) is no verdict
    assert rule.decide({0: rule.NodeStall(0, 2, (culprit(0), culprit(1)), ()),
                        1: rule.NodeStall(1, 2, (culprit(2), culprit(3)), ())}, 2, 2, 0.0) is None


def test_a_deadlocked_collective_is_a_verdict_on_every_rank_only_with_collective_s():
    long = {n: rule.NodeStall(n, 1, (), (n,), long=True) for n in range(2)}
    assert rule.decide(long, 2, 1, 0.0) is None
    v = rule.decide(long, 2, 1, 120.0)
    assert v.collective and v.culprits == ()  # names no rank: each agent ends its own still waiting
    assert rule.decide({0: long[0], 1: rule.NodeStall(1, 1, (), (1,), long=False)}, 2, 1, 120.0) is None


def test_reports_and_verdicts_round_trip_and_refuse_other_versions():
    r = rule.NodeStall(3, 2, (culprit(6),), (7,), long=False)
    assert rule.NodeStall.decode(r.encode()).same(r)
    v = rule.HangVerdict((culprit(6),))
    assert rule.HangVerdict.decode(v.encode()).culprits[0].rank == 6
    for every in (rule.HangVerdict((), collective=True), rule.HangVerdict((), overdue=True)):
        assert rule.HangVerdict.decode(every.encode()) == every and len(every.encode()) < 80
    bad = json.loads(r.encode())
    bad["v"] = 99
    with pytest.raises(ValueError, match="version 99"):
        rule.NodeStall.decode(json.dumps(bad))


def test_the_root_aggregates_reports_as_they_come_and_clears_when_a_node_does():
    agg = rule.StallAggregator(2, 1, 0.0)
    assert agg.update(rule.NodeStall(0, 1, (culprit(0),), ())) is None
    assert agg.update(rule.NodeStall(1, 1, (), (1,))) is not None
    assert agg.update(rule.NodeStall(1, 1, (), ())) is None  # node 1 trains again


# ---------------------------------------------------------------------------------------------- the file
def test_the_progress_file_round_trips_and_a_reader_never_takes_a_torn_record(tmp_path):
    path = str(tmp_path / "progress")
    board = hp.ProgressBoard.create(path, 3)
    w = hp.ProgressWriter(path, 2)
    w.enter(hp.COLLECTIVE)
    got = board.read(2)
    assert got.phase_name == "collective" and got.pid == os.getpid() and got.seq % 2 == 0
    assert board.read(0) is None and board.read(1) is None
    # a writer stopped in the middle of a write leaves an odd sequence number and a half-written body:
    # the reader keeps the last whole record it read
    import struct
    struct.pack_into("<Q", board.mm, 2 * hp.RECORD, got.seq + 1)
    struct.pack_into("<q", board.mm, 2 * hp.RECORD + 8, 0)
    torn = board.read(2, tries=3)
    assert torn == got and hp.ProgressBoard(path, 3, board.mm).read(2, tries=3) is None  # a new reader: none
    w.enter(hp.WORK)  # the writer runs again: whole
    # an agent that re-opens the file (it adopted its predecessor's trainers) keeps what they wrote
    again = hp.ProgressBoard.create(path, 3)
    assert again.read(2).pid == os.getpid()
    w.close(); again.close(); board.close(unlink=True)
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------------------------- the watch
CHILD = r"""
import sys, time
from megatron_ft.health import progress as hp
w = hp.ProgressWriter(sys.argv[1], int(sys.argv[2]))
for _ in range(5):
    w.step(0.02, 0.01)
w.enter({"work": hp.WORK, "collective": hp.COLLECTIVE, "save": hp.SAVE, "rendezvous": hp.RENDEZVOUS}[sys.argv[3]])
print("ready", flush=True)
if sys.argv[4] == "deaf":  # a script's own SIGUSR1 handler that does not end the process
    import signal
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
if sys.argv[4] == "progress":
    while True:
        time.sleep(0.05); w.enter(hp.WORK); w.enter(hp.COLLECTIVE)
time.sleep(600)
"""


@pytest.fixture
def bed(tmp_path):
    cfg = ftconfig.from_dict({"run_id": "hangtest", "cluster": {"nodes": 1, "ranks_per_node": 3},
                              "parallel": {"tensor": 1, "pipeline": 1},
                              "agent": {"shm_dir": str(tmp_path)},
                              "hang": {"tick_s": 0.05, "floor_s": 0.6, "k": 2.0, "first_s": 30.0,
                                       "start_s": 1.5}})
    board = hp.ProgressBoard.create(hp.board_path(str(tmp_path), cfg.run_id, 0), 3)
    procs = []

    def start(index, phase, then="sleep"):
        p = subprocess.Popen([sys.executable, "-c", CHILD, board.path, str(index), phase, then],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    events = str(tmp_path / "events" / "agent-n0.jsonl")
    watch = HangWatch(cfg, 0, board, None, events)
    yield cfg, watch, start, events
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    board.close(unlink=True)


def run_ticks(watch, seconds, until=None):
    """Tick for ``seconds``, or until the process ``until`` has ended."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until is not None and until.poll() is not None):
        watch.tick()
        time.sleep(watch.hang.tick_s)


def test_a_stopped_trainer_is_killed_once_every_other_rank_waits(bed):
    cfg, watch, start, events = bed
    victim = start(0, "collective")
    a, b = start(1, "collective"), start(2, "collective")
    os.kill(victim.pid, signal.SIGSTOP)
    end = time.monotonic() + 5
    while process_state(victim.pid) != "T" and time.monotonic() < end:
        time.sleep(0.01)
    assert process_state(victim.pid) == "T"
    run_ticks(watch, 5.0, until=victim)
    assert victim.wait(5) == -signal.SIGKILL
    assert a.poll() is None and b.poll() is None
    [ev] = [json.loads(line) for line in open(events)]
    assert ev["event"] == "hang" and ev["rank"] == 0 and ev["pid"] == victim.pid and "stopped" in ev["phase"]
    assert ev["quiet_s"] >= cfg.hang.floor_s and ev["bound_s"] >= cfg.hang.floor_s


def test_a_trainer_stuck_in_its_own_work_is_killed_and_a_progressing_one_blocks_the_verdict(bed):
    cfg, watch, start, events = bed
    stuck = start(0, "work")
    start(1, "collective")
    moving = start(2, "collective", then="progress")  # slow, but progressing
    run_ticks(watch, 1.2)
    assert stuck.poll() is None, "killed while rank 2 still progressed"
    moving.kill(); moving.wait()
    start(2, "collective")  # now every other rank waits
    run_ticks(watch, 5.0, until=stuck)
    assert stuck.wait(5) == -signal.SIGKILL
    assert [json.loads(line)["rank"] for line in open(events)] == [0]


def test_a_round_that_never_forms_is_ended_once_its_ranks_pass_the_start_deadline(bed):
    # every rank waits in its rendezvous (a store that never answers): waiting, then hung past start_s -
    # those past it at the verdict are ended however many; the later ones, still within it, wait (in a job
    # the first kill opens a fast round, which replaces them all)
    # each is sent SIGUSR1 first (a trainer writes its stacks to its log on it, and ends), SIGKILL a second
    # later if it still runs (rank 0 here ignores SIGUSR1)
    cfg, watch, start, events = bed
    procs = [start(0, "rendezvous", then="deaf")] + [start(r, "rendezvous") for r in (1, 2)]
    run_ticks(watch, 6.0, until=procs[0])
    run_ticks(watch, 0.3)
    ended = {r: p.poll() for r, p in enumerate(procs) if p.poll() is not None}
    assert ended.get(0) == -signal.SIGKILL, ended
    assert all(code == -signal.SIGUSR1 for r, code in ended.items() if r), ended
    assert all(procs[r].poll() is None for r in range(3) if r not in ended)
    evs = [json.loads(line) for line in open(events)]
    assert sorted(e["rank"] for e in evs) == sorted(ended) and {e["phase"] for e in evs} == {"rendezvous"}
    assert all(e["stacks"] for e in evs)
    assert all(e["quiet_s"] >= cfg.hang.start_s and e["bound_s"] == cfg.hang.start_s for e in evs)  # not before


def test_a_deadlocked_collective_ends_every_rank_still_waiting_with_collective_s(tmp_path):
    cfg = ftconfig.from_dict({"run_id": "hangcoll", "cluster": {"nodes": 1, "ranks_per_node": 2},
                              "parallel": {"tensor": 1, "pipeline": 1}, "agent": {"shm_dir": str(tmp_path)},
                              "hang": {"tick_s": 0.05, "floor_s": 0.6, "collective_s": 1.0}})
    board = hp.ProgressBoard.create(hp.board_path(str(tmp_path), cfg.run_id, 0), 2)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, board.path, str(r), "collective", "sleep"],
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 2
        events = str(tmp_path / "events.jsonl")
        watch = HangWatch(cfg, 0, board, None, events)
        run_ticks(watch, 5.0, until=procs[1])
        run_ticks(watch, 0.3)
        assert [p.wait(5) for p in procs] == [-signal.SIGKILL] * 2  # no stacks asked: SIGKILL at once
        evs = [json.loads(line) for line in open(events)]
        assert sorted(e["rank"] for e in evs) == [0, 1] and all(e["collective"] and not e["stacks"] for e in evs)
        assert all(e["quiet_s"] >= 1.0 for e in evs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        board.close(unlink=True)


def test_no_verdict_when_every_rank_works_at_once_or_in_megatrons_own_save(bed):
    cfg, watch, start, events = bed
    procs = [start(0, "work"), start(1, "work"), start(2, "save")]
    run_ticks(watch, 1.2)
    assert all(p.poll() is None for p in procs)
    assert not os.path.exists(events)


def test_a_paused_agent_judges_nothing_for_the_floor_after_it_runs_again(bed):
    cfg, watch, start, events = bed
    stuck = start(0, "work")
    start(1, "collective"), start(2, "collective")
    watch.tick()
    watch._last_tick -= 30.0  # the agent did not run for 30 s (SIGSTOP, an overloaded host)
    end = time.monotonic() + cfg.hang.floor_s * 0.8
    while time.monotonic() < end:
        assert watch.tick().clear
        time.sleep(cfg.hang.tick_s)
    assert stuck.poll() is None
    run_ticks(watch, 5.0, until=stuck)
    assert stuck.wait(5) == -signal.SIGKILL


def test_a_verdict_that_went_stale_is_not_acted_on(bed):
    cfg, watch, start, events = bed
    p = start(0, "collective", then="progress")
    record = watch.board.read(0)
    stale = rule.HangVerdict((rule.Culprit(0, p.pid, record.seq, "work", 9.0),))
    time.sleep(0.2)  # it moved on
    watch._act(stale, {0: watch.board.read(0)}, time.monotonic())
    assert p.poll() is None and not os.path.exists(events)


def test_the_root_derives_the_verdict_from_the_reports_set_on_its_store():
    cfg = ftconfig.from_dict({"run_id": "hangroot", "cluster": {"nodes": 2, "ranks_per_node": 1},
                              "parallel": {"tensor": 1, "pipeline": 1}})

    class Store:  # what the embedded store gives the hook: the key under its prefix, the value
        def derive(self, prefix, fn):
            self.prefix, self.fn = prefix, fn

    store = Store()
    watch = HangWatch(cfg, 0, None, store)
    assert store.prefix == rule.STALL_KEY
    assert store.fn("0", rule.NodeStall(0, 1, (culprit(0),), ()).encode()) == {rule.HANG_KEY: None}
    out = store.fn("1", rule.NodeStall(1, 1, (), (1,)).encode())
    assert rule.HangVerdict.decode(out[rule.HANG_KEY]).culprits[0].rank == 0
    assert store.fn("1", rule.NodeStall(0, 1, (), ()).encode()) == {}  # a report under another node's key
    assert watch.status()["hang_verdicts"] == []


EXITING = r"""
import sys, threading, time
from megatron_ft.health import progress as hp
from megatron_ft.trainer import progress
hp.ProgressBoard.create(sys.argv[1], 1)
assert progress.install(sys.argv[1], 0) is not None
threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: the interpreter waits for it
progress.close(exit_s=0.5)
time.sleep(2.0)  # still running: the watch waits for the interpreter's end, not the training's
if sys.argv[2] == "raise":
    raise RuntimeError("the training failed")
"""


@pytest.mark.parametrize("how,code", [("end", 0), pytest.param("raise", 1, marks=pytest.mark.slow)])
def test_a_trainer_that_does_not_end_after_its_training_ends_itself_with_its_stacks(tmp_path, how, code):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path / "progress"), how], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert time.monotonic() - t0 < 30
    assert "has not ended: its threads' stacks follow" in out.stderr and "time.sleep" not in out.stdout
    assert "Thread 0x" in out.stderr  # faulthandler's dump


def test_a_rank_persistently_slower_in_its_own_work_is_reported_once_and_not_killed(tmp_path):
    cfg = ftconfig.from_dict({"run_id": "straggle", "cluster": {"nodes": 1, "ranks_per_node": 3},
                              "parallel": {"tensor": 1, "pipeline": 1}, "agent": {"shm_dir": str(tmp_path)},
                              "hang": {"straggler_ratio": 1.5, "straggler_iterations": 4}})
    board = hp.ProgressBoard.create(hp.board_path(str(tmp_path), cfg.run_id, 0), 3)
    events = str(tmp_path / "events.jsonl")
    watch = HangWatch(cfg, 0, board, None, events)
    writers = [hp.ProgressWriter(board.path, i) for i in range(3)]
    for it in range(10):
        for i, w in enumerate(writers):
            slow = i == 2 and it != 1  # one fast iteration: the count starts again
            w.step(0.1, 0.08 if slow else 0.04)
        watch.tick()
    [ev] = [json.loads(line) for line in open(events)]
    assert ev["event"] == "straggler" and ev["rank"] == 2 and ev["iterations"] == 4
    assert ev["work_s"] == 0.08 and ev["node_median_work_s"] == 0.04
    assert [s["rank"] for s in watch.status()["stragglers"]] == [2]
    writers[2].step(0.1, 0.04)  # it recovers: no longer reported
    watch.tick()
    assert watch.status()["stragglers"] == []
    for w in writers:
        w.close()
    board.close(unlink=True)


def test_the_root_s_running_counts_decide_as_the_rule_does_on_every_sequence_of_reports():
    import random

    rng = random.Random(5)
    for trial in range(300):
        nodes, rpn = rng.randint(1, 4), rng.randint(1, 3)
        coll = rng.choice([0.0, 60.0])
        agg, newest = rule.StallAggregator(nodes, rpn, coll), {}
        for _ in range(12):
            n = rng.randrange(nodes)
            ranks = list(range(n * rpn, (n + 1) * rpn))
            hung = tuple(culprit(r) if rng.random() < 0.5 else rule.Culprit(r, 100 + r, 4, "rendezvous", 901.0)
                         for r in ranks if rng.random() < 0.2)
            waiting = tuple(r for r in ranks if r not in {c.rank for c in hung} and rng.random() < 0.8)
            rep = rule.NodeStall(n, rpn, hung, waiting, long=bool(waiting) and rng.random() < 0.5)
            got = agg.update(rep)
            if rep.clear:
                newest.pop(n, None)
            else:
                newest[n] = rep
            want = rule.decide(newest, nodes, rpn, coll)
            assert got == want, (trial, newest)


def test_many_ranks_quiet_in_their_own_work_is_the_jobs_work_not_a_hang_to_end_them_for():
    # on NCCL ranks blocked in a device sync behind one stuck peer look like this: a few waiting, most "hung"
    reports = {0: rule.NodeStall(0, 2, (), (0, 1)),
               1: rule.NodeStall(1, 2, (culprit(2), culprit(3)), ()),
               2: rule.NodeStall(2, 2, (culprit(4), culprit(5)), ())}
    assert rule.decide(reports, 3, 2, 0.0) is None  # 4 hung > one node's 2 ranks
    few = {0: rule.NodeStall(0, 2, (), (0,)), 1: rule.NodeStall(1, 2, (culprit(2), culprit(3)), ())}
    assert rule.decide({**few, 0: rule.NodeStall(0, 2, (), (0, 1))}, 2, 2, 0.0) is not None
    assert rule.decide({0: rule.NodeStall(0, 2, (culprit(0),), (1,)),
                        1: rule.NodeStall(1, 2, (culprit(2), culprit(3)), ())}, 2, 2, 0.0) is None  # 3 > 1 waiting


def test_ranks_all_past_a_deadline_of_their_phase_are_a_verdict_however_many():
    # a round that never formed: every rank of the job still in its rendezvous (or start-up) past start_s
    never = {n: rule.NodeStall(n, 2, tuple(rule.Culprit(r, 100 + r, 3, ph, 901.0)
                                           for r, ph in ((2 * n, "rendezvous"), (2 * n + 1, "start"))), ())
             for n in range(3)}
    v = rule.decide(never, 3, 2, 0.0)
    assert v.overdue and v.culprits == () and not v.collective  # O(1) however many: each agent ends its own
    agg = rule.StallAggregator(3, 2, 0.0)
    assert [agg.update(never[n]) is not None for n in range(3)] == [False, False, True]
    # one rank quiet in its own work among them: the few-rule again (6 hung, none waiting)
    mixed = {**never, 2: rule.NodeStall(2, 2, (culprit(4), never[2].hung[1]), ())}
    assert rule.decide(mixed, 3, 2, 0.0) is None
    assert agg.update(mixed[2]) is None
    # a rank stopped in its start-up is judged as stopped, not as past its deadline
    assert not rule.overdue(rule.Culprit(0, 9, 2, "start (stopped)", 6.0, stopped=True))


def test_a_job_of_one_rank_is_judged_only_when_its_process_is_stopped():
    quiet = rule.NodeStall(0, 1, (rule.Culprit(0, 9, 2, "work", 60.0),), ())
    stopped = rule.NodeStall(0, 1, (rule.Culprit(0, 9, 2, "work (stopped)", 60.0, stopped=True),), ())
    assert rule.decide({0: quiet}, 1, 1, 0.0) is None
    assert rule.decide({0: stopped}, 1, 1, 0.0).culprits[0].stopped
    assert rule.NodeStall.decode(stopped.encode()).hung[0].stopped


ENDS = r"""
import atexit, sys
from megatron_ft.health import progress as hp
from megatron_ft.trainer import progress
hp.ProgressBoard.create(sys.argv[1], 1)
assert progress.install(sys.argv[1], 0) is not None
atexit.register(progress.close)  # as the checkpoint managers close at exit
if sys.argv[2] == "raise":
    raise RuntimeError("gloo: connection closed by peer")
"""


@pytest.mark.parametrize("how,phase", [("end", hp.DONE), ("raise", hp.EXITING)])
def test_a_trainer_ended_by_an_error_does_not_say_its_training_is_over(tmp_path, how, phase):
    """A node's training is over (no verdict on the others: the job is ending) only where every local
    trainer ended well; a trainer that a lost peer's broken collective ends says "exiting", so that its
    agent still judges the lost node."""
    path = str(tmp_path / "progress")
    out = subprocess.run([sys.executable, "-c", ENDS, path, how], capture_output=True, text=True, timeout=60)
    assert out.returncode == (1 if how == "raise" else 0), out.stderr
    assert hp.ProgressBoard.create(path, 1).read(0).phase == phase  # re-opened as an adopting agent does
