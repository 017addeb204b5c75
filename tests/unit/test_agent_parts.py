"""The agent stays in parts: the service (``agent/server.py``) small, no class of ``megatron_ft/agent/``
with more than :data:`MAX_METHODS` methods, every operation of the protocol in the dispatch table, and
the slot store below its callers - it imports none of the parts that tell the redundancy, the
persister or the network, and they reach the slots through it, never through the agent. Read from the
source (ast), but for the table."""
from __future__ import annotations

import ast
import os

from conftest import REPO
from test_import_graph import graph
from megatron_ft import config as ftconfig

AGENT = os.path.join(REPO, "megatron_ft", "agent")
MAX_SERVER_LINES = 400
MAX_METHODS = 25


def class_methods(path: str) -> dict[str, int]:
    """Class name -> functions defined at its class level (methods, properties, static methods)."""
    tree = ast.parse(open(path).read(), path)
    return {node.name: sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_the_counter_counts_methods_and_properties_at_class_level_only(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("class A:\n    def a(self):\n        def inner():\n            pass\n"
                 "    @property\n    def b(self):\n        pass\n    x = 1\n"
                 "class B:\n    async def c(self):\n        pass\n")
    assert class_methods(str(f)) == {"A": 2, "B": 1}


def test_the_agent_service_is_under_400_lines():
    with open(os.path.join(AGENT, "server.py")) as f:
        n = sum(1 for _ in f)
    assert n < MAX_SERVER_LINES, f"megatron_ft/agent/server.py has {n} lines"


def test_no_class_of_the_agent_has_more_than_25_methods():
    big = {f"{f}:{c}": n for f in sorted(os.listdir(AGENT)) if f.endswith(".py")
           for c, n in class_methods(os.path.join(AGENT, f)).items() if n > MAX_METHODS}
    assert not big, f"classes over {MAX_METHODS} methods: {big}"


def test_every_operation_of_the_protocol_has_a_handler():
    from megatron_ft.agent.operations import HANDLERS
    from megatron_ft.agent.protocol import MESSAGES

    assert set(HANDLERS) == set(MESSAGES.ops)


def test_the_slot_store_imports_nothing_that_calls_out():
    g = graph()
    above = {f"megatron_ft.agent.{m}" for m in ("server", "operations", "persister", "launcher_watch", "redundancy",
                                                "exchange_sender", "peer_rebuild", "job_agreement", "decisions")}
    for part in ("slot_store", "node_agreement", "shm_budget", "guard_memory"):
        assert not g[f"megatron_ft.agent.{part}"] & above, part


def test_the_redundancy_reaches_the_slots_through_the_slot_store():
    def reaches_the_agent(n: ast.AST) -> bool:  # ``x.agent``, but not the configuration's ``cfg.agent``
        return (isinstance(n, ast.Attribute) and n.attr == "agent"
                and not (isinstance(n.value, (ast.Name, ast.Attribute))
                         and getattr(n.value, "id", getattr(n.value, "attr", None)) == "cfg"))

    for f in ("redundancy.py", "exchange_sender.py", "peer_rebuild.py", "peer_directory.py", "block_store.py",
              "persister.py"):
        tree = ast.parse(open(os.path.join(AGENT, f)).read())
        assert not [n.lineno for n in ast.walk(tree) if reaches_the_agent(n)], f


def test_container_sizes_are_one_store_key_per_node_not_per_rank():
    import threading

    from megatron_ft import config as ftconfig
    from megatron_ft.agent.peer_directory import PeerDirectory

    class Store:
        def __init__(self):
            self.data, self.reads = {}, 0

        def publish(self, key, value):
            self.data[key] = value

        def get(self, key):
            self.reads += 1
            return self.data.get(key)

    cfg = ftconfig.from_dict({"cluster": {"nodes": 2, "ranks_per_node": 4}, "parallel": {"tensor": 1, "pipeline": 1}})
    store = Store()
    dirs = [PeerDirectory(cfg, n, (0, 1), list(range(8)), store, None, dict, threading.Event()) for n in range(2)]
    for r in range(8):
        dirs[r // 4].publish_size(r, 1000 + r)
    assert sorted(store.data) == ["size/0", "size/1"]
    assert dirs[0].sizes() == {r: 1000 + r for r in range(8)} and store.reads == 2  # one read per node


def test_the_node_agreement_is_attached_before_the_job_agreements_threads_start(tmp_path, monkeypatch):
    """A restarted agent's verdict thread learns the job's verdict at its first watch (the verdict is
    already in the store) and hands it to the slot store at once: the slot store's agreement must be
    attached by then. Started first, the thread's first verdict raced the attach; losing the race killed
    the thread (AssertionError in ``adopt_verdict``), and the restarted agent never protected a step
    again while training went on (chaos, the ``agent`` kind)."""
    from megatron_ft.agent import job_agreement
    from megatron_ft.agent.server import Agent

    cfg = ftconfig.from_dict({"run_id": f"attach-{os.getpid()}", "cluster": {"nodes": 1, "ranks_per_node": 1},
                              "parallel": {"tensor": 1, "pipeline": 1},
                              "agent": {"shm_dir": str(tmp_path), "socket_dir": str(tmp_path)}})
    attached_at_start = []
    real_start = job_agreement.JobAgreement.start

    def start(self):
        attached_at_start.append(agent.slots.agreement.job is self)
        return real_start(self)

    monkeypatch.setattr(job_agreement.JobAgreement, "start", start)
    agent = Agent(cfg, 0)
    try:
        agent.start_agreement()
        assert attached_at_start == [True] and agent.agreement is agent.slots.agreement.job
    finally:
        agent.shutdown()
