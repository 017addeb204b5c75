"""The settings of going on at fewer data-parallel replicas (``recovery.elastic_after_s``,
``cluster.elastic.min_data_parallel``): off by default, bad values named, a job that could not shrink
refused before anything starts - by ``megatron-ft config`` from the layout, by ``megatron-ft launch``
from the layout and the training command's batch sizes (megatron_ft/launch/command.py)."""
import os
import subprocess
import sys
import uuid

import pytest
import yaml

from megatron_ft import cli, config
from megatron_ft.launch.command import batch_sizes, describe_elastic, elastic_refusal_of

#: 3 nodes x 2 ranks at TP1 PP2: DP 3, and DP 2 after losing a node (the policy's worked example)
THREE_BY_TWO = {"cluster": {"nodes": 3, "ranks_per_node": 2}, "parallel": {"tensor": 1, "pipeline": 2}}


def elastic(data: dict, after_s: float = 30) -> dict:
    """``data`` with shrinking on after ``after_s`` seconds."""
    return {**data, "recovery": {**data.get("recovery", {}), "elastic_after_s": after_s}}


def write(tmp_path, data: dict, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_shrinking_is_off_by_default():
    for cfg in (config.load(), config.from_dict({})):
        assert cfg.recovery.elastic_after_s == 0 and not cfg.recovery.elastic
        assert cfg.cluster.elastic.min_data_parallel == 1
        assert elastic_refusal_of(cfg) is None and describe_elastic(cfg) is None
    assert config.from_dict({"cluster": {"elastic": None}}).cluster.elastic.min_data_parallel == 1  # "elastic:"
    on = config.from_dict(elastic(THREE_BY_TWO))
    assert on.recovery.elastic and on.recovery.elastic_after_s == 30.0


@pytest.mark.parametrize("data, match", [
    ({"recovery": {"elastic_after_s": -1}}, r"recovery.elastic_after_s=-1 is invalid: must be a number >= 0.0"),
    ({"recovery": {"elastic_after_s": "soon"}}, r"recovery.elastic_after_s='soon' is invalid: must be a number >= 0"),
    ({"recovery": {"elastic_after_s": True}}, r"recovery.elastic_after_s=True is invalid: must be a number >= 0"),
    ({"cluster": {"elastic": {"min_data_parallel": 0}}},
     r"cluster.elastic.min_data_parallel=0 is invalid: must be an integer >= 1"),
    ({"cluster": {"elastic": {"min_data_parallel": 1.5}}},
     r"cluster.elastic.min_data_parallel=1.5 is invalid: must be an integer >= 1"),
    ({"cluster": {"elastic": {"min_data_paralel": 2}}},
     r"unknown key\(s\) \['cluster.elastic.min_data_paralel'\]; allowed: \['cluster.elastic.min_data_parallel'\]"),
    ({"cluster": {"elastic": 2}}, r"cluster.elastic=2 must be a mapping"),
])
def test_bad_values_are_named(data, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(data)


def test_a_minimum_above_the_jobs_data_parallel_size_is_refused_when_shrinking_is_on():
    data = {**THREE_BY_TWO, "cluster": {**THREE_BY_TWO["cluster"], "elastic": {"min_data_parallel": 4}}}
    with pytest.raises(config.ConfigError, match=r"cluster.elastic.min_data_parallel=4 is invalid: must be at most "
                                                 r"the job's data-parallel size 3 .* recovery.elastic_after_s=30"):
        config.from_dict(elastic(data))
    assert config.from_dict(data).cluster.elastic.min_data_parallel == 4  # off: nothing to check it against
    # at the job's own size it reads, and the launch's check says why it cannot shrink
    at_three = config.from_dict(elastic({**data, "cluster": {**data["cluster"], "elastic": {"min_data_parallel": 3}}}))
    assert "DP 2 is below cluster.elastic.min_data_parallel=3" in elastic_refusal_of(at_three)


@pytest.mark.parametrize("data, reason", [
    ({"cluster": {"nodes": 2, "ranks_per_node": 2}, "parallel": {"tensor": 1, "pipeline": 4}},
     "losing one node leaves 2 ranks at TP1 x PP4: 2 ranks are not a multiple of TP1 x PP4 = 4; this layout "
     "fits no smaller number of nodes"),
    ({"cluster": {"nodes": 1, "ranks_per_node": 4}, "parallel": {"tensor": 1, "pipeline": 2}},
     "a job of one node has no node to lose and go on without"),
    ({"cluster": {"nodes": 4, "ranks_per_node": 2}, "parallel": {"tensor": 1, "pipeline": 1, "expert": 4}},
     "losing one node leaves 6 ranks at TP1 x PP1: DP 6 is not a multiple of the expert parallelism 4; this "
     "layout fits only after losing more nodes: 2 nodes at DP 4"),
])
def test_a_layout_that_cannot_shrink_is_refused_when_on_and_read_when_off(tmp_path, capsys, data, reason):
    path = write(tmp_path, elastic(data))
    refusal = elastic_refusal_of(config.load(path))
    assert refusal.startswith("recovery.elastic_after_s=30 is invalid for this job: it needs a smaller "
                              "data-parallel size to go on at") and reason in refusal, refusal
    assert refusal.endswith("(or set recovery.elastic_after_s: 0, off)") or "one node" in reason
    assert cli.main(["config", path]) == 2
    assert f"megatron-ft: configuration error: {refusal}" in capsys.readouterr().err
    off = write(tmp_path, data, "off.yaml")
    assert elastic_refusal_of(config.load(off)) is None
    assert cli.main(["config", off]) == 0 and capsys.readouterr().out == f"{off}: valid\n"


def test_config_prints_the_sizes_a_job_goes_on_at(tmp_path, capsys):
    path = write(tmp_path, elastic(THREE_BY_TWO))
    assert cli.main(["config", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: valid"
    assert out[1].startswith("recovery.elastic_after_s=30: a node lost with no standby or replacement")
    assert "(DP 3 now, at least cluster.elastic.min_data_parallel=1): 2 nodes at DP 2, 1 node at DP 1" in out[1]
    assert "the refusal at launch is in place; the continuation is not yet" in out[1]
    assert cli.main(["config", "--print", path]) == 0
    printed = capsys.readouterr().out
    assert '"elastic_after_s": 30.0' in printed and '"min_data_parallel": 1' in printed


@pytest.mark.parametrize("argv, sizes", [
    (["pretrain_gpt.py", "--global-batch-size", "18", "--micro-batch-size", "2"], (18, 2)),
    (["pretrain_gpt.py", "--global-batch-size=18", "--micro-batch-size=2"], (18, 2)),
    (["pretrain_gpt.py", "--micro-batch-size=2", "--num-layers", "2"], (None, 2)),
    (["pretrain_gpt.py", "--global-batch-size", "8", "--global-batch-size=16"], (16, None)),  # the last wins
    (["pretrain_gpt.py", "--num-layers", "2", "--global-batch-sizes", "4"], (None, None)),  # no abbreviations
    ([], (None, None)),
])
def test_the_batch_sizes_of_a_training_command(argv, sizes):
    assert batch_sizes(argv) == sizes


@pytest.mark.parametrize("argv, match", [
    (["x.py", "--global-batch-size", "0"], r"--global-batch-size='0' is invalid: must be an integer >= 1"),
    (["x.py", "--micro-batch-size=two"], r"--micro-batch-size='two' is invalid"),
    (["x.py", "--micro-batch-size"], r"--micro-batch-size='' is invalid"),
])
def test_bad_batch_sizes_are_named(argv, match):
    with pytest.raises(config.ConfigError, match=match):
        batch_sizes(argv)


def test_the_batch_is_checked_only_when_both_sizes_are_given():
    cfg = config.from_dict(elastic(THREE_BY_TWO))
    assert elastic_refusal_of(cfg) is None
    assert elastic_refusal_of(cfg, 12, 2) is None  # 12 = DP 3 x 2 x 2 = DP 2 x 2 x 3
    assert elastic_refusal_of(cfg, 18, None) is None and elastic_refusal_of(cfg, None, 2) is None
    refusal = elastic_refusal_of(cfg, 18, 2)
    assert refusal == ("recovery.elastic_after_s=30 is invalid for this job: it needs a smaller data-parallel size "
                       "to go on at, and losing one node leaves 4 ranks at TP1 x PP2: DP 2, and the global batch 18 "
                       "is not a multiple of DP 2 x micro-batch 2 = 4; a global batch that fits DP 3 and DP 2 at "
                       "micro-batch 2 is a multiple of 12 (12, 24, 36, ...), or the global batch 18 fits at "
                       "micro-batch 1 or 3")
    assert elastic_refusal_of(config.from_dict(THREE_BY_TWO), 18, 2) is None  # off: nothing to refuse


def session_processes(sid: int) -> list[int]:
    """Every process of session ``sid`` still alive (its leader ended: what it left behind)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # stat's 6th field: the session
            out.append(int(pid))
    return out


def test_launch_refuses_a_batch_that_cannot_shrink_before_anything_starts(tmp_path):
    """`megatron-ft launch` with 3 nodes x 2 ranks TP1 PP2 and shrinking on, for a training command of
    global batch 18 at micro-batch 2: DP 2 after a lost node does not divide it. The launch ends at once
    with exit 2 and the reason - no run directory, no agent, no trainer, nothing in /dev/shm."""
    run_id = f"elastic-{uuid.uuid4().hex[:8]}"
    path = write(tmp_path, elastic({**THREE_BY_TWO, "run_id": run_id}))
    run_dir, marker = tmp_path / "run", tmp_path / "trainer-ran"
    cmd = [sys.executable, "-m", "megatron_ft.cli", "launch", "--config", path, "--run-dir", str(run_dir), "--",
           "-c", f"open({str(marker)!r}, 'w')", "--global-batch-size", "18", "--micro-batch-size", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 2, (out, err)
    assert ("megatron-ft: configuration error: recovery.elastic_after_s=30 is invalid for this job" in err
            and "the global batch 18 is not a multiple of DP 2 x micro-batch 2 = 4" in err
            and "a multiple of 12" in err), err
    assert session_processes(proc.pid) == []
    assert not run_dir.exists() and not marker.exists()
    assert [n for n in os.listdir("/dev/shm") if run_id in n] == []
