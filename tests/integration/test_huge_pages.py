"""Shared memory on a huge-page tmpfs (``megatron-ft shm-mount``): how a directory's pages are
detected, the mount helper's input checks, and a real agent on a real huge-page mount whose
snapshots restore through the mapping read path, bit for bit, with corrupt chunks still rejected."""
import os
import subprocess
import sys
import uuid

import pytest
import torch
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.trainer import recovery
from megatron_ft.agent import shm
from megatron_ft.capture import snapfile
from megatron_ft.testing.sim import AgentProc
from megatron_ft.capture.state import TorchStateAdapter

from test_agent import make_model, restorer, state_equal, train_and_snapshot

MOUNTS = """\
sysfs /sys sysfs rw 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
megatron-ft-shm /run/mft tmpfs rw,relatime,size=4194304k,huge=always 0 0
megatron-ft-shm /run/mft/inner tmpfs rw,huge=advise 0 0
tmpfs /run/ws tmpfs rw,huge=within_size 0 0
/dev/sda1 / ext4 rw 0 0
"""
THP = "always within_size advise [never] deny force\n"


@pytest.mark.parametrize("directory,thp,want", [
    ("/dev/shm", THP, shm.SMALL),
    ("/run/mft", THP, shm.HUGE),
    ("/run/mft/sub/dir", THP, shm.HUGE),  # below the mount point
    ("/run/mft/inner", THP, shm.ADVISE),  # the longest mount point wins
    ("/run/ws", THP, shm.HUGE),
    ("/run/mftx", THP, shm.SMALL),  # not below /run/mft: the root file system
    ("/home", THP, shm.SMALL),  # not a tmpfs
    ("/dev/shm", "always within_size advise never deny [force]", shm.HUGE),
    ("/run/mft", "always within_size advise never [deny] force", shm.SMALL),
])
def test_page_backing_reads_mount_options_and_the_global_override(directory, thp, want):
    assert shm.page_backing(directory, MOUNTS, thp) == want


@pytest.mark.parametrize("directory,size,huge,match", [
    ("/run/x", "20q", "always", "size '20q'"),
    ("/run/x", "", "always", "size ''"),
    ("/run/x", "0", "always", "size '0'"),
    ("/run/x", "8g", "sometimes", "huge 'sometimes' is not one of"),
    ("run/x", "8g", "always", "must be an absolute path"),
])
def test_mount_command_rejects_bad_values(directory, size, huge, match):
    with pytest.raises(ValueError, match=match):
        shm.mount_command(directory, size, huge)


def test_mount_command():
    assert shm.mount_command("/run/x", "80%") == [
        "mount", "-t", "tmpfs", "-o", "size=80%,huge=always,mode=1777", "megatron-ft-shm", "/run/x"]


@pytest.fixture
def huge_dir(tmp_path):
    """A real 128 MiB huge-page tmpfs (skipped where this process may not mount)."""
    d = str(tmp_path / "huge-shm")
    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "shm-mount", d, "--size", "128m"],
                         capture_output=True, text=True)
    if out.returncode == 2 and "failed" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)


def test_a_directorys_backing_is_looked_up_once_per_mount(tmp_path, monkeypatch):
    """A restore asks for the backing of every container's directory: read from the system once, and
    again when a tmpfs is mounted there (another device)."""
    d = str(tmp_path / "later-huge")
    os.makedirs(d)
    reads = []
    real = shm.page_backing
    monkeypatch.setattr(shm, "page_backing", lambda directory, *given: reads.append(directory) or real(directory, *given))
    before = shm.backing_of(d)
    assert shm.backing_of(d) == before and reads == [d]  # the second answer from the process's table
    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "shm-mount", d, "--size", "16m"],
                         capture_output=True, text=True)
    if out.returncode == 2 and "failed" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert before != shm.HUGE and shm.backing_of(d) == shm.HUGE and reads == [d, d]
    finally:
        subprocess.run(["umount", "-l", d], check=False)


def test_snapshots_on_a_huge_page_mount_restore_through_the_mapping(huge_dir, tmp_path):
    assert shm.page_backing(huge_dir) == shm.HUGE
    again = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "shm-mount", huge_dir, "--size", "64m"],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "already a mount point" in again.stderr
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = ftconfig.replace(ftconfig.load(), run_id=run_id, cluster={"nodes": 1, "ranks_per_node": 1},
                           parallel={"tensor": 1, "pipeline": 1}, agent={"shm_dir": huge_dir},
                           persist={"dir": str(tmp_path / "persist"), "interval": 0})
    path = str(tmp_path / "job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    agent = AgentProc(cfg, path).start()
    try:
        c = agent.client()
        m, opt, _ = train_and_snapshot(c, cfg, 3)
        versions = c.request("list", rank=0)["versions"]
        assert [v["step"] for v in versions] == [3, 2]
        assert all(os.path.dirname(v["path"]) == huge_dir for v in versions)
        cont = recovery.Container(versions[0]["path"])
        assert cont.mapped  # the read path of a huge-page slot
        cont.close()
        # newest: bit for bit through the mapping
        m2, opt2 = make_model(seed=1)
        res = restorer(cfg, c).restore(TorchStateAdapter(m2, opt2))
        assert (res.source, res.step) == ("local_memory", 3)
        state_equal(m, opt, m2, opt2)
        # a flipped byte in step 3 is caught on this path too: step 2 is restored instead
        seg = shm.open_segment(versions[0]["path"])
        hdr = snapfile.read_header(seg.mm)
        seg.mm[hdr.geometry.data_off + 100] ^= 0xFF
        seg.close()
        m3, opt3 = make_model(seed=2)
        res = restorer(cfg, c).restore(TorchStateAdapter(m3, opt3))
        assert (res.source, res.step) == ("local_memory", 2)
        assert any("chunk 0 checksum mismatch" in r for r in res.rejected), res.rejected
        assert "2 MiB pages" in agent.log()
    finally:
        agent.kill()
