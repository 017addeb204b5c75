"""Peer redundancy with real agent processes: N simulated nodes (one agent each, its own shared
memory, TCP between agents, the embedded TCPStore on the root agent), one trainer per node driven
from this process. A node loss is SIGKILL of its agent plus removal of its shared memory; a fresh
agent takes its place and the rank is restored bit for bit from the group."""
import os
import time
import uuid

import pytest
import torch
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.demo import free_port
from megatron_ft.recovery import Restorer
from megatron_ft.snapshot import SnapshotEngine
from megatron_ft.state import TorchStateAdapter

from conftest import AgentProc


def make_model(rank, seed=0):
    torch.manual_seed(seed + 100 * rank)
    width = 64 + 16 * rank  # unequal state sizes: parity blocks are zero-padded
    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def identity(cfg, rank, world):
    return {"run_id": cfg.run_id, "rank": rank, "world_size": world}


class Cluster:
    def __init__(self, tmp_path, nodes, **redundancy):
        self.run_id = f"t{uuid.uuid4().hex[:10]}"
        base = free_port()
        self.cfg = ftconfig.replace(
            ftconfig.load(), run_id=self.run_id, cluster={"nodes": nodes, "ranks_per_node": 1},
            parallel={"tensor": 1, "pipeline": 1}, redundancy=redundancy,
            persist={"dir": str(tmp_path / "persist"), "interval": 0, "on_failure": False},
            health={"store_port": base if base + nodes < 65000 else 20000})
        self.path = str(tmp_path / "job.yaml")
        with open(self.path, "w") as f:
            yaml.safe_dump(self.cfg.to_dict(), f)
        self.nodes = nodes
        self.agents = [AgentProc(self.cfg, self.path, n) for n in range(nodes)]
        for a in self.agents:
            a.start()
        self.models = [make_model(r) for r in range(nodes)]
        self.clients = [a.client(r) for r, a in enumerate(self.agents)]
        self.engines = [SnapshotEngine(c, r, identity(self.cfg, r, nodes), 1 << 14)
                        for r, c in enumerate(self.clients)]

    def status(self, n):
        return self.clients[n].request("status")["status"]

    def train(self, steps, start=1):
        for step in range(start, start + steps):
            for r, (m, opt) in enumerate(self.models):
                self.engines[r].wait()
                torch.manual_seed(step * 1000 + r)
                loss = m(torch.randn(8, 16)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ad = TorchStateAdapter(m, opt)
                ad.extra = {"iteration": step}
                self.engines[r].snapshot(step, *ad.capture())
            for e in self.engines:
                e.wait()
            self.wait_complete(step)

    def wait_complete(self, step, nodes=None, timeout=60):
        deadline = time.time() + timeout
        nodes = range(self.nodes) if nodes is None else nodes
        while True:
            got = [self.status(n)["redundancy"]["complete_step"] for n in nodes]
            if all(g >= step for g in got):
                return
            if time.time() > deadline:  # a wait limit, not a performance check
                pytest.fail(f"step {step} not complete on every node: {got}; "
                            + "\n".join(self.agents[n].log()[-3000:] for n in nodes))
            time.sleep(0.05)

    def lose_node(self, n):
        """The node's memory is gone with it: kill its agent, drop its shared memory, start a fresh one."""
        self.agents[n].kill()
        for name in os.listdir(self.cfg.agent.shm_dir):
            if name.startswith(f"mft.{self.run_id}.n{n}."):
                os.unlink(os.path.join(self.cfg.agent.shm_dir, name))

    def replace_node(self, n):
        self.agents[n].start()
        self.clients[n] = self.agents[n].client(n)

    def restore(self, rank):
        m2, opt2 = make_model(rank, seed=7)
        res = Restorer(rank, self.nodes, identity(self.cfg, rank, self.nodes), self.run_id, self.cfg.persist.dir,
                       self.clients[rank]).restore(TorchStateAdapter(m2, opt2))
        return res, m2, opt2

    def close(self):
        for a in self.agents:
            a.stop()
        for name in os.listdir(self.cfg.agent.shm_dir):
            if name.startswith(f"mft.{self.run_id}."):
                os.unlink(os.path.join(self.cfg.agent.shm_dir, name))


def assert_same(m1, o1, m2, o2):
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k in o1.state[p1]:
            assert torch.equal(o1.state[p1][k], o2.state[p2][k]), k


@pytest.fixture
def cluster(tmp_path, request):
    nodes, red = request.param
    c = Cluster(tmp_path, nodes, **red)
    yield c
    c.close()


SCHEMES = [
    pytest.param((2, {"scheme": "replica", "replicas": 2}), 1, "peer_memory", id="replica"),
    pytest.param((3, {"scheme": "xor"}), 1, "decoded", id="xor"),
    # k=2, m=2 on 4 nodes: D_0 = ranks 0, 1 on node 0, D_1 = ranks 2, 3 on node 2; rank 1 also
    # lives whole on data node 0 (peer_memory), rank 2 only on node 2: decoded
    pytest.param((4, {"scheme": "rs", "k": 2, "m": 2}), 1, "peer_memory", id="rs-copy"),
    pytest.param((4, {"scheme": "rs", "k": 2, "m": 2}), 2, "decoded", id="rs-decode"),
]


@pytest.mark.parametrize("cluster,lost,source", SCHEMES, indirect=["cluster"])
def test_one_node_lost_is_rebuilt_from_peers_bit_exact(cluster, lost, source):
    cluster.train(3)
    cluster.lose_node(lost)
    cluster.replace_node(lost)
    res, m2, o2 = cluster.restore(lost)
    assert (res.source, res.step) == (source, 3), res.rejected
    assert_same(*cluster.models[lost], m2, o2)
    assert not os.path.exists(cluster.cfg.persist.dir) or not os.listdir(cluster.cfg.persist.dir)  # no disk


@pytest.mark.parametrize("cluster", [SCHEMES[2].values[0]], indirect=True, ids=["rs"])
def test_rs_survives_m_lost_nodes_including_the_root(cluster):
    cluster.train(2)
    for n in (0, 1):  # both of D_0's holders (node 0 is also the root agent with the store)
        cluster.lose_node(n)
    for n in (0, 1):
        cluster.replace_node(n)
    for n in (0, 1):
        res, m2, o2 = cluster.restore(n)
        assert (res.source, res.step) == ("decoded", 2), res.rejected
        assert_same(*cluster.models[n], m2, o2)
