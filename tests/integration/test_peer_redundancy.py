"""Peer redundancy with real agent processes (megatron_ft.testing.sim.LocalCluster): N simulated nodes, one
agent each with its own shared memory, TCP between agents, the embedded TCPStore on the root
agent; one trainer per node driven from this process. Losing a node = SIGKILL of its agent plus
removal of its shared memory; a fresh agent takes its place and the rank is restored bit for bit
from the group (or, past the scheme's tolerance, from disk)."""
import logging
import os
import signal

import pytest
import torch

from megatron_ft.agent.protocol import AgentClient, AgentError
from megatron_ft.testing.helpers import wait_for
from megatron_ft.testing.sim import LocalCluster
from megatron_ft.trainer.recovery import MemoryTierUnknown
from megatron_ft.capture.state import TorchStateAdapter


def make_model(rank, seed):
    torch.manual_seed(seed + 100 * rank)
    width = 256 + 32 * rank  # unequal state sizes: parity blocks are zero-padded
    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def assert_same(a, b):
    (m1, o1), (m2, o2) = a, b
    for (n, x), (_, y) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(x, y), n
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k in o1.state[p1]:
            assert torch.equal(o1.state[p1][k], o2.state[p2][k]), k


@pytest.fixture
def cluster(tmp_path, request):
    nodes, red = request.param[:2]
    persist = request.param[2] if len(request.param) > 2 else 0
    c = LocalCluster(str(tmp_path), nodes, make_model, chunk_bytes=1 << 14, persist_interval=persist, **red)
    yield c
    c.close()


REPLICA = (2, {"scheme": "replica", "replicas": 2})
XOR = (3, {"scheme": "xor"})
RS = (4, {"scheme": "rs", "k": 2, "m": 2})

SCHEMES = [
    pytest.param(REPLICA, 1, "peer_memory", id="replica"),
    pytest.param(XOR, 1, "decoded", id="xor"),
    # k=2, m=2 on 4 nodes: D_0 = ranks 0, 1 on node 0, D_1 = ranks 2, 3 on node 2; rank 1 also
    # lives whole on data node 0 (peer_memory), rank 2 only on node 2: decoded
    pytest.param(RS, 1, "peer_memory", id="rs-copy"),
    pytest.param(RS, 2, "decoded", id="rs-decode"),
]


@pytest.mark.parametrize("cluster,lost,source", SCHEMES, indirect=["cluster"])
def test_one_node_lost_is_rebuilt_from_peers_bit_exact(cluster, lost, source):
    cluster.train(3)
    cluster.lose_node(lost)
    cluster.replace_node(lost)
    res, model = cluster.restore(lost)
    assert (res.source, res.step) == (source, 3), res.rejected
    assert_same(cluster.models[lost], model)
    assert not os.path.exists(cluster.cfg.persist.dir)  # nothing was read from (or written to) disk


@pytest.mark.parametrize("cluster", [RS], indirect=True, ids=["rs"])
def test_rs_survives_m_lost_nodes_including_the_root(cluster):
    cluster.train(2)
    # memory: data nodes (0, 2) keep two slots + copies, parity nodes (1, 3) one staging slot +
    # parity; one version per node is (k+m)/k shares, as in ECHECK (here k=2, m=2: 2 shares)
    for n in range(4):
        st = cluster.status(n)
        slots = [s["bytes"] for r in st["ranks"].values() for s in r["slots"]]
        assert len(slots) == (2 if n in (0, 2) else 1), (n, slots)
        share = slots[0]
        one_version = (share if n in (0, 2) else 0) + st["redundancy"]["block_bytes"] / 2
        assert one_version <= 1.1 * 2 * max(s["bytes"] for m in range(4)
                                             for r in cluster.status(m)["ranks"].values() for s in r["slots"]), n
    for n in (0, 1):  # both holders of D_0; node 0 is also the root agent holding the store
        cluster.lose_node(n)
    for n in (0, 1):
        cluster.replace_node(n)
    for n in (0, 1):
        res, model = cluster.restore(n)
        assert (res.source, res.step) == ("decoded", 2), res.rejected
        assert_same(cluster.models[n], model)
    # the group protects new versions again, with the new root
    cluster.train(1, start=3)
    assert {cluster.status(n)["redundancy"]["complete_step"] for n in range(4)} == {3}


