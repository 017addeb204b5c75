"""The agent's version table (megatron_ft.agent.versions), in process: worked cases, then random
sequences of every event checked against the double-buffer and protection rules after each one."""
import random

import pytest

from megatron_ft.agent.versions import CLEAN, EMPTY, WRITING, BusyError, TransitionError, VersionTable


def snap(t, rank, step, keep=()):
    s = t.begin(rank, step, keep)
    t.commit(rank, s.index, step)
    return s.index


def test_double_buffer_alternates_and_protects_the_newest_clean():
    t = VersionTable()
    t.add_rank(0, 2)
    a = snap(t, 0, 1)
    b = snap(t, 0, 2)
    assert a != b and t.clean_steps() == {0: [2, 1]}
    assert t.begin(0, 3).index == a  # step 2 (newest clean) is never handed out
    t.abort(0, a)
    assert t.clean_steps() == {0: [2]}


def test_agreed_step_is_protected_over_a_newer_unagreed_one():
    t = VersionTable()
    t.add_rank(0, 2)
    snap(t, 0, 1)
    t.agree(0, 1)
    snap(t, 0, 2)  # not agreed (another rank failed to commit it)
    s = t.begin(0, 3)
    assert t.get(0).slots[s.index].step == 3 and t.get(0).slot_with(1) is not None  # 2 was overwritten


def test_keep_and_pins_make_the_table_busy():
    t = VersionTable()
    t.add_rank(0, 2)
    snap(t, 0, 1)
    snap(t, 0, 2)
    t.get(0).slot_with(1).pins += 1
    with pytest.raises(BusyError, match="no free slot for step 3"):
        t.begin(0, 3)
    t.get(0).slot_with(1).pins -= 1
    with pytest.raises(BusyError):
        t.begin(0, 3, keep={1})  # the group's complete version (1) and the newest clean (2)


def test_commit_of_a_slot_not_being_written_is_refused():
    t = VersionTable()
    t.add_rank(0, 2)
    s = t.begin(0, 4)
    with pytest.raises(TransitionError, match="commit of step 5"):
        t.commit(0, s.index, 5)
    with pytest.raises(KeyError):
        t.commit(0, 7, 4)


def test_rewind_lowers_the_agreed_step_and_frees_slots_for_later_snapshots():
    """After resuming from an older step, newer versions are an abandoned future: without a rewind
    the stale agreed step would keep protecting them and every later snapshot would be refused."""
    t = VersionTable()
    t.add_rank(0, 2)
    snap(t, 0, 5)
    snap(t, 0, 6)
    t.agree(0, 6)
    emptied = t.rewind(0, 5)
    assert [s.step for s in t.get(0).slots if s.state == CLEAN] == [5] and len(emptied) == 1
    assert t.get(0).agreed == 5
    for step in (6, 7, 8):  # snapshots go on, the resumed version protected until a newer one is agreed
        snap(t, 0, step)
        t.agree(0, step)
        assert t.get(0).slot_with(step - 1) is not None or step == 6
    assert t.newest_consistent() == 8


def test_rewind_to_fresh_empties_everything():
    t = VersionTable()
    t.add_rank(0, 2)
    snap(t, 0, 3)
    w = t.begin(0, 4)
    t.rewind(0, -1)
    assert all(s.state == EMPTY for s in t.get(0).slots) and w.state == EMPTY and t.get(0).agreed == -1


def test_install_keeps_the_protected_version_when_another_slot_is_free():
    t = VersionTable()
    t.add_rank(0, 2)
    snap(t, 0, 6)
    s = t.install(0, 5)
    assert s.state == WRITING and t.get(0).slot_with(6) is not None
    t.commit(0, s.index, 5)
    assert t.clean_steps() == {0: [6, 5]}


def test_newest_consistent_prefers_the_agreed_step():
    t = VersionTable()
    for r in (0, 1):
        t.add_rank(r, 2)
        snap(t, r, 1)
        snap(t, r, 2)
        t.agree(r, 1)
    assert t.newest_consistent() == 1
    t.agree(0, 2)
    t.agree(1, 2)
    assert t.newest_consistent() == 2
    t.invalidate(1, 2)
    assert t.newest_consistent() == 1
    assert t.agreed_low(2) == 2 and t.agreed_low(3) == -1


