"""Config validation: every bad value names the field, the value and what is allowed."""
import os

import pytest

from megatron_ft import config
from megatron_ft.testing.helpers import inmem_ckpt_flags


def test_default_config_is_local_cpu():
    cfg = config.load()
    assert (cfg.cluster.nodes, cfg.cluster.ranks_per_node) == (2, 2)
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.data_parallel) == (1, 2, 2)
    assert cfg.snapshot.interval == 1


def test_shipped_config_file_matches_embedded_default():
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert config.load(os.path.join(here, "configs", "local-cpu.yaml")) == config.load()


@pytest.mark.parametrize("data, match", [
    ({"cluster": {"nodes": 0}}, r"cluster.nodes=0 is invalid: must be an integer >= 1"),
    ({"cluster": {"nodes": "two"}}, r"cluster.nodes='two'"),
    ({"snapshot": {"interval": -1}}, r"snapshot.interval=-1"),
    ({"snapshot": {"chunk_mib": 4096}}, r"snapshot.chunk_mib=4096 is invalid: must be an integer >= 1 and <= 1024"),
    ({"persist": {"keep": 0}}, r"persist.keep=0"),
    ({"launch": {"rdzv_port": 80}}, r"launch.rdzv_port=80"),
    ({"launch": {"rdzv_ports": 0}}, r"launch.rdzv_ports=0 is invalid: must be an integer >= 1 and <= 1000"),
    ({"launch": {"trainer_port": 70000}}, r"launch.trainer_port=70000 is invalid: must be an integer >= 1024 and <= 65535"),
    ({"network": {"peer_port": "any"}}, r"network.peer_port='any'"),
    # the ranges of the port plan must not overlap (one machine: the agents' servers take port + node)
    ({"network": {"peer_port": 29401}}, r"network.peer_port=29401 is invalid: its ports 29401-29402 \(the agents' "
                                        r"peer transport\) overlap 29400-29407 of launch.rdzv_port=29400"),
    ({"cluster": {"nodes": 150}, "parallel": {"pipeline": 1}},
     r"network.peer_port=29600 is invalid: its ports 29600-29749 .* overlap 29500-29649 of health.store_port"),
    ({"launch": {"trainer_port": 65534}}, r"launch.trainer_port=65534 is invalid: its ports 65534-65537 .* run past 65535"),
    ({"launch": {"start_timeout_s": 0}}, r"launch.start_timeout_s=0 is invalid: must be a number >= 1.0"),
    ({"agent": {"required": "yes"}}, r"agent.required='yes' is invalid: must be true or false"),
    ({"run_id": "bad id!"}, r"run_id='bad id!'"),
    ({"parallel": {"pipeline": 3}}, r"does not divide the world size"),
    ({"snapshot": {"intervall": 2}}, r"unknown key\(s\) \['snapshot.intervall'\]"),
    ({"redundancey": {"scheme": "xor"}}, r"unknown key\(s\) \['redundancey'\]"),
    ({"persist": {"on_failure": "yes"}}, r"persist.on_failure='yes'"),
    ({"redundancy": {"scheme": "replica", "transport": "nccl"}},
     r"redundancy.transport='nccl' is invalid: must be one of agent, scheduled"),
    ({"redundancy": {"scheme": "xor", "transport": "scheduled"}},
     r"redundancy.transport='scheduled' is invalid: the scheduled transport sends whole copies: it needs "
     r"redundancy.scheme=replica, not 'xor'"),
    ({"schedule": {"mode": "eager"}}, r"schedule.mode='eager' is invalid: must be one of pipelined, one-buffer"),
    ({"schedule": {"sub_buffers": 0}}, r"schedule.sub_buffers=0 is invalid: must be an integer >= 1 and <= 64"),
    ({"schedule": {"mu": 1.5}}, r"schedule.mu=1.5 is invalid: must be a number > 0.0 and <= 1.0"),
    ({"schedule": {"profile_iterations": 1}}, r"schedule.profile_iterations=1 is invalid: must be an integer >= 2"),
    ({"schedule": {"idle": "cpu"}}, r"schedule.idle='cpu' is invalid: must be one of network, device, auto"),
    ({"schedule": {"compare_modes": "local,none"}},
     r"schedule.compare_modes=.*must list modes of pipelined, .*, end, local, off"),
])
def test_bad_values_are_named(data, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(data)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [1, 2\n")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load(str(bad))


def test_flags_override_file(tmp_path, monkeypatch):
    f = tmp_path / "job.yaml"
    p = inmem_ckpt_flags(monkeypatch, f,
                         "run_id: job1\nsnapshot: {interval: 5}\npersist: {interval: 20, dir: /tmp/x}\n")
    args = p.parse_args(["--inmem-ckpt", "--inmem-ckpt-config", str(f), "--inmem-ckpt-interval", "2",
                         "--inmem-ckpt-persist-dir", "/tmp/y"])
    cfg = config.from_args(args)
    assert args.inmem_ckpt and cfg.run_id == "job1"
    assert cfg.snapshot.interval == 2 and cfg.persist.interval == 20 and cfg.persist.dir == "/tmp/y"
    args = p.parse_args(["--inmem-ckpt-config", str(f), "--inmem-ckpt-interval", "0"])
    with pytest.raises(config.ConfigError, match="snapshot.interval=0"):
        config.from_args(args)


def test_socket_path_too_long_is_a_clear_error():
    from megatron_ft.agent.protocol import socket_path

    with pytest.raises(ValueError, match=r"agent.socket_dir='/tmp/x+' is too long"):
        socket_path("/tmp/" + "x" * 120, "run", 0)


def test_launch_rejects_bad_node_rank(tmp_path, capsys):
    from megatron_ft import cli

    rc = cli.main(["launch", "--nodes", "2", "--node-rank", "5", "--run-dir", str(tmp_path), "--", "train.py"])
    assert rc == 2
    assert "--node-rank=5 is invalid: must be in [0, 1]" in capsys.readouterr().err


def test_duplicate_yaml_keys_are_refused(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("cluster:\n  nodes: 2\nagent:\n  shm_dir: /dev/shm\ncluster:\n  nodes: 3\n")
    with pytest.raises(config.ConfigError, match=r"key 'cluster' is given twice \(first line 1\)"):
        config.load(str(p))
    p.write_text("cluster:\n  nodes: 2\n  nodes: 3\n")
    with pytest.raises(config.ConfigError, match="key 'nodes' is given twice"):
        config.load(str(p))


def test_launch_refuses_a_missing_shared_memory_directory_before_anything_runs(tmp_path, capsys):
    """No agent can hold snapshots: the launcher ends at once with exit 2 and the reason, before any
    agent or trainer starts (agent.required defaults to true)."""
    import yaml

    from megatron_ft import cli, fatal

    cfg = config.replace(config.load(), agent={"shm_dir": str(tmp_path / "no-such-tmpfs")},
                         cluster={"nodes": 1, "ranks_per_node": 1}, parallel={"tensor": 1, "pipeline": 1})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    marker = tmp_path / "trainer-ran"
    rc = cli.main(["launch", "--config", str(path), "--node-rank", "0", "--run-dir", str(tmp_path / "run"), "--",
                   "-c", f"open({str(marker)!r}, 'w')"])
    out = capsys.readouterr().out
    assert rc == fatal.EXIT_CODE and "agent.shm_dir=" in out and "does not exist" in out, out
    assert not marker.exists()
    assert fatal.read(str(tmp_path / "run"))[0] == 0


def test_a_trainer_without_its_agent_ends_the_job_unless_allowed(tmp_path):
    """agent.required (default): no agent -> exit 2 and a fatal record the launchers act on (never
    retried by torchrun); agent.required: false -> it trains unprotected, saying so."""
    import subprocess
    import sys

    from megatron_ft import fatal

    code = ("import sys; from megatron_ft import config; from megatron_ft.trainer.checkpointer import InMemoryCheckpointer; "
            "cfg = config.replace(config.load(), agent={'required': sys.argv[1] == 'true'}); "
            "c = InMemoryCheckpointer(cfg, None, 0, 1, {}, node=0, agent_socket='/nonexistent/agent.sock'); "
            "print('protected:', c.engine is not None)")
    env = dict(os.environ, MFT_RUN_DIR=str(tmp_path), MFT_NODE_RANK="0")
    out = subprocess.run([sys.executable, "-c", code, "true"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == fatal.EXIT_CODE, out.stderr[-2000:]
    node, msg = fatal.read(str(tmp_path))
    assert node == 0 and "no snapshot agent at /nonexistent/agent.sock" in msg and "agent.required" in msg
    os.unlink(fatal.record_path(str(tmp_path), 0))
    out = subprocess.run([sys.executable, "-c", code, "false"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "protected: False" in out.stdout, out.stderr[-2000:]
    assert "in-memory snapshots are OFF" in out.stderr and fatal.read(str(tmp_path)) is None


def test_launcher_takes_the_training_commands_flags_for_its_agents(tmp_path):
    """One source of truth: --inmem-ckpt-* on the training command override the YAML for the agents
    too (the launcher reads them from the command it starts), exactly as the trainers apply them."""
    from megatron_ft import launch

    yml = tmp_path / "job.yaml"
    yml.write_text("persist:\n  dir: /tmp/from-yaml\n  interval: 10\n")
    cmd = ["pretrain_gpt.py", "--num-layers", "2", "--inmem-ckpt", "--inmem-ckpt-persist-dir", str(tmp_path / "fast"),
           "--inmem-ckpt-persist-interval", "3", f"--inmem-ckpt-config={yml}"]
    cfg = launch.job_config(None, cmd)
    assert (cfg.persist.dir, cfg.persist.interval) == (str(tmp_path / "fast"), 3)
    trainer = config.from_args(config.command_flags(cmd[1:]))
    assert config.settings_differ(config.shared_settings(trainer), config.shared_settings(cfg)) == []
    assert launch.job_config(str(yml), cmd).persist.dir == str(tmp_path / "fast")
    other = tmp_path / "other.yaml"
    other.write_text("persist:\n  interval: 5\n")
    with pytest.raises(config.ConfigError, match="other.yaml.*job.yaml|job.yaml.*other.yaml"):
        launch.job_config(str(other), cmd)
    with pytest.raises(config.ConfigError, match="--inmem-ckpt"):
        launch.job_config(None, ["x.py", "--inmem-ckpt-persist-interval", "often"])


def test_settings_that_differ_are_named_with_both_values():
    a = config.shared_settings(config.load(None))
    b = dict(a, **{"persist.dir": "/elsewhere", "persist.interval": 7})
    assert config.settings_differ(a, b) == [f"persist.dir: {a['persist.dir']!r} vs '/elsewhere'",
                                            f"persist.interval: {a['persist.interval']!r} vs 7"]


def test_launch_takes_its_node_from_a_slurm_step(tmp_path, capsys, monkeypatch):
    """Under srun the launcher places itself by the step's environment (no --node-rank): node 1 of the
    step's hosts, the first as the rendezvous. Here the hosts do not exist, so the launcher then refuses
    to start (exit 2, before anything runs) - after saying where it stood."""
    from megatron_ft import cli

    for k in [k for k in os.environ if k.startswith("SLURM") or k == "JOB_COMPLETION_INDEX"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "mft-absent-a[1-2]")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.setenv("SLURMD_NODENAME", "mft-absent-a2")
    rc = cli.main(["launch", "--nodes", "2", "--run-dir", str(tmp_path), "--", "train.py"])
    out = capsys.readouterr()
    assert rc == 2, out
    assert ("slurm: this host is node 1 of 2 (SLURMD_NODENAME=mft-absent-a2 in SLURM_STEP_NODELIST); nodes "
            "mft-absent-a1, mft-absent-a2, rendezvous on mft-absent-a1") in out.out, out.out
    monkeypatch.setenv("SLURMD_NODENAME", "mft-absent-b7")  # not among the step's hosts, and no SLURM_NODEID
    assert cli.main(["launch", "--nodes", "2", "--run-dir", str(tmp_path), "--", "train.py"]) == 2
    assert "cannot tell this host's place" in capsys.readouterr().err


def test_a_host_beyond_the_nodes_without_redundancy_says_it_has_nothing_to_do(tmp_path, capsys, monkeypatch):
    """An allocation's extra host is a standby; under redundancy.scheme none it says why it does nothing
    and ends (exit 0: the job's step does not fail for it)."""
    from megatron_ft import cli

    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    rc = cli.main(["launch", "--nodes", "2", "--run-dir", str(tmp_path), "--", "train.py"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "kubernetes: this host is a standby (host 2 of the allocation, beyond its 2 nodes)" in out
    assert "a standby has nothing to take over; this host does nothing" in out
