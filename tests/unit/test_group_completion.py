"""Group completion (megatron_ft.agent.group_completion, pure) and the block store that keeps what
it says (megatron_ft.agent.block_store, real shared-memory files in a temporary directory), in
process: worked cases, then random orders of contributions and announcements across a simulated
group, checked after every event against the rule that the group's recovery point is held whole."""
import os
import random

import numpy as np
import pytest

from megatron_ft.agent.block_store import MAX_VERSIONS, BlockStore
from megatron_ft.agent.group_completion import GroupCompletion
from megatron_ft.redundancy import exchange as xch


def test_a_step_is_complete_once_every_member_announced_it():
    g = GroupCompletion(0, (0, 1, 2))
    assert g.begin(4, now=0.0) and not g.begin(4, now=0.0) and not g.begin(3, now=0.0)
    g.exchange_started(4, 10.0)
    assert g.announce(0, 4, 11.0) is None and g.announce(2, 6, 11.0) is None
    done = g.announce(1, 5, 12.5)  # every member holds 4 or newer: the group's lower bound is 4
    assert (done.step, done.seconds) == (4, 2.5) and g.complete_step == 4 and g.inflight_step == -1
    assert g.announce(1, 5, 13.0) is None and g.newest_announced() == {0: 4, 1: 5, 2: 6}


def test_primary_slots_of_complete_inflight_and_scheduled_steps_are_protected():
    g = GroupCompletion(0, (0, 1), exchange_timeout_s=60, scheduled_timeout_s=100)
    g.begin(2, now=0.0)
    g.scheduled(3, now=0.0)
    assert g.protected(now=1.0) == ({2, 3}, None)
    assert g.protected(now=61.0) == ({3}, 2)  # the exchange of 2 is given up after its timeout
    assert g.protected(now=101.0) == (set(), None)
    g.announce(0, 3, 0.0), g.announce(1, 3, 0.0)
    assert g.protected(now=102.0) == ({3}, None)


def test_announced_steps_stay_kept_until_one_as_new_is_complete():
    g = GroupCompletion(0, (0, 1))
    for s in (1, 2):
        g.claim(s), g.announce(0, s, 0.0)
    assert not g.claim(2) and g.kept_blocks() == {1, 2}
    g.announce(1, 1, 0.0)
    assert g.complete_step == 1 and g.kept_blocks() == {1, 2}
    g.announce(1, 2, 0.0)
    assert g.kept_blocks() == {2}


def test_rewind_lowers_complete_announced_and_kept_steps():
    g = GroupCompletion(0, (0, 1))
    for s in (3, 5):
        g.claim(s), g.announce(0, s, 0.0), g.announce(1, s, 0.0)
    g.claim(6), g.announce(0, 6, 0.0)
    g.begin(7, now=0.0)
    g.rewind(4)
    assert (g.complete_step, g.kept_blocks(), g.inflight_step) == (4, {4}, -1)
    assert g.newest_announced() == {0: 4, 1: 4} and g.claim(5)  # the next versions are completed again


def land(b, v, step, kind, data: bytes, src) -> bool:
    """A contribution as the exchange's landing puts it in: into the block store's destination, applied."""
    view = b.destination(v, kind, len(data))
    view[:] = data
    return b.apply(v, step, kind, view, src)


def store(tmp_path, node=0):
    return BlockStore(str(tmp_path), "run", node)


def test_a_third_version_only_while_two_are_kept_then_newer_contributions_are_refused(tmp_path):
    b = store(tmp_path)
    v1 = b.version_for("copy.r1", 1, 16, 1, {})
    v2 = b.version_for("copy.r1", 2, 16, 1, {})
    assert v1 is not v2 and b.version_for("copy.r1", 3, 16, 1, {}) is v1  # two alternate while nothing is kept
    b.keep({2, 3})
    v4 = b.version_for("copy.r1", 4, 16, 1, {})
    assert v4 not in (v1, v2) and {v.step for v in b.blocks["copy.r1"]} == {2, 3, 4}
    b.keep({2, 3, 4})
    assert b.version_for("copy.r1", 5, 16, 1, {}) is None and len(b.blocks["copy.r1"]) == MAX_VERSIONS
    assert b.version_for("copy.r1", 1, 16, 1, {}) is None  # stale: newer versions exist
    names = [os.path.basename(v.segment.path) for v in b.blocks["copy.r1"]]
    assert len(set(names)) == len(names) == len(os.listdir(tmp_path))
    b.remove_segments()
    assert os.listdir(tmp_path) == []


def test_a_too_small_version_is_unlinked_and_replaced(tmp_path):
    b = store(tmp_path)
    b.version_for("copy.r1", 1, 16, 1, {})
    b.version_for("copy.r1", 2, 16, 1, {})
    b.keep({2})
    v = b.version_for("copy.r1", 3, 4096, 1, {})
    assert v.segment.size >= 4096 and len(os.listdir(tmp_path)) == 2 == len(b.blocks["copy.r1"])


def test_xor_contributions_accumulate_and_one_for_a_reset_version_is_dropped(tmp_path):
    b = store(tmp_path)
    x, y = np.arange(16, dtype=np.uint8), np.full(16, 7, np.uint8)

    def put(v, step, data, src):
        land(b, v, step, xch.XOR, data.tobytes(), src)
        b.received(v, step, src)

    v = b.version_for("xor.g0.p0", 1, 16, 2, {})
    put(v, 1, x, 0)
    assert not v.complete
    put(v, 1, y, 1)
    assert v.complete and bytes(v.segment.array[:16]) == (x ^ y).tobytes()
    b.version_for("xor.g0.p1", 1, 16, 2, {})
    w = b.version_for("xor.g0.p1", 2, 16, 2, {})
    u = b.version_for("xor.g0.p1", 3, 16, 2, {})  # reuses step 1's version
    put(u, 1, x, 0)  # a late contribution to step 1: dropped, not mixed into step 3
    assert bytes(u.segment.array[:16]) == bytes(16) and not u.got and w.step == 2


