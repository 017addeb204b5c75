"""The snapshot agent with real processes, sockets and shared memory (single node, no torch.distributed)."""
import os
import time

import pytest
import torch

from megatron_ft.agent import shm
from megatron_ft.capture import snapfile
from megatron_ft.agent import persist
from megatron_ft.agent.protocol import AgentError
from megatron_ft.trainer.recovery import Restorer
from megatron_ft.trainer.snapshot import SnapshotEngine
from megatron_ft.capture.state import TorchStateAdapter
from megatron_ft.clock import wait_until


def make_model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def train_and_snapshot(client, cfg, steps, chunk=1 << 14, start=1, model=None):
    m, opt = model or make_model()
    ad = TorchStateAdapter(m, opt)
    eng = SnapshotEngine(client, 0, identity(cfg), chunk)
    for step in range(start, start + steps):
        eng.wait()
        loss = m(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ad.extra = {"iteration": step}
        eng.snapshot(step, *ad.capture())
    eng.wait()
    return m, opt, eng


def identity(cfg):
    return {"run_id": cfg.run_id, "rank": 0, "world_size": 1}


def a_status(client):
    return client.request("status")["status"]


def restorer(cfg, client):
    return Restorer(0, 1, identity(cfg), cfg.run_id, cfg.persist.dir, client)


def state_equal(m1, o1, m2, o2):
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k in o1.state[p1]:
            assert torch.equal(o1.state[p1][k], o2.state[p2][k]), k


def test_double_buffer_never_hands_out_the_clean_slot(agent):
    c = agent.client()
    m, opt, eng = train_and_snapshot(c, agent.cfg, 1)
    table = c.request("status")["status"]["ranks"]["0"]["slots"]
    clean = [s["slot"] for s in table if s["state"] == "clean"]
    assert len(clean) == 1
    for step in (2, 3, 4):
        slot = c.request("begin", rank=0, step=step)["slot"]
        assert slot not in clean  # the newest agreed clean version is protected
        c.request("abort", rank=0, slot=slot)
    # commit of a step that was never begun is refused
    with pytest.raises(AgentError, match="commit of step 9"):
        c.request("commit", rank=0, slot=1 - clean[0], step=9)


def test_a_malformed_request_is_refused_naming_the_field_and_the_agent_serves_on(agent):
    """Requests are typed (megatron_ft.agent.protocol.MESSAGES): a wrong type, a missing or an
    unknown field, an unknown operation are refused before the agent acts, with the field and the
    value; the connection and the agent go on serving."""
    c = agent.client()
    with pytest.raises(AgentError, match=r"agent op 'begin': step='3' is invalid: Input should be a valid integer"):
        c.request("begin", rank=0, step="3")
    with pytest.raises(AgentError, match=r"agent op 'commit': field 'slot' is missing"):
        c.request("commit", rank=0, step=1)
    with pytest.raises(AgentError, match=r"agent op 'list': field 'stpe' is not one of"):
        c.request("list", rank=0, stpe=1)
    with pytest.raises(AgentError, match=r"agent op 'rewind': rank=-2 is invalid"):
        c.request("rewind", rank=-2, step=1)
    with pytest.raises(AgentError, match=r"agent op 'drop_all' is unknown; allowed: \['abort', 'adopt'"):
        c.request("drop_all")
    assert c.request("status")["status"]["node"] == 0
    # a fresh start's rewind of a rank that never registered (nothing held yet) is no error
    assert c.request("rewind", rank=5, step=-1)["dropped"] == 0


def test_restore_is_bit_exact_and_newest(agent):
    c = agent.client()
    m, opt, eng = train_and_snapshot(c, agent.cfg, 5)
    rng = torch.get_rng_state()
    m2, opt2 = make_model(seed=1)
    ad2 = TorchStateAdapter(m2, opt2)
    res = restorer(agent.cfg, c).restore(ad2)
    assert (res.source, res.step) == ("local_memory", 5)
    assert ad2.restored_extra == {"iteration": 5}
    state_equal(m, opt, m2, opt2)
    assert torch.equal(torch.get_rng_state(), rng)


def test_corrupt_chunk_falls_back_to_older_clean_version(agent):
    c = agent.client()
    m, opt, eng = train_and_snapshot(c, agent.cfg, 3)
    versions = c.request("list", rank=0)["versions"]
    assert [v["step"] for v in versions] == [3, 2]
    seg = shm.open_segment(versions[0]["path"])
    hdr = snapfile.read_header(seg.mm)
    seg.mm[hdr.geometry.data_off + 100] ^= 0xFF  # flip bits in chunk 0 of step 3
    seg.close()
    m2, opt2 = make_model(seed=1)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("local_memory", 2)
    assert any("chunk 0 checksum mismatch" in r for r in res.rejected)


def test_torn_snapshot_is_never_restored_after_agent_crash(agent):
    c = agent.client()
    train_and_snapshot(c, agent.cfg, 2)
    # a writer begins step 3 and dies half way: the slot is WRITING, data half written
    slot = c.request("begin", rank=0, step=3)["slot"]
    seg = shm.open_segment(os.path.join(agent.cfg.agent.shm_dir, shm.segment_name(agent.cfg.run_id, 0, 0, slot)))
    hdr = snapfile.read_header(seg.mm)
    seg.mm[hdr.geometry.data_off: hdr.geometry.data_off + 64] = b"\x01" * 64
    seg.close()
    agent.kill()  # the agent dies too; its shared memory stays
    agent.start()  # a new agent re-adopts the slots
    c = agent.client()
    status = c.request("status")["status"]["ranks"]["0"]["slots"]
    assert sorted((s["state"], s["step"]) for s in status) == [("clean", 2), ("empty", -1)]
    m2, opt2 = make_model(seed=1)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("local_memory", 2)


def test_agent_restart_keeps_snapshots_and_trainer_reconnects(agent):
    c = agent.client()
    m, opt, eng = train_and_snapshot(c, agent.cfg, 2)
    agent.kill()
    agent.start()
    # the same client reconnects transparently and snapshotting continues
    m, opt, eng = train_and_snapshot(c, agent.cfg, 2, start=3, model=(m, opt))
    assert [h.ok for h in eng.history] == [True, True]
    m2, opt2 = make_model(seed=1)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("local_memory", 4)
    state_equal(m, opt, m2, opt2)


def test_snapshot_failure_never_raises_into_training(agent):
    c = agent.client()
    m, opt, eng = train_and_snapshot(c, agent.cfg, 1)
    agent.kill()  # no agent: begin fails; training must go on
    ad = TorchStateAdapter(m, opt)
    eng.snapshot(2, *ad.capture())
    st = eng.wait()
    assert not st.ok and "not started" in st.error


def test_save_at_breakpoint_and_disk_fallback(agent):
    c = agent.client()
    m, opt, eng = train_and_snapshot(c, agent.cfg, 3)
    eng.close()
    c.close(orderly=False)  # the trainer "dies": connection drops without bye
    base = agent.cfg.persist.dir
    deadline = time.time() + 30
    while persist.complete_steps(base, agent.cfg.run_id, 1) != [3]:
        if time.time() > deadline:  # a wait limit, not a performance check
            pytest.fail(f"step 3 was never persisted at breakpoint:\n{agent.log()}")
        time.sleep(0.05)
    agent.stop()  # clean shutdown removes the segments
    assert shm.list_segments(agent.cfg.agent.shm_dir, agent.cfg.run_id, 0) == []
    agent.start()  # cold start: memory is empty -> disk
    c = agent.client()
    m2, opt2 = make_model(seed=1)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("disk", 3)
    state_equal(m, opt, m2, opt2)


def test_periodic_persist_and_retention(job_config, tmp_path):
    from megatron_ft import config as ftconfig
    from conftest import AgentProc
    import yaml

    cfg, _ = job_config
    cfg = ftconfig.replace(cfg, persist={"interval": 2, "keep": 2})
    path = str(tmp_path / "job2.yaml")
    yaml.safe_dump(cfg.to_dict(), open(path, "w"))
    a = AgentProc(cfg, path).start()
    try:
        c = a.client()
        model = make_model()
        for step in range(1, 8):  # one step at a time, each due persist finished before the next snapshot
            model = train_and_snapshot(c, cfg, 1, start=step, model=model)[:2]
            if step % 2 == 0:
                # the job's verdict moves before the agent's own agreement hook queues the persist it makes
                # due: wait (bounded) for this step's persist itself, or the next step's snapshot could
                # overtake it and the catch-up rule would persist that one instead
                wait_until(lambda: step in a_status(c)["persisted"] or None, 30, f"step {step} persisted")
            c.request("wait_persisted", wait_s=30)
        assert sorted(a_status(c)["persisted"]) == [2, 4, 6]
        assert persist.complete_steps(cfg.persist.dir, cfg.run_id, 1) == [6, 4]
    finally:
        a.kill()
        a.forget_socket()


def test_cold_start_with_nothing_starts_fresh(agent):
    c = agent.client()
    m2, opt2 = make_model(seed=1)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert res.source == "none" and res.step == -1


def test_shared_memory_too_small_is_a_clear_error(tmp_path):
    with pytest.raises(shm.SharedMemoryError, match="shared memory too small"):
        shm.create("/dev/shm/mft.test-too-big.n0.r0.s0", 1 << 50)
    assert not os.path.exists("/dev/shm/mft.test-too-big.n0.r0.s0")


def test_identity_mismatch_is_rejected(agent):
    c = agent.client()
    train_and_snapshot(c, agent.cfg, 2)
    other = Restorer(0, 1, {**identity(agent.cfg), "world_size": 8}, agent.cfg.run_id, agent.cfg.persist.dir, c)
    m2, opt2 = make_model(seed=1)
    res = other.restore(TorchStateAdapter(m2, opt2))
    assert res.source == "none"
    assert any("world_size=1 does not match this job's 8" in r for r in res.rejected)



def test_shared_memory_limit_refuses_registration_and_training_goes_on(job_config, tmp_path):
    """Slots that do not fit the agent's shared-memory budget are refused with a clear error;
    the trainer skips snapshots (retrying rarely) and keeps training."""
    import yaml

    from conftest import AgentProc
    from megatron_ft import config as ftconfig

    cfg, _ = job_config
    cfg = ftconfig.replace(cfg, agent={"shm_limit_mib": 1})
    path = str(tmp_path / "job-small.yaml")
    yaml.safe_dump(cfg.to_dict(), open(path, "w"))
    a = AgentProc(cfg, path).start()
    try:
        c = a.client()
        m = torch.nn.Linear(512, 1024)  # 2 MiB of parameters: two slots do not fit in 1 MiB
        ad = TorchStateAdapter(m)
        eng = SnapshotEngine(c, 0, identity(cfg), 1 << 20)
        for step in (1, 2):
            eng.snapshot(step, *ad.capture())
            st = eng.wait()
            assert not st.ok
        assert "shared memory too small" in eng.history[0].error
        assert "agent.shm_limit_mib=1" in eng.history[0].error
        assert "retrying at step" in eng.history[1].error  # no second attempt right away
    finally:
        a.kill()
        a.forget_socket()


def test_corrupt_only_version_is_invalidated_and_restore_fails_loudly(agent):
    """Loading began from a snapshot that then failed its checksum and nothing else is left: the
    trainer must not train on half-restored state (RestoreFailed), and the corrupt copy is gone."""
    from megatron_ft.trainer.recovery import RestoreFailed

    c = agent.client()
    train_and_snapshot(c, agent.cfg, 1)
    [v] = c.request("list", rank=0)["versions"]
    seg = shm.open_segment(v["path"])
    hdr = snapfile.read_header(seg.mm)
    seg.mm[hdr.geometry.data_off + hdr.geometry.data_len - 8] ^= 0x01  # last chunk
    seg.close()
    m2, opt2 = make_model(seed=1)
    with pytest.raises(RestoreFailed, match="chunk .* checksum mismatch"):
        restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert c.request("list", rank=0)["versions"] == []  # invalidated at the agent
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))  # the restarted process
    assert res.source == "none"


