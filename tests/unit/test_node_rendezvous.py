"""The ``megatron-ft`` rendezvous backend (megatron_ft/torchrun/node_rendezvous.py) on a real TCPStore,
its nodes as threads: rounds complete when every node id joined, ranks are node ids, a node whose
workers failed or a replacement opens the next round and the running nodes learn it from their watcher
(no polling), every wait is bounded and names what it waited for."""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousConnectionError,
                                                  RendezvousParameters, RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from megatron_ft.torchrun import node_rendezvous as nr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def host():
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))
    yield port, store


def node(port: int, i: int, n: int, join_s: float = 20.0) -> nr.NodeRendezvous:
    client = lambda: TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))  # noqa: E731
    return nr.NodeRendezvous("job-g0", client(), i, n, join_s, "127.0.0.1", client())


def join_all(handlers) -> dict:
    out, threads = {}, []
    for h in handlers:
        t = threading.Thread(target=lambda h=h: out.__setitem__(h.node, h.next_rendezvous()))
        t.start()
        threads.append(t)
    for t in threads:
        t.join(30)
    return out


def wait_for(cond, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_round_completes_when_every_node_id_joined_and_ranks_are_node_ids(host):
    port, _ = host
    nodes = [node(port, i, 3) for i in (2, 0, 1)]  # joining in any order
    infos = join_all(nodes)
    assert sorted((i, info.rank, info.world_size) for i, info in infos.items()) == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]
    assert {h.round for h in nodes} == {0}
    # torchrun's own use of the round's store: the bootstrap address, and keys apart from the next round's
    assert infos[1].bootstrap_store_info.master_addr == "127.0.0.1"
    infos[0].store.set("x", "round0")
    assert infos[2].store.get("x") == b"round0"
    assert all(h.num_nodes_waiting() == 0 for h in nodes)


def test_a_failed_node_opens_the_next_round_and_the_running_nodes_learn_it_without_polling(host):
    port, _ = host
    nodes = [node(port, i, 3) for i in range(3)]
    join_all(nodes)
    joined = {}
    t = threading.Thread(target=lambda: joined.__setitem__(1, nodes[1].next_rendezvous()))  # its workers failed
    t.start()
    assert wait_for(lambda: nodes[0].num_nodes_waiting() == 1 and nodes[2].num_nodes_waiting() == 1)
    rest = join_all([nodes[0], nodes[2]])  # torchrun restarts their workers and they join
    t.join(30)
    assert {h.round for h in nodes} == {1} and joined[1].rank == 1 and rest[2].rank == 2
    assert nodes[0].num_nodes_waiting() == 0


def test_a_replacement_of_a_running_node_opens_the_next_round_with_the_same_rank(host):
    port, _ = host
    nodes = [node(port, i, 2) for i in range(2)]
    join_all(nodes)
    standby = node(port, 1, 2)  # node 1 lost; its standby's torchrun, fresh
    got = {}
    t = threading.Thread(target=lambda: got.__setitem__("s", standby.next_rendezvous()))
    t.start()
    assert wait_for(lambda: nodes[0].num_nodes_waiting() == 1)
    join_all([nodes[0]])
    t.join(30)
    assert got["s"].rank == 1 and standby.round == nodes[0].round == 1


def test_a_node_that_never_joins_ends_the_wait_in_time_naming_it(host):
    port, _ = host
    lonely = node(port, 0, 2, join_s=1.0)  # its own bound, named in the error, not the default 20 s
    with pytest.raises(RendezvousTimeoutError, match=r"not within 1 s \(round 0: nodes \[1\] never joined\)"):
        lonely.next_rendezvous()


def test_a_closed_rendezvous_refuses_a_join(host):
    port, _ = host
    nodes = [node(port, i, 2) for i in range(2)]
    join_all(nodes)
    assert nodes[0].shutdown()
    assert nodes[1].is_closed()
    with pytest.raises(RendezvousClosedError):
        nodes[1].next_rendezvous()


def test_a_join_whose_host_store_is_gone_fails_at_once():
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))
    h = node(port, 0, 2, join_s=30.0)
    del store  # the host's torchrun (and its store) gone with its node
    with pytest.raises(RendezvousConnectionError):  # at once: waiting out join_s would be a timeout error
        h.next_rendezvous()


def test_torchrun_finds_the_backend_by_name_and_its_parameters_are_checked():
    nr.register()
    port = free_port()
    params = RendezvousParameters(nr.BACKEND, f"127.0.0.1:{port}", "job-g0", 2, 2, is_host="true", node="1",
                                  join_timeout="5")
    h = get_rendezvous_handler(params)
    assert isinstance(h, nr.NodeRendezvous) and (h.node, h.nodes, h.join_timeout_s) == (1, 2, 5.0)
    with pytest.raises(ValueError, match="node=<this node's id>"):
        nr.create_handler(RendezvousParameters(nr.BACKEND, f"127.0.0.1:{free_port()}", "j", 2, 2, is_host="true"))
    with pytest.raises(ValueError, match="fixed number of nodes"):
        nr.create_handler(RendezvousParameters(nr.BACKEND, f"127.0.0.1:{free_port()}", "j", 1, 2, node="0"))


def test_a_node_stops_its_own_watcher_without_waking_the_others(host):
    """Before its process exits (and before each join) a node wakes its watcher with a stop of its own:
    the thread ends at once - none may still be inside the store's blocking wait when the interpreter
    finalizes - and no other node takes that for a new round."""
    port, _ = host
    nodes = [node(port, i, 2) for i in range(2)]
    join_all(nodes)
    watchers = [h._watcher for h in nodes]
    assert all(w is not None and w.is_alive() for w in watchers)
    nodes[0].stop_watching()  # waits at most 5 s for it; unwoken, it would wait out its 300 s slice
    assert not watchers[0].is_alive()
    time.sleep(0.2)
    assert nodes[0].num_nodes_waiting() == 0 and nodes[1].num_nodes_waiting() == 0 and watchers[1].is_alive()
    nr.stop_all()
    assert not watchers[1].is_alive()


def test_a_running_node_learns_at_once_that_the_host_s_store_is_gone():
    """The generation's host lost while the job trains: the watcher's wait fails, and torchrun's next
    look (num_nodes_waiting, every monitor interval) raises - as torch's c10d does on its next look at
    the store - so the launcher moves to its next generation instead of waiting for the workers to fail."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))
    nodes = [node(port, i, 2) for i in range(2)]
    join_all(nodes)
    assert nodes[1].num_nodes_waiting() == 0
    del store  # the host's torchrun gone

    def raised() -> bool:
        try:
            nodes[1].num_nodes_waiting()
            return False
        except RendezvousConnectionError:
            return True

    assert wait_for(raised, 10.0)
