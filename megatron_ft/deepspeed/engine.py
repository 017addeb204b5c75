"""DeepSpeed's ``save_checkpoint``/``load_checkpoint`` through megatron-ft's in-memory tier.

:func:`enable_inmem_ckpt` installs :class:`InMemoryCheckpointEngine` as ``engine.checkpoint_engine``
and wraps ``engine.load_checkpoint``. What happens then::

    engine.save_checkpoint(dir, tag)            (every rank; DeepSpeed's own code path)
      checkpoint_engine.makedirs(dir)           real directory (DeepSpeed writes `latest` there)
      checkpoint_engine.create(tag)             wait for the previous snapshot; start a new file set
      checkpoint_engine.save(sd, dir/tag/F)     encode sd -> tensors + JSON tree (capture/tree.py); F is
                                                only a key: nothing is written under dir/tag
      checkpoint_engine.commit(tag)             one snapshot of step engine.global_steps with all
                                                of this rank's files + RNG, copied to the agent's
                                                shared memory in the background
    engine.step() -> _take_model_step           waits first until that copy is committed

    engine.load_checkpoint(dir)                 (every rank)
      InMemoryCheckpointer.restore()            newest step every rank holds, verified (checksums,
                                                run/step/topology identity): memory -> disk; read
                                                into fresh buffers, never into the live model
      DeepSpeed's load_checkpoint(dir, tag)     with the snapshot's tag (not the `latest` file);
                                                checkpoint_engine.load(dir/tag/F) rebuilds F (its
                                                loader asserts os.path.exists(F): each restored F
                                                missing on disk gets a one-line text placeholder)
      RNG (python, numpy, torch) restored last

Which files a rank snapshots. DeepSpeed names files per rank; each rank keeps *all* files it
will read back on restore, so recovery never needs another rank's memory:

* ``mp_rank_XX_model_states.pt`` (ZeRO 0-2): DeepSpeed writes it on data-parallel rank 0 only
  and every rank reads it; here every rank snapshots its own copy (``save_non_zero_checkpoint``
  on all ranks). Costs one copy of the module weights per rank (documented in docs/deepspeed.md).
* ``zero_pp_rank_D_mp_rank_XX_model_states.pt`` (ZeRO-3) and
  ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``: already one per rank.
* ``layer_LL-model_MM-model_states.pt`` (pipeline engine): DeepSpeed writes a stage's layers on
  its data-parallel rank 0; here every rank of the stage snapshots them.

Snapshot step = ``engine.global_steps`` at commit; the tag is in the JSON record. Topology
identity = (zero stage, dp, mp, pp, pipeline engine): a snapshot of another layout is rejected.
A failed save (an unencodable value, no agent, no room) is logged and skipped; it never raises
into training. Elastic ZeRO checkpoints and universal checkpoints read other ranks' files and
are refused by :func:`enable_inmem_ckpt`, as are MoE layers and the pipeline engine with tensor
(slice) parallelism. Verified with DeepSpeed 0.19.8; besides the public CheckpointEngine API this
module relies on ``engine._take_model_step``, ``engine._get_all_ckpt_names``/``_get_ckpt_name``,
``engine.save_non_zero_checkpoint`` and ``PipelineModule.save_state_dict``/``ckpt_layer_path_list``.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import re
from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from .. import config as ftconfig
from ..capture import rng
from ..capture import tree as treecodec
from ..capture.layout import Layout
from ..capture.state import StateTensor, fresh_targets
from ..trainer.checkpointer import InMemoryCheckpointer
from ..trainer.recovery import RestoreFailed

log = logging.getLogger("megatron_ft.deepspeed")

RECORD_FORMAT = "megatron-ft-deepspeed"
RECORD_VERSION = 1
#: tree encodings a record may name: the shared codec's, and the DeepSpeed-only one it replaced
TREE_FORMATS = {(treecodec.FORMAT, treecodec.VERSION), ("megatron-ft-dsdict", 1)}
ENGINE_NAME = "MegatronFTInMemoryCheckpointEngine"
VERIFIED_DEEPSPEED = "0.19."


class DeepSpeedStateAdapter:
    """StateAdapter over the files of one ``save_checkpoint`` call (see megatron_ft/capture/state.py).

    ``capture`` returns every tensor of every file (``f{i}.t{k}``: tensor k of file i), the torch
    RNG, and a JSON record with the files' trees; ``targets`` allocates fresh CPU buffers;
    ``finish_restore`` keeps the decoded record for :meth:`InMemoryCheckpointEngine.load`."""

    def __init__(self) -> None:
        self.tag: Optional[str] = None
        self.files: list[tuple[str, Any, list[torch.Tensor]]] = []  # (name, tree, tensors)
        self.rng: dict = {}
        self.restored: Optional[dict] = None  # {"tag", "files": {name: (tree, [tensor])}, "rng"}
        self._buffers: dict[str, torch.Tensor] = {}

    def begin(self, tag: str) -> None:
        self.tag, self.files, self.rng = tag, [], {}

    def add_file(self, name: str, state: Any) -> None:
        enc = treecodec.Encoder()
        tree = enc.encode(state, name)
        self.files.append((name, tree, [treecodec.owned(t) for t in enc.tensors]))

    def capture(self) -> tuple[list[StateTensor], dict]:
        out = [StateTensor(f"f{i}.t{k}", t) for i, (_, _, ts) in enumerate(self.files) for k, t in enumerate(ts)]
        rng_tensors, rng_record = rng.capture()
        out += [StateTensor(n, t) for n, t in rng_tensors]
        extra = {
            "format": RECORD_FORMAT, "version": RECORD_VERSION, "codec": [treecodec.FORMAT, treecodec.VERSION],
            "tag": self.tag,
            "files": [{"name": name, "tensors": len(ts), "tree": tree} for name, tree, ts in self.files],
            **rng_record,
        }
        return out, extra

    def targets(self, layout: Layout, extra: dict) -> dict[str, StateTensor]:
        self._buffers = fresh_targets(layout)
        return {name: StateTensor(name, t) for name, t in self._buffers.items()}

    def finish_restore(self, extra: dict) -> None:
        if extra.get("format") != RECORD_FORMAT or extra.get("version") != RECORD_VERSION:
            raise ValueError(f"not a {RECORD_FORMAT} v{RECORD_VERSION} record: {extra.get('format')!r} "
                             f"v{extra.get('version')!r}")
        if tuple(extra.get("codec") or ()) not in TREE_FORMATS:
            raise ValueError(f"record codec {extra.get('codec')!r} is not one of {sorted(TREE_FORMATS)}")
        files = {}
        for i, f in enumerate(extra["files"]):
            files[f["name"]] = (f["tree"], [self._buffers[f"f{i}.t{k}"] for k in range(f["tensors"])])
        self.restored = {"tag": extra["tag"], "files": files, "python_rng": extra["python_rng"],
                         "numpy_rng": extra["numpy_rng"],
                         "rng": {n: t for n, t in self._buffers.items() if n.startswith("rng.")}}
        self._buffers = {}


class InMemoryCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` whose files live in megatron-ft snapshots (one per save)."""

    def __init__(self, ds_engine: Any, ckpt: InMemoryCheckpointer, adapter: DeepSpeedStateAdapter):
        super().__init__(None)
        self.name = ENGINE_NAME
        self.ds_engine = ds_engine
        self.ckpt = ckpt
        self.adapter = adapter
        self._saving: Optional[CheckpointCommitInfo] = None
        self._save_error: Optional[str] = None
        self._load_root: Optional[str] = None  # dir/tag being loaded from the restored snapshot

    # ------------------------------------------------------------------ save
    def _tag_dir(self, info: CheckpointCommitInfo) -> str:
        return os.path.abspath(os.path.join(info.save_dir, str(info.tag)))

    def create(self, info: CheckpointCommitInfo) -> None:
        self.ckpt.before_optimizer_step()  # the previous snapshot may still read the tensors it references
        self._saving, self._save_error = info, None
        self.adapter.begin(str(info.tag))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self._saving is not None and _inside(path, self._tag_dir(self._saving)):
            return  # the tag directory is virtual: its files are snapshot entries
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        if self._saving is None:
            self._save_error = f"save({path}) outside create()/commit()"
        elif self._save_error is None:
            try:
                self.adapter.add_file(self._file_name(path, self._tag_dir(self._saving)), state_dict)
            except Exception as e:  # never into training: this step is simply not snapshotted
                self._save_error = f"{type(e).__name__}: {e}"
        if self._save_error is not None:
            log.warning("rank %d: DeepSpeed file %s not snapshotted: %s", self.ckpt.rank, path, self._save_error)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        ok = self._save_error is None and self._saving is not None
        self._saving = None
        step = int(self.ds_engine.global_steps)
        if not ok:
            log.warning("rank %d: snapshot of tag %s (step %d) skipped: %s", self.ckpt.rank, info.tag, step,
                        self._save_error)
            self.adapter.files = []
            return False
        try:
            self.ckpt.after_iteration(step, int(getattr(self.ds_engine, "global_samples", 0)))
        except Exception as e:  # a failed snapshot never stops training
            log.warning("rank %d: snapshot of tag %s (step %d) failed: %s", self.ckpt.rank, info.tag, step, e)
            return False
        return True

    def _file_name(self, path: str, root: str) -> str:
        if not _inside(path, root) or os.path.abspath(path) == root:
            raise ValueError(f"{path} is not inside the checkpoint directory {root}")
        return os.path.relpath(os.path.abspath(path), root)

    # ------------------------------------------------------------------ load
    def restored_paths(self) -> list[str]:
        if self._load_root is None or self.adapter.restored is None:
            return []
        return sorted(os.path.join(self._load_root, n) for n in self.adapter.restored["files"])

    def load(self, path: str, map_location: Any = None) -> Any:
        if self._load_root is None or self.adapter.restored is None:
            raise FileNotFoundError(f"{path}: no megatron-ft snapshot is being loaded")
        name = self._file_name(path, self._load_root)
        files = self.adapter.restored["files"]
        if name not in files and self._resolve(name, files) == name:
            raise FileNotFoundError(f"{path}: the restored snapshot (tag {self.adapter.restored['tag']}) holds "
                                    f"{sorted(files)}")
        tree, tensors = files[self._resolve(name, files)]
        # a fresh structure per call (DeepSpeed may modify what it loads); the buffers are owned by the
        # restored snapshot and dropped after load_checkpoint
        fix = None
        if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
            fix = lambda t: t.to(map_location)  # noqa: E731
        return treecodec.decode_tree(tree, tensors, fix)

    @staticmethod
    def _resolve(name: str, files: dict) -> str:
        """DeepSpeed reads model-parallel rank 0's model-states file on every rank (the loader's
        file-count check, and the pipeline engine's common state); a rank is served its own
        model-states file instead, which holds the same common fields (and its own client state)."""
        m = _MODEL_STATES.fullmatch(name)
        if name in files or m is None:
            return name
        own = [f for f in files if (g := _MODEL_STATES.fullmatch(f)) and g.group(1) == m.group(1)]
        return own[0] if len(own) == 1 else name

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return True  # every rank snapshots what it reads back (see the module docstring)

    def preserves_storage_sharing(self) -> bool:
        return False  # only a tensor's own elements are copied: no clone needed before save()

    def cleanup(self) -> None:
        self.ckpt.before_optimizer_step()


