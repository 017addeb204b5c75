"""The fast restart rounds' decisions (megatron_ft.spares.fast_restart): pure, no processes."""

from megatron_ft.spares import fast_restart as fr


def test_a_keeper_reports_what_torchrun_must_handle_and_opens_a_round_for_the_rest():
    r = fr.Round(0, budget=2)
    assert fr.after_exit(r, -9) == fr.after_exit(r, 1) == fr.OPEN_NEXT  # a crash, or a peer's crash felt
    assert fr.after_exit(r, 0) == fr.REPORT  # done
    assert fr.after_exit(r, 2) == fr.REPORT  # megatron_ft.fatal: end the job, do not retry
    assert fr.after_exit(r, 3) == fr.REPORT  # the guard's rollbacks exhausted: never a restart loop
    assert fr.after_exit(r.stop(), 1) == fr.REPORT  # torchrun is stopping its workers
    assert fr.after_exit(fr.Round(1, budget=2), 1, node_lost=True) == fr.REPORT  # its ranks cannot come back
    assert fr.after_exit(fr.Round(1, budget=2), 1) == fr.OPEN_NEXT
    assert fr.after_exit(fr.Round(2, budget=2), 1) == fr.REPORT  # the budget is spent
    assert fr.after_exit(fr.Round(0, budget=0), -9) == fr.REPORT  # fast restarts off


def test_a_keeper_joins_only_a_newer_round():
    assert fr.joins(fr.Round(0, 3), 1) == 1
    assert fr.joins(fr.Round(1, 3), 1) is None
    assert fr.joins(fr.Round(1, 3), 3) == 3  # it lagged: straight to the newest
    assert fr.joins(fr.Round(0, 3).stop(), 1) is None


def test_budget_comes_from_the_launcher_and_needs_the_job_store():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "MFT_FAST_RESTARTS": "3"}
    assert fr.budget(env) == 3
    assert fr.budget({**env, "MFT_FAST_RESTARTS": "x"}) == 0
    assert fr.budget({k: v for k, v in env.items() if k != "MASTER_PORT"}) == 0
    assert fr.budget({k: v for k, v in env.items() if k != "MFT_FAST_RESTARTS"}) == 0


def test_a_verdict_counts_only_when_it_came_during_this_attempt():
    assert fr.verdict_time("2/77/150.25") == 150.25  # the verdict's wall-clock field, parsed
    assert fr.verdict_time("garbage") == float("-inf") and fr.verdict_time(None) == float("-inf")


def test_the_job_ends_with_the_code_its_first_fatal_record_gives(tmp_path):
    from megatron_ft import fatal

    assert fatal.read(str(tmp_path)) is None and fatal.exit_code(str(tmp_path)) == fatal.EXIT_CODE
    fatal.write(str(tmp_path), 1, "rank 2: 3 restored versions failed the guard", fatal.EXIT_ROLLBACKS_EXHAUSTED)
    assert fatal.read(str(tmp_path)) == (1, "rank 2: 3 restored versions failed the guard")
    assert fatal.exit_code(str(tmp_path)) == 3
    fatal.write(str(tmp_path), 0, "rank 0: a configuration error")  # node0 sorts first: its code
    assert fatal.exit_code(str(tmp_path)) == 2
