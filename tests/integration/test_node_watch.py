"""The node's watcher of fast restart rounds and verdicts (megatron_ft/spares/node_watch.py): a real
torchrun job store (a TCPStore hosted by a forked process, as a rank-0 keeper hosts it), a real root
agent's store (an EmbeddedStore), and nodes of several keepers (the keepers' ends of their sockets,
speaking the keepers' messages). Counted, not timed: a node's requests per round and while idle do
not grow with its keepers, and a node's keepers are told everything each needs."""
import os
import signal
import socket
import threading
import time
import uuid

import pytest
import yaml

from megatron_ft import config as ftconfig
from megatron_ft.spares import fast_restart as fr
from megatron_ft.spares.messages import FROM_WATCHER
from megatron_ft.spares.node_watch import NodeWatch
from megatron_ft.testing.helpers import free_port
from megatron_ft.transport import wire


class Node:
    """A node's watcher (run in a thread here, as the watcher process runs it) and ``keepers`` sockets."""

    def __init__(self, keepers: int, round_wait_s: float = 300.0):
        self.watch = NodeWatch(round_wait_s=round_wait_s)
        self.keepers = []
        for _ in range(keepers):
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.watch.add(theirs)
            mine.settimeout(20)
            self.keepers.append(mine)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set() and self.watch.step(0.05):
            pass

    def send_all(self, msg):
        for k in self.keepers:
            wire.send_packet(k, msg)

    def told(self, k, n):
        """The next ``n`` messages keeper ``k`` is told (each within 20 s)."""
        return [wire.recv_packet(self.keepers[k], FROM_WATCHER)[0].model_dump(exclude={"v", "nbytes", "wait_s",
                                                                                        "run_id"}) for _ in range(n)]

    def store_counts(self):
        return {k.removeprefix("job store "): v for k, v in self.watch.counts().items() if k.startswith("job store")}

    def close(self):
        for k in self.keepers:
            k.close()
        deadline = time.monotonic() + 5
        while self.watch.keepers and time.monotonic() < deadline:  # the watcher drops them (its streams stop)
            time.sleep(0.01)
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def job_store():
    pid, port = fr.host_round_store("127.0.0.1", 0, stamp="job")
    yield port, pid
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def test_a_nodes_round_requests_do_not_grow_with_its_keepers_and_each_keeper_is_told(job_store):
    port, host = job_store
    sub = {"op": "rounds", "addr": "127.0.0.1", "port": port, "attempt": "job/0", "limit": 3}
    idle_nodes = {keepers: Node(keepers, round_wait_s=0.15) for keepers in (1, 8)}  # short waits, to count some
    try:
        for node in idle_nodes.values():
            node.send_all(dict(sub, attempt="job/1"))
        time.sleep(0.1)
        idle0 = {L: sum(n.store_counts().values()) for L, n in idle_nodes.items()}
        time.sleep(0.6)  # idle: the same few waits (and a liveness check after each) on every node
        idle = {L: sum(n.store_counts().values()) - idle0[L] for L, n in idle_nodes.items()}
        assert 2 <= idle[1] <= 12 and abs(idle[8] - idle[1]) <= 2, idle  # 8 keepers polling: about 100
    finally:
        for node in idle_nodes.values():
            node.close()
    nodes = {keepers: Node(keepers) for keepers in (1, 8)}
    try:
        for node in nodes.values():
            node.send_all(sub)
        time.sleep(0.2)
        before = {L: n.store_counts() for L, n in nodes.items()}

        nodes[8].send_all({"op": "open", "round": 1})  # every trainer of the node failed: one add
        assert all(nodes[L].told(k, 1) == [{"op": "opened", "round": 1}] for L in nodes for k in range(L))
        wire.send_packet(nodes[1].keepers[0], {"op": "publish", "round": 1, "port": port + 1})  # rank 0's node
        for L, node in nodes.items():
            assert all(node.told(k, 1) == [{"op": "port", "round": 1, "port": port + 1}] for k in range(L))
        time.sleep(0.2)  # any duplicate would arrive by now; none must
        for node in nodes.values():
            for k in node.keepers:
                k.settimeout(0.01)
                with pytest.raises(OSError):
                    k.recv(1)
                k.settimeout(20)
        per_round = {L: {k: v - before[L].get(k, 0) for k, v in n.store_counts().items()
                         if v != before[L].get(k, 0)}
                     for L, n in nodes.items()}
        # waits on round/1 and port/1, one get of the port, one check for a newer round; the writes:
        # one add on the node of failures (8 keepers asked), one set on rank 0's node (with its client,
        # which reads the store's stamp first)
        assert per_round[8] == {"wait": 2, "check": 1, "get": 1, "add": 1, "connect": 1, "stamp": 1}, per_round
        assert per_round[1] == {"wait": 2, "check": 1, "get": 1, "set": 1, "connect": 1, "stamp": 1}, per_round

        late = Node(3)  # keepers that subscribe late are caught up at once, with no request of theirs
        late.send_all(sub)
        assert all(late.told(k, 2) == [{"op": "opened", "round": 1}, {"op": "port", "round": 1, "port": port + 1}]
                   for k in range(3))

        os.kill(host, signal.SIGKILL)  # the job store ends (its host, rank 0's keeper, ended): no more rounds
        for node in (*nodes.values(), late):
            for k in range(len(node.keepers)):
                (msg,) = node.told(k, 1)
                assert msg["op"] == "gone" and msg["reason"], msg
        late.close()
    finally:
        for node in nodes.values():
            node.close()


