"""``megatron-ft deploy kubernetes``: the rendered manifests are valid Kubernetes objects (the API's
own schemas, offline, strict: an unknown field fails) and carry what the job needs."""
import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from megatron_ft import config as ftconfig
from megatron_ft import deploy

EXAMPLES = os.path.join(REPO, "examples", "kubernetes")
#: the oldest API the manifests must fit (backoffLimitPerIndex and podFailurePolicy are on by default
#: from 1.29/1.26) and the newest the validator knows
KUBERNETES = ("1.30.0", kubernetes_validate.latest_version() + ".0")
COMMAND = ["/opt/Megatron-LM/pretrain_gpt.py", "--inmem-ckpt", "--save", "/ckpt", "--load", "/ckpt",
           "<model and data flags>"]


def render(name, *extra):
    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "deploy", "kubernetes",
                          f"--config={os.path.join(REPO, 'configs', name + '.yaml')}",
                          "--image=registry.example.com/megatron-lm-ft:core_v0.19.0", "--state-bytes-per-rank=12GiB",
                          "--gpus-per-node=8", f"--persist-claim={name}-persist", *extra, "--", *COMMAND],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("name", ["replica-16x8", "rs-16x8"])
def test_the_examples_are_the_rendered_manifests_and_validate(name):
    text = render(name)
    with open(os.path.join(EXAMPLES, name + ".yaml"), encoding="utf-8") as f:
        assert f.read() == text, f"examples/kubernetes/{name}.yaml is stale: render it again (its README)"
    docs = list(yaml.safe_load_all(text))
    for doc in docs:
        for version in KUBERNETES:
            kubernetes_validate.validate(doc, version, strict=True)
    service, config_map, job = docs
    cfg = ftconfig.load(os.path.join(REPO, "configs", name + ".yaml"))
    spec = job["spec"]
    # one pod per node, its index the node rank; the pods under the headless Service's name
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", cfg.cluster.nodes,
                                                                                 cfg.cluster.nodes)
    assert service["spec"]["clusterIP"] == "None" and spec["template"]["spec"]["subdomain"] == name
    # the pods read the cluster file with their names, node 0 as the rendezvous, the mounted secret
    pod_cfg = ftconfig.from_dict(yaml.safe_load(config_map["data"]["cluster.yaml"]))
    assert pod_cfg.health.host_of(3) == f"{name}-3.{name}" and pod_cfg.launch.master_addr == f"{name}-0.{name}"
    assert pod_cfg.security.secret_file == "/etc/megatron-ft/secret/secret"
    assert pod_cfg.redundancy == cfg.redundancy and pod_cfg.cluster == cfg.cluster
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:5] == ["megatron-ft", "launch", "--config", "/etc/megatron-ft/cluster.yaml",
                                        "--run-dir"] and container["command"][-len(COMMAND):] == COMMAND
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert volumes["secret"]["secret"]["secretName"] == f"{name}-secret" and mounts["secret"]["readOnly"]
    assert volumes["persist"]["persistentVolumeClaim"]["claimName"] == f"{name}-persist"
    assert mounts["persist"]["mountPath"] == cfg.persist.dir and mounts["shm"]["mountPath"] == cfg.agent.shm_dir
    # /dev/shm: the plan's bytes for the fullest node, in memory
    shm = volumes["shm"]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"] == deploy.quantity(deploy.shm_bytes_per_node(cfg, 12 << 30))
    # every port megatron-ft listens on, in the pod and the Service
    want = [p for r in ftconfig.port_plan(pod_cfg) for p in range(r.first, r.first + r.count)]
    assert [p["containerPort"] for p in container["ports"]] == want
    assert [p["port"] for p in service["spec"]["ports"]] == want
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_shared_memory_follows_the_scheme():
    """Two slots per rank, plus the peer blocks: a replica node holds one other node's snapshots too."""
    base = {"cluster": {"nodes": 4, "ranks_per_node": 2}}
    none = deploy.shm_bytes_per_node(ftconfig.from_dict(base), 1 << 30)
    replica = deploy.shm_bytes_per_node(ftconfig.from_dict({**base, "redundancy": {"scheme": "replica"}}), 1 << 30)
    assert none == int(2 * 2 * (1 << 30) * (1 + deploy.SHM_MARGIN))
    assert replica == int((2 * 2 + 3 * 2) * (1 << 30) * (1 + deploy.SHM_MARGIN))


@pytest.mark.parametrize("args,match", [
    (["--name=Bad_Name"], r"--name='Bad_Name' is invalid"),
    (["--state-bytes-per-rank=lots"], r"--state-bytes-per-rank='lots' is invalid"),
    (["--state-bytes-per-rank=0"], r"--state-bytes-per-rank=0 is invalid"),
])
def test_bad_input_is_refused_naming_the_value(args, match):
    import re

    out = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "deploy", "kubernetes", "--image=x",
                          "--state-bytes-per-rank=1GiB", *args, "--", "train.py"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and re.search(match, out.stderr), out.stderr
