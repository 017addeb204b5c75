"""``megatron-ft deploy kubernetes``: a job's Kubernetes manifests, rendered from its cluster file.

:func:`kubernetes_manifests` is pure; the command prints its result as one YAML stream for
``kubectl apply -f``. What it renders, for a job named ``J`` (``--name``, default the run id):

* a headless ``Service`` ``J`` (``clusterIP: None``) selecting the job's pods and publishing them
  before they are ready, so that every pod has the DNS name ``J-<index>.J`` while the launchers start
  (an indexed Job's pod is named ``J-<index>``; ``subdomain: J`` puts it under the Service);
* a ``ConfigMap`` ``J-cluster`` holding the cluster file as the pods read it: ``health.host_pattern:
  "J-{node}.J"``, ``launch.master_addr: J-0.J`` (node 0 hosts the rendezvous), ``network.interface:
  eth0`` (the pod's network, for gloo/NCCL and megatron-ft's servers), ``security.secret_file`` the
  mounted Secret, everything else as the file says;
* an indexed ``Job`` ``J``: ``completions`` = ``parallelism`` = ``cluster.nodes``, a pod's index its
  node rank (``megatron-ft launch`` reads ``JOB_COMPLETION_INDEX``: :mod:`megatron_ft.scheduler`).
  A pod that is lost is replaced by the Job controller with a pod of the same index - the same name,
  so the same node: the node's replacement, restored from its group's peers or from disk - up to
  ``--replacements`` times per index (``backoffLimitPerIndex``); a pod evicted or preempted
  (``DisruptionTarget``) does not count; a launcher that refuses its configuration (exit 2) fails
  the whole Job at once (``podFailurePolicy``) instead of being retried;
* ``/dev/shm`` as an ``emptyDir`` with ``medium: Memory`` and a ``sizeLimit`` computed like ``megatron-ft
  plan --state-bytes-per-rank``: per node, two snapshot slots per local rank plus the peer blocks it
  holds, :data:`~megatron_ft.agent.block_store.MAX_VERSIONS` versions each, plus :data:`SHM_MARGIN`
  (headers, rounding);
* the job secret from the ``Secret`` ``--secret`` (key ``secret``), mounted read-only - never rendered:
  the operator creates it (``kubectl create secret generic J-secret --from-file=secret=FILE``), so no
  manifest in a repository carries it;
* ``persist.dir`` from a ``PersistentVolumeClaim`` (``--persist-claim``), which must be shared storage
  that outlives the pods; without one the directory is the pod's own and dies with it (a loss beyond
  the redundancy then starts from iteration 0).

Standby pods are not rendered: the Job controller already replaces a lost pod by one of the same index
(the node's own name), and a standby claiming the same node would race that replacement.

    >>> from megatron_ft.config import from_dict
    >>> m = kubernetes_manifests(from_dict({"run_id": "gpt", "cluster": {"nodes": 2, "ranks_per_node": 4}}),
    ...     image="registry.example/train:1", command=["pretrain_gpt.py", "--inmem-ckpt"], state_bytes_per_rank=1 << 30)
    >>> [x["kind"] for x in m]
    ['Service', 'ConfigMap', 'Job']
    >>> job = m[2]["spec"]
    >>> job["completions"], job["template"]["spec"]["subdomain"]
    (2, 'gpt')
    >>> [v["emptyDir"] for v in job["template"]["spec"]["volumes"] if v["name"] == "shm"]
    [{'medium': 'Memory', 'sizeLimit': '9012Mi'}]
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Optional

import yaml

from . import config as ftconfig
from .agent.block_store import MAX_VERSIONS
from .fatal import JOB_ENDING

#: the slots' headers and page rounding, on top of the state's bytes
SHM_MARGIN = 0.10
#: own snapshot slots per local rank (the agent's double buffer)
SLOTS_PER_RANK = 2
CONFIG_DIR = "/etc/megatron-ft"
SECRET_DIR = "/etc/megatron-ft/secret"
RUN_DIR = "/var/run/megatron-ft"


def shm_bytes_per_node(cfg: ftconfig.FTConfig, state_bytes_per_rank: int) -> int:
    """The most shared memory any node of ``cfg`` needs for its slots and peer blocks, with
    :data:`SHM_MARGIN` (pure).

    >>> from megatron_ft.config import from_dict
    >>> round(shm_bytes_per_node(from_dict({"cluster": {"nodes": 2, "ranks_per_node": 4}}), 1 << 30) / (1 << 30), 3)
    8.8
    """
    from .redundancy.plan import plan_from_config

    if state_bytes_per_rank <= 0:
        raise ftconfig.ConfigError(f"--state-bytes-per-rank={state_bytes_per_rank} is invalid: must be > 0")
    mem = plan_from_config(cfg).memory(state_bytes_per_rank)
    extra = cfg.recovery.marked_versions  # prefer: certified keeps two more of each
    need = max((SLOTS_PER_RANK + extra) * m.primary + (MAX_VERSIONS + extra) * m.redundancy for m in mem)
    return int(need * (1 + SHM_MARGIN))


def quantity(nbytes: int) -> str:
    """A Kubernetes quantity for ``nbytes``, rounded up to whole MiB (``Gi`` when exact).

    >>> quantity(9 << 30), quantity((9 << 30) + 1)
    ('9Gi', '9217Mi')
    """
    mib = -(-nbytes // (1 << 20))
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def _ports(cfg: ftconfig.FTConfig) -> list[dict]:
    """Every port megatron-ft's processes listen on (``port_plan``), one named entry per port."""
    names = {"launch.rdzv_port": "rdzv", "health.store_port": "store", "network.peer_port": "peer",
             "launch.trainer_port": "trainers"}
    out = []
    for r in ftconfig.port_plan(cfg):
        for i in range(r.count):
            name = names[r.setting] + (f"-{i}" if r.count > 1 else "")
            out.append({"name": name, "containerPort": r.first + i, "protocol": "TCP"})
    return out


