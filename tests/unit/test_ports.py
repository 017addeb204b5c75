"""The job's port plan: every server megatron-ft runs listens on a port its configuration sets."""
def test_the_port_plan_names_every_server_and_moves_with_its_settings():
    """Every server megatron-ft runs has a range, set by one setting; hosts of their own use the same
    ports on every host, one machine one port per node; fast restart rounds widen the trainers' range."""
    from megatron_ft import config
    from megatron_ft.network import peer_port, rendezvous_ports

    one = config.from_dict({"cluster": {"nodes": 3}, "parallel": {"pipeline": 1}})
    by = {r.setting: (r.first, r.count) for r in config.port_plan(one)}
    assert by == {"launch.rdzv_port": (29400, 8), "health.store_port": (29500, 3), "network.peer_port": (29600, 3),
                  "launch.trainer_port": (29700, 4)}
    hosts = config.replace(one, health={"host_pattern": "n{node}"}, launch={"max_restarts": 0, "trainer_port": 31000},
                           network={"peer_port": 30000})
    by = {r.setting: (r.first, r.count) for r in config.port_plan(hosts)}
    assert by["network.peer_port"] == (30000, 1) and by["launch.trainer_port"] == (31000, 1)  # no fast rounds
    assert [peer_port(one, n) for n in range(3)] == [29600, 29601, 29602]
    assert [peer_port(hosts, n) for n in range(3)] == [30000] * 3
    assert rendezvous_ports(one, 9)[:2] == [29401, 29402]  # generation 9 of 8 ports: wraps around


def test_the_trainers_store_moves_to_the_configured_port_once():
    from megatron_ft.spares.fast_restart import adopt_trainer_port, round_port

    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "45123", "MFT_TRAINER_PORT": "29700"}
    adopt_trainer_port(env)
    assert env == {"MASTER_ADDR": "node0", "MASTER_PORT": "29700"} and round_port(env, 2) == 29702
    env["MASTER_PORT"] = "29702"  # a fast round's own port is left alone afterwards
    adopt_trainer_port(env)
    assert env["MASTER_PORT"] == "29702"
    plain = {"MASTER_ADDR": "a", "MASTER_PORT": "45123"}  # a plain torchrun: torchrun's choice stays
    adopt_trainer_port(plain)
    assert plain["MASTER_PORT"] == "45123"


def test_the_trainers_store_listens_on_its_address_only_not_every_interface():
    """The trainers' process-group store megatron-ft hosts (a keeper's fork, or torchrun's rank 0) is
    given its listening socket: bound to MASTER_ADDR's address, where torch alone would bind every
    interface. Both hosts serve a client; ``ss`` shows the address."""
    import datetime
    import os
    import signal
    import subprocess

    from megatron_ft.spares import fast_restart as fr
    from megatron_ft.testing.hosts import parse_listeners
    from megatron_ft.testing.helpers import free_port

    def listening(port):
        ss = subprocess.run(["ss", "-H", "-ltn", f"sport = :{port}"], capture_output=True, text=True).stdout
        return sorted({x.address for x in parse_listeners(ss)})

    from torch.distributed import TCPStore

    port = free_port()
    store = fr.hosted_store("127.0.0.1", port, None, datetime.timedelta(seconds=5), wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v" and listening(port) == ["127.0.0.1"]
    del client, store

    pid, got = fr.host_round_store("127.0.0.1", free_port())
    try:
        client = TCPStore("127.0.0.1", got, is_master=False, timeout=datetime.timedelta(seconds=5))
        client.set("k", "w")
        assert client.get("k") == b"w" and listening(got) == ["127.0.0.1"]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