@pytest.mark.parametrize("cluster", [REPLICA + (1,)], indirect=True, ids=["replica"])
def test_whole_replica_group_lost_falls_back_to_disk(cluster, caplog):
    cluster.train(2)
    cluster.clients[0].request("wait_persisted", wait_s=60)
    cluster.clients[1].request("wait_persisted", wait_s=60)
    for n in (0, 1):
        cluster.lose_node(n)
    for n in (0, 1):
        cluster.replace_node(n)
    with caplog.at_level(logging.WARNING, logger="megatron_ft"):
        res, model = cluster.restore(1)
    assert (res.source, res.step) == ("disk", 2), res.rejected
    assert_same(cluster.models[1], model)
    assert "falling back to the newest persisted checkpoint" in caplog.text


@pytest.mark.parametrize("cluster", [XOR], indirect=True, ids=["xor"])
def test_node_lost_mid_exchange_recovers_the_previous_complete_version(cluster):
    cluster.train(2)
    # node 1's agent dies after the first contribution of step 3 left it, before the rest
    cluster.agents[1].kill()
    cluster.agents[1].start(fault="mid-exchange:3")  # adopts node 1's slots; dies inside the exchange of step 3
    cluster.clients[1] = cluster.agents[1].client(1)
    cluster.train(1, start=3, wait_complete=False)
    cluster.agents[1].proc.wait(timeout=120)
    assert cluster.agents[1].proc.returncode == -9
    cluster.lose_node(1)
    cluster.replace_node(1)
    res, model = cluster.restore(1)
    assert (res.source, res.step) == ("decoded", 2), res.rejected
    # step 2's state, not step 3's: rebuild the expected model from a run stopped at step 2
    ref = state_after(2)
    assert_same(ref, model)


@pytest.mark.parametrize("cluster", [XOR], indirect=True, ids=["xor"])
def test_a_member_that_does_not_answer_leaves_the_memory_tier_unknown_not_empty(cluster):
    """Rank 1's rebuild needs node 2. While node 2's agent cannot answer (stopped: the kernel still
    accepts its connections), what the group holds is unknown: the restore raises instead of going
    down to disk or a fresh start; once it answers, the same restore decodes step 2."""
    cluster.train(2)
    cluster.lose_node(1)
    cluster.replace_node(1)
    stopped = cluster.agents[2].proc.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        with pytest.raises(MemoryTierUnknown, match=r"node 2: .* did not say what the group holds within 2 s"):
            cluster.restore(1, group_wait_s=2.0)
    finally:
        os.kill(stopped, signal.SIGCONT)
    res, model = cluster.restore(1)
    assert (res.source, res.step) == ("decoded", 2), res.rejected
    assert_same(cluster.models[1], model)


