"""DeepSpeed through megatron-ft's in-memory tier: real agents, real fast restart rounds, real SIGKILL.

Each scenario runs ``scripts/pretrain_deepspeed.py`` on 2 gloo ranks (1 simulated node) twice:

1. the reference: plain torchrun, no checkpointing at all, uninterrupted;
2. under ``megatron-ft launch`` (agent + torchrun with restarts) with ``--inmem-ckpt`` (a
   DeepSpeed ``save_checkpoint`` into the agent's shared memory after every iteration). Rank 1 is
   SIGKILLed from outside once it has logged iteration ``KILL_AT`` (or kills itself at a fault
   point); the keepers of the warm spares fork both ranks again in fast round 1 (torchrun restarts
   nothing), ``engine.load_checkpoint`` restores the newest step both
   ranks hold, verified, and training runs to the end.

Then every rank's final digests (parameters / ZeRO partitions, the optimizer's state dict, LR
scheduler, RNG, data position) and the loss of every iteration, re-run ones included, must equal
the reference bit for bit.

The default suite runs the codec units and one in-process DeepSpeed engine (world size 1) against
a real agent (~20 s together). The end-to-end scenarios took 90-250 s each on 2 shared, heavily
loaded cores and are marked slow (``pytest -m slow tests/integration/test_deepspeed.py``).
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.testing import faults
from megatron_ft.testing.helpers import free_port, read_jsonl, with_free_ports
from megatron_ft.rank_files import find_rank_file

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install '.[deepspeed]')")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "pretrain_deepspeed.py")
ITERS, KILL_AT, SLEEP = 12, 5, 0.25
TIMEOUT = 600


# ---------------------------------------------------------------- codec (no processes)


# ---------------------------------------------------------------- one process, real agent


def test_failed_save_is_skipped_and_load_restores_newest_good_snapshot(tmp_path, job_config, agent, monkeypatch):
    """World size 1 in this process, a real agent: a save_checkpoint whose client state cannot be
    encoded returns normally (no snapshot); load_checkpoint then restores the newest good save bit
    for bit into a model that was changed afterwards."""
    import torch.distributed as dist

    cfg, _ = job_config
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("MFT_NODE_RANK", "0")
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True})
        from megatron_ft.deepspeed import enable_inmem_ckpt

        ce = enable_inmem_ckpt(engine, cfg)

        def step():
            loss = engine(torch.randn(2, 8)).pow(2).mean()
            engine.backward(loss)
            engine.step()

        ckpt_dir = str(tmp_path / "ckpt")
        step()
        assert engine.save_checkpoint(ckpt_dir, client_state={"k": 1})
        saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        saved_rng = torch.get_rng_state()
        step()
        assert engine.save_checkpoint(ckpt_dir, client_state={"bad": object()})  # logged, not raised
        ce.ckpt.before_optimizer_step()
        assert [h.step for h in ce.ckpt.engine.history] == [1]  # step 2 was never snapshotted
        step()
        torch.manual_seed(123)
        path, client = engine.load_checkpoint(ckpt_dir)
        assert path.endswith("global_step1/mp_rank_00_model_states.pt") and client["k"] == 1
        assert engine.global_steps == 1
        for n, p in engine.module.named_parameters():
            assert torch.equal(p, saved[n]), n
        assert torch.equal(torch.get_rng_state(), saved_rng)
        ce.ckpt.close()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- end to end


def script_args(stage, pipeline, run_dir, inmem, fault=None):
    args = [SCRIPT, f"--zero-stage={stage}", f"--iters={ITERS}",
            f"--dump-final-state={os.path.join(run_dir, 'final', 'state')}"]
    if pipeline:
        args.append("--pipeline")
    if inmem:
        args += ["--inmem-ckpt", f"--save-dir={os.path.join(run_dir, 'ckpt')}", f"--iter-sleep={SLEEP}"]
    return faults.wrap(args, fault) if fault else args


def env_for(run_dir, **extra):
    env = dict(os.environ, DS_ACCELERATOR="cpu", MFT_RUN_DIR=run_dir, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def wait(p, log, what):
    try:
        rc = p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"{what} did not finish in {TIMEOUT} s; log {log}")
    if rc != 0:
        pytest.fail(f"{what} exited {rc}:\n{open(log, errors='replace').read()[-4000:]}")


def reference(tmp, stage, pipeline):
    run_dir = str(tmp / "ref")
    log = str(tmp / "ref.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", *script_args(stage, pipeline, run_dir, inmem=False)]
    p = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env_for(run_dir),
                         start_new_session=True)
    wait(p, log, "reference run")
    return run_dir


def job_config(tmp):
    cfg = with_free_ports(ftconfig.load(), run_id=f"ds{uuid.uuid4().hex[:10]}",
                          cluster={"nodes": 1, "ranks_per_node": 2}, parallel={"tensor": 1, "pipeline": 1},
                          persist={"dir": str(tmp / "persist"), "interval": 0}, launch={"max_restarts": 2})
    path = str(tmp / "job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    return cfg, path


def recovered_run(tmp, stage, pipeline, shm_cleanup, kill_rank=1, fault=None):
    """The job under megatron-ft launch; rank ``kill_rank`` is SIGKILLed from outside once it logged
    iteration KILL_AT (``fault=None``) or kills itself at a fault point (megatron_ft.testing.faults)."""
    cfg, cfg_path = job_config(tmp)
    shm_cleanup(cfg)
    run_dir = str(tmp / "run")
    log = str(tmp / "run.log")
    cmd = [sys.executable, "-m", "megatron_ft.cli", "launch", f"--config={cfg_path}", f"--run-dir={run_dir}",
           "--", *script_args(stage, pipeline, run_dir, inmem=True, fault=fault and f"{fault}:{KILL_AT}:{kill_rank}")]
    p = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env_for(run_dir),
                         start_new_session=True)
    killed = None
    try:
        if fault is None:
            prog = os.path.join(run_dir, "progress", f"rank{kill_rank}.jsonl")
            deadline = time.time() + TIMEOUT
            while killed is None:
                recs = [r for r in read_jsonl(prog) if r["iteration"] >= KILL_AT]
                if recs:
                    killed = recs[0]
                    os.kill(recs[0]["pid"], signal.SIGKILL)
                elif p.poll() is not None or time.time() > deadline:
                    pytest.fail(f"rank {kill_rank} never reached iteration {KILL_AT}:\n"
                                f"{open(log, errors='replace').read()[-4000:]}")
                else:
                    time.sleep(0.02)
        wait(p, log, "megatron-ft run")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return run_dir, killed


def restores(run_dir):
    out = []
    for r in (0, 1):
        out += [e for e in read_jsonl(find_rank_file(os.path.join(run_dir, "events"), r, ".jsonl") or "") if e["event"] == "restore"]
    return out


def compare(ref_dir, run_dir):
    problems = []
    for r in (0, 1):
        want = {}
        for rec in read_jsonl(os.path.join(ref_dir, "progress", f"rank{r}.jsonl")):
            want[rec["iteration"]] = rec["loss_hex"]
        got = {}
        for rec in read_jsonl(os.path.join(run_dir, "progress", f"rank{r}.jsonl")):
            got.setdefault(rec["iteration"], set()).add(rec["loss_hex"])
        if sorted(want) != list(range(1, ITERS + 1)):
            problems.append(f"reference rank {r} logged iterations {sorted(want)}")
        for it, loss in sorted(want.items()):
            if got.get(it) != {loss}:
                problems.append(f"rank {r} iteration {it}: loss {sorted(got.get(it, ()))} != reference {loss}")
        ref_s = json.load(open(os.path.join(ref_dir, "final", f"state.rank{r}.json")))
        run_s = json.load(open(os.path.join(run_dir, "final", f"state.rank{r}.json")))
        for section in sorted(set(ref_s) | set(run_s)):
            if ref_s.get(section) != run_s.get(section):
                problems.append(f"rank {r} final {section} differs")
    return problems


def check_recovery(tmp_path, shm_cleanup, stage, pipeline=False, fault=None):
    ref_dir = reference(tmp_path, stage, pipeline)
    run_dir, killed = recovered_run(tmp_path, stage, pipeline, shm_cleanup, fault=fault)
    events = restores(run_dir)
    # first start: nothing to restore; after the kill both ranks restore the same step from memory,
    # forked again by their keepers in fast round 1 (warm spares, the default): torchrun restarted nothing
    assert [e["source"] for e in events if (e["restart_count"], e.get("fast_round", 0)) == (0, 0)] == ["none", "none"], events
    after = [e for e in events if (e["restart_count"], e.get("fast_round", 0)) != (0, 0)]
    assert len(after) == 2 and {e["source"] for e in after} == {"local_memory"}, events
    assert {(e["restart_count"], e["fast_round"]) for e in after} == {(0, 1)}, events
    assert len({e["step"] for e in after}) == 1, events
    # the killed rank 1 came back as a fresh fork; rank 0 rejoined in its own process (in-process restart)
    assert {e["rank"]: e["in_process_attempt"] for e in after} == {0: 1, 1: 0}, events
    step = after[0]["step"]
    if killed is not None:  # rank 1 had saved KILL_AT before logging it: nothing older than that is needed
        assert KILL_AT <= step <= killed["iteration"] + 1, (step, killed, events)
    problems = compare(ref_dir, run_dir)
    assert not problems, problems
    return step, after


@pytest.mark.slow
def test_zero2_sigkill_recovers_bit_exact(tmp_path, shm_cleanup):
    check_recovery(tmp_path, shm_cleanup, stage=2)


@pytest.mark.slow
def test_zero1_sigkill_recovers_bit_exact(tmp_path, shm_cleanup):
    check_recovery(tmp_path, shm_cleanup, stage=1)


@pytest.mark.slow
def test_zero3_sigkill_recovers_bit_exact(tmp_path, shm_cleanup):
    check_recovery(tmp_path, shm_cleanup, stage=3)


@pytest.mark.slow
def test_zero3_corrupt_snapshot_is_never_restored(tmp_path, shm_cleanup):
    """Rank 1 flips a byte of its committed snapshot of KILL_AT, then SIGKILLs itself: restore must
    reject that step (checksum) and resume both ranks from KILL_AT - 1, still bit exact."""
    step, after = check_recovery(tmp_path, shm_cleanup, stage=3, fault="corrupt-after-commit")
    assert step == KILL_AT - 1
    assert any("checksum mismatch" in r for e in after for r in e["rejected"]), after


@pytest.mark.slow
def test_pipeline_engine_sigkill_recovers_bit_exact(tmp_path, shm_cleanup):
    check_recovery(tmp_path, shm_cleanup, stage=1, pipeline=True)