_MODEL_STATES = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")


def _inside(path: str, root: str) -> bool:
    path, root = os.path.abspath(path), os.path.abspath(root)
    return path == root or path.startswith(root + os.sep)


def deepspeed_topology(engine: Any) -> dict:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    pipe = isinstance(engine, PipelineEngine)
    return {"framework": "deepspeed", "zero_stage": int(engine.zero_optimization_stage()),
            "dp": int(engine.seq_dp_world_size), "mp": int(engine.mp_world_size),
            "pp": int(engine.num_stages) if pipe else 1, "pipeline_engine": pipe}


def enable_inmem_ckpt(engine: Any, cfg: Optional[ftconfig.FTConfig] = None,
                      fallback_to_files: bool = True) -> InMemoryCheckpointEngine:
    """Route ``engine.save_checkpoint``/``load_checkpoint`` through megatron-ft (call on every rank,
    after ``deepspeed.initialize``). ``cfg``: the megatron-ft config (default: ``$MFT_CONFIG`` or the
    embedded default, with ``$MFT_RUN_ID``). With ``fallback_to_files``, a ``load_checkpoint`` that
    finds no valid snapshot (memory or megatron-ft's disk tier) reads DeepSpeed's own files, if any.
    Returns the installed checkpoint engine (``.ckpt`` is the :class:`InMemoryCheckpointer`)."""
    import deepspeed
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if not deepspeed.__version__.startswith(VERIFIED_DEEPSPEED):
        log.warning("megatron-ft's DeepSpeed tier was verified with DeepSpeed %sx, this is %s: run "
                    "tests/integration/test_deepspeed.py before relying on it", VERIFIED_DEEPSPEED, deepspeed.__version__)
    if cfg is None:
        cfg = _config_from_env()
    topology = _supported_topology(engine)
    adapter = DeepSpeedStateAdapter()
    ckpt = InMemoryCheckpointer(cfg, adapter, dist.get_rank(), dist.get_world_size(), topology)
    ce = InMemoryCheckpointEngine(engine, ckpt, adapter)
    disk_engine = engine.checkpoint_engine if engine.checkpoint_engine is not None else TorchCheckpointEngine()
    engine.checkpoint_engine = ce
    engine.save_non_zero_checkpoint = True  # every rank keeps its own model-states file

    _patch_take_model_step(engine, ce)
    _patch_ckpt_names(engine, ce)
    if topology["pipeline_engine"]:
        _patch_pipeline_module(engine.module, ce)
    _patch_load_checkpoint(engine, ce, disk_engine, fallback_to_files)
    return ce