def pod_config(cfg: ftconfig.FTConfig, name: str) -> ftconfig.FTConfig:
    """``cfg`` as a pod of job ``name`` reads it (module doc)."""
    return ftconfig.replace(cfg, health={"hosts": [], "host_pattern": f"{name}-{{node}}.{name}"},
                            launch={"master_addr": f"{name}-0.{name}"}, network={"interface": "eth0"},
                            security={"secret_file": f"{SECRET_DIR}/secret"})


def kubernetes_manifests(cfg: ftconfig.FTConfig, *, image: str, command: list[str], state_bytes_per_rank: int,
                         name: Optional[str] = None, namespace: str = "default", secret: Optional[str] = None,
                         replacements: int = 3, gpus_per_node: int = 0,
                         persist_claim: Optional[str] = None) -> list[dict[str, Any]]:
    """The Service, ConfigMap and indexed Job of the module doc, as dicts (pure)."""
    name = name or re.sub(r"[^a-z0-9-]", "-", cfg.run_id.lower()).strip("-")
    if not re.fullmatch(r"[a-z]([a-z0-9-]{0,50}[a-z0-9])?", name):
        raise ftconfig.ConfigError(f"--name={name!r} is invalid: a Kubernetes name of at most 52 lowercase letters, "
                                   f"digits and '-', starting with a letter (the pods are named NAME-<index>)")
    if not image:
        raise ftconfig.ConfigError("--image is required: the container image with megatron-ft and the training code")
    if not command:
        raise ftconfig.ConfigError("give the training command after '--' (the script megatron-ft launch starts)")
    if replacements < 0 or gpus_per_node < 0:
        raise ftconfig.ConfigError(f"--replacements={replacements} and --gpus-per-node={gpus_per_node}: must be >= 0")
    secret = secret or f"{name}-secret"
    labels = {"app.kubernetes.io/name": "megatron-ft", "app.kubernetes.io/instance": name}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    nodes = cfg.cluster.nodes
    pod_cfg = pod_config(cfg, name)
    ports = _ports(pod_cfg)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {"batch.kubernetes.io/job-name": name},
                        "ports": [{"name": p["name"], "port": p["containerPort"], "protocol": "TCP"} for p in ports]}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {**meta, "name": f"{name}-cluster"},
                  "data": {"cluster.yaml": yaml.safe_dump(pod_cfg.to_dict(), sort_keys=False)}}
    mounts = [{"name": "shm", "mountPath": cfg.agent.shm_dir},
              {"name": "cluster", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory",
                                     "sizeLimit": quantity(shm_bytes_per_node(cfg, state_bytes_per_rank))}},
        {"name": "cluster", "configMap": {"name": f"{name}-cluster"}},
        {"name": "secret", "secret": {"secretName": secret, "defaultMode": 0o400}}]
    if persist_claim:
        mounts.append({"name": "persist", "mountPath": cfg.persist.dir})
        volumes.append({"name": "persist", "persistentVolumeClaim": {"claimName": persist_claim}})
    container: dict[str, Any] = {
        "name": "node", "image": image,
        "command": ["megatron-ft", "launch", "--config", f"{CONFIG_DIR}/cluster.yaml", "--run-dir", RUN_DIR,
                    "--", *command],
        "ports": ports, "volumeMounts": mounts}
    if gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_node}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {
        "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
        "backoffLimitPerIndex": replacements, "maxFailedIndexes": 0,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In", "values": list(JOB_ENDING)}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
        "template": {"metadata": {"labels": labels}, "spec": {
            "subdomain": name, "restartPolicy": "Never", "containers": [container], "volumes": volumes}}}}
    return [service, config_map, job]


