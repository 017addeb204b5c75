"""The demo's verdict on a finished run: what its files say (:class:`RunRecords`), the checks every
scenario shares (bit for bit against the reference, hang verdicts, restarts, failure verdicts, the
promised recovery tier and the step resumed from), the JSON summary, and the report printed above it.

A scenario (:mod:`megatron_ft.testing.demo_scenarios`) takes part through its hooks, each called at its
place so that the problems keep their order: ``judge_verdicts`` after the restart check,
``check_resumed_steps`` before the step checks, ``tier_failure`` for the promise, ``summary_fields`` for
the summary's :data:`~megatron_ft.testing.demo_scenarios.SCENARIO_FIELDS` (placeholders here, so that
the summary's keys keep one order whatever the scenario), and ``report`` for its own lines."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import tiers
from .demo_results import (BREAKDOWN_NAMES, _all_records, compare, life, recovery_breakdown, restarted_by,
                           snapshot_stall, unexpected_verdicts)
from .demo_run import Run
from .demo_scenarios import SCENARIO_FIELDS


@dataclass
class RunRecords:
    """What the run's progress and event records say about its failure and recovery. torchrun's restart
    counters differ between nodes (only the failed node's counts), so "before" and "after" the failure
    are told apart by trainer lives (process and in-process attempt): the lives that logged progress
    before the kill are the first, every other came after."""

    progress: list[dict]
    events: list[dict]
    first_lives: set
    last_before_kill: int
    after: list[dict]  # the restores of the lives after the kill
    rollback_events: list[dict]
    refused: set[int]  # restored steps the guard's loss check rolled back
    recovered_from: str  # what the failed ranks recovered from (the others restore their own local copy)
    resumed: int
    recovery_seconds: Optional[float]
    breakdown: Optional[dict]
    start_seconds: Optional[float]


def read_run_records(run: Run) -> RunRecords:
    """The run's records, read once the job ended."""
    kill_time = run.kill_time
    progress = _all_records(run.run_dir, "progress")
    first_lives = {life(r) for r in progress if kill_time is not None and r["time"] <= kill_time}
    last_before_kill = max((r["iteration"] for r in progress if life(r) in first_lives), default=0)
    events = _all_records(run.run_dir, "events")
    after = [e for e in events
             if e.get("event") == "restore" and kill_time is not None and life(e) not in first_lives]
    # the guard's loss check rolled back these lives' restored steps (they exited; their restarts restored older ones)
    rollback_events = [e for e in events if e.get("event") == "rollback"]
    refused = {e["step"] for e in rollback_events}
    sources = sorted({e["source"] for e in after if not run.victims or e["rank"] in run.victims})
    recovered_from = sources[0] if len(sources) == 1 else ("none" if not sources else "+".join(sources))
    resumed = max((e["step"] for e in after if e["step"] not in refused), default=-1)
    recovery_seconds = None
    # the restarted processes are those whose restore came after the kill (a rank that had not yet
    # logged progress when the kill landed is not a restarted one)
    restarted_lives = {life(e) for e in after if e["time"] > (kill_time or 0)}
    restarted = [r["time"] for r in progress if kill_time is not None and life(r) in restarted_lives
                 and r["time"] > kill_time]
    if restarted:
        recovery_seconds = round(min(restarted) - kill_time, 3)
    breakdown = recovery_breakdown(after, progress, kill_time) if kill_time is not None else None
    first_gen = [r["time"] for r in progress if kill_time is None or life(r) in first_lives]
    start_seconds = round(min(first_gen) - run.t0, 3) if first_gen else None
    return RunRecords(progress, events, first_lives, last_before_kill, after, rollback_events, refused,
                      recovered_from, resumed, recovery_seconds, breakdown, start_seconds)


def judge_hangs(run: Run, rec: RunRecords, problems: list[str]) -> dict:
    """The hang verdicts: one on each victim of a hang scenario, none anywhere else; the summary's hang
    fields."""
    expects_hang = run.scenario.expects_hang
    hangs = [e for e in rec.events if e.get("event") == "hang"]
    verdict_time = min((e["time"] for e in hangs), default=None)
    hang_detected_s = (round(verdict_time - run.hang_time, 3)
                       if verdict_time is not None and run.hang_time is not None and expects_hang else None)
    # the verdict -> the job's next completed iteration (the stalled job completes none in between)
    after_verdict_s = (round(min(r["time"] for r in rec.progress if r["time"] > verdict_time) - verdict_time, 3)
                       if hang_detected_s is not None and any(r["time"] > verdict_time for r in rec.progress)
                       else None)
    expected_hangs = sorted(run.victims) if expects_hang and run.hang_time is not None else []
    hang_ok = sorted(e["rank"] for e in hangs) == expected_hangs
    if not hang_ok and expected_hangs:
        problems.append(f"hang verdicts on rank(s) {sorted(e['rank'] for e in hangs)}, want exactly one on each of "
                        f"{expected_hangs}")
    elif not hang_ok:
        problems.append(f"false hang verdict(s): {[(e['rank'], e['phase'], e['quiet_s']) for e in hangs]}")
    return {
        # --fail hang: the stop -> the agent's verdict (and SIGKILL); the recovery follows it
        # (hang-in-restore: the restarted victim reaching its restore -> the verdict)
        "hang_detected_s": hang_detected_s,
        "hang_verdicts": [{k: e[k] for k in ("rank", "phase", "quiet_s", "bound_s", "iteration_p99_s")} for e in hangs],
        "hang_ok": hang_ok,
        "recovery_seconds_after_verdict": after_verdict_s,
        "hang_to_iteration_s": round(hang_detected_s + after_verdict_s, 3)
        if hang_detected_s is not None and after_verdict_s is not None else None,
    }


def trainer_lives(rec: RunRecords) -> dict[int, set]:
    """rank -> its trainer lives."""
    lives: dict[int, set] = {}
    for r in rec.progress:
        lives.setdefault(r["rank"], set()).add(life(r))
    return lives


def judge_restarts(run: Run, lives: dict[int, set], problems: list[str]) -> list[int]:
    """No failure: one life per rank (a restart would mean something was judged failed); the ranks
    restarted."""
    restarted_ranks = sorted(r for r, ls in lives.items() if len(ls) > 1) if run.scenario.trains_through else []
    if restarted_ranks:
        problems.append(f"rank(s) {restarted_ranks} restarted in a run without a failure")
    return restarted_ranks


def judge_verdicts(run: Run, lives: dict[int, set], problems: list[str]) -> list[str]:
    """The root agents' failure verdicts on live nodes (less those the scenario accounts for), and - hosts
    of their own - servers off the port plan and anything served to an outsider; the false verdicts."""
    expected_verdicts = set(run.lost_nodes) | ({run.agent_killed[0]} if run.agent_killed is not None else set())
    false_verdicts = unexpected_verdicts(run.run_dir, expected_verdicts)
    false_verdicts = run.scenario.judge_verdicts(run, lives, false_verdicts, problems)
    problems += [f"false failure verdict: {v}" for v in false_verdicts]
    problems += [f"off the port plan: {x}" for x in (run.listeners or {}).get("off_plan", [])]
    problems += [f"an outsider was served: {x}" for x in (run.stranger or {}).get("served", [])]
    return false_verdicts


def promised_tier(run: Run) -> Optional[str]:
    """The tier (megatron_ft.tiers) the failure must recover from, or better; None without a failure."""
    if run.kill_time is None:
        return None
    cfg = run.cfg
    if run.lost_nodes:
        from ..redundancy.plan import plan_from_config

        promise = tiers.promised("node", cfg.redundancy.scheme,
                                 beyond_tolerance=not plan_from_config(cfg).survives(run.lost_nodes))
        if promise in ("peer_memory", "decoded") and not any(run.complete_at_loss.values()):
            promise = "none"  # lost before its group completed any version: nothing in memory to rebuild
        return promise
    return tiers.promised(run.scenario.tier_failure(run.args), cfg.redundancy.scheme)


def judge_tier(run: Run, rec: RunRecords, problems: list[str]) -> dict:
    """The promised tier, and whether the job resumed from it at a step good enough; the summary's tier
    fields."""
    promise = promised_tier(run)
    resumed_ok = run.scenario.check_resumed_steps(run, rec.after, problems)
    # from disk, at least the newest step persisted whole before the loss (a node's loss without redundancy):
    # a newer one the survivors' agents finished writing after it (the lost nodes' files already written) is
    # as good; with none persisted whole yet, a fresh start is all there is
    want_step = max((s for s in run.persisted_at_kill if s <= rec.last_before_kill), default=None)
    if promise == "disk" and want_step is None:
        promise = "none"
    step_ok = not (run.kill_time is not None and rec.recovered_from == "disk" and want_step is not None
                   and rec.resumed < want_step)
    if not step_ok:
        problems.append(f"resumed from persisted step {rec.resumed}, but step {want_step} was persisted whole "
                        f"before the failure")
    certified_at_kill, certified_ok = judge_certified(run, rec, problems)
    held_at_loss, held_ok = judge_peer_step(run, rec, problems)
    step_ok = step_ok and certified_ok and held_ok
    return {
        "promised_tier": promise,
        "tier_ok": bool(promise in (None, "none") or (rec.recovered_from != "none"
                                                      and tiers.meets(rec.recovered_from, promise)))
        and step_ok and resumed_ok,
        "newest_persisted_before_failure": want_step,
        "group_complete_at_loss": {str(n): v for n, v in run.complete_at_loss.items()} if run.lost_nodes else None,
        "newest_complete_at_loss": held_at_loss,
        "certified_before_failure": certified_at_kill,
    }


def judge_certified(run: Run, rec: RunRecords, problems: list[str]) -> tuple[Optional[int], bool]:
    """recovery.prefer: certified - the restore takes a certified version, at least the newest one
    certified before the failure (a later certification may land while the kill does) - from memory:
    the peers keep their blocks of it too; a loss beyond the redundancy goes to disk, where it need not
    be. (that step, whether the resumed one passes)"""
    kill_time, after, resumed = run.kill_time, rec.after, rec.resumed
    certified_at_kill = max((e["step"] for e in rec.events if e.get("event") == "certified" and kill_time is not None
                             and e["time"] <= kill_time), default=None)
    if (run.eff_cfg.recovery.prefer == "certified" and kill_time is not None and certified_at_kill is not None
            and after and rec.recovered_from not in ("disk", "none")):
        uncertified = sorted({e["step"] for e in after if e.get("certified") is not True})
        if uncertified or resumed < certified_at_kill:
            problems.append(f"recovery.prefer: certified, step {certified_at_kill} certified before the failure, "
                            f"but the job resumed from step {resumed}" +
                            (f" (not certified: step(s) {uncertified})" if uncertified else ""))
            return certified_at_kill, False
    return certified_at_kill, True


def judge_peer_step(run: Run, rec: RunRecords, problems: list[str]) -> tuple[Optional[int], bool]:
    """From peer memory, at least the newest step every lost node's agent had seen complete in its group
    (its log is final): the survivors hold those copies. A survivor may have seen a newer one complete
    that the lost agent never heard of, so this is a floor, not the step itself. How far it trails the
    failure is the transfers' lag - a loaded machine lengthens it - not a fault. (that step, whether the
    resumed one passes)"""
    complete_at_loss = run.complete_at_loss
    held_at_loss = (min(max(v) for v in complete_at_loss.values())
                    if complete_at_loss and all(complete_at_loss.values()) else None)
    if (run.kill_time is not None and rec.recovered_from in ("peer_memory", "decoded") and held_at_loss is not None
            and not rec.refused and run.eff_cfg.recovery.prefer == "newest" and rec.resumed < held_at_loss):
        problems.append(f"resumed from step {rec.resumed} out of peer memory, but step {held_at_loss} was complete "
                        f"in the lost node's group before the failure")
        return held_at_loss, False
    return held_at_loss, True


def build_summary(run: Run) -> dict:
    """The demo's JSON summary of the finished run (the problems found in order, the first ten kept)."""
    rec = read_run_records(run)
    if run.looking is not None:
        run.looking.join(60)
    identical, problems = compare(run.ref_dir, run.run_dir, run.world,
                                  {life(e): e["step"] for e in rec.rollback_events})
    hang = judge_hangs(run, rec, problems)
    lives = trainer_lives(rec)
    restarted_ranks = judge_restarts(run, lives, problems)
    false_verdicts = judge_verdicts(run, lives, problems)
    tier = judge_tier(run, rec, problems)
    summary = {
        "scenario": run.args.fail,
        "megatron_lm_series": run.series if run.args.megatron_lm else None,
        **tier,
        "transport": run.cfg.redundancy.transport if run.cfg.redundancy.scheme != "none" else None,
        **recovery_fields(run, rec),
        **hang,
        "restarted_ranks": restarted_ranks,
        **dict.fromkeys(SCENARIO_FIELDS),
        **restore_fields(run, rec),
        "bitwise_identical": identical,
        # the training-visible stall per snapshot against a raw copy of the same bytes
        "snapshot_stall": snapshot_stall(run.run_dir),
        "false_verdicts": false_verdicts,
        **failure_fields(run, rec),
        "reference_seconds": round(run.ref_seconds, 1),
        "run_seconds": round(run.run_seconds, 1),
        "problems": problems[:10],
        "workdir": run.workdir,
    }
    fields = run.scenario.summary_fields(run)
    assert set(fields) <= set(SCENARIO_FIELDS), fields  # the summary's keys keep one order
    summary.update(fields)
    summary.update(bed_fields(run))
    return summary


def recovery_fields(run: Run, rec: RunRecords) -> dict:
    """Where the failed ranks recovered from, at which step, and how long it took."""
    kill_time = run.kill_time
    return {
        "recovered_from": rec.recovered_from if run.args.fail != "none" else "none",
        "resumed_step": rec.resumed,
        "lost_iterations": (rec.last_before_kill - rec.resumed) if kill_time is not None and rec.resumed >= 0 else
        (rec.last_before_kill if kill_time is not None else 0),
        "recovery_seconds": rec.recovery_seconds,
    }


def restore_fields(run: Run, rec: RunRecords) -> dict:
    """The restores after the failure: their time, rollbacks, phases and how the restarted trainers came;
    the job's start against its cold start."""
    after, cold_start_seconds = rec.after, run.cold_start_seconds
    return {
        "restore_seconds": round(max((e["seconds"] for e in after), default=0.0), 4),
        # restored versions the guard refused (NaN or Inf in bytes that verified): every rank rolled back
        # or whose losses after the restore failed it (every rank dropped the version and restarted)
        "rollbacks": max((e.get("rollbacks", 0) for e in after), default=0) + len(rec.refused),
        "recovery_breakdown": rec.breakdown,
        # how the restarted trainers came: a fast restart round beneath torchrun (warm spares), or
        # torchrun's own restart of its workers (its restart count)
        "restarted_by": restarted_by(after) if run.kill_time is not None else None,
        # ranks whose trainer survived and rejoined in its own process (in-process restart)
        "kept_in_place": sorted({e["rank"] for e in after if life(e)[1] > 0}),
        # ranks whose restore went into weights built uninitialised (the restore overwrote them)
        "built_uninitialised": sorted({e["rank"] for e in after if e.get("weights_initialised") is False}),
        "cold_start_seconds": cold_start_seconds,
        "start_seconds": rec.start_seconds,
        "warm_spares": run.cfg.launch.warm_spares,
        "recovery_vs_cold_start": round(rec.recovery_seconds / cold_start_seconds, 3)
        if rec.recovery_seconds and cold_start_seconds else None,
    }


def failure_fields(run: Run, rec: RunRecords) -> dict:
    """What failed, and when."""
    args, kill_time, second = run.args, run.kill_time, run.second
    return {
        "kill_point": args.kill_point if kill_time is not None else None,
        "agent_killed": run.agent_killed is not None,
        "lost_nodes": run.lost_nodes,
        "second_failure": {"node": second[0], "pid": second[1], "after_first_s": round(second[2] - kill_time, 2)}
        if second else None,
        "standby": bool(args.standby),
        "killed_after_iteration": args.kill_at if kill_time is not None else None,
        "last_iteration_before_kill": rec.last_before_kill if kill_time is not None else None,
        "iterations": args.iters,
        "world_size": run.world,
    }


def bed_fields(run: Run) -> dict:
    """--slurm: the job and what Slurm made of the lost host; hosts of their own: megatron-ft's servers
    seen before the failure, and an outsider's probes."""
    out = {}
    if run.slurm is not None:
        lost = dict(run.slurm_lost)
        if lost:  # Slurm's own clock: the host was marked DOWN no later than the job ended
            end = run.slurm.job_end(run.p.job_id)
            lost["job_end"] = end
            lost["during_the_job"] = bool(lost["since"] and end and lost["since"] <= end)
        out["slurm"] = {"job": run.p.job_id, "lost_node": lost or None}
    if run.listeners is not None:
        out["listeners"] = run.listeners
    if run.stranger is not None:
        out["stranger"] = run.stranger
    return out


def print_report(run: Run, summary: dict) -> None:
    """The report printed above the summary's JSON line."""
    say = run.say
    say("")
    say("=" * 72)
    say(f" scenario            : {run.args.fail}")
    if run.kill_time is not None:
        report_recovery(run, summary)
    run.scenario.report(run, summary)
    say(f" bitwise identical   : {summary['bitwise_identical']}  (final model, optimizer, scheduler, RNG of "
        f"{run.world} ranks; every iteration's loss)")
    st = summary["snapshot_stall"]
    if st:
        say(f" snapshot stall      : {st['stall_median_s'] * 1e3:.2f} ms per snapshot (median, slowest rank; largest "
            f"{st['stall_max_s'] * 1e3:.1f} ms) for {st['bytes_per_rank']} bytes per rank, a raw copy of which takes "
            f"{st['raw_copy_s'] * 1e3:.2f} ms: {st['stall_vs_raw_copy']}x"
            + (f"; Megatron's whole save call {st['megatron_save_median_s'] * 1e3:.1f} ms (its state dict and ours)"
               if "megatron_save_median_s" in st else ""))
        if st["raw_copy_s"] < 1e-3:
            say("   (a copy this small takes microseconds: the ratio shows the fixed cost of taking a snapshot, not "
                "a copy's; a state of hundreds of MB per rank gives the figure that means something)")
    for pr in summary["problems"]:
        say(f"   ! {pr}")
    say("=" * 72)


def report_recovery(run: Run, summary: dict) -> None:
    """The report's lines on the failure and its recovery."""
    say, args = run.say, run.args
    say(f" killed              : rank(s) {run.victims} after iteration {args.kill_at} "
        f"(job had reached {summary['last_iteration_before_kill']})")
    say(f" recovered from      : {summary['recovered_from']} (step {summary['resumed_step']}, "
        f"{summary['lost_iterations']} iteration(s) lost); promised: {summary['promised_tier']} or better -> "
        f"{'OK' if summary['tier_ok'] else 'WRONG TIER'}")
    if summary["hang_detected_s"] is not None:
        v = summary["hang_verdicts"][0]
        say(f" hang found          : {summary['hang_detected_s']} s after the hang (rank {v['rank']} quiet "
            f"{v['quiet_s']} s in {v['phase']}; bound {v['bound_s']} s from the iteration p99 "
            f"{v['iteration_p99_s']} s); then SIGKILL and the normal recovery")
    if summary["rollbacks"]:
        say(f" rolled back         : {summary['rollbacks']} restored version(s) refused by the guard "
            f"(NaN or Inf in bytes that verified, or losses after the restore)")
    say(f" recovery            : {summary['recovery_seconds']} s kill -> first iteration after restart "
        f"(restore itself {summary['restore_seconds']} s); the job's cold start (reference run, no warm "
        f"spares) {summary['cold_start_seconds']} s launch -> first iteration, so "
        f"{summary['recovery_vs_cold_start']}x")
    kept = summary["kept_in_place"]
    say(f"   restarted by       : {summary['restarted_by']}"
        + (f" (ranks {kept} kept in their processes" + (
            f", {summary['built_uninitialised']} with their weights built uninitialised for the restore)"
            if summary["built_uninitialised"] else ")") if kept else ""))
    breakdown = summary["recovery_breakdown"]
    if breakdown:
        say("   where it went      : " + ", ".join(f"{BREAKDOWN_NAMES[k]} {v:.2f} s" for k, v in breakdown.items()
                                               if v is not None))