@pytest.mark.parametrize("next_stamp", ["job-g1", "job-g0"], ids=["next-generation", "next-attempt"])
def test_a_round_asked_for_as_its_store_ends_is_never_opened_in_the_next_store_on_its_port(next_stamp):
    """Chaos seed 60 trial 0 (launcher0): node 0's launcher died and took generation 0's job store with
    it as a trainer of node 1 failed; node 1's watcher asked to open round 1, its writer's client retried
    the refused port for 10 s and reached generation 1's store, newly on the same trainer port, and
    opened round 1 there: node 1's trainers moved to round 1, node 0's new ones (cold) stayed in round 0,
    and the job hung. Now the writer writes nothing once its store ended, and a client reaching a store
    of another rendezvous (its stamp) ends the stream naming it."""
    from torch.distributed import TCPStore
    import datetime

    from megatron_ft.spares.node_watch import RoundStream

    port = free_port()
    old, _ = fr.host_round_store("127.0.0.1", port, stamp="job-g0")
    news = []
    stream = RoundStream("127.0.0.1", port, 3, lambda s, m: news.append(m), timeout_s=4.0, stamp="job-g0").start()
    new = None
    try:
        deadline = time.monotonic() + 10
        while stream.counts["wait"] < 1 and time.monotonic() < deadline:  # the watch thread follows it
            time.sleep(0.01)
        os.kill(old, signal.SIGKILL)  # its host ends (the launcher's kill took node 0's torchrun)
        os.waitpid(old, 0)
        while not news and time.monotonic() < deadline:
            time.sleep(0.01)
        assert news and news[0]["op"] == "gone", news
        stream.open(1)  # a keeper asked before the news reached the watcher's main thread
        time.sleep(0.1)  # the writer's client is retrying the refused port
        new, _ = fr.host_round_store("127.0.0.1", port, stamp=next_stamp)  # the next store, the same port
        stream._threads[1].join(10)
        assert not stream._threads[1].is_alive()
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        assert not client.check(["mft/fast/round/1"]), "a stale round opened in the next store"
        if next_stamp != "job-g0":
            assert any("is rendezvous 'job-g1'" in m.get("reason", "") for m in news), news
    finally:
        stream.stop()
        for pid in (old, new):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError, TypeError):
                pass


@pytest.fixture
def root_store(tmp_path):
    from megatron_ft.health.store import EmbeddedStore

    run, port = f"t{uuid.uuid4().hex[:8]}", free_port()
    root = EmbeddedStore(run, 0, 2, [], port, timeout_s=2.0)
    assert root.connect(10) == 0
    cfg = ftconfig.replace(ftconfig.load(), run_id=run, cluster={"nodes": 2}, health={"store_port": port})
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    yield root, str(path)
    root.close()


