"""Bootstrap for upstream Megatron-LM's own training scripts (``pretrain_gpt.py`` and the rest).

The patch set calls :func:`before_training_import` as the first statement of
``megatron/training/__init__.py`` and :func:`after_training_import` as its last, so every script that
imports ``megatron.training`` gets the same set-up without a hand edit:

* **Ranks pinned to nodes** (any machine, only under ``megatron-ft launch``, i.e. with
  ``MFT_NODE_RANK`` set): ``RANK`` becomes ``MFT_NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK`` before
  Megatron reads it, so a restarted or replacement node's trainers get the ranks whose snapshots its
  agent and its peers hold (torchrun's c10d rendezvous orders nodes by host name and pid). torchrun's
  own rank is kept in ``MFT_TORCHRUN_RANK``: that rank's host is ``MASTER_ADDR``, so it (not pinned rank
  0) hosts the process-group store; ``torch.distributed.init_process_group`` is given that store
  (:func:`megatron_ft.trainer.distributed.rendezvous_store`) when Megatron passes none.
* **CPU layer** (only when ``torch.cuda.is_available()`` is false; never installed with CUDA):
  :mod:`megatron_ft.megatron.cpu_compat` plus what ``megatron.training`` needs beyond megatron-core:
  a stand-in for the Triton kernel modules it imports (no Triton without CUDA), ``initialize_megatron``
  without its CUDA assertion, one "device" for the model-parallel set-up, no fused-kernel build, no
  compile warm-up of the fusions the CPU flags turn off, the
  dataset helpers' compiled module taken from the installed megatron-core wheel when its source is
  byte-identical to the tree's (no pybind11 build), the gloo backend, and the CPU flags appended to
  ``sys.argv`` when absent (:data:`CPU_FLAGS`). One log line says what was done.

Both functions are idempotent and cheap; neither does I/O beyond reading files and the environment.

**In a warm spare pool** (:mod:`megatron_ft.spares.pool` imports ``megatron.training`` from the
script's tree before any trainer exists): the process-wide part runs there once (the pool has no
``LOCAL_RANK``, so no rank is pinned, and no CUDA is touched: see the pool's contracts), and the
per-process part (:func:`for_this_process`: the pinned rank, the CPU flags in ``sys.argv``) runs in
each trainer the pool forks, before its script.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from typing import Any, Callable

import torch

log = logging.getLogger("megatron_ft.upstream")

#: Flags appended to a CPU run's command line when the user gave none of the same name
#: (value-less flags are switches). Fused kernels, Transformer Engine and GPU initialisation need CUDA.
CPU_FLAGS: tuple[tuple[str, str | None], ...] = (
    ("--transformer-impl", "local"),
    ("--distributed-backend", "gloo"),
    ("--use-cpu-initialization", None),
    ("--no-gradient-accumulation-fusion", None),
    ("--no-masked-softmax-fusion", None),
    ("--no-bias-gelu-fusion", None),
    ("--no-bias-swiglu-fusion", None),
    ("--no-bias-dropout-fusion", None),
    ("--no-rope-fusion", None),
    ("--no-persist-layer-norm", None),
)

#: Modules of megatron-core that import Triton at import time; stood in for on CPU.
TRITON_MODULES = (
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",  # core_v0.16.1 (guarded from 0.17 on)
    "megatron.core.transformer.moe.ops.paged_stash",  # core_v0.19.0: via pipeline_parallel.schedules
)

_done: set[str] = set()


def pin_rank() -> int | None:
    """Under ``megatron-ft launch``: rewrite ``RANK`` (and ``GROUP_RANK``) to the node-pinned rank.
    Returns the pinned rank, or None outside megatron-ft (nothing changed). Idempotent."""
    node = os.environ.get("MFT_NODE_RANK")
    if node is None or "LOCAL_RANK" not in os.environ:
        return None
    local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    os.environ.setdefault("MFT_TORCHRUN_RANK", os.environ.get("RANK", "0"))
    rank = int(node) * per_node + local
    os.environ["RANK"] = str(rank)
    os.environ["GROUP_RANK"] = node
    return rank


def cpu_argv(argv: list[str]) -> list[str]:
    """``argv`` with :data:`CPU_FLAGS` appended where absent (``--x`` and ``--x=v`` both count)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in CPU_FLAGS:
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out