def test_resume_from_an_older_step_keeps_snapshots_going(agent):
    """After the job resumes from an older step, the stale newer agreed step must not keep every
    later snapshot out of the slots (the restore tells the agent it rewound)."""
    c = agent.client()
    m, opt, eng = train_and_snapshot(c, agent.cfg, 3)  # steps 1..3, 3 agreed
    c.request("global", rank=0, step=3)
    c.request("invalidate", rank=0, step=3)  # e.g. found corrupt: the job resumes from step 2
    m2, opt2 = make_model(seed=5)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("local_memory", 2)
    ranks = a_status(c)["ranks"]["0"]
    assert ranks["global_step"] == 2
    _, _, eng2 = train_and_snapshot(c, agent.cfg, 3, start=3, model=(m2, opt2))
    assert [h.step for h in eng2.history if h.ok] == [3, 4, 5], [h.error for h in eng2.history]
    assert sorted(v["step"] for v in c.request("list", rank=0)["versions"]) == [4, 5]


def test_truncated_slot_is_never_read_past_its_end(agent):
    """A committed slot cut short behind the agent's back: the breakpoint save refuses it (no SIGBUS
    in the agent), the restore falls back to the older clean version, and the slot is repaired."""
    c = agent.client()
    train_and_snapshot(c, agent.cfg, 2)
    newest = max(c.request("list", rank=0)["versions"], key=lambda v: v["step"])
    os.truncate(newest["path"], 4096)
    c.request("persist", step=newest["step"])
    c.request("wait_persisted", wait_s=30)
    st = a_status(c)
    assert newest["step"] not in st["persisted"] and st["persist_errors"], st
    assert [v["step"] for v in c.request("list", rank=0)["versions"]] == [1]
    assert os.path.getsize(newest["path"]) > 4096  # its size is back: the slot is usable again
    m2, opt2 = make_model(seed=7)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("local_memory", 1)
    assert agent.proc.poll() is None  # the agent survived