def _config_from_env() -> ftconfig.FTConfig:
    """The megatron-ft config when none is given: ``$MFT_CONFIG`` or the embedded default, with
    ``$MFT_RUN_ID`` as its run id if set."""
    cfg = ftconfig.load(os.environ.get("MFT_CONFIG"))
    if os.environ.get("MFT_RUN_ID"):
        cfg = ftconfig.replace(cfg, run_id=os.environ["MFT_RUN_ID"])
    return cfg


def _supported_topology(engine: Any) -> dict:
    """:func:`deepspeed_topology` of ``engine``, after refusing (``ConfigError``) the layouts whose
    restore reads other ranks' files: elastic ZeRO checkpoints, universal checkpoints, MoE layers,
    and the pipeline engine with tensor (slice) parallelism."""
    if engine.zero_optimization_stage() in (1, 2) and engine.zero_elastic_checkpoint():
        raise ftconfig.ConfigError("zero_optimization.elastic_checkpoint=true is invalid with megatron-ft: every rank "
                                   "would read every other rank's optimizer file; set it to false")
    if engine.load_universal_checkpoint():
        raise ftconfig.ConfigError("checkpoint.load_universal=true is invalid with megatron-ft's in-memory tier: "
                                   "universal checkpoints are read from disk; disable it or do not call enable_inmem_ckpt")
    if engine.has_moe_layers:
        raise ftconfig.ConfigError("DeepSpeed MoE layers are not supported by megatron-ft's in-memory tier yet "
                                   "(expert files are read across ranks)")
    topology = deepspeed_topology(engine)
    if topology["pipeline_engine"] and engine.grid.get_slice_parallel_world_size() > 1:
        raise ftconfig.ConfigError("the pipeline engine with tensor (slice) parallelism > 1 is not supported by "
                                   "megatron-ft's in-memory tier yet (layer files are merged across slice ranks)")
    return topology


