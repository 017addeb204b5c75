"""Every shipped cluster config is valid and plannable: `megatron-ft plan` runs on it."""
import glob
import os
import subprocess
import sys

import pytest

from megatron_ft import config as ftconfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")) + glob.glob(os.path.join(REPO, "configs", "cpu", "*.yaml"))
                 + glob.glob(os.path.join(REPO, "configs", "gpu", "*.yaml")))


def test_there_are_real_cluster_examples():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"local-cpu.yaml", "a100-16x8-400g.yaml", "a100-4x4-100g.yaml", "h100-1000x8-rs.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_shipped_config_plans(path):
    cfg = ftconfig.load(path)  # validated: raises ConfigError naming the field otherwise
    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "plan", "--config", path,
                          "--state-bytes-per-rank", "1GiB"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    # the plan is of this file's cluster: its topology, from the file's own numbers (DP = the rest)
    n, r, tp, pp = cfg.cluster.nodes, cfg.cluster.ranks_per_node, cfg.parallel.tensor, cfg.parallel.pipeline
    topology = f"topology: {n} nodes x {r} ranks = {n * r} ranks, TP {tp} x DP {n * r // (tp * pp)} x PP {pp}"
    assert topology in lines, (topology, out.stdout[:2000])
    if cfg.parallel.expert > 1:  # a MoE job: what a rank holds of the dense and the expert state, and with whom
        ep = cfg.parallel.expert
        assert any(ln.startswith(f"mixture of experts: EP {ep}, EDP {n * r // (tp * pp) // ep} ") for ln in lines), out.stdout
    # of its scheme, with the simultaneous node failures that scheme survives: none, m - 1 of m
    # replicas (GEMINI), one per parity group (REFT), m of k + m (ECHECK)
    red = cfg.redundancy
    assert any(ln.startswith(f"scheme: {red.scheme} (") for ln in lines), out.stdout[:2000]
    tolerance = {"none": 0, "replica": red.replicas - 1, "xor": 1, "rs": red.m}[red.scheme]
    assert f"  whole job: any {tolerance} failure(s) wherever they fall" in lines, (tolerance, out.stdout)
    if not cfg.health.one_machine:  # real clusters say where every node's agent listens
        assert cfg.health.host_of(cfg.cluster.nodes - 1) != "127.0.0.1"


def cli_schema() -> dict:
    import json

    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "config", "--schema"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_schema_validates_every_shipped_config_and_refuses_bad_ones():
    """`megatron-ft config --schema` is what editors check a cluster file with: every shipped file
    passes it, and a wrong type, an out-of-range value, a scheme that does not exist and an unknown
    key each fail it."""
    import jsonschema

    schema = cli_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in CONFIGS:
        errors = [e.message for e in validator.iter_errors(ftconfig.load_yaml(open(path)))]
        assert errors == [], (path, errors)
    for bad in ({"cluster": {"nodes": "two"}}, {"cluster": {"nodes": 0}}, {"redundancy": {"scheme": "raid6"}},
                {"snapshot": {"intervall": 1}}, {"snapshot": {"interval": "sometimes"}}, {"clusters": {}}):
        assert list(validator.iter_errors(bad)), bad
    assert not list(validator.iter_errors({"snapshot": {"interval": "auto"}, "persist": {"interval": 10}}))
