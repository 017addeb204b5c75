"""The demo's recovery breakdown (megatron_ft.testing.demo.recovery_breakdown), from records: the
phases of the restarted rank that trained first, adding up to its recovery."""
from megatron_ft.testing.demo import recovery_breakdown


def restore(pid, end, ready, rdzv=(None, None), start=None):
    return {"event": "restore", "pid": pid, "rank": 0, "time": end,
            "timeline": {"process_start": start, "rendezvous_start": rdzv[0], "rendezvous_end": rdzv[1],
                         "ready": ready, "restore_start": ready + 0.01}}


def test_phases_of_the_rank_that_trained_first_add_up_to_its_recovery():
    kill = 100.0
    restores = [restore(11, end=106.0, ready=105.5, rdzv=(103.0, 104.0), start=101.0),
                restore(12, end=105.5, ready=105.0, rdzv=(102.5, 104.0), start=100.5),
                restore(9, end=50.0, ready=49.0, start=40.0)]  # the first generation's restore, before the kill
    progress = [{"pid": 11, "time": 107.0}, {"pid": 12, "time": 106.0}, {"pid": 12, "time": 108.0},
                {"pid": 9, "time": 99.0}]
    b = recovery_breakdown(restores, progress, kill)
    assert b == {"detect_respawn": 0.5, "imports": 2.0, "rendezvous": 1.5, "build": 1.0, "restore": 0.5,
                 "first_iteration": 0.5}
    assert sum(b.values()) == 106.0 - kill


def test_without_a_rendezvous_record_imports_run_to_ready_and_nothing_restarted_is_none():
    b = recovery_breakdown([restore(5, end=12.0, ready=11.0, start=10.5)], [{"pid": 5, "time": 13.0}], 10.0)
    assert (b["imports"], b["rendezvous"], b["build"]) == (0.5, None, None)
    assert recovery_breakdown([], [], 10.0) is None