def _patch_take_model_step(engine: Any, ce: InMemoryCheckpointEngine) -> None:
    """Before each optimizer step: the background copy of the last snapshot must be finished."""
    take_step = engine._take_model_step

    def _take_model_step(*args, **kwargs):
        ce.ckpt.before_optimizer_step()
        return take_step(*args, **kwargs)

    engine._take_model_step = _take_model_step


def _patch_ckpt_names(engine: Any, ce: InMemoryCheckpointEngine) -> None:
    """File lists: DeepSpeed globs the checkpoint directory; while a snapshot is being loaded, answer
    from the restored snapshot instead (each listed file gets a placeholder on disk)."""
    all_names = engine._get_all_ckpt_names

    def _get_all_ckpt_names(checkpoints_path, tag):
        if ce._load_root is None:
            return all_names(checkpoints_path, tag)
        # what the glob finds once every model-parallel rank has saved (see InMemoryCheckpointEngine._resolve)
        names = [engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder=f"{m:02d}")
                 for m in range(_model_ranks(engine))]
        _placeholders(names, ce.adapter.restored["tag"])
        return names

    engine._get_all_ckpt_names = _get_all_ckpt_names


def _patch_load_checkpoint(engine: Any, ce: InMemoryCheckpointEngine, disk_engine: Any,
                           fallback_to_files: bool) -> None:
    """``load_checkpoint``: restore the newest verified snapshot, then let DeepSpeed read it (with the
    snapshot's tag) and restore the RNG last. When no snapshot is restored, or it holds another tag
    than the one asked for: DeepSpeed's own files through ``disk_engine`` if ``fallback_to_files``,
    else ``(None, None)``."""
    ds_load = engine.load_checkpoint
    adapter = ce.adapter

    def load_checkpoint(load_dir, tag=None, **kwargs):
        ce.ckpt.before_optimizer_step()
        try:
            res = ce.ckpt.restore()
        except RestoreFailed as e:  # the buffers were fresh: the live model is untouched
            log.warning("rank %d: %s", ce.ckpt.rank, e)
            res = None
        restored = adapter.restored if res is not None and res.source != "none" else None
        if restored is None or (tag is not None and str(tag) != restored["tag"]):
            adapter.restored = None
            if restored is not None:
                log.warning("rank %d: tag %s was asked for, the in-memory tier holds %s: reading files",
                            ce.ckpt.rank, tag, restored["tag"])
            if not fallback_to_files:
                return None, None
            return _load_files(engine, disk_engine, ds_load, load_dir, tag, **kwargs)
        ce._load_root = os.path.abspath(os.path.join(load_dir, restored["tag"]))
        _placeholders([os.path.join(ce._load_root, n) for n in restored["files"]], restored["tag"])
        try:
            result = ds_load(load_dir, tag=restored["tag"], **kwargs)
        finally:
            ce._load_root = None
        _set_rng(restored)
        adapter.restored = None
        return result

    engine.load_checkpoint = load_checkpoint