class Node:
    """One group member: its completion state and block store, as the agent wires them."""

    def __init__(self, tmp_path, node, members):
        self.node, self.members = node, members
        self.c = GroupCompletion(node, members)
        self.b = BlockStore(str(tmp_path / f"n{node}"), "run", node)
        os.makedirs(self.b.shm_dir)

    def key(self):  # replica of 2: this node holds its neighbour's copy
        return f"copy.r{(self.node - 1) % len(self.members)}"

    def held_complete(self, step):
        return any(v.step == step and v.complete for v in self.b.blocks.get(self.key(), []))


@pytest.mark.parametrize("seed", range(40))
def test_random_orders_never_lose_the_groups_recovery_point(tmp_path, seed):
    """Three members, each holding a neighbour's copy. Contributions of steps 1..30 and the
    announcements they cause are delivered in a random order (a sender's own steps in order, as on
    one connection). After every event: for the newest step C any member believes complete, every
    member still holds, complete and with the right bytes, the version of a step >= C that it
    announced - the part of the recovery point the others counted on."""
    rng = random.Random(seed)
    members = (0, 1, 2)
    nodes = {n: Node(tmp_path, n, members) for n in members}
    queues = {n: [("put", (n + 1) % 3, s) for s in range(1, 31)] for n in members}  # per sender, in order
    inbox: list = []  # announcements in flight, delivered in any order
    while any(queues.values()) or inbox:
        choices = [n for n in members if queues[n]] + (["ann"] * len(inbox))
        pick = rng.choice(choices)
        if pick == "ann":
            to, frm, s = inbox.pop(rng.randrange(len(inbox)))
            nd = nodes[to]
            if nd.c.announce(frm, s, 0.0) is not None:
                nd.b.keep(nd.c.kept_blocks())
        else:
            _, dst, s = queues[pick].pop(0)
            nd = nodes[dst]
            v = nd.b.version_for(nd.key(), s, 16, 1, {})
            if v is not None:
                land(nd.b, v, s, xch.COPY, bytes([s]) * 16, pick)
                nd.b.received(v, s, pick)
                if nd.held_complete(s) and nd.c.claim(s):
                    nd.b.keep(nd.c.kept_blocks())
                    inbox += [(m, dst, s) for m in members]
        newest = max(n.c.complete_step for n in nodes.values())
        if newest >= 0:
            for n in nodes.values():
                held = [v for v in n.b.blocks[n.key()] if v.complete and v.step >= newest]
                assert held, (seed, n.node, newest, [(v.step, v.complete) for v in n.b.blocks[n.key()]])
                assert all(bytes(v.segment.array[:16]) == bytes([v.step]) * 16 for v in held)
    assert min(n.c.complete_step for n in nodes.values()) >= 1  # the group did complete versions
    for n in nodes.values():
        n.b.remove_segments()


def test_the_certified_and_the_watched_steps_keep_their_blocks_until_a_rewind_drops_them():
    """recovery.prefer: certified - a node keeps its peer blocks of the step its ranks certified and of the
    one they watch, beside the complete one, so that a lost member's ranks can be rebuilt there."""
    from megatron_ft.agent.group_completion import GroupCompletion

    g = GroupCompletion(node=0, members=(0, 1))
    for step in (3, 4, 5):
        g.claim(step)
        g.announce(0, step, now=0.0)
        g.announce(1, step, now=0.0)
    g.marked({3, 4})
    assert g.kept_blocks() == {3, 4, 5}
    g.marked({3, -1})  # the watch ended (its step now certified, or dropped)
    assert g.kept_blocks() == {3, 5}
    g.rewind(2)  # the job resumed from 2: 3 belonged to an abandoned future
    assert (g.marked_steps, g.kept_blocks()) == (set(), {2})


def test_a_parity_contribution_sent_again_is_dropped_not_xored_twice(tmp_path):
    """A restarted agent may send a version the group already holds once more: XOR-ed in a second
    time its contribution would cancel itself out of the parity (the rebuilt rank would be the other
    contributors' bytes). The block keeps one contribution per node."""
    import numpy as np

    b = store(tmp_path)
    v = b.version_for("xor.g0.l0.s0", 2, 8, 2, {})
    a, c = np.arange(8, dtype=np.uint8), np.full(8, 7, np.uint8)

    def put(src, data):
        ok = land(b, v, 2, "xor", data.tobytes(), src)
        if ok:
            b.received(v, 2, src)
        return ok

    assert put(1, a) and put(2, c) and v.complete
    assert not put(1, a)  # node 1 again
    assert bytes(v.segment.array[:8]) == (a ^ c).tobytes()


def test_a_version_rebuilt_from_the_group_is_never_exchanged_again_from_here():
    """A replacement rebuilt its rank at step 2 from the group: the job's verdict naming 2 agreed must
    not make it send 2 again (its rebuilt slot would be pinned while the next snapshot needs it). A
    rollback below it makes the new life's versions exchangeable again."""
    g = GroupCompletion(1, (0, 1, 2))
    g.rebuilt(2)
    assert not g.begin(2, now=0.0) and g.begin(3, now=0.0)
    g.rewind(1)
    assert g.begin(2, now=1.0)