class _Dumper(yaml.SafeDumper):
    """YAML for people: no anchors, multi-line strings (the cluster file) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    """One YAML stream for ``kubectl apply -f``."""
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False)


def add_parser(sub) -> None:
    deploy = sub.add_parser("deploy", help="render a job's manifests for a scheduler (kubernetes)")
    targets = deploy.add_subparsers(dest="target", required=True)
    p = targets.add_parser("kubernetes", help="a headless Service, the cluster file as a ConfigMap, an indexed Job")
    p.add_argument("--config", default=None, help="cluster YAML (default: the embedded configs/local-cpu.yaml)")
    p.add_argument("--image", required=True, help="container image with megatron-ft and the training code")
    p.add_argument("--state-bytes-per-rank", required=True, metavar="N",
                   help="snapshot bytes per rank (e.g. 12GiB), for /dev/shm's size")
    p.add_argument("--name", default=None, help="job name (default: the run id)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--secret", default=None, help="the Secret holding the job secret under key 'secret' (default: NAME-secret)")
    p.add_argument("--replacements", type=int, default=3, help="pods the Job controller may replace per node (default 3)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu limit per pod (default 0)")
    p.add_argument("--persist-claim", default=None, help="PersistentVolumeClaim mounted at persist.dir (shared storage)")
    p.add_argument("--output", default=None, help="write here instead of standard output")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command megatron-ft launch starts")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from .redundancy.report import parse_bytes

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        state = parse_bytes(args.state_bytes_per_rank)
    except argparse.ArgumentTypeError as e:
        raise ftconfig.ConfigError(f"--state-bytes-per-rank={args.state_bytes_per_rank!r} is invalid: {e}") from None
    manifests = kubernetes_manifests(
        ftconfig.load(args.config), image=args.image, command=command, state_bytes_per_rank=state, name=args.name,
        namespace=args.namespace, secret=args.secret, replacements=args.replacements,
        gpus_per_node=args.gpus_per_node, persist_claim=args.persist_claim)
    text = to_yaml(manifests)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