def _load_files(engine: Any, disk_engine: Any, ds_load: Any, load_dir: str, tag: Optional[str], **kwargs):
    """DeepSpeed's own load from files on disk (e.g. a job's initial checkpoint)."""
    ce = engine.checkpoint_engine
    engine.checkpoint_engine = disk_engine
    try:
        return ds_load(load_dir, tag=tag, **kwargs)
    finally:
        engine.checkpoint_engine = ce


PLACEHOLDER = ("megatron-ft placeholder: DeepSpeed read this file (tag {tag}) through megatron-ft's in-memory "
               "tier; its contents were never written to disk\n")


def _model_ranks(engine: Any) -> int:
    """How many ``mp_rank_XX`` model-states files DeepSpeed writes per tag (pipeline: one per
    stage x slice rank, though ``engine.mp_world_size`` counts only the slice ranks)."""
    grid = getattr(engine, "grid", None)
    return int(grid.get_model_parallel_world_size()) if grid is not None else int(engine.mp_world_size)


def _placeholders(paths: list[str], tag: str) -> None:
    """DeepSpeed's loader asserts ``os.path.exists`` on a file before reading it through the
    checkpoint engine: give each such file a one-line text placeholder (not loadable by
    torch.load), never over an existing file."""
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(PLACEHOLDER.format(tag=tag))


def _set_rng(restored: dict) -> None:
    rng.restore(restored["rng"], restored)


def _patch_pipeline_module(module: Any, ce: InMemoryCheckpointEngine) -> None:
    """The pipeline engine saves a stage's layers on data-parallel rank 0 and every rank of the
    stage reads them (``PipelineModule.save_state_dict``/``ckpt_layer_path_list``): make every rank
    snapshot its stage's layers, and list layer files from the restored snapshot."""
    save_state_dict = module.save_state_dict
    layer_list = module.ckpt_layer_path_list

    def save_all_layers(save_dir, checkpoint_engine, exclude_frozen_params=False):
        if checkpoint_engine is not ce:
            return save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params=exclude_frozen_params)
        for idx, layer in enumerate(module.forward_funcs):
            if not hasattr(layer, "state_dict"):
                continue
            sd = layer.state_dict()
            if exclude_frozen_params:
                for n in module._get_frozen_parameter_names(layer):
                    del sd[n]
            ce.save(sd, module.ckpt_layer_path(save_dir, idx))

    def ckpt_layer_path_list(ckpt_dir, local_layer_idx):
        if ce._load_root is None:
            return layer_list(ckpt_dir, local_layer_idx)
        pattern = os.path.join(os.path.abspath(ckpt_dir), f"layer_{local_layer_idx + module._local_start:02d}-")
        return sorted(fnmatch.filter(ce.restored_paths(), pattern + "*model_states.pt"))

    module.save_state_dict = save_all_layers
    module.ckpt_layer_path_list = ckpt_layer_path_list
