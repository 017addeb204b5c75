"""A trainer of a new job generation (fewer data-parallel replicas after a lost node, or more after one came
back) restoring from the previous generation's containers its launcher imported into its node's memory.

The launcher names the generation's record in the trainer's environment (``MFT_GENERATION``,
:mod:`megatron_ft.launch.generation`); its node holds, as ``mft.<run>.e<n>.n<node>.in<old rank>``, every
old container its ranks need (:func:`~megatron_ft.policy.generations.needed_by_node`). Two restores use
them: the project's script's (:func:`restore_generation`, through
:func:`megatron_ft.megatron.reslice_restore.restore_resliced`: the shards cut from the old ranks by their
extents records, the RNG streams, buffers and step counters of the old data-parallel replica 0 of this
rank's coordinate, the progress from its record), and upstream Megatron-LM's local checkpoint tier
(:mod:`megatron_ft.megatron.resharded_state_dict`: the sharded tensors filled by their global coordinates).
Both open the containers with :func:`open_imports` and report with :func:`generation_result`.

When: only where the generation's own restore found nothing (its agents hold no version of it yet, nor
does its persist directory): a generation's first start, or a restart of it before its first snapshot was
agreed by every rank - both restore the record's step again (the launcher releases the imports once every
rank of its node agreed a newer step; a restore that finds them gone ends the job, saying so). Collective over every rank of the generation
(the final all-gather of the re-sliced buckets, in :func:`restore_resliced`); every rank reaches it
together, as the generation's restore said ``none`` on every rank.
"""
from __future__ import annotations

import os
import time
from typing import Any, Optional

from .. import config as ftconfig
from .. import fatal
from ..launch.generation import ENV, GenerationRecord, import_name
from ..policy.elastic import coordinates, rank_of
from ..trainer.recovery import Container, RestoreResult
from .reslice_restore import restore_resliced

#: the tiers a re-sliced restore's containers came from, best first (the restore reports the worst)
TIERS = ("local_memory", "peer_memory", "decoded")


def generation_record(env: Optional[dict] = None) -> Optional[GenerationRecord]:
    """This trainer's generation record (None: generation 0, or not under ``megatron-ft launch``)."""
    path = (os.environ if env is None else env).get(ENV)
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return GenerationRecord.from_json(f.read())


def open_imports(cfg: ftconfig.FTConfig, rank: int, node: int, rec: GenerationRecord) -> dict[int, Container]:
    """The containers of ``rec``'s previous generation that ``rank`` (on ``node``) restores from: every old
    data-parallel rank of its tensor and pipeline coordinate, old data-parallel rank 0 first, each open and
    checked (CLEAN, the record's step, the previous run's identity). The caller closes them. Imports
    released already end the job (never a start over); a missing or torn one raises (the handover said
    every import was in place)."""
    tp, _, pp = coordinates(rank, rec.tensor, rec.pipeline, rec.data_parallel)
    olds = [rank_of(tp, d, pp, rec.tensor, rec.previous.data_parallel) for d in range(rec.previous.data_parallel)]
    sources: dict[int, Container] = {}
    try:
        for o in olds:
            path = os.path.join(cfg.agent.shm_dir, import_name(cfg.run_id, node, o))
            if not os.path.exists(path):  # released once the generation agreed a newer step: never start over
                fatal.end_job(f"rank {rank}: generation {rec.number} holds no version of its own and the previous "
                              f"generation's containers were released ({path} is gone): nothing in memory to "
                              f"restore from")
            sources[o] = Container(path)
            sources[o].check_identity(identity(rec), rec.step)
    except BaseException:
        for c in sources.values():
            c.close()
        raise
    return sources


def identity(rec: GenerationRecord) -> dict:
    """The identity every previous-generation container must carry (what does not change with the size)."""
    return {"run_id": rec.previous_run_id}


def generation_result(rec: GenerationRecord, node: int, read: list[int], seconds: float, **extra) -> RestoreResult:
    """The restore's result: ``source`` the worst tier among the old ranks ``read``, ``extra`` the sizes
    before and after, each old rank's tier and the decision's time (plus ``extra``)."""
    here = rec.slots[node]
    tiers = {o: rec.sources.get(o) or ("local_memory" if rec.previous_slots[rec.holder[o]] == here else "peer_memory")
             for o in read}
    worst = max(tiers.values(), key=TIERS.index) if tiers else "local_memory"
    return RestoreResult(worst, rec.step, seconds, {
        "data_parallel_before": rec.previous.data_parallel, "data_parallel_after": rec.data_parallel,
        "generation": rec.number, "kind": rec.kind, "tiers": {str(o): t for o, t in tiers.items()},
        "decided_at": rec.decided_at, **extra})


def restore_generation(cfg: ftconfig.FTConfig, adapter: Any, rank: int, node: int,
                       rec: GenerationRecord) -> RestoreResult:
    """Restore ``adapter`` (a :class:`~megatron_ft.megatron.state.MegatronStateAdapter`) for ``rank`` (on
    ``node``) of generation ``rec`` from its node's imported containers (:func:`open_imports`). The
    result's ``source`` is the worst tier among the old ranks read, ``extra`` says the sizes before and
    after and each old rank's tier (:func:`generation_result`)."""
    t0 = time.perf_counter()
    sources = open_imports(cfg, rank, node, rec)
    try:
        done = restore_resliced(adapter, sources, next(iter(sources)), rec.step, identity(rec))
    finally:
        for c in sources.values():
            c.close()
    return generation_result(rec, node, done.containers, time.perf_counter() - t0, copies=done.copies,
                             elements=done.elements)