def _stand_in_triton_modules() -> list[str]:
    """Empty stand-ins for megatron-core modules that need Triton (only their names are imported
    at module level; calling them on CPU raises)."""
    if importlib.util.find_spec("triton") is not None:
        return []
    done = []
    for name in TRITON_MODULES:
        if name in sys.modules:
            continue
        mod = types.ModuleType(name, "megatron-ft CPU stand-in: this module needs Triton (CUDA)")

        def _needs_triton(*_a: Any, _name: str = name, **_k: Any) -> Any:
            raise RuntimeError(f"{_name} needs Triton and CUDA; not available on a CPU run")

        def __getattr__(attr: str, _f: Callable[..., Any] = _needs_triton) -> Any:
            if attr.startswith("__"):  # module protocol (__file__, __path__, ...): a plain module's answer
                raise AttributeError(attr)
            return _f

        mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
        sys.modules[name] = mod
        done.append(name.rsplit(".", 1)[-1])
    return done


def _dataset_helpers() -> str | None:
    """Load the installed megatron-core wheel's compiled dataset helpers as the tree's
    ``megatron.core.datasets.helpers_cpp`` when the tree has none and both ``helpers.cpp`` are
    byte-identical; then ``compile_helpers`` (a ``make`` that needs pybind11) has nothing to do."""
    name = "megatron.core.datasets.helpers_cpp"
    tree = importlib.util.find_spec("megatron.core.datasets")
    if tree is None or not tree.submodule_search_locations:
        return None
    tree_dir = list(tree.submodule_search_locations)[0]
    if importlib.util.find_spec(name) is not None:
        return None  # the tree has its own build
    try:
        from importlib.metadata import distribution

        dist = distribution("megatron-core")
    except Exception:
        return None
    wheel_dir = str(dist.locate_file("megatron/core/datasets"))
    if os.path.realpath(wheel_dir) == os.path.realpath(tree_dir):
        return None

    def digest(path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return None

    if digest(os.path.join(tree_dir, "helpers.cpp")) != digest(os.path.join(wheel_dir, "helpers.cpp")):
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(wheel_dir, "helpers_cpp" + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            sys.modules[name] = mod
            import megatron.core.datasets.utils as ds_utils

            ds_utils.compile_helpers = lambda: None
            return f"dataset helpers from megatron-core {dist.version}"
    return None


def _wrap(module: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    orig = getattr(module, attr)
    if not getattr(orig, "_megatron_ft", False):
        new = make(orig)
        new._megatron_ft = True  # type: ignore[attr-defined]
        setattr(module, attr, new)


def _store_for_init_process_group() -> None:
    """``init_process_group`` with no store and the env:// method gets the store hosted by
    torchrun's rank 0 (see :func:`pin_rank`)."""
    import torch.distributed as dist

    from ..trainer import distributed as ftdist

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("store") is None and kwargs.get("init_method") in (None, "env://") and len(args) <= 1:
                import datetime

                timeout = kwargs.get("timeout") or datetime.timedelta(minutes=10)
                kwargs.pop("init_method", None)
                kwargs["store"] = ftdist.rendezvous_store(timeout)
                kwargs.setdefault("rank", ftdist.stable_rank())
                kwargs.setdefault("world_size", int(os.environ["WORLD_SIZE"]))
            return ftdist.timed_rendezvous(lambda: orig(*args, **kwargs))

        return init_process_group

    _wrap(dist, "init_process_group", make)


def _distributed_optimizer_state_before_first_step() -> None:
    """Without Apex or Transformer Engine (always so on CPU), megatron-core's
    ``DistributedOptimizer.state_dict`` asserts that torch Adam holds a ``step`` for every parameter,
    which a fresh optimizer does not: every resume (``load_checkpoint`` builds the sharded state dict
    with ``is_loading=True`` before any step) fails, from memory and from disk alike. Give the inner
    torch Adam its initial state first (``step`` 0, zero moments: exactly what it holds before its
    first step); the load then overwrites all of it. ``load_state_dict`` runs under ``no_grad`` and
    leaves each parameter its own ``step``."""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def state_dict(self: Any) -> Any:
            inner = self.optimizer
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and len(inner.state) == 0:
                for group in inner.param_groups:
                    for p in group["params"]:
                        st = inner.state[p]
                        st["step"] = torch.tensor(0.0)
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return orig(self)

        return state_dict

    _wrap(distrib_optimizer.DistributedOptimizer, "state_dict", make)

    # fp32 parameters (all a CPU run has): the optimizer's main parameter shards are views of the
    # model's leaf parameters, which load_state_dict copies into; outside no_grad autograd refuses.
    # The checkpoint's step is the one in its param groups. load_state_dict gives every parameter's
    # state the *same* tensor holding it, which torch Adam would then increment once per parameter
    # per step; worse, the parameter-state load that follows (dp_reshardable and the other sharding
    # types) copies into that shared tensor the ``step`` it captured from the *fresh* optimizer when
    # the loading state dict was built (a non-persistent object: 0), so every resume restarted Adam's
    # bias correction. Each parameter gets its own tensor holding the checkpoint's step.
    def make_load(orig: Callable[..., Any]) -> Callable[..., Any]:
        def load_state_dict(self: Any, state_dict: Any) -> Any:
            groups = (state_dict.get("optimizer") or {}).get("param_groups", []) if isinstance(state_dict, dict) else []
            steps = {g["step"] for g in groups if isinstance(g, dict) and g.get("step") is not None}
            with torch.no_grad():
                out = orig(self, state_dict)
            step = float(steps.pop()) if len(steps) == 1 else None
            for st in self.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    old = st["step"]
                    st["step"] = torch.tensor(step, dtype=old.dtype, device=old.device) if step is not None \
                        else old.detach().clone()
            return out

        return load_state_dict

    _wrap(distrib_optimizer.DistributedOptimizer, "load_state_dict", make_load)


def _no_warm_up_of_disabled_fusions() -> None:
    """Upstream's ``set_jit_fusion_options`` compiles (``torch.compile``) the fused bias+GeLU/SwiGLU
    and bias+dropout+add functions on sample tensors, so that the first step need not, whatever the
    fusion flags say. The CPU layer turns those fusions off (:data:`CPU_FLAGS`): the model never calls
    them, and compiling them was 7 of the 7.3 s a re-forked trainer spent between its rendezvous and
    its restore (four trainers at once on 2 cores), a cold one's alike. The warm-up is skipped while
    all three fusions are off (it still runs when a user turned one on)."""
    import megatron.training.initialize as initialize

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _warmup_jit_function(*a: Any, **k: Any) -> Any:  # core_v0.19.0: (tp_size=None)
            from megatron.training.global_vars import get_args

            args = get_args()
            if args.bias_gelu_fusion or args.bias_swiglu_fusion or args.bias_dropout_fusion:
                return orig(*a, **k)
            return None

        return _warmup_jit_function

    _wrap(initialize, "_warmup_jit_function", make)


def for_this_process() -> list[str]:
    """What the bootstrap does per process, idempotent: the node-pinned rank (and the process-group
    store of torchrun's rank 0), and with the CPU layer the CPU flags appended to ``sys.argv``.
    Returns what it did, for the log line."""
    said = []
    if pin_rank() is not None:
        _store_for_init_process_group()
        said.append(f"rank {os.environ['RANK']} pinned to node {os.environ['MFT_NODE_RANK']}")
    if "cpu" in _done:
        full = cpu_argv(sys.argv)
        added = full[len(sys.argv):]
        sys.argv[:] = full
        if added:
            said.append(f"CPU flags added: {' '.join(added)}")
    return said


def _in_process_restart() -> list[str]:
    """Under a keeper that offers in-process restart (``MFT_IN_PROCESS_FD``): upstream's
    ``pretrain_gpt.py`` asks ``inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)`` for its
    entry point; when upstream's own in-process restart (``--inprocess-restart``, nvidia-resiliency-ext)
    is off, the answer becomes ``pretrain`` run through :func:`megatron_ft.trainer.in_process.run`, each
    later attempt after upstream's own reset of its global state (``destroy_global_state``: its global
    variables, the micro-batch calculator, memory buffers, megatron-core's parallel state, the rerun
    state machine) and of the default process group. Called once ``megatron.training`` is imported.

    Not offered where ``pretrain`` takes a configuration container the script built once from the
    arguments it parsed before (core_v0.17 on): an attempt after upstream's reset would find no
    arguments, and a container a failed attempt changed. There the keeper forks a fresh trainer from the
    warm pool for each round instead (as when a trainer does not say it can rejoin)."""
    from ..trainer import in_process

    if not in_process.offered():
        return []
    import inspect

    import megatron.training.training as training

    if next(iter(inspect.signature(training.pretrain).parameters), "") == "cfg_container":
        os.environ.pop(in_process.ENV_FD, None)  # never says it can rejoin: each round a fresh trainer
        return ["in-process restart not offered (pretrain takes a configuration container built once, "
                "core_v0.17 on): a fresh trainer from the warm pool for each round"]
    try:
        import megatron.training.inprocess_restart as upstream_inprocess
    except ImportError:  # a tree without it: its scripts cannot be wrapped here
        return []

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def maybe_wrap_for_inprocess_restart(pretrain: Callable[..., Any]) -> Any:
            wrapped, store = orig(pretrain)
            if wrapped is not pretrain or store is not None:  # upstream's own in-process restart is on
                return wrapped, store

            def run_attempts(*args: Any, **kwargs: Any) -> Any:
                def attempt(number: int) -> Any:
                    if not number:
                        return pretrain(*args, **kwargs)
                    holds = _agent_holds_version_of_last_attempt()
                    reset_upstream_state()
                    if not in_process.build_uninitialised(holds):
                        return pretrain(*args, **kwargs)
                    sys.argv.append("--no-initialization")  # upstream's flag: the restore overwrites them
                    try:
                        return pretrain(*args, **kwargs)
                    finally:
                        sys.argv.remove("--no-initialization")

                return in_process.run(attempt)

            return run_attempts, None

        return maybe_wrap_for_inprocess_restart

    _wrap(upstream_inprocess, "maybe_wrap_for_inprocess_restart", make)
    return ["in-process restart offered"]


def _agent_holds_version_of_last_attempt() -> Callable[[], bool]:
    """For :func:`megatron_ft.trainer.in_process.build_uninitialised`, from the arguments upstream parsed in
    the attempt before (read before its global state is reset): whether this rank's agent holds a
    version of it. False without in-memory checkpoints, or when that attempt never parsed them."""
    from megatron.training import global_vars

    args = global_vars._GLOBAL_ARGS
    if args is None or not getattr(args, "inmem_ckpt", False):
        return lambda: False
    from .. import config as ftconfig
    from ..trainer.checkpointer import agent_holds_version

    cfg, rank = ftconfig.from_args(args), args.rank
    return lambda: agent_holds_version(cfg, rank)


def reset_upstream_state() -> None:
    """Between two attempts of upstream's ``pretrain`` in one process: what upstream resets for its
    own in-process restart, and the aborted round's default group."""
    import torch.distributed as dist
    from megatron.training import training

    training.destroy_global_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _say(said: list[str]) -> None:
    if said and int(os.environ.get("RANK", "0")) == 0:
        print(f"[megatron-ft] {'; '.join(said)}", flush=True)


def _in_a_forked_trainer() -> None:
    """A trainer forked from a warm spare pool that imported ``megatron.training`` (whose import
    therefore does not run again): the per-process part, with its log line."""
    _say(["megatron.training from the spare pool", *for_this_process(), *_in_process_restart()])


def _typing_override() -> bool:
    """Python < 3.12: ``typing.override`` (megatron/training/models/{gpt,hybrid}.py of core_v0.19.0)."""
    import typing

    if hasattr(typing, "override"):
        return False
    from typing_extensions import override

    typing.override = override  # type: ignore[attr-defined]
    return True


def before_core_import() -> None:
    """First statement of the patched ``megatron/core/__init__.py`` (and of :func:`before_training_import`):
    what must exist before megatron-core's first import. Any machine: ``typing.override`` on Python < 3.12;
    without CUDA: the Triton stand-ins (megatron-core 0.19 imports Triton kernels at import time, and
    ``pretrain_gpt.py`` imports megatron.core before megatron.training)."""
    if "core" in _done:
        return
    _done.add("core")
    _typing_override()
    if not torch.cuda.is_available():
        _stand_in_triton_modules()


def before_training_import() -> None:
    """First statement of the patched ``megatron/training/__init__.py``. Process-wide set-up (the CPU
    layer) once, then :func:`for_this_process`; the latter again in every trainer a warm spare pool
    forks after importing ``megatron.training`` (:func:`megatron_ft.spares.for_each_trainer`)."""
    if "before" in _done:
        return
    _done.add("before")
    said = []
    before_core_import()
    if not torch.cuda.is_available():
        stood_in = [n.rsplit(".", 1)[-1] for n in TRITON_MODULES if n in sys.modules
                    and getattr(sys.modules[n], "__file__", None) is None]
        from .cpu_compat import install_upstream_cpu

        install_upstream_cpu()
        _done.add("cpu")
        helpers = _dataset_helpers()
        said.append("no CUDA: megatron-ft CPU layer installed"
                    + (f", Triton modules stood in ({', '.join(stood_in)})" if stood_in else "")
                    + (f", {helpers}" if helpers else ""))
    said += for_this_process()
    _say(said)
    from ..spares import for_each_trainer

    for_each_trainer(_in_a_forked_trainer)


def _field_docstrings_once() -> None:
    """Upstream's ``ArgumentGroupFactory`` reads every config dataclass's field docstrings from its
    source at every ``parse_args`` (``inspect.getsource`` parses the class's whole module): about
    0.5 s per call on 2 cores, twice per start (``pretrain_gpt.py``'s in-process-restart check, then
    ``initialize_megatron``). The source does not change while the process runs: memoised per class
    and filled once here, so a trainer forked from a warm spare pool inherits it. Any machine."""
    try:
        import argparse

        from megatron.training import argument_utils, arguments
    except ImportError:  # a tree without the factory: nothing to do
        return
    factory = argument_utils.ArgumentGroupFactory
    cache: dict[type, dict[str, str]] = {}

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _get_field_docstrings(self: Any, src_cfg_class: type) -> dict[str, str]:
            if src_cfg_class not in cache:
                cache[src_cfg_class] = orig(self, src_cfg_class)
            return dict(cache[src_cfg_class])  # a copy: the caller updates it with its bases'

        return _get_field_docstrings

    _wrap(factory, "_get_field_docstrings", make)
    try:
        arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    except Exception as e:  # the parse itself will say what is wrong
        log.info("megatron-ft: argument docstrings not read ahead (%s)", e)


def _disk_save_is_its_own_phase() -> None:
    """Megatron's own checkpoint to disk (``save_checkpoint_and_time``, and ``save_checkpoint`` as the
    training module calls it directly - core_v0.16.1's save after the last iteration does - each without
    ``non_persistent_ckpt``) is the ``save`` phase of the hang rule (``hang.save_s``, not the iteration's
    bound): every rank may write for minutes with no collective. The in-memory saves keep their phases.
    Before, core_v0.16.1's final save ran in ``work``: a save longer than the bound was a hang verdict
    on the ranks still writing, SIGKILLed at the job's end."""
    import megatron.training.training as training

    from ..health import progress as hp
    from ..trainer import progress as rank_progress

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def disk_save(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("non_persistent_ckpt"):
                return orig(*args, **kwargs)
            with rank_progress.phase(hp.SAVE):
                return orig(*args, **kwargs)

        disk_save.__name__ = disk_save.__qualname__ = orig.__name__
        return disk_save

    for name in ("save_checkpoint_and_time", "save_checkpoint"):
        if hasattr(training, name):
            _wrap(training, name, make)


def after_training_import() -> None:
    """Last statement of the patched ``megatron/training/__init__.py``: the argument docstrings read
    once (:func:`_field_docstrings_once`); on CPU, ``initialize_megatron`` without its CUDA assertion
    and no fused-kernel build."""
    if "after" in _done:
        return
    _done.add("after")
    _field_docstrings_once()
    _say(_in_process_restart())
    _disk_save_is_its_own_phase()
    if torch.cuda.is_available():
        return
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    try:  # core_v0.16.1 builds them in _compile_dependencies; megatron.legacy is gone from 0.17 on
        import megatron.legacy.fused_kernels as fused_kernels

        fused_kernels.load = lambda args: None  # CUDA kernels; CPU runs use the unfused paths
    except ImportError:
        pass

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
            kwargs["allow_no_cuda"] = True
            return orig(*args, **kwargs)

        return initialize_megatron

    _wrap(initialize, "initialize_megatron", make)
    _distributed_optimizer_state_before_first_step()
    _no_warm_up_of_disabled_fusions()
    training.initialize_megatron = initialize.initialize_megatron
    sys.modules["megatron.training"].initialize_megatron = initialize.initialize_megatron  # type: ignore[attr-defined]
