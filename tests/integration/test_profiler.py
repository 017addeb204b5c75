"""The timeline profiler: megatron-core hooks on a real 2-stage pipeline, the
profile files, their summary, and ``megatron-ft timeline``.

* ``profiled_run`` (module scope, ~1 min): two real megatron-core ranks (PP=2, gloo) under torchrun,
  tests/integration/profiler_job.py: ``pretrain_gpt.train`` with ``ProfilingHooks`` and schedule-point callbacks.
* the summary of hand-made profiles (the worked example of spans.py / docs/scheduling.md).
* slow: the whole path a user takes, ``megatron-ft launch ... --inmem-ckpt --inmem-ckpt-profile-iterations``.
"""
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml

from megatron_ft import cli
from megatron_ft import config as ftconfig
from megatron_ft.schedule import profiler as prof_mod
from megatron_ft.rank_files import find_rank_file
from megatron_ft.schedule.spans import LinkModel
from megatron_ft.testing.helpers import free_port, with_free_ports

from conftest import REPO

PROFILED, ITERS, MICROBATCHES = 3, 4, 4
ACT_BYTES = 32 * 2 * 64 * 4  # seq x micro-batch x hidden x fp32: one activation / gradient message
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"



def run_env(run_dir):
    return dict(os.environ, MFT_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(REPO, "tests", "integration", "profiler_job.py"), "--out", str(out), "--iters", str(ITERS),
           "--profile", str(PROFILED)]
    p = subprocess.run(cmd, env=run_env(out), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        pytest.fail(f"profiler job failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    jobs = {r: json.load(open(out / f"job.rank{r}.json")) for r in (0, 1)}
    return out, jobs


@pytest.mark.slow  # a 70 s torchrun fixture; test_recovery's scheduled run profiles by default
def test_profile_files_hold_every_kind_with_p2p_bytes(profiled_run):
    out, jobs = profiled_run
    profiles = prof_mod.load_profiles(str(out))
    assert [p["rank"] for p in profiles] == [0, 1]
    for p in profiles:
        r = p["rank"]
        assert (p["format"], p["version"], p["complete"]) == ("megatron-ft-profile", 1, True)
        assert p["meta"]["pp_rank"] == r and p["meta"]["pp_size"] == 2
        assert [it["iteration"] for it in p["iterations"]] == list(range(PROFILED))  # only the first W
        assert p["snapshot_bytes"] > 4 * 50_000  # fp32 params + Adam moments of ~100k parameters / 2 stages
        for it in p["iterations"]:
            length = it["end"] - it["start"]
            assert length > 0
            evs = it["events"]
            assert all(0 <= e["start"] <= e["end"] <= length + 1e-6 for e in evs)
            names = [e["name"] for e in evs]
            assert names.count("forward-compute") == MICROBATCHES == names.count("backward-compute")
            kinds = {e["kind"] for e in evs}
            assert {"compute", "send", "recv", "collective", "optimizer", "phase", "ckpt"} <= kinds
            # stage 0 sends activations forward and receives gradients back; stage 1 the reverse
            sends = [e for e in evs if e["kind"] == "send"]
            recvs = [e for e in evs if e["kind"] == "recv"]
            want = ("p2p.send_next", "p2p.recv_next") if r == 0 else ("p2p.send_prev", "p2p.recv_prev")
            assert {e["name"] for e in sends} == {want[0]} and {e["name"] for e in recvs} == {want[1]}
            assert len(sends) == len(recvs) == MICROBATCHES
            assert {e["bytes"] for e in sends + recvs} == {ACT_BYTES}
            grad = [e for e in evs if e["name"] == "grad-sync"]
            assert len(grad) == 1 and grad[0]["bytes"] > 0 and grad[0]["src"] == "ddp"
            opt = [e for e in evs if e["kind"] == "optimizer"]
            assert len(opt) == 1 and opt[0]["start"] > grad[0]["end"] - 1e-6
            gather = [e for e in evs if e["name"] == "params-all-gather" and e["kind"] == "collective"]
            assert len(gather) == 1 and opt[0]["start"] <= gather[0]["start"] <= gather[0]["end"] <= opt[0]["end"]
            ckpt = [e for e in evs if e["kind"] == "ckpt"]
            assert [e["bytes"] for e in ckpt] == [65536]
        s = p["summary"]
        assert "error" not in s, s
        assert s["network_idle_spans"] and s["iteration_s"] > 0


@pytest.mark.slow  # a 70 s torchrun fixture; test_recovery's scheduled run profiles by default
def test_callbacks_fire_at_schedule_points_and_uninstall_restores(profiled_run):
    _, jobs = profiled_run
    for r, job in jobs.items():
        seen = job["seen"]
        begins = [e for e in seen if e["point"] == "iteration.begin"]
        assert [e["iteration"] for e in begins] == list(range(ITERS))  # callbacks outlive the profile
        for it in range(ITERS):
            fwd = [e for e in seen if e["point"] == "timer.stop:forward-compute" and e["iteration"] == it]
            assert [e["count"] for e in fwd] == list(range(MICROBATCHES))
            assert all(a["elapsed"] < b["elapsed"] for a, b in zip(fwd, fwd[1:]))
            p2p = [e for e in seen if e["point"] == "p2p.after" and e["iteration"] == it]
            assert len(p2p) == MICROBATCHES + 1  # 1F1B on 2 stages: one P2P call per micro-batch, plus one
            key = "recv_next_bytes" if r == 0 else "recv_prev_bytes"
            assert {e[key] for e in p2p if e["recv_next" if r == 0 else "recv_prev"]} == {ACT_BYTES}
            points = [e["point"] for e in seen if e["iteration"] == it]
            assert points.index("grad_sync.after") < points.index("optimizer.before") < points.index("optimizer.after")
        # the profile ended after PROFILED iterations, but the callbacks keep the wrappers in place
        assert job["after_profile"]["installed"] and job["after_profile"]["timers_wrapped"]
        assert job["after_profile"]["profile_path"].endswith(f"rank{r}.json")
        assert all(job["restored"].values()), job["restored"]


@pytest.mark.slow  # a 70 s torchrun fixture; test_recovery's scheduled run profiles by default
def test_timeline_cli_writes_trace_and_png(profiled_run, tmp_path, capsys):
    out, _ = profiled_run
    dest = tmp_path / "tl"
    assert cli.main(["timeline", str(out), "--out", str(dest), "--reserved-bytes", "256KiB", "--show", "2"]) == 0
    printed = capsys.readouterr().out
    assert "rank 0:" in printed and "rank 1:" in printed
    trace = json.load(open(dest / "trace.json"))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    for r in (0, 1):
        cats = {e["cat"] for e in xs if e["pid"] == r}
        assert {"compute", "send", "recv", "collective", "optimizer", "ckpt", "ckpt planned", "idle (avg)"} <= cats
        planned = [e for e in xs if e["pid"] == r and e["cat"] == "ckpt planned"]
        plan = trace["otherData"]["plans"][str(r)]
        snap = prof_mod.load_profiles(str(out))[r]["snapshot_bytes"]
        assert plan["checkpoint_bytes"] == snap and plan["sub_buffer_bytes"] == 65536
        shown_chunks = [c for c in plan["chunk_list"] if c["iteration"] < PROFILED - 1]
        assert len(planned) == len(shown_chunks) and sum(c["size"] for c in plan["chunk_list"]) == snap
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "send", "recv", "ckpt planned", "ckpt"} <= names
    assert open(dest / "timeline.png", "rb").read(8) == PNG_MAGIC
    summary = json.load(open(dest / "summary.json"))
    assert set(summary) == {"0", "1"}


@pytest.mark.slow  # a 70 s torchrun fixture; test_recovery's scheduled run profiles by default
def test_timeline_needs_a_checkpoint_size(profiled_run, tmp_path, capsys):
    out, _ = profiled_run
    d = tmp_path / "profile"
    d.mkdir()
    for r in (0, 1):
        p = json.load(open(find_rank_file(str(out / "profile"), r, ".json")))
        p["snapshot_bytes"] = None
        json.dump(p, open(d / f"rank{r}.json", "w"))
    assert cli.main(["timeline", str(tmp_path), "--out", str(tmp_path / "tl")]) == 2
    assert "give --ckpt-bytes" in capsys.readouterr().err
    assert cli.main(["timeline", str(tmp_path), "--out", str(tmp_path / "tl"), "--ckpt-bytes", "1MiB"]) == 0
    plan = json.load(open(tmp_path / "tl" / "summary.json"))["0"]["plan"]
    assert plan["checkpoint_bytes"] == 2 ** 20


def test_profile_version_is_checked(tmp_path):
    d = tmp_path / "profile"
    d.mkdir()
    json.dump({"format": "megatron-ft-profile", "version": 99, "rank": 0, "iterations": []}, open(d / "rank0.json", "w"))
    with pytest.raises(ValueError, match="profile.version=99"):
        prof_mod.load_profiles(str(tmp_path))
    with pytest.raises(ValueError, match="holds no profile"):
        prof_mod.load_profiles(str((tmp_path / "empty").mkdir() or tmp_path / "empty"))


def _iteration(n, start, recv_end, extra=0.0):
    """The worked example of spans.py (link 100 B/s), the receive's wait ``recv_end`` varying."""
    shift = recv_end - 5.0
    evs = [("forward-compute", "compute", 0, 2, 0), ("p2p.send_next", "send", 2, 2.5, 50),
           ("p2p.recv_next", "recv", 2.5, recv_end, 50), ("backward-compute", "compute", recv_end, 8 + shift, 0),
           ("grad-sync", "collective", 8 + shift, 9 + shift, 1000), ("optimizer.step", "optimizer", 9 + shift, 10 + shift, 0),
           ("forward-backward", "phase", 0, 8 + shift, 0), ("ckpt.copy", "ckpt", 0.5, 1.0, 10)]
    return {"iteration": n, "start": start, "end": start + 10 + shift + extra,
            "events": [{"name": a, "kind": k, "start": s, "end": e, "bytes": b, "src": ""} for a, k, s, e, b in evs]}


def test_summary_of_the_worked_example_with_variance():
    profile = {"rank": 3, "iterations": [_iteration(0, 0.0, 7.0),  # warm-up: left out
                                         _iteration(1, 20.0, 5.0), _iteration(2, 40.0, 5.2)]}
    s = prof_mod.summarize_rank(profile, LinkModel(100.0), min_span_s=0.01)
    assert (s.used_idle, s.used_bubbles, s.dropped) == ((1, 2), (1, 2), ((0, "warm-up"),))
    idle = [(round(x.start, 6), round(x.end, 6), round(x.variance, 6)) for x in s.summary.idle_spans]
    # idle [0, 2), [recv_end, 8 + shift), [9 + shift, 10 + shift): the middle length is 3 in both
    assert idle == [(0.0, 2.0, 0.0), (5.1, 8.1, 0.0), (9.1, 10.1, 0.0)]
    (bubble,) = s.summary.bubbles  # [2, recv_end) less 0.5 s at each end: lengths 2.0 and 2.2
    assert (round(bubble.start, 6), round(bubble.end, 6), round(bubble.variance, 6)) == (2.5, 4.6, 0.01)
    assert round(s.summary.iteration_s, 6) == 10.1 and round(s.summary.iteration_variance, 6) == 0.01
    # an iteration with an extra short bubble is left out of the bubbles' average, and named
    odd = _iteration(3, 60.0, 5.0)
    # a 0.2 s computation inside the bubble splits it: [2.5, 2.9) and [4.1, 5.0) after the reservations
    odd["events"].append({"name": "forward-compute", "kind": "compute", "start": 3.4, "end": 3.6, "bytes": 0, "src": ""})
    s = prof_mod.summarize_rank({"rank": 3, "iterations": profile["iterations"] + [odd, _iteration(4, 80.0, 5.0)]},
                                LinkModel(100.0), min_span_s=0.01)
    assert s.used_bubbles == (1, 2, 4) and (3, "2 bubbles, most iterations have 1") in s.dropped
    assert s.used_idle == (1, 2, 3, 4)
    # the bandwidth estimate: the fastest P2P transfer, 50 B in 0.5 s
    assert prof_mod.estimate_link([profile]).bandwidth == 100.0


def test_profiler_keeps_only_the_first_w_iterations():
    p = prof_mod.Profiler(rank=0, iterations=2)
    for i in range(4):
        p.begin_iteration(i)
        p.record("forward-compute", "compute", p.origin, p.origin, 0, "timer")
        p.end_iteration()
    assert [it["iteration"] for it in p.iterations] == [0, 1] and p.done
    with pytest.raises(ValueError, match="event.kind='gpu'"):
        q = prof_mod.Profiler(rank=0, iterations=1)
        q.begin_iteration(0)
        q.record("x", "gpu", 0.0, 0.0)
    with pytest.raises(ValueError, match="profile.iterations=0"):
        prof_mod.Profiler(rank=0, iterations=0)


def test_scheduled_run_profiles_plan_only_from_the_iterations_without_traffic():
    """A scheduled-transport profile goes on past the planned iterations; the summary must not see them."""
    its = [_iteration(0, 0.0, 7.0), _iteration(1, 20.0, 5.0), _iteration(2, 40.0, 5.2),
           _iteration(3, 60.0, 9.0), _iteration(4, 80.0, 9.0)]  # 3, 4: traffic changes the timeline
    s = prof_mod.summarize_rank({"rank": 0, "meta": {"planned_iterations": 3}, "iterations": its},
                                LinkModel(100.0), min_span_s=0.01)
    assert s.used_idle == (1, 2) and round(s.summary.iteration_s, 6) == 10.1


def test_a_checkpoint_chunk_seen_after_its_iteration_closed_goes_to_that_iteration():
    p = prof_mod.Profiler(rank=0, iterations=3)
    p.begin_iteration(0)
    p.end_iteration()
    t0 = p.origin + p.iterations[0]["start"]
    p.record("ckpt-chunk", "ckpt", t0 + 0.001, t0 + 0.5, 64, "step3")  # completion seen at the iteration's end
    p.record("forward-compute", "compute", t0 + 0.001, t0 + 0.002)  # not a checkpoint: dropped
    (ev,) = p.iterations[0]["events"]
    assert (ev["kind"], ev["bytes"], round(ev["start"], 3), round(ev["end"], 3)) == ("ckpt", 64, 0.001, 0.5)


def test_timeline_draws_the_schedule_a_transport_ran(tmp_path, capsys):
    """RUN_DIR/transport/node0/rank0.json: its sends are drawn over the iterations after the plan."""
    (tmp_path / "profile" / "node0").mkdir(parents=True)
    (tmp_path / "transport" / "node0").mkdir(parents=True)
    its = [_iteration(n, 20.0 * n, 5.0) for n in range(5)]
    prof = {"format": "megatron-ft-profile", "version": 1, "rank": 0, "complete": True,
            "meta": {"planned_iterations": 3}, "snapshot_bytes": None, "clock": {"wall_at_origin": 1000.0},
            "iterations": its}
    json.dump(prof, open(tmp_path / "profile" / "node0" / "rank0.json", "w"))
    tr = {"format": "megatron-ft-transport", "version": 1, "rank": 0,
          "schedule": {"mode": "pipelined", "buffers": 2, "buffer_bytes": 100, "interval_iterations": 2,
                       "sends": [[0, 0, 0.0, 0, 100, 0], [0, 1, 5.0, 100, 50, 1]]},
          "plan": {"planned_at_step": 3, "link_bandwidth": 100.0, "nbytes": 150}}
    json.dump(tr, open(tmp_path / "transport" / "node0" / "rank0.json", "w"))
    assert cli.main(["timeline", str(tmp_path), "--out", str(tmp_path / "tl")]) == 0
    assert "scheduled transport, mode pipelined: 2 chunks" in capsys.readouterr().out
    trace = json.load(open(tmp_path / "tl" / "trace.json"))
    planned = sorted((e["ts"], e["dur"], e["args"]["plan_iteration"]) for e in trace["traceEvents"]
                     if e.get("cat") == "ckpt planned")
    # iteration 3 runs plan iteration 0 (100 B at 0 s: 1 s), iteration 4 plan iteration 1 (50 B at 5 s);
    # times from the earliest box (iteration 0's start)
    assert planned == [(pytest.approx(60.0e6), pytest.approx(1e6), 0), (pytest.approx(85.0e6), pytest.approx(0.5e6), 1)]


@pytest.mark.slow
def test_launch_with_inmem_ckpt_and_profile_then_timeline(tmp_path, shm_cleanup):
    """The user's path: megatron-ft launch (agent + torchrun, PP=2) with snapshots and the profiler."""
    run_id = f"pf{uuid.uuid4().hex[:10]}"
    cfg = with_free_ports(ftconfig.load(), run_id=run_id, cluster={"nodes": 1, "ranks_per_node": 2},
                          parallel={"tensor": 1, "pipeline": 2},
                          persist={"dir": str(tmp_path / "persist"), "interval": 0},
                          launch={"max_restarts": 0})
    cfg_path = tmp_path / "job.yaml"
    yaml.safe_dump(cfg.to_dict(), open(cfg_path, "w"))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_ft.cli", "launch", f"--config={cfg_path}", f"--run-dir={run_dir}", "--",
           os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--pipeline-model-parallel-size", "2",
           "--num-layers", "2", "--train-iters", "5", "--inmem-ckpt", "--inmem-ckpt-profile-iterations", "4"]
    shm_cleanup(cfg)
    p = subprocess.run(cmd, env=run_env(run_dir), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    profiles = prof_mod.load_profiles(str(run_dir))
    assert [q["rank"] for q in profiles] == [0, 1]
    for q in profiles:
        assert len(q["iterations"]) == 4 and q["complete"]
        assert q["snapshot_bytes"] > 0 and "error" not in q["summary"]
        assert {"compute", "send", "recv", "collective", "optimizer"} <= {e["kind"] for e in q["iterations"][-1]["events"]}
    assert cli.main(["timeline", str(run_dir)]) == 0
    assert os.path.getsize(run_dir / "timeline" / "trace.json") > 0
    shutil.rmtree(run_dir / "timeline")