def test_persist_verifies_every_chunk_before_writing(agent):
    c = agent.client()
    train_and_snapshot(c, agent.cfg, 2)
    v2 = next(v for v in c.request("list", rank=0)["versions"] if v["step"] == 2)
    with open(v2["path"], "r+b") as f:  # flip a byte in the middle of the data area
        g = snapfile.read_header(f.read(snapfile.HEADER_SIZE)).geometry
        f.seek(g.data_off + g.data_len // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))
    c.request("persist", step=2)
    c.request("persist", step=1)
    c.request("wait_persisted", wait_s=30)
    st = a_status(c)
    assert st["persisted"] == [1] and "checksum mismatch" in st["persist_errors"][-1], st
    assert not os.path.exists(persist.rank_file(agent.cfg.persist.dir, agent.cfg.run_id, 2, 0))


@pytest.mark.parametrize("cut", ["empty", "inside-header", "past-header", "inside-data", "missing"])
def test_a_slot_damaged_while_no_agent_ran_loses_only_its_own_version(agent, cut):
    """The agent dies, the newest committed slot is cut (to zero bytes, inside its 4 KiB header, just
    past it, inside its data) or deleted, a new agent starts: that slot comes back at full size and
    empty, the older clean slot is adopted and restored, and the next snapshots use both slots again.
    (A cut to zero bytes ended the restarted agent - and the job - before.)"""
    c = agent.client()
    m, opt, _ = train_and_snapshot(c, agent.cfg, 2)
    newest = max(c.request("list", rank=0)["versions"], key=lambda v: v["step"])
    size = os.path.getsize(newest["path"])
    agent.kill()
    if cut == "missing":
        os.unlink(newest["path"])
    else:
        os.truncate(newest["path"], {"empty": 0, "inside-header": 100, "past-header": snapfile.HEADER_SIZE + 8,
                                     "inside-data": size // 3}[cut])
    agent.start()
    assert os.path.getsize(newest["path"]) == size
    assert [v["step"] for v in c.request("list", rank=0)["versions"]] == [1]
    m2, opt2 = make_model(seed=3)
    res = restorer(agent.cfg, c).restore(TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("local_memory", 1)
    # the double buffer is whole again: two more snapshots, both slots clean
    _, _, eng = train_and_snapshot(c, agent.cfg, 2, start=2, model=(m2, opt2))
    assert [h.step for h in eng.history if h.ok] == [2, 3], [h.error for h in eng.history]
    slots = a_status(c)["ranks"]["0"]["slots"]
    assert sorted((s["state"], s["step"]) for s in slots) == [("clean", 2), ("clean", 3)], slots
    assert agent.proc.poll() is None


def test_a_standbys_pre_started_agent_waits_for_its_node_then_serves_it(job_config, tmp_path):
    """A standby starts its node's agent before it knows the node (imports done while it waits);
    the arguments its launcher hands over after the claim make it that node's agent, logging where
    it is told."""
    import subprocess

    from megatron_ft.launch import AGENT_MODULE, AGENT_PRELOAD
    from megatron_ft.spares.prestart import hand_over
    from megatron_ft.spares.prestart import start as prestart
    from megatron_ft.testing.sim import AgentProc

    cfg, path = job_config
    proc = AgentProc(cfg, path)
    waiting = prestart(AGENT_MODULE, AGENT_PRELOAD, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                       start_new_session=True)
    try:
        time.sleep(0.5)
        assert not os.path.exists(proc.sock) and waiting.poll() is None  # no node yet: nothing served
        log = tmp_path / "node0-agent.log"
        assert hand_over(waiting, ["--config", path, "--node", "0"], log=str(log))
        assert not hand_over(waiting, ["--node", "1"])  # once
        proc.proc = waiting
        proc.wait_ready(60)
        c = proc.client()
        assert a_status(c)["node"] == 0
        c.close()
        text = log.read_text()
        assert "megatron_ft.agent: pre-started" in text and "agent node 0" in text, text
    finally:
        waiting.terminate()
        waiting.wait(timeout=60)


def test_a_cpu_job_stages_nothing_for_a_gpu(agent):
    """The GPU path (device_staging) is set up only for state on a CUDA device."""
    m, opt, eng = train_and_snapshot(agent.client(), agent.cfg, 2)
    assert eng.history[-1].ok
    assert eng._staging is None
    eng.close()


def test_megatron_ft_status_prints_every_agents_table_and_names_a_missing_one(agent, tmp_path):
    """``megatron-ft status`` (:func:`~megatron_ft.agent.protocol.agent_status` per node, the call the
    demo also makes): the running agent's table as JSON; a node with no agent named with its socket and
    exit status 1."""
    import json
    import subprocess
    import sys

    import yaml

    from megatron_ft import config as ftconfig
    from megatron_ft.agent.protocol import agent_status

    assert agent_status(agent.cfg, 0)["node"] == 0
    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "status", "--config", agent.cfg_path],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["run_id"] == agent.cfg.run_id, out
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump(ftconfig.replace(agent.cfg, cluster={"nodes": 2}).to_dict()))
    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "status", "--config", str(two)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "node 1: no agent at " in out.stdout, out