def test_a_nodes_verdict_watch_is_one_long_poll_whatever_its_keepers_and_none_when_idle(root_store):
    root, config = root_store
    root.set("last_verdict", "1/4242/100.5")  # a verdict of an earlier attempt
    watches = lambda: root._server.op_counts().get("watch last_verdict", 0)  # noqa: E731
    nodes = {L: Node(L) for L in (1, 8)}
    try:
        w0 = watches()
        for node in nodes.values():
            node.send_all({"op": "verdicts", "config": config, "settle_s": 1.0})  # a round starts on each keeper
        for L, node in nodes.items():
            assert all(node.told(k, 1) == [{"op": "verdict", "value": "1/4242/100.5"}] for k in range(L))
        time.sleep(0.2)
        root.set("last_verdict", f"1/4243/{time.time()}")  # a node lost during the round
        value = root.get("last_verdict")
        for L, node in nodes.items():
            assert all(node.told(k, 1) == [{"op": "verdict", "value": value}] for k in range(L))
        time.sleep(1.0)  # the window ends
        during = {L: n.watch.counts()["root watch"] for L, n in nodes.items()}
        at_root = watches() - w0
        time.sleep(0.5)
        assert watches() - w0 == at_root, "a watch of the root with no round settling"
        # per node: the first (answered at once: a verdict is there), one held until the change, one
        # until the window's end; 8 keepers reading every 0.25 s for 6 s would have made 8 * 24 = 192
        assert during == {1: 3, 8: 3} and at_root == 6, (during, at_root)
    finally:
        for node in nodes.values():
            node.close()


def test_on_etcd_a_nodes_verdict_watch_is_an_etcd_watch_that_tells_every_keeper(tmp_path):
    """The same long poll on an etcd store (a real etcd): one read and a watch stream from its revision."""
    from test_health import ETCD, running_etcd

    if ETCD is None:
        pytest.skip("no etcd binary on PATH (scripts/setup.sh installs it as root)")
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed (pip install -e '.[etcd]')")
    from megatron_ft.health.etcd import EtcdKV

    with running_etcd(tmp_path) as url:
        run = f"t{uuid.uuid4().hex[:8]}"
        cfg = ftconfig.replace(ftconfig.load(), run_id=run, cluster={"nodes": 2}, health={"store": url})
        path = tmp_path / "node.yaml"
        path.write_text(yaml.safe_dump(cfg.to_dict()))
        kv = EtcdKV(url, f"mft/{run}/", 2.0)
        node = Node(4)
        try:
            node.send_all({"op": "verdicts", "config": str(path), "settle_s": 1.0})
            time.sleep(0.3)  # the watch is held (nothing to tell: no verdict yet)
            kv.set("last_verdict", f"1/4243/{time.time()}")
            value = kv.get("last_verdict")
            assert all(node.told(k, 1) == [{"op": "verdict", "value": value}] for k in range(4))
            time.sleep(1.0)  # the window ends
            assert node.watch.counts()["root watch"] <= 3 and not node.watch.counts()["root error"]
        finally:
            node.close()


def test_a_bad_message_is_refused_naming_its_value_and_the_watcher_goes_on():
    from megatron_ft.spares.messages import TO_WATCHER

    with pytest.raises(ValueError, match=r"keeper watch op 'port': port=70000 is invalid"):
        FROM_WATCHER.parse({"v": 1, "op": "port", "round": 1, "port": 70000})
    with pytest.raises(ValueError, match=r"node watcher op 'open': round=0 is invalid"):
        TO_WATCHER.parse({"v": 1, "op": "open", "round": 0})
    with pytest.raises(ValueError, match=r"node watcher op 'rounds': field 'limit' is missing"):
        TO_WATCHER.parse({"v": 1, "op": "rounds", "addr": "h", "port": 1, "attempt": "a"})
    node = Node(2)
    try:
        node.keepers[0].send(b'{"v": 1, "op": "verdicts", "config": "", "settle_s": "long"}')
        node.keepers[0].send(b"not json")
        node.send_all({"op": "verdicts", "config": "/nonexistent.yaml", "settle_s": 0.2})  # no config: no news
        time.sleep(0.3)
        assert len(node.watch.keepers) == 2 and node.watch.counts()["root watch"] == 0
    finally:
        node.close()