def test_the_certified_and_the_watched_versions_keep_their_slots():
    """recovery.prefer: certified - with two more slots, snapshots go on while the certified version and
    the watched one stay; a newer certified version releases the older one's slot."""
    t = VersionTable()
    t.add_rank(0, 4)
    snap(t, 0, 1)
    assert t.certify(0, 1) and not t.certify(0, 7)  # 7 is not held: nothing marked
    snap(t, 0, 2)
    assert t.watch(0, 2)
    for step in range(3, 9):
        t.agree(0, step - 1)
        snap(t, 0, step)
        t.check()
    assert {1, 2} <= set(t.clean_steps()[0])
    t.certify(0, 2)
    assert (t.get(0).certified, t.get(0).candidate) == (2, -1)
    snap(t, 0, 9)
    snap(t, 0, 10)
    assert 1 not in t.clean_steps()[0] and 2 in t.clean_steps()[0]  # 1 is no longer kept


def test_rewind_and_invalidate_drop_the_marks_of_the_versions_they_drop():
    t = VersionTable()
    t.add_rank(0, 4)
    for step in (1, 2, 3):
        snap(t, 0, step)
    t.certify(0, 2)
    t.watch(0, 3)
    t.rewind(0, 2)  # 3 belonged to an abandoned future
    assert (t.get(0).certified, t.get(0).candidate) == (2, -1)
    t.invalidate(0, 2)
    assert t.get(0).certified == -1
    t.check()


@pytest.mark.parametrize("seed", range(40))
def test_random_event_orders_keep_every_rule(seed):
    """Random interleavings of begin/commit/abort/invalidate/agree/rewind/pin/install on 2 ranks with
    1, 2 or 4 slots: after every event the invariants hold, ``begin`` never hands out the protected or
    a kept or pinned slot, and a committed step stays readable until a newer one is protected."""
    rng = random.Random(seed)
    nslots = rng.choice([1, 2, 4])
    t = VersionTable()
    ranks = (0, 1)
    for r in ranks:
        t.add_rank(r, nslots)
    writing: dict[int, tuple[int, int]] = {}
    step = 0
    for _ in range(300):
        r = rng.choice(ranks)
        rv = t.get(r)
        ev = rng.choice(["begin", "begin", "commit", "commit", "abort", "invalidate", "agree", "rewind", "pin",
                         "unpin", "install", "watch", "certify"])
        if ev == "begin":
            step += 1
            keep = {rng.choice([s.step for s in rv.clean()])} if rv.clean() and rng.random() < 0.3 else set()
            protected = rv.protected()
            before = {s.index: (s.state, s.step, s.pins) for s in rv.slots}
            kept = {s.index for s in rv.slots if s.state == CLEAN and s.step in keep} | {s.index for s in rv.marked()}
            try:
                s = t.begin(r, step, keep)
            except BusyError:
                assert all(s.pins or s.index in kept or s is protected for s in rv.slots)
                continue
            assert s is not protected and s.index not in kept and before[s.index][2] == 0
            writing[r] = (s.index, step)
        elif ev == "commit" and r in writing:
            idx, st = writing.pop(r)
            if rv.slots[idx].state == WRITING and rv.slots[idx].step == st:
                t.commit(r, idx, st)
                assert rv.slot_with(st) is rv.slots[idx]
            else:  # a rewind or reuse took it: the commit must be refused
                with pytest.raises(TransitionError):
                    t.commit(r, idx, st)
        elif ev == "abort" and r in writing:
            t.abort(r, writing.pop(r)[0])
        elif ev == "invalidate" and rv.clean():
            st = rng.choice(rv.clean()).step
            t.invalidate(r, st)
            assert rv.slot_with(st) is None
        elif ev == "agree" and rv.clean():
            t.agree(r, rng.choice(rv.clean()).step)
        elif ev == "rewind":
            to = rng.choice([s.step for s in rv.clean()] + [-1])
            t.rewind(r, to)
            writing.pop(r, None)
            assert all(s.step <= to for s in rv.slots) and rv.agreed == to
        elif ev == "pin" and rv.slots:
            rng.choice(rv.slots).pins += 1
        elif ev == "unpin":
            pinned = [s for s in rv.slots if s.pins]
            if pinned:
                rng.choice(pinned).pins -= 1
        elif ev == "install":
            step += 1
            try:
                s = t.install(r, step)
            except BusyError:
                assert all(s.pins for s in rv.slots)
                continue
            writing[r] = (s.index, step)
        elif ev in ("watch", "certify") and rv.clean():
            st = rng.choice(rv.clean()).step
            was = rv.certified
            held = getattr(t, ev)(r, st)
            if ev == "watch":
                assert held and rv.candidate == st
            else:  # an older step than the certified one changes nothing
                assert held == (st >= was) and rv.certified == max(was, st)
        t.check()
