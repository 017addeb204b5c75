"""The multi-host test bed (megatron_ft.testing.hosts) and what a cluster's network asks of a node:
hosts of their own (addresses, names, /dev/shm), nothing left behind - also when the harness is
SIGKILLed - and a node whose own name resolves to loopback refused at launch within seconds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.testing import hosts
from megatron_ft.testing.helpers import wait_for

from conftest import REPO


@pytest.fixture
def bed_allowed():
    why = hosts.unavailable_reason()
    if why:
        if os.environ.get("CI") == "true":  # CI must run the multi-host tests, not skip them
            pytest.fail(f"multi-host test skipped under CI=true: {why}")
        pytest.skip(why)


def leftovers(tag: str) -> dict:
    """What of bed ``tag`` is still on the machine."""
    mounts = [ln for ln in open("/proc/mounts") if f"{hosts.PREFIX}shm" in ln or f"{hosts.PREFIX}{tag}" in ln]
    return {"namespaces": hosts.bed_namespaces(tag), "mounts": mounts,
            "state": os.path.exists(os.path.join(hosts.STATE_DIR, f"{tag}.json")),
            "reaper": subprocess.run(["pgrep", "-f", f"testing.hosts reap {tag}"], capture_output=True,
                                     text=True).stdout.split()}


def test_hosts_have_their_own_names_addresses_and_memory_and_leave_nothing(bed_allowed):
    with hosts.HostBed(3, shm_mib=16, rate="200mbit", loopback_names={2}) as bed:
        tag = bed.plan.tag
        seen = [bed.run(i, ["sh", "-c", "hostname; getent hosts node0 node1 node2; ip -4 -br addr show eth0; "
                                        "df -k /dev/shm | tail -1"]).stdout.split("\n") for i in range(3)]
        assert [s[0] for s in seen] == ["node0", "node1", "node2"]
        assert "10.77.0.13" in seen[0][3] and "127.0.1.1" in seen[2][3]  # only node2 sees itself on loopback
        assert all(bed.plan.address(i) in s[4] for i, s in enumerate(seen))
        assert all(s[5].split()[1] == str(16 * 1024) for s in seen)  # a private 16 MiB /dev/shm each
        assert "tbf" in subprocess.run(["tc", "-n", bed.plan.host_ns(0), "qdisc", "show", "dev", "eth0"],
                                       capture_output=True, text=True).stdout
        # host 1 reaches host 0; nothing of the machine's own network is reachable
        srv = bed.popen(0, [sys.executable, "-c", "import socket; s = socket.create_server(('10.77.0.11', 7001)); "
                                                  "c, _ = s.accept(); c.sendall(b'hi')"])
        from megatron_ft import network

        outside = sorted(a for n, addrs in network.local_addresses().items() for a in addrs
                         if not a.startswith("127."))  # this machine's own addresses, outside the bed
        got = bed.run(1, [sys.executable, "-c", textwrap.dedent(f"""
            import socket, time
            for _ in range(100):
                try:
                    print(socket.create_connection(('node0', 7001), timeout=2).recv(2).decode()); break
                except ConnectionRefusedError:
                    time.sleep(0.05)
            reached = []
            for a in {outside!r}:
                try:
                    socket.create_connection((a, 22), timeout=1); reached.append(a)
                except ConnectionRefusedError:
                    reached.append(a)  # something answered: the machine's stack is reachable
                except OSError:
                    pass
            print('outside', 'reached' if reached else 'unreachable')""")])
        assert got.stdout.split() == ["hi", "outside", "unreachable"], got.stderr
        srv.wait(timeout=30)
        # a host lost: every process on it dies at once with its memory; its replacement is empty
        bed.run(1, ["sh", "-c", "echo x > /dev/shm/slot"])
        sleeper = bed.popen(1, ["sleep", "600"])
        wait_for("the sleeper to run on host 1", lambda: sleeper.pid in bed.processes(1), 10)
        killed = bed.lose(1)
        assert sleeper.wait(timeout=10) == -signal.SIGKILL and killed and not bed.processes(1)
        bed.replace(1)
        assert bed.run(1, ["ls", "/dev/shm"]).stdout == "" and bed.run(1, ["hostname"]).stdout.strip() == "node1"
    wait_for("the bed's reaper to go", lambda: not leftovers(tag)["reaper"], 10)
    assert leftovers(tag) == {"namespaces": [], "mounts": [], "state": False, "reaper": []}


def class_bytes(ns: str) -> dict[str, int]:
    """Bytes each HTB class of ``ns``'s eth0 has sent (``tc -s class show``)."""
    out = subprocess.run(["tc", "-s", "-n", ns, "class", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    found, current = {}, None
    for line in out.splitlines():
        f = line.split()
        if f[:2] == ["class", "htb"]:
            current = f[2]
        elif f[:1] == ["Sent"] and current:
            found[current] = int(f[1])
    return found


def test_a_link_with_classes_carries_the_lower_effort_dscp_in_its_lower_class(bed_allowed):
    """On a bed with traffic classes, what a connection marked with the lower-effort DSCP sends (as the
    agents' replication connections are, with ``network.replication_dscp: 8``) is queued in the link's
    lower class; what an unmarked one sends (the collectives) in the default class."""
    with hosts.HostBed(2, shm_mib=8, rate="200mbit", classes=True) as bed:
        srv = bed.popen(1, [sys.executable, "-c", textwrap.dedent("""
            import socket
            s = socket.create_server(('0.0.0.0', 7002))
            for _ in range(2):
                c, _ = s.accept()
                while c.recv(1 << 20):
                    pass""")])
        sent = bed.run(0, [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from megatron_ft.transport import wire
            for dscp, mib in (({hosts.LOWER_EFFORT_DSCP}, 3), (0, 1)):
                for _ in range(100):
                    try:
                        s = wire.open_socket(('node1', 7002), 10, dscp)
                        break
                    except ConnectionRefusedError:
                        time.sleep(0.05)
                s.sendall(bytes(mib << 20))
                s.close()
            print('sent')""")], env={**os.environ, "PYTHONPATH": REPO})
        assert sent.stdout.split() == ["sent"], sent.stderr
        srv.wait(timeout=30)
        got = class_bytes(bed.plan.host_ns(0))
        assert 3 << 20 <= got["1:20"] < (3 << 20) * 1.2, got  # the marked connection's bytes (and its headers)
        assert 1 << 20 <= got["1:10"] < 3 << 20, got  # the unmarked one's, with the handshakes and acks


def test_hosts_with_cores_of_their_own_run_every_process_on_theirs(bed_allowed):
    """``own_cores``: what runs on host i, and what it starts, is bound to core i (modulo the
    machine's cores), so that two hosts do not take each other's CPU (the link benchmark's hosts)."""
    cores = sorted(os.sched_getaffinity(0))
    probe = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), subprocess.run([sys.executable, " \
            "'-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True).stdout)"
    with hosts.HostBed(2, shm_mib=8, own_cores=True) as bed:
        for i in (0, 1):
            out = bed.run(i, [sys.executable, "-c", probe]).stdout.split()  # its own, and its child's
            want = str([cores[i % len(cores)]])
            assert out == [want, want], (i, out)
    with hosts.HostBed(1, shm_mib=8) as bed:  # the default: every core
        assert bed.run(0, [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]).stdout.strip() \
            == str(cores)


def test_a_harness_killed_in_the_middle_leaves_nothing_behind(bed_allowed, tmp_path):
    """The process that made a bed is SIGKILLed while its hosts run processes: its reaper tears
    everything down (processes, /dev/shm, namespaces)."""
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from megatron_ft.testing.hosts import HostBed
        bed = HostBed(2, shm_mib=8).up()
        for i in range(2):
            bed.popen(i, ["sleep", "600"])
            bed.run(i, ["sh", "-c", "echo x > /dev/shm/slot"])
        print(bed.plan.tag, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        tag = proc.stdout.readline().strip()
        assert tag and len(hosts.bed_namespaces(tag)) == 3
        pids = [p for ns in hosts.bed_namespaces(tag) for p in hosts.processes_in(ns)]
        assert len(pids) >= 4  # two holders, two sleepers
    finally:  # a failed check above still leaves the tear-down to the reaper, not to the next test
        proc.kill()
        proc.wait(timeout=10)
    wait_for("the reaper to tear the bed down", lambda: leftovers(tag) == {"namespaces": [], "mounts": [],
                                                                          "state": False, "reaper": []}, 30)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]


def _cluster_file(path, nodes: int, interface: str = "eth0") -> str:
    from megatron_ft.transport.credential import job_secret_file

    secret = job_secret_file("", {}, os.path.dirname(path), multi_host=False)  # a file every bed host reads
    cfg = ftconfig.replace(ftconfig.load(), run_id=f"hosts-{os.getpid()}", cluster={"nodes": nodes, "ranks_per_node": 1},
                           parallel={"tensor": 1, "pipeline": 1}, launch={"master_addr": "node0"},
                           health={"host_pattern": "node{node}"}, network={"interface": interface},
                           security={"secret_file": secret})
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    return str(path)


def test_a_node_whose_name_resolves_to_loopback_is_refused_at_launch(bed_allowed, tmp_path):
    """Debian's '127.0.1.1 <hostname>' on one host: its launcher ends the job within seconds (exit 2)
    naming the name, the address and the fix, before any agent or trainer starts; a host whose name
    resolves to its address passes the same check, and the interface setting gives its servers that
    address and its trainers the collectives' interface."""
    cfg_path = _cluster_file(tmp_path / "job.yaml", 2)
    run_dir = tmp_path / "run"
    with hosts.HostBed(2, shm_mib=16, loopback_names={1}) as bed:
        t0 = time.monotonic()
        out = bed.run(1, [sys.executable, "-m", "megatron_ft.cli", "launch", f"--config={cfg_path}", "--node-rank=1",
                          f"--run-dir={run_dir}", "--", os.path.join(REPO, "scripts", "pretrain_gpt.py")],
                      timeout=120, cwd=REPO)
        took = time.monotonic() - t0
        text = out.stdout + out.stderr
        assert out.returncode == 2, text[-3000:]
        assert "node1 resolves to 127.0.1.1 here, a loopback address" in text and "network.interface" in text, text
        assert not os.path.exists(run_dir / "node1" / "agent.pid")  # refused before the agent started
        record = json.load(open(run_dir / "node1" / "fatal.json"))
        assert "127.0.1.1" in json.dumps(record)
        print(f"refused in {took:.1f} s")
        probe = textwrap.dedent(f"""
            import json, os
            from megatron_ft import config, network
            cfg = config.load({cfg_path!r})
            print(json.dumps({{"problem": network.node_address_problem(cfg, 0, env={{}}),
                              "listen": network.listen_address(cfg, 0),
                              "env": {{k: v for k, v in network.trainer_env(cfg, {{"NCCL_SOCKET_IFNAME": "ib0"}}).items()
                                      if k.endswith("IFNAME")}}}}))
        """)
        got = json.loads(bed.run(0, [sys.executable, "-c", probe], cwd=REPO).stdout)
        assert got == {"problem": None, "listen": "10.77.0.11",
                       "env": {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "ib0"}}  # the user's choice stays
        bad = bed.run(0, [sys.executable, "-c", "from megatron_ft import network; network.interface_address('ib7')"],
                      cwd=REPO)
        assert "network.interface='ib7' is invalid on node0: no such interface; this host has eth0 (10.77.0.11)" \
            in bad.stderr, bad.stderr


@pytest.mark.parametrize("argv,tier", [
    # default-suite time: the node loss covers the bed, its listeners and the stranger's probes; the
    # trainer kill on hosts is in the slow set (`pytest -m slow tests/integration/test_hosts.py`)
    pytest.param(["--fail=trainer"], "local_memory", marks=pytest.mark.slow),
    (["--fail=node", "--redundancy=replica"], "peer_memory"),
], ids=["trainer", "node-replica"])
def test_a_failure_on_hosts_of_their_own_recovers_at_its_tier(bed_allowed, tmp_path, argv, tier, reference_dir):
    """The demo with every node on a host of its own (--hosts): its own address, name, /dev/shm; the
    collectives and the agents on the bed's eth0; a lost node's host dies whole and a new one takes its
    name. Bit-exact at the promised tier, nothing of the bed left. Before the failure, megatron-ft's own
    servers listen on the default ports of the plan (hosts of their own: the same on every host) and
    nowhere else."""
    from conftest import run_demo

    work = tmp_path / "w"
    beds_before = set(hosts.bed_namespaces())
    # 24 iterations: the suite's reference run of that length serves (one machine's or the hosts' own)
    s = run_demo([sys.executable, "-m", "megatron_ft.cli", "demo", "--hosts", "--quiet", f"--workdir={work}",
                  "--iters=24", "--kill-at=7", f"--reference-dir={reference_dir}", *argv], timeout=600)
    assert s["recovered_from"] == tier and (s["newest_complete_at_loss"] or 5) <= s["resumed_step"] <= 7, s
    log = (work / "run.log").read_text()
    assert "rendezvous generation 0 hosted by node 0 at node0:29400" in log
    assert s["listeners"]["off_plan"] == [] and not s["problems"], s
    own = {tuple(x[:3]) for x in s["listeners"]["own"]}
    assert {("node0", "torchrun", 29400), ("node0", "agent", 29500), ("node1", "agent", 29500)} <= own, own
    # the trainers' store, hosted by torchrun rank 0's warm-spare keeper, on MASTER_ADDR's host
    assert any(o == "store host" and p == 29700 for _, o, p in own), own
    agent_log = (work / "run" / "node0" / "agent.log").read_text()
    # an outsider on the job's network (a third host): every store operation and, with peer redundancy,
    # every peer op, to every node, without the job's secret or with a guessed answer to the challenge,
    # refused before any effect (node 1 may be lost while the probes run: node 0's are all challenged)
    from megatron_ft.agent.peer_protocol import PEER_MESSAGES
    from megatron_ft.health.wire_store import STORE_MESSAGES

    ops = len(STORE_MESSAGES.ops) + (len(PEER_MESSAGES.ops) if tier == "peer_memory" else 0)
    probes = 2 * ops * 2  # nodes x ops x (no answer, a guessed answer)
    assert s["stranger"]["probes"] == probes, s["stranger"]
    assert s["stranger"]["challenged"] >= probes // 2 and s["stranger"]["served"] == [], s["stranger"]
    assert "store: refused a connection from 10.77.0.13:" in agent_log
    # megatron-ft's own servers on the node's address, not a wildcard (off_plan would name one)
    assert ["node0", "agent", 29500, "10.77.0.11"] in s["listeners"]["own"], s["listeners"]
    if tier == "peer_memory":
        assert s["lost_nodes"] == [1]
        assert {("node0", "agent", 29600), ("node1", "agent", 29600)} <= own, own
        assert "peer transport on 10.77.0.11:29600" in agent_log  # the interface's address, not a wildcard
        assert "peers-n0: refused a connection from 10.77.0.13:" in agent_log
    assert set(hosts.bed_namespaces()) <= beds_before  # the demo's bed is gone with it


@pytest.mark.slow  # default-suite time: tests/integration/test_slurm.py runs a standby host of its own under Slurm
def test_a_standby_host_takes_a_lost_nodes_place_under_its_own_name(bed_allowed, tmp_path):
    """Node 0 (the store's first root, the rendezvous host) is lost with its host; a standby on a host of
    its own (node2: no node's name in the cluster file) claims its rank and serves it under its own name:
    the other nodes find its store and peer address through the root's store, it never becomes the root
    (they could not reach it under node 0's name), and node 0's ranks come back from their replica."""
    from conftest import run_demo

    work = tmp_path / "w"
    beds_before = set(hosts.bed_namespaces())
    s = run_demo([sys.executable, "-m", "megatron_ft.cli", "demo", "--hosts", "--quiet", f"--workdir={work}",
                  "--iters=8", "--kill-at=4", "--fail=node", "--victim-node=0", "--redundancy=replica", "--standby"],
                 timeout=600)
    assert s["standby"] and s["lost_nodes"] == [0] and s["recovered_from"] == "peer_memory", s
    assert 1 <= s["newest_complete_at_loss"] <= s["resumed_step"] <= s["last_iteration_before_kill"], s
    assert not s["problems"], s
    assert "claimed it, starting as node 0 on this host (node2, not node0)" in (work / "standby.log").read_text()
    node0 = (work / "run" / "node0" / "agent.log").read_text()  # the lost agent's lines, then the standby's
    assert node0.count("node 0: this agent is the root") == 1, node0[-3000:]
    assert "node 1: this agent is the root" in (work / "run" / "node1" / "agent.log").read_text()
    assert s["stranger"]["served"] == [], s["stranger"]  # the outsider is the bed's last host
    assert set(hosts.bed_namespaces()) <= beds_before
