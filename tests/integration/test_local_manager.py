"""The Megatron-LM local-tier contract (save / find_latest / load) of InMemoryLocalCheckpointManager.

End to end: a real agent subprocess, two real megatron-core ranks under torchrun (data parallel 2,
distributed optimizer, so ``fully_parallel`` deduplication and the re-distribution on load both
run), and a second torchrun job whose fresh model and RNGs are scrambled, which restores and trains on.
Every model, optimizer, scheduler and RNG digest must match the first run bit for bit.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import uuid

import pytest
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.megatron import local_manager
from megatron_ft.testing import faults
from megatron_ft.trainer.recovery import Container
from megatron_ft.rank_files import find_rank_file

from conftest import REPO, AgentProc

ITERS = 4


@pytest.fixture
def two_rank_job(tmp_path, shm_cleanup):
    run_id = f"lm{uuid.uuid4().hex[:10]}"
    cfg = ftconfig.replace(ftconfig.load(), run_id=run_id, cluster={"nodes": 1, "ranks_per_node": 2},
                           parallel={"tensor": 1, "pipeline": 1},
                           persist={"dir": str(tmp_path / "persist"), "interval": 0})
    path = str(tmp_path / "job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    shm_cleanup(cfg)
    agent = AgentProc(cfg, path).start()
    yield cfg, path, agent
    agent.kill()
    agent.forget_socket()  # a killed agent leaves its socket file behind


def run_phase(tmp_path, cfg_path, agent, phase, fault=None, expect_ok=True):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, MFT_CONFIG=cfg_path, MFT_AGENT_SOCKET=agent.sock, MFT_RUN_DIR=str(tmp_path / "run"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    job = [os.path.join(REPO, "tests", "integration", "local_manager_job.py"), "--phase", phase, "--out", str(out),
           "--iters", str(ITERS)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(29500 + os.getpid() % 1000 + (7 if phase == "load" else 0)), *(faults.wrap(job, fault) if fault else job)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    (out / f"{phase}.log").write_text(p.stdout + p.stderr)  # what a failed check below names
    if expect_ok and p.returncode != 0:
        pytest.fail(f"{phase} phase failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}\n{agent.log()}")
    if not expect_ok:
        assert p.returncode != 0, "the fault injection did not kill the job"
    return out


def digests(out, tag):
    recs = {}
    for path in sorted(glob.glob(str(out / f"{tag}.rank*.json"))):
        rec = json.load(open(path))
        recs[rec["rank"]] = rec
    assert sorted(recs) == [0, 1], f"missing digests for {tag}: {sorted(recs)}"
    return recs


def check_resume(out, found, agent=None):
    got = json.load(open(out / "found.json"))["found"]
    if got != found:  # say why: the load phase's restore lines and the agent's log
        log = (out / "load.log").read_text() if (out / "load.log").exists() else ""
        lines = [ln for ln in log.splitlines() if "restore" in ln.lower() or "megatron-ft" in ln.lower()][-30:]
        pytest.fail(f"the load phase found {got}, not {found}:\n" + "\n".join(lines)
                    + (f"\n--- agent log ---\n{agent.log()[-6000:]}" if agent is not None else ""))
    for it in (found, found + 1):  # the restored state, then one more iteration trained from it
        assert digests(out, f"load.it{it}") == digests(out, f"save.it{it}"), f"iteration {it} differs"


def test_save_load_round_trip_bit_exact(tmp_path, two_rank_job):
    cfg, path, agent = two_rank_job
    out = run_phase(tmp_path, path, agent, "save")
    # the load phase scrambles its fresh model and RNGs before restoring (tests/integration/local_manager_job.py)
    assert digests(out, "save.it1") != digests(out, f"save.it{ITERS}")
    # the distributed optimizer's bucket padding (uninitialised bytes) is kept, named as padding in each
    # snapshot's record: a restore does not judge those tensors by their values
    for rank in (0, 1):
        newest = max(agent.client(rank).request("list", rank=rank)["versions"], key=lambda v: v["step"])
        cont = Container(newest["path"])
        assert cont.version["extra"].get("padding"), (rank, sorted(cont.version["extra"]))
        cont.close()
    run_phase(tmp_path, path, agent, "load")
    check_resume(out, ITERS, agent)


@pytest.mark.slow  # default-suite time (CI < 15 min); run with -m slow
def test_torn_snapshot_is_not_offered(tmp_path, two_rank_job):
    cfg, path, agent = two_rank_job
    out = run_phase(tmp_path, path, agent, "save", fault=f"mid-copy:{ITERS}:1", expect_ok=False)
    run_phase(tmp_path, path, agent, "load")
    check_resume(out, ITERS - 1, agent)


@pytest.mark.slow  # default-suite time (CI < 15 min); run with -m slow
def test_corrupt_snapshot_is_not_restored(tmp_path, two_rank_job):
    cfg, path, agent = two_rank_job
    out = run_phase(tmp_path, path, agent, "save", fault=f"corrupt-after-commit:{ITERS}:1",
                    expect_ok=False)
    run_phase(tmp_path, path, agent, "load")
    check_resume(out, ITERS - 1, agent)
    events = [json.loads(ln) for ln in open(find_rank_file(str(tmp_path / "run" / "events"), 1, ".jsonl")) if '"restore"' in ln]
    assert any("checksum mismatch" in r for e in events for r in e["rejected"]), events


@pytest.mark.slow  # default-suite time (CI < 15 min); run with -m slow
def test_nothing_to_find_returns_minus_one(tmp_path, two_rank_job):
    cfg, path, agent = two_rank_job
    out = run_phase(tmp_path, path, agent, "load")
    assert json.load(open(out / "found.json"))["found"] == -1


# ---------------------------------------------------------------- units (no processes)


def _args(**kw):
    base = dict(inmem_ckpt=False, non_persistent_ckpt_type=None, ckpt_format="torch_dist", save="/s", load="/s",
                non_persistent_save_interval=None, inmem_ckpt_config=None, inmem_ckpt_interval=None,
                inmem_ckpt_persist_interval=None, inmem_ckpt_persist_dir=None, inmem_ckpt_profile_iterations=0,
                inmem_ckpt_profile_dir=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_validate_args_selects_and_checks():
    a = _args(inmem_ckpt=True, inmem_ckpt_interval=5)
    local_manager.validate_args(a)
    assert (a.non_persistent_ckpt_type, a.non_persistent_save_interval) == ("in_memory", 5)
    a = _args(non_persistent_ckpt_type="in_memory", inmem_ckpt_interval="auto")
    local_manager.validate_args(a)
    assert (a.inmem_ckpt, a.non_persistent_save_interval) == (True, 1)
    untouched = _args(non_persistent_ckpt_type="local")
    local_manager.validate_args(untouched)
    assert untouched.non_persistent_save_interval is None
    for bad, msg in ((_args(inmem_ckpt=True, non_persistent_ckpt_type="global"), "non-persistent-ckpt-type global"),
                     (_args(inmem_ckpt=True, ckpt_format="torch"), "--ckpt-format torch:"),
                     (_args(inmem_ckpt=True, load=None), "--load is not set"),
                     (_args(inmem_ckpt=True, inmem_ckpt_interval=3, non_persistent_save_interval=4), "disagree")):
        with pytest.raises(ftconfig.ConfigError, match=msg):
            local_manager.validate_args(bad)



def _scheduled_config(tmp_path):
    import yaml

    cfg = ftconfig.replace(ftconfig.load(), redundancy={"scheme": "replica", "transport": "scheduled"})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return str(path)


def test_scheduled_transport_and_profiler_need_the_training_loop_hooks(tmp_path, monkeypatch):
    """redundancy.transport: scheduled and the profiler act through the patched train()'s loop hooks
    (patch 0005). Accepted at argument validation; a tree patched without that patch is refused at the
    first save, naming the patch, instead of training unprotected."""
    for var in ("MFT_RUN_DIR", "MFT_NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    local_manager.validate_args(_args(inmem_ckpt=True, inmem_ckpt_config=_scheduled_config(tmp_path)))
    with pytest.raises(ftconfig.ConfigError, match="--inmem-ckpt-profile-iterations needs --inmem-ckpt-profile-dir"):
        local_manager.validate_args(_args(inmem_ckpt=True, inmem_ckpt_profile_iterations=3))
    local_manager.validate_args(_args(inmem_ckpt=True, inmem_ckpt_profile_iterations=3,
                                      inmem_ckpt_profile_dir=str(tmp_path)))

    m = object.__new__(local_manager.InMemoryLocalCheckpointManager)  # the check alone: no agent needed
    m.cfg, m._profiler, m._loop = ftconfig.load(_scheduled_config(tmp_path)), None, None
    with pytest.raises(ftconfig.ConfigError, match="redundancy.transport: scheduled need.*0005-training-call"):
        m._check_loop_hooks()
    m.cfg = ftconfig.replace(m.cfg, redundancy={"transport": "agent"})
    m._check_loop_hooks()  # nothing needs the hooks
    m._profiler = object()
    with pytest.raises(ftconfig.ConfigError, match="^--inmem-ckpt-profile-iterations need"):
        m._check_loop_hooks()
    m._loop = object()
    m._check_loop_hooks()


def test_a_configuration_error_under_the_launcher_ends_the_job_once(tmp_path):
    """Under megatron-ft launch (MFT_RUN_DIR, MFT_NODE_RANK) a bad value ends the job (exit 2, the
    message recorded for every launcher) instead of torchrun retrying it max_restarts times."""
    import json
    import subprocess
    import sys

    code = ("import argparse\nfrom megatron_ft.megatron import local_manager\n"
            "local_manager.validate_args(argparse.Namespace(inmem_ckpt=True, non_persistent_ckpt_type=None, "
            "ckpt_format='torch', save='/s', load='/s'))\n")
    env = dict(os.environ, MFT_RUN_DIR=str(tmp_path), MFT_NODE_RANK="1", RANK="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    rec = json.loads((tmp_path / "node1" / "fatal.json").read_text())
    assert rec["node"] == 1 and rec["message"].startswith("rank 3: --ckpt-format torch:")
