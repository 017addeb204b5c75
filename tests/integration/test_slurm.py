"""A real Slurm (munge, slurmctld, one slurmd per host) on the multi-host test bed runs the job as one
``sbatch`` job: ``srun`` starts ``megatron-ft launch`` on every host of the allocation, each takes its node
from the step, and the allocation's extra host is a standby. One host dies mid-run: Slurm marks it DOWN,
the standby takes the lost node's place under its own name, and the job ends bit-exact at peer_memory."""
from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from conftest import REPO, run_demo
from megatron_ft.testing import hosts, slurm

DOC = os.path.join(REPO, "docs", "deploy.md")
EXAMPLE = os.path.join(REPO, "examples", "slurm", "megatron-ft-demo.sbatch")


def doc_recipe() -> str:
    """The sbatch script of docs/deploy.md's Slurm section (its first bash block)."""
    section = open(DOC, encoding="utf-8").read().split("## Slurm", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def slurm_allowed():
    why = hosts.unavailable_reason() or slurm.unavailable_reason()
    if why:
        if os.environ.get("CI") == "true":  # CI must run it, not skip it
            pytest.fail(f"Slurm test skipped under CI=true: {why}")
        pytest.skip(why)


def test_slurm_conf_names_the_hosts_and_keeps_everything_in_its_directory():
    conf = slurm.slurm_conf("/w", "node3", ["node0", "node1", "node2"], 2)
    lines = dict(line.split("=", 1) for line in conf.splitlines() if "=" in line and not line.startswith(("Node", "Part")))
    assert lines["SlurmctldHost"] == "node3" and lines["AuthInfo"] == "socket=/w/munge.sock"
    assert lines["SlurmdTimeout"] == str(slurm.SLURMD_TIMEOUT_S) and lines["ProctrackType"] == "proctrack/linuxproc"
    assert all(v.startswith("/w/") for k, v in lines.items() if k.endswith(("File", "Location", "Dir")))
    assert "NodeName=node0,node1,node2 CPUs=2 State=UNKNOWN" in conf


#: the bound on the demo (reference run, Slurm job, the loss and the recovery): the demo fails past it
BOUND_S = 300


def test_a_lost_host_under_slurm_is_replaced_by_the_allocations_standby(slurm_allowed, tmp_path, reference_dir):
    work = tmp_path / "w"
    beds_before = set(hosts.bed_namespaces())
    # the suite's reference runs: the job's 24 iterations without megatron-ft give the same final state on
    # one machine's processes or on hosts of their own (one reference for every 2 x 2 run of that length)
    s = run_demo([sys.executable, "-m", "megatron_ft.cli", "demo", "--hosts", "--slurm", "--quiet",
                  f"--workdir={work}", "--iters=24", "--kill-at=4", "--fail=node", "--redundancy=replica",
                  "--standby", f"--timeout={BOUND_S}", f"--reference-dir={reference_dir}"], timeout=BOUND_S + 120)
    assert (s["lost_nodes"], s["recovered_from"]) == ([1], "peer_memory"), s
    assert 1 <= s["newest_complete_at_loss"] <= s["resumed_step"] <= s["last_iteration_before_kill"], s
    assert not s["problems"], s["problems"]
    # Slurm saw the host die: DOWN within SlurmdTimeout and its ping interval
    lost = s["slurm"]["lost_node"]
    assert lost and lost["name"] == "node1" and lost["state"].startswith("down") and lost["during_the_job"], s["slurm"]
    # every launcher took its node from the step; the third host waited as the standby and took node 1
    log = (work / "run.log").read_text()
    for i in (0, 1):
        assert f"slurm: this host is node {i} of 2 (SLURMD_NODENAME=node{i} in SLURM_STEP_NODELIST)" in log
    assert "slurm: this host is a standby (host 2 of the allocation, beyond its 2 nodes)" in log
    assert "claimed it, starting as node 1 on this host (node2, not node1)" in log
    # the launchers that ran to the end said so: the survivor and the standby, each exit 0
    exits = {p.name: p.read_text().strip() for p in (work / "run" / "slurm-exit").iterdir()}
    assert exits == {"node0": "0", "node2": "0"}, exits
    assert set(hosts.bed_namespaces()) <= beds_before  # the daemons and the hosts are gone


def test_the_docs_recipe_is_the_example():
    assert doc_recipe() == open(EXAMPLE, encoding="utf-8").read()


def test_the_docs_slurm_recipe_runs_as_written(slurm_allowed, tmp_path):
    """The doc's script, submitted with sbatch to a real Slurm of three hosts: two nodes train to the end
    (each took its node from the step), the third waits as the standby and stands down when the job ends."""
    script = tmp_path / "recipe.sbatch"
    script.write_text(doc_recipe())
    run_dir = tmp_path / "run"
    env = {"MFT": REPO, "RUN_DIR": str(run_dir), "ITERS": "6",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    with hosts.HostBed(4) as bed:
        cluster = slurm.SlurmOnBed(bed, str(tmp_path / "slurm"), [0, 1, 2]).start()
        try:
            out = cluster.run(["sbatch", "--parsable", str(script)], env=env, cwd=str(tmp_path))
            assert out.returncode == 0, out.stderr
            job = out.stdout.strip().split(";")[0]
            deadline = time.monotonic() + 400
            while (state := cluster.job_state(job)) in slurm.ACTIVE and time.monotonic() < deadline:
                time.sleep(1)
        finally:
            cluster.stop()
    log = next(tmp_path.glob("megatron-ft-demo-*.log")).read_text(errors="replace")
    assert state == "COMPLETED", f"{state}\n{log[-4000:]}"
    for i in (0, 1):
        assert f"slurm: this host is node {i} of 2 (SLURMD_NODENAME=node{i} in SLURM_STEP_NODELIST)" in log
    assert "slurm: this host is a standby (host 2 of the allocation, beyond its 2 nodes)" in log
    assert "with no failed node to take over; standing down" in log, log[-3000:]
    last = {}
    for path in (run_dir / "progress").glob("rank*.jsonl"):
        last[path.name] = json.loads(path.read_text().splitlines()[-1])["iteration"]
    assert last == {f"rank{r}.jsonl": 6 for r in range(4)}, last
    assert (run_dir / "job.secret").stat().st_mode & 0o077 == 0  # the recipe's secret: the user's alone