def state_after(steps, rank=1):
    """Rank ``rank``'s state after ``steps`` training steps (LocalCluster.train's recipe), recomputed here."""
    m, opt = make_model(rank, 0)
    for step in range(1, steps + 1):
        torch.manual_seed(step * 1000 + rank)
        loss = m(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m, opt


@pytest.mark.parametrize("cluster", [RS], indirect=True, ids=["rs"])
def test_a_parity_nodes_rank_is_decoded_with_its_own_parity_once_its_slot_moved_on(cluster):
    """rs k=2 m=2 on 4 nodes: parity node 3 keeps one staging slot for its rank 3, which lives whole on
    data node 2 (copy.r3). Step 2 is complete in the group; rank 3 then snapshots step 3 into its only
    slot, and nodes 1 and 2 are lost before the group completes step 3. Rank 3's step 2 is still in
    the group's memory: rank 1's copy on node 0 and node 3's own parity row decode it. Before, the
    agent counted only the other members' blocks, found nothing, and the whole job restarted fresh."""
    cluster.train(2)
    m, opt = cluster.models[3]  # rank 3 alone takes step 3 (the others never will: it never completes)
    torch.manual_seed(3 * 1000 + 3)
    loss = m(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ad = TorchStateAdapter(m, opt)
    ad.extra = {"iteration": 3}
    cluster.engines[3].snapshot(3, *ad.capture())
    cluster.engines[3].wait()
    assert [v["step"] for v in cluster.clients[3].request("list", rank=3)["versions"]] == [3]
    assert cluster.status(0)["redundancy"]["complete_step"] == 2
    for n in (1, 2):
        cluster.lose_node(n)
    for n in (1, 2):
        cluster.replace_node(n)
    reply = cluster.clients[3].request("peer_list", rank=3, wait_s=30)
    assert not reply["unanswered"], reply
    assert {"step": 2, "source": "decoded"} in reply["versions"], reply
    # the job agrees on step 2 (ranks 0-2 hold nothing newer): rank 3's agent decodes it into its slot
    assert cluster.clients[3].request("recover", rank=3, step=2, wait_s=30)["source"] == "decoded"
    res, model = cluster.restore(3)
    assert (res.source, res.step) == ("local_memory", 2), res.rejected
    assert_same(state_after(2, rank=3), model)
    for r in (1, 2):  # and the lost ranks come back at that step too
        res, model = cluster.restore(r)
        assert (res.source, res.step) == ("peer_memory" if r == 1 else "decoded", 2), res.rejected
        assert_same(state_after(2, rank=r), model)


@pytest.mark.parametrize("cluster", [XOR], indirect=True, ids=["xor"])
def test_corrupt_parity_block_is_never_restored(cluster):
    cluster.train(3)
    cluster.lose_node(1)
    cluster.replace_node(1)
    # flip a byte in the data area of every step-3 parity block that rank 1's pieces decode from
    shm_dir, run = cluster.cfg.agent.shm_dir, cluster.run_id
    flipped = 0
    for name in os.listdir(shm_dir):
        if name.startswith(f"mft.{run}.") and ".blk.xor." in name:
            path = os.path.join(shm_dir, name)
            node = int(name.split(".")[2][1:])
            st = cluster.status(node)["redundancy"]["blocks"]
            key = name.split(".blk.")[1].rsplit(".", 1)[0]
            if any(step == 3 and file == name for step, _, file in st[key]):
                size = os.path.getsize(path)
                with open(path, "r+b") as f:  # 12 bytes spread over the block's second half
                    for i in range(12):
                        f.seek(size // 2 + i * (size // 2) // 12)
                        b = f.read(1)
                        f.seek(-1, 1)
                        f.write(bytes([b[0] ^ 0xFF]))
                flipped += 1
    assert flipped
    res, model = cluster.restore(1)
    assert (res.source, res.step) == ("decoded", 2), res.rejected
    assert any("step 3" in r for r in res.rejected)
    assert_same(state_after(2), model)


@pytest.mark.parametrize("cluster", [(2, {"scheme": "replica", "replicas": 2, "transport": "scheduled"})],
                         indirect=True, ids=["replica-scheduled"])
def test_scheduled_transport_pins_are_released_when_the_trainer_dies(cluster):
    """The slot a trainer's scheduled transport reads is pinned in its agent, which outlives
    the trainer: a repeated pin is harmless, and a lost trainer's pin is released (else a restarted
    job could never write that slot again). With the scheduled transport the agents do not exchange."""
    cluster.train(2, wait_complete=False)

    def pins():
        return {s["step"]: s["pins"] for s in cluster.status(0)["ranks"]["0"]["slots"]}

    assert len(cluster.status(0)["ranks"]["0"]["slots"]) == 4  # complete, sending, newest, writing
    transport = AgentClient(cluster.agents[0].sock, 30)  # a trainer's transport connection (role: transport)
    transport.connect({"rank": 0, "local_rank": 0, "pid": os.getpid(), "run_id": cluster.run_id, "role": "transport"})
    for _ in range(2):
        assert transport.request("sched_pin", rank=0, step=2)["size"] > 0
    assert pins()[2] == 1
    trainer = AgentClient(cluster.agents[0].sock, 30)
    trainer.connect({"rank": 0, "local_rank": 0, "pid": os.getpid(), "run_id": cluster.run_id})
    trainer.close(orderly=False)  # the trainer process dies
    wait_for("the lost trainer's pin to be released", lambda: pins()[2] == 0, 10.0, cluster.agents[0].log)
    assert pins()[2] == 0
    with pytest.raises(AgentError, match="does not hold step 7 clean"):
        transport.request("sched_pin", rank=0, step=7)
    assert cluster.status(1)["redundancy"]["complete_step"] == -1  # nobody sent: no agent exchange
    transport.close()


@pytest.mark.parametrize("cluster", [REPLICA], indirect=True)
def test_a_stranger_without_the_jobs_secret_gets_nothing_from_the_peer_transport(cluster):
    """An outsider connecting to an agent's peer port without the job's secret, or with a wrong one, is
    refused before any operation - holds, get, put, announce - and logged; the job's own agents (which
    prove the secret) go on exchanging. With the secret, holds answers what the agent holds: the probe
    reaches a live agent."""
    from megatron_ft.network import peer_port
    from megatron_ft.transport import wire
    from megatron_ft.transport.credential import read_secret

    cluster.train(2)
    addr = ("127.0.0.1", peer_port(cluster.cfg, 0))
    secret = read_secret(cluster.cfg.security.secret_file)
    held = wire.Client(addr, 5.0, secret=secret).request("holds", run_id=cluster.cfg.run_id)
    assert held["primary"], held  # rank 0's clean steps: what a stranger must not learn
    requests = {"holds": {}, "announce": {"node": 1, "step": 99},
                "get": {"what": "primary", "step": 2, "lo": 0, "hi": 64, "rank": 0},
                "put": {"key": "copy.r1", "kind": "copy", "step": 99, "length": 4, "src": 1, "expect": 4, "meta": {}}}
    for wrong in (None, b"not-the-jobs-secret-at-all"):
        for op, fields in requests.items():
            c = wire.Client(addr, 2.0, secret=wrong, reconnects=0)
            try:
                reply = c.request(op, run_id=cluster.cfg.run_id, **fields)
            except (wire.WireError, wire.RemoteError, OSError):
                continue
            finally:
                c.close()
            assert "primary" not in reply and "ok" not in reply, (op, wrong, reply)  # the challenge, no answer
    def refusals() -> int:
        with open(cluster.agents[0].log_path) as f:
            return f.read().count("refused a connection from 127.0.0.1")

    wait_for("the agent to log the refusals", lambda: refusals() >= 8, 10, lambda: cluster.logs([0]))
    cluster.train(2, start=3)  # the job's own exchange goes on


def test_the_agents_replication_connections_carry_the_configured_dscp(tmp_path):
    """``network.replication_dscp``: what each agent sends its peers (the copies) carries that DSCP in its
    IP header (``ss --tos`` reads it from the kernel's socket), so a network with traffic classes can
    queue it behind the collectives; 0 (the default) leaves the connections unmarked."""
    import subprocess

    from megatron_ft import network

    def peer_tos(cfg) -> list[str]:
        ports = {str(network.peer_port(cfg, n)) for n in range(2)}
        out = subprocess.run(["ss", "-tn", "--tos", "state", "established"], capture_output=True, text=True).stdout
        return [f.split("tos:")[1].split()[0] for f in out.splitlines()[1:]
                if len(f.split()) > 3 and f.split()[3].rsplit(":", 1)[-1] in ports and "tos:" in f]

    seen = {}
    for dscp in (8, 0):
        c = LocalCluster(str(tmp_path / f"d{dscp}"), 2, make_model, chunk_bytes=1 << 14,
                         config={"network": {"replication_dscp": dscp}}, scheme="replica", replicas=2)
        try:
            c.train(2)
            wait_for("a complete version in the group", lambda: all(
                (c.status(n)["redundancy"]["complete_step"] or -1) >= 1 for n in range(2)), 30)
            seen[dscp] = peer_tos(c.cfg)
        finally:
            c.close()
    assert seen[8].count("0x20") >= 2, seen  # each agent's connection to the other, marked
    assert seen[0] and set(seen[0]) <= {"0", "0x0"}, seen  # ss prints an unmarked socket as tos:0
