"""A job generation as the launchers carry it out: its record, its configuration and where it is written.

When a job goes on at fewer data-parallel replicas, or grows back (:mod:`megatron_ft.policy.generations`
says which slots and sizes), generation ``n`` runs as a job of its own kind: a configuration with
``cluster.nodes`` = its node count, its nodes' hosts in its slot order and its own run id
(:func:`~megatron_ft.policy.generations.run_id_of`: ``<run>.e<n>``), so that every part whose work depends
on the node count - the monitor, the store, the rendezvous, the redundancy plan, the agreement, the hang
watch - is the one it always was, for N' nodes. What crosses from one generation to the next is memory:
each new node's agent-side files ``mft.<run>.e<n>.n<i>.in<old rank>`` (:func:`import_name`), each an old
rank's whole container of the record's ``step``, linked from a slot of the old agent on the same host or
fetched from the old agent holding it (:mod:`megatron_ft.launch.elastic`); its trainers restore their
shards re-sliced from those (:mod:`megatron_ft.megatron.generation_restore`).

:class:`GenerationRecord` is the decision as every launcher reads it (store key ``elastic/plan/<n>`` of the
old generation's store, and the run directory's ``generation.json`` - the pointer a returning node's
launcher reads to find the running generation). Versioned JSON, validated on read.

Worked example: 3 slots x 2 ranks, TP1 PP2, slot 1 lost; generation 1 runs slots 0 and 2 as nodes 0 and 1.

>>> from megatron_ft.config import from_dict
>>> cfg = from_dict({"run_id": "j", "cluster": {"nodes": 3, "ranks_per_node": 2},
...                  "parallel": {"pipeline": 2}, "redundancy": {"scheme": "replica"}})
>>> rec = GenerationRecord(1, "shrink", "j", (0, 2), (), 3, 2, 1, 2, 1, step=7, previous_slots=(0, 1, 2),
...                        lost=(1,), holder={2: 2, 3: 2})
>>> g = generation_config(cfg, rec)
>>> g.run_id, g.cluster.nodes, rec.data_parallel, rec.previous.data_parallel
('j.e1', 2, 2, 3)
>>> GenerationRecord.from_json(rec.to_json()) == rec
True
>>> import_name("j.e1", 1, 4)
'mft.j.e1.n1.in4'
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .. import config as ftconfig
from ..agent import shm
from ..policy.generations import Generation, run_id_of

FORMAT = "megatron-ft-generation/1"
#: the environment variable naming a trainer's generation record (set by its launcher in a generation > 0)
ENV = "MFT_GENERATION"
POINTER = "generation.json"


@dataclass(frozen=True)
class GenerationRecord:
    """Generation ``number`` (``kind``: ``start``, ``shrink`` or ``grow``) of run ``base_run_id``: ``slots[i]``
    (generation 0's node ids) trains as node ``i``; ``idle`` wait. It restores from the previous generation
    (node ``i`` of it was ``previous_slots[i]``) at ``step``; ``holder``: old rank -> the previous
    generation's node whose agent holds that rank's container of ``step`` (its own, or rebuilt there from
    the redundancy when its node was lost: ``rebuilt``, node -> old ranks); ``sources``: old rank -> the
    tier it came from (``local_memory``, ``peer_memory``, ``decoded``), as the plan expects it."""

    number: int
    kind: str
    base_run_id: str
    slots: tuple[int, ...]
    idle: tuple[int, ...]
    full: int
    ranks_per_node: int
    tensor: int
    pipeline: int
    expert: int
    step: int = -1
    previous_slots: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    holder: dict[int, int] = field(default_factory=dict)
    rebuilt: dict[int, list[int]] = field(default_factory=dict)
    sources: dict[int, str] = field(default_factory=dict)
    decided_at: float = 0.0  # time.time() of the decision (the shrink's or grow-back's clock starts there)
    decider: int = -1  # the slot whose launcher decided it (it also plans the step)

    @classmethod
    def first(cls, cfg: ftconfig.FTConfig) -> "GenerationRecord":
        c, p = cfg.cluster, cfg.parallel
        return cls(0, "start", cfg.run_id, tuple(range(c.nodes)), (), c.nodes, c.ranks_per_node, p.tensor,
                   p.pipeline, p.expert)

    @property
    def generation(self) -> Generation:
        return Generation(self.number, self.slots, self.ranks_per_node, self.tensor, self.pipeline, self.expert,
                          self.idle, self.full)

    @property
    def previous(self) -> Generation:
        return Generation(self.number - 1, self.previous_slots, self.ranks_per_node, self.tensor, self.pipeline,
                          self.expert, (), self.full)

    @property
    def data_parallel(self) -> int:
        return self.generation.data_parallel

    @property
    def run_id(self) -> str:
        return run_id_of(self.base_run_id, self.number)

    @property
    def previous_run_id(self) -> str:
        return run_id_of(self.base_run_id, self.number - 1)

    def node_of(self, slot: int) -> Optional[int]:
        """The node ``slot`` trains as in this generation (None: it does not)."""
        return self.slots.index(slot) if slot in self.slots else None

    def to_json(self) -> str:
        d = asdict(self)
        d["holder"] = {str(k): v for k, v in self.holder.items()}
        d["rebuilt"] = {str(k): v for k, v in self.rebuilt.items()}
        d["sources"] = {str(k): v for k, v in self.sources.items()}
        return json.dumps({"format": FORMAT, **d}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GenerationRecord":
        """The record in ``text``; ``ValueError`` naming what is wrong for anything else."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"a generation record is not JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"a generation record has format {d.get('format') if isinstance(d, dict) else None!r}, "
                             f"expected {FORMAT!r}")
        try:
            return cls(int(d["number"]), str(d["kind"]), str(d["base_run_id"]), tuple(int(s) for s in d["slots"]),
                       tuple(int(s) for s in d["idle"]), int(d["full"]), int(d["ranks_per_node"]), int(d["tensor"]),
                       int(d["pipeline"]), int(d["expert"]), int(d["step"]), tuple(int(s) for s in d["previous_slots"]),
                       tuple(int(s) for s in d["lost"]), {int(k): int(v) for k, v in d["holder"].items()},
                       {int(k): [int(r) for r in v] for k, v in d["rebuilt"].items()},
                       {int(k): str(v) for k, v in d["sources"].items()}, float(d["decided_at"]), int(d["decider"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a generation record lacks or mistypes a field: {e!r}") from None


def generation_config(cfg: ftconfig.FTConfig, rec: GenerationRecord) -> ftconfig.FTConfig:
    """Generation ``rec``'s configuration, from generation 0's ``cfg``: its run id, its node count, its
    nodes' hosts in its slot order (the rendezvous on its node 0's host). One machine: the per-node ports
    follow the node number, as for any job."""
    if rec.number == 0:
        return cfg
    h = cfg.health
    changes: dict = {"run_id": rec.run_id, "cluster": {"nodes": len(rec.slots)},
                     "redundancy": fitted_redundancy(cfg.redundancy, len(rec.slots))}
    if not h.one_machine:
        hosts = [h.host_of(s) for s in rec.slots]
        changes["health"] = {"hosts": hosts, "host_pattern": ""}
        changes["launch"] = {"master_addr": hosts[0]}
    return ftconfig.replace(cfg, **changes)


def fitted_redundancy(r, nodes: int) -> dict:
    """The redundancy settings a generation of ``nodes`` nodes runs with: the job's where they fit; else the
    nearest that does - Reed-Solomon keeps its ``m`` (the losses it survives) and codes over fewer data
    nodes (k = nodes - m), down to ``m = nodes - 1``; a replica or XOR group no larger than the nodes; one
    node alone has no peer (``none``). Pure.

    >>> from megatron_ft.config import RedundancyConfig
    >>> fitted_redundancy(RedundancyConfig(scheme="rs", k=2, m=2), 3)
    {'k': 1, 'm': 2}
    >>> fitted_redundancy(RedundancyConfig(scheme="rs", k=4, m=2), 2), fitted_redundancy(RedundancyConfig(scheme="replica"), 1)
    ({'k': 1, 'm': 1}, {'scheme': 'none'})
    """
    if nodes < 2 and r.scheme != "none":
        return {"scheme": "none"}
    if r.scheme == "rs" and r.k + r.m > nodes:
        m = min(r.m, nodes - 1)
        return {"k": max(1, nodes - m), "m": m}
    if r.scheme == "replica" and r.replicas > nodes:
        return {"replicas": nodes}
    if r.scheme == "xor" and r.group_size > nodes:
        return {"group_size": 0}
    return {}


def import_name(run_id: str, node: int, old_rank: int) -> str:
    """The shared-memory file holding old rank ``old_rank``'s container for node ``node`` of the
    generation that runs as ``run_id`` (removed with that node's other files)."""
    return shm.import_segment_name(run_id, node, old_rank)


def pointer_path(run_dir: str) -> str:
    return os.path.join(run_dir, POINTER)


def read_pointer(run_dir: str) -> Optional[GenerationRecord]:
    """The newest generation record in the run directory (None: the job never changed its size)."""
    try:
        with open(pointer_path(run_dir), encoding="utf-8") as f:
            return GenerationRecord.from_json(f.read())
    except FileNotFoundError:
        return None


def write_pointer(run_dir: str, rec: GenerationRecord) -> None:
    """Replace the run directory's pointer with ``rec`` (atomically; every launcher of the generation writes
    the same record, the newest number wins)."""
    old = read_pointer(run_dir)
    if old is not None and old.number > rec.number:
        return
    tmp = f"{pointer_path(run_dir)}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(rec.to_json())
    os.replace(tmp, pointer_path(run_dir))


def generation_dir(run_dir: str, number: int) -> str:
    """Where generation ``number``'s launchers keep their node directories (generation 0: the run directory)."""
    return run_dir if number == 0 else os.path.join(run_dir, f"e{number}")
