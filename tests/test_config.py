"""Config validation: every bad value names the field, the value and what is allowed."""
import argparse
import os

import pytest

from megatron_ft import config


def test_default_config_is_local_cpu():
    cfg = config.load()
    assert (cfg.cluster.nodes, cfg.cluster.ranks_per_node) == (2, 2)
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.data_parallel) == (1, 2, 2)
    assert cfg.snapshot.interval == 1


def test_shipped_config_file_matches_embedded_default():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert config.load(os.path.join(here, "configs", "local-cpu.yaml")) == config.load()


@pytest.mark.parametrize("data, match", [
    ({"cluster": {"nodes": 0}}, r"cluster.nodes=0 is invalid: must be an integer >= 1"),
    ({"cluster": {"nodes": "two"}}, r"cluster.nodes='two'"),
    ({"snapshot": {"interval": -1}}, r"snapshot.interval=-1"),
    ({"snapshot": {"chunk_mib": 4096}}, r"snapshot.chunk_mib=4096 is invalid: must be an integer >= 1 and <= 1024"),
    ({"persist": {"keep": 0}}, r"persist.keep=0"),
    ({"launch": {"rdzv_port": 80}}, r"launch.rdzv_port=80"),
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
    monkeypatch.delenv("MFT_CONFIG", raising=False)
    monkeypatch.delenv("MFT_RUN_ID", raising=False)
    f = tmp_path / "job.yaml"
    f.write_text("run_id: job1\nsnapshot: {interval: 5}\npersist: {interval: 20, dir: /tmp/x}\n")
    p = config.add_inmem_ckpt_args(argparse.ArgumentParser())
    args = p.parse_args(["--inmem-ckpt", "--inmem-ckpt-config", str(f), "--inmem-ckpt-interval", "2",
                         "--inmem-ckpt-persist-dir", "/tmp/y"])
    cfg = config.from_args(args)
    assert args.inmem_ckpt and cfg.run_id == "job1"
    assert cfg.snapshot.interval == 2 and cfg.persist.interval == 20 and cfg.persist.dir == "/tmp/y"
    args = p.parse_args(["--inmem-ckpt-config", str(f), "--inmem-ckpt-interval", "0"])
    with pytest.raises(config.ConfigError, match="snapshot.interval=0"):
        config.from_args(args)


def test_socket_path_too_long_is_a_clear_error():
    from megatron_ft.protocol import socket_path

    with pytest.raises(ValueError, match=r"agent.socket_dir='/tmp/x+' is too long"):
        socket_path("/tmp/" + "x" * 120, "run", 0)


def test_launch_rejects_bad_node_rank(tmp_path, capsys):
    from megatron_ft import cli

    rc = cli.main(["launch", "--nodes", "2", "--node-rank", "5", "--run-dir", str(tmp_path), "--", "train.py"])
    assert rc == 2
    assert "--node-rank=5 is invalid: must be in [0, 1]" in capsys.readouterr().err
