#!/usr/bin/env python3
"""Real megatron-core GPT pretraining loop on synthetic data (CPU/gloo or GPU/nccl).

Launch with torchrun, e.g. TP1 PP2 DP2 on four processes::

    MFT_RUN_DIR=/tmp/run torchrun --nproc-per-node 4 scripts/pretrain_gpt.py \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --train-iters 20

Everything is built from megatron-core itself: ``parallel_state``, ``GPTModel`` with the
local layer spec, megatron's DDP wrapper, the distributed optimizer from
``get_megatron_optimizer``, ``OptimizerParamScheduler`` and the pipeline schedules from
``get_forward_backward_func``. On a machine without CUDA the CPU shims of
:mod:`megatron_ft.megatron.cpu_compat` are installed first.

The run is bit-for-bit deterministic: fixed seeds (python, numpy, torch and megatron's
RNG tracker), a deterministic data order driven by ``consumed_samples``
(:mod:`megatron_ft.testing.data`) and one intra-op thread per process.

Checkpointing hooks in at four marked places (search for ``HOOK``), through a
:class:`TrainingHooks` object passed to :func:`train`:

(a) ``restore``: after everything is built, before the loop; may restore state and
    return a new ``iteration`` / ``consumed_samples`` (the data iterator is rebuilt);
(b) ``before_optimizer_step``: after forward/backward and the gradient reduction, just
    before ``optimizer.step()``;
(c) ``after_iteration``: after a completed iteration (optimizer step, scheduler step,
    ``iteration`` and ``consumed_samples`` updated), with its loss where the rank has it;
(d) ``before_iteration``: at the start of each iteration (optional: called when the hooks
    object has it; the profiler of ``--inmem-ckpt-profile-iterations`` uses it).

A hook ends the loop cleanly after the current iteration by setting the hooks object's
``stop_requested`` (the reference checkpoint's ``--ref-stop-after-save`` does).

Reference checkpoint: ``--ref-save-dir DIR --ref-save-at N [--ref-stop-after-save]`` saves the full
training state after iteration N as megatron-core's own distributed checkpoint, and
``--ref-load-dir DIR`` starts a job - of any data-parallel size - from it
(:mod:`megatron_ft.megatron.dist_reference`): Megatron's own reshard, the reference for a resume at
another data-parallel size. ``--train-iters`` stays the job's full length in every run.

Per-iteration progress: with ``MFT_RUN_DIR`` set, every rank appends one JSON line per
iteration to ``$MFT_RUN_DIR/progress/rank{RANK}.jsonl`` (flushed after each line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

# Allow running from a source checkout without installing the package.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_ft.testing.data import (  # noqa: E402
    MicroBatchIterator,
    SyntheticTokenDataset,
    build_data_iterator,
)
from megatron_ft import config as ftconfig  # noqa: E402
from megatron_ft.config import add_inmem_ckpt_args  # noqa: E402
from megatron_ft.trainer import in_process  # noqa: E402
from megatron_ft.trainer.checkpointer import agent_holds_version  # noqa: E402
from megatron_ft.trainer.distributed import init_process_group  # noqa: E402
from megatron_ft.megatron.cpu_compat import cpu_config_overrides, install_cpu_compat  # noqa: E402


# ======================================================================================
# Arguments
# ======================================================================================
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Megatron-style command-line arguments (defaults: a tiny GPT, 20 iterations)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--vocab-size", type=int, default=128, help="synthetic vocabulary size")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the embedding table like Megatron (times the TP size)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("mixture of experts (megatron-core MoE; off without --num-experts)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (every transformer layer's MLP becomes a MoE layer)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: the experts are split over this many ranks of the data-parallel x tensor ranks")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ETP: tensor parallelism inside each expert (default: --tensor-model-parallel-size)")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"],
                   help="how tokens reach their experts' ranks: allgather (default; gathers every token of "
                        "the EP group, works on gloo) or alltoall (exchanges only each rank's routed tokens)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the load-balancing loss (0: off, as Megatron-LM's default)")
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing: a per-expert routing bias (a router buffer) updated "
                        "every step from the tokens each expert got (needs --moe-router-score-function sigmoid)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)

    g = p.add_argument_group("parallelism and batch")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline stage: the interleaved 1F1B schedule (needs PP > 1, "
                        "--num-layers a multiple of PP x this, micro-batches a multiple of PP)")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=16)

    g = p.add_argument_group("optimization")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=2)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations, fp32 main parameters and gradients in the "
                        "distributed optimizer (as Megatron-LM's --bf16)")

    g = p.add_argument_group("data-parallel communication (megatron-core DDP)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce-scatter each bucket's gradients while the backward pass goes on")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather each bucket's updated parameters during the next forward pass "
                        "(needs --overlap-grad-reduce, as in Megatron-LM)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="accepted as Megatron-LM's command lines give it: this script always shards the optimizer "
                        "over the data-parallel ranks (megatron-core's DistributedOptimizer)")
    g.add_argument("--ddp-bucket-size", type=int, default=None, metavar="ELEMENTS",
                   help="elements per DDP bucket (megatron-core's default: one bucket per buffer "
                        "without --overlap-grad-reduce, else max(40M, 1M x DP))")

    g = p.add_argument_group("logging and output")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (cleanly) once the iteration number is a multiple of this, as Megatron-LM does")
    g.add_argument("--min-iteration-s", type=float, default=0.0, metavar="S",
                   help="pad every iteration to at least S seconds (a demo's clock: time for a node to come back "
                        "while the job trains; the numbers are unchanged)")
    g.add_argument("--dump-final-state", metavar="PATH_PREFIX", default=None,
                   help="write PATH_PREFIX.rank{R}.json with digests of the final state")

    g = p.add_argument_group("reference checkpoint (megatron-core dist_checkpointing)",
                             "Megatron's own checkpoint of the full training state (torch_dist; the distributed "
                             "optimizer dp_reshardable), loadable at another data-parallel size: the reference "
                             "for a resume at another size (megatron_ft.megatron.dist_reference). Keep "
                             "--train-iters the job's full length in every run (the LR schedule depends on it).")
    g.add_argument("--ref-load-dir", metavar="DIR", default=None,
                   help="at start, load the checkpoint in DIR and continue from its iteration and consumed "
                        "samples (the weights are built uninitialised)")
    g.add_argument("--ref-save-dir", metavar="DIR", default=None,
                   help="save the checkpoint into DIR after iteration --ref-save-at")
    g.add_argument("--ref-save-at", metavar="N", type=int, default=None,
                   help="the iteration after which --ref-save-dir is written")
    g.add_argument("--ref-stop-after-save", action="store_true",
                   help="end the run cleanly right after that save")
    add_inmem_ckpt_args(p)
    args = p.parse_args(argv)

    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if not 0 <= args.lr_warmup_iters < args.lr_decay_iters:
        p.error(
            f"need 0 <= --lr-warmup-iters ({args.lr_warmup_iters}) < --lr-decay-iters "
            f"({args.lr_decay_iters}, default: --train-iters)"
        )
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        pp = args.pipeline_model_parallel_size
        if vpp < 1 or pp < 2:
            p.error(f"--virtual-pipeline-model-parallel-size {vpp}: needs a value >= 1 and "
                    f"--pipeline-model-parallel-size > 1 (is {pp})")
        if args.num_layers % (pp * vpp):
            p.error(f"--num-layers {args.num_layers} is not a multiple of pipeline {pp} x virtual {vpp} "
                    f"(each model chunk gets the same number of layers)")
        if vpp == 1:
            args.virtual_pipeline_model_parallel_size = None
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        p.error("--overlap-param-gather needs --overlap-grad-reduce (as Megatron-LM requires)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        p.error(f"--ddp-bucket-size {args.ddp_bucket_size}: needs a positive number of elements")
    if args.num_experts is None:
        moe_only = [flag for flag, given in (
            ("--expert-model-parallel-size", args.expert_model_parallel_size != 1),
            ("--moe-router-enable-expert-bias", args.moe_router_enable_expert_bias),
            ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff != 0.0)) if given]
        if moe_only:
            p.error(f"{', '.join(moe_only)} given without --num-experts: they apply to MoE models only")
    else:
        if args.num_experts < 1:
            p.error(f"--num-experts {args.num_experts}: needs at least 1 expert")
        if not 1 <= args.moe_router_topk <= args.num_experts:
            p.error(f"--moe-router-topk {args.moe_router_topk}: needs 1 <= topk <= --num-experts ({args.num_experts})")
        ep = args.expert_model_parallel_size
        if ep < 1 or args.num_experts % ep:
            p.error(f"--expert-model-parallel-size {ep}: needs a divisor of --num-experts ({args.num_experts})")
        if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
            p.error("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                    f"(is {args.moe_router_score_function}), as megatron-core requires")
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.ref_save_at is None:
        if args.ref_save_dir is not None:
            p.error("--ref-save-dir needs --ref-save-at (the iteration after which it is written)")
        if args.ref_stop_after_save:
            p.error("--ref-stop-after-save needs --ref-save-at and --ref-save-dir")
    else:
        if args.ref_save_dir is None:
            p.error(f"--ref-save-at {args.ref_save_at} needs --ref-save-dir (where the checkpoint goes)")
        if not 1 <= args.ref_save_at <= args.train_iters:
            p.error(f"--ref-save-at {args.ref_save_at}: needs 1 <= N <= --train-iters ({args.train_iters})")
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = int(math.ceil(args.vocab_size / multiple) * multiple)
    return args


# ======================================================================================
# Distributed setup
# ======================================================================================
def init_distributed(args: argparse.Namespace) -> None:
    """Create the default process group (gloo without CUDA, nccl with) and Megatron's groups.

    The rank is stable per simulated node and every elastic restart gets a fresh store
    (see :mod:`megatron_ft.trainer.distributed`).
    """
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world_size = init_process_group()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    args.rank = rank
    args.world_size = world_size
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"micro-batch-size * data-parallel-size = {per_step}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp:
        raise ValueError(
            f"the interleaved schedule needs the micro-batches per iteration ({args.num_microbatches} = "
            f"--global-batch-size / (micro-batch-size x DP)) to be a multiple of --pipeline-model-parallel-size {pp}"
        )


def set_seeds(seed: int) -> None:
    """Seed python, numpy, torch and megatron's RNG tracker, as Megatron-LM does.

    Pipeline stages get different seeds (``seed + 100 * pp_rank``); TP ranks get different
    tensor-parallel dropout streams via ``model_parallel_cuda_manual_seed``.
    """
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ======================================================================================
# Build
# ======================================================================================
@dataclass
class TrainingObjects:
    """Everything a training step, a checkpoint save or a restore needs."""

    model: List[DistributedDataParallel]  # model chunks (one without virtual PP)
    optimizer: Any  # megatron ChainedOptimizer; .chained_optimizers[0] is the DistributedOptimizer
    scheduler: OptimizerParamScheduler
    config: TransformerConfig
    args: argparse.Namespace
    dataset: Optional[SyntheticTokenDataset] = field(repr=False, default=None)


def param_dtype(args: argparse.Namespace) -> torch.dtype:
    """The model parameters' dtype: bf16 with ``--bf16`` (fp32 main parameters in the optimizer)."""
    return torch.bfloat16 if args.bf16 else torch.float32


#: the arguments megatron-core's configs take under the flags' own names: TransformerConfig's, its
#: mixture-of-experts ones (with ``--num-experts``), OptimizerConfig's
TRANSFORMER_SETTINGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "hidden_dropout",
                        "attention_dropout", "init_method_std", "tensor_model_parallel_size",
                        "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "bf16")
MOE_SETTINGS = ("moe_router_topk", "moe_ffn_hidden_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size", "moe_token_dispatcher_type", "moe_router_load_balancing_type",
                "moe_aux_loss_coeff", "moe_router_score_function", "moe_router_enable_expert_bias",
                "moe_router_bias_update_rate")
OPTIMIZER_SETTINGS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "bf16")


def settings_of(args: argparse.Namespace, names: Sequence[str]) -> Dict[str, Any]:
    """``{name: args.name}`` for each of ``names``."""
    return {name: getattr(args, name) for name in names}


def build_transformer_config(args: argparse.Namespace, initialise: bool = True) -> TransformerConfig:
    """``initialise``: False builds the weights uninitialised (megatron-core's
    ``perform_initialization``), for a model a restore overwrites whole."""
    kwargs: Dict[str, Any] = dict(
        settings_of(args, TRANSFORMER_SETTINGS),
        perform_initialization=initialise,
        use_cpu_initialization=True,
        params_dtype=param_dtype(args),
        pipeline_dtype=param_dtype(args),
        # As Megatron-LM sets it; also makes the schedules call the autograd engine directly.
        deallocate_pipeline_outputs=True,
    )
    if args.num_experts is not None:
        kwargs.update(
            settings_of(args, MOE_SETTINGS),
            num_moe_experts=args.num_experts,
            moe_grouped_gemm=False,  # one GEMM per local expert (grouped GEMM needs its CUDA kernels)
        )
    if not torch.cuda.is_available():
        kwargs.update(cpu_config_overrides(param_dtype(args)))
    config = TransformerConfig(**kwargs)
    # Without this there is silently no data-parallel gradient reduction
    # (megatron.training normally sets it).
    config.finalize_model_grads_func = finalize_model_grads
    return config


def build_model(args: argparse.Namespace, config: TransformerConfig) -> List[DistributedDataParallel]:
    """This rank's model chunks, each wrapped in DDP: one, or one per virtual pipeline stage (the
    interleaved schedule: chunk ``i`` of stage ``p`` holds layers of virtual stage ``i * PP + p``)."""
    vpp = args.virtual_pipeline_model_parallel_size
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=True,
        bucket_size=args.ddp_bucket_size,
    )
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type="learned_absolute",
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():
            gpt.cuda(torch.cuda.current_device())
        module = Float16Module(config, gpt) if args.bf16 else gpt  # as Megatron-LM wraps a bf16 model
        # as Megatron-LM: only the first chunk's gradients go in buckets of their own
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                              disable_bucketing=bool(chunks)))
    return chunks


def build_training_objects(args: argparse.Namespace, initialise: bool = True) -> TrainingObjects:
    """Seeds, model, distributed optimizer, LR scheduler and dataset (after init_distributed);
    ``initialise``: see :func:`build_transformer_config`."""
    set_seeds(args.seed)
    config = build_transformer_config(args, initialise)
    model = build_model(args, config)
    opt_config = OptimizerConfig(
        **settings_of(args, OPTIMIZER_SETTINGS),
        optimizer="adam",
        use_distributed_optimizer=True,
        params_dtype=param_dtype(args),
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    # Megatron counts scheduler steps in samples.
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    dataset = SyntheticTokenDataset(
        vocab_size=args.vocab_size, seq_length=args.seq_length, seed=args.seed
    )
    return TrainingObjects(model, optimizer, scheduler, config, args, dataset)


def build_iterator(objs: TrainingObjects, consumed_samples: int) -> MicroBatchIterator:
    """This rank's micro-batch iterator, positioned at ``consumed_samples``."""
    args = objs.args
    if objs.dataset is None:
        raise ValueError("TrainingObjects.dataset is not set")
    return build_data_iterator(
        objs.dataset,
        consumed_samples=consumed_samples,
        micro_batch_size=args.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        total_samples=args.train_iters * args.global_batch_size,
    )


# ======================================================================================
# Forward step and train step
# ======================================================================================
def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Megatron-LM's GPT loss: (sum of token losses, token count, {'lm loss': [sum, count]})."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(
    data_iterator: Iterator[Dict[str, torch.Tensor]], model: torch.nn.Module
) -> Tuple[torch.Tensor, Callable[..., Any]]:
    """One micro-batch forward. Every stage draws the batch, so all iterators stay in step."""
    batch = next(data_iterator)
    if torch.cuda.is_available():  # GPU path: the synthetic batches are built on the host
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    output = model(
        batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"]
    )
    return output, partial(loss_func, batch["loss_mask"])


@dataclass
class StepResult:
    loss: Optional[float]  # mean token loss over the global batch (last stage only)
    grad_norm: Optional[float]
    update_successful: bool
    lr: float


class TrainingHooks:
    """No-op hooks; checkpointing subclasses this and passes an instance to :func:`train`."""

    #: set by a hook to end the loop cleanly after the current iteration (read after HOOK (c))
    stop_requested: bool = False

    def restore(
        self, objs: TrainingObjects, iteration: int, consumed_samples: int
    ) -> Tuple[int, int]:
        """HOOK (a) "restore point": return the (iteration, consumed_samples) to start at."""
        return iteration, consumed_samples

    def before_optimizer_step(self, objs: TrainingObjects, iteration: int) -> None:
        """HOOK (b) "before_optimizer_step": grads are reduced; params not yet updated."""

    def after_iteration(self, objs: TrainingObjects, iteration: int, consumed_samples: int,
                        loss: Optional[float] = None) -> None:
        """HOOK (c) "after_iteration": ``iteration`` iterations are complete; ``loss`` is the last
        one's (on the last pipeline stage, else None)."""

    def before_iteration(self, objs: TrainingObjects, iteration: int) -> None:
        """HOOK (d) "before_iteration": iteration ``iteration`` (0-based) is about to start."""


def train_step(
    objs: TrainingObjects,
    data_iterator: Iterator[Dict[str, torch.Tensor]],
    iteration: int,
    hooks: TrainingHooks,
) -> StepResult:
    """One iteration: forward/backward over all micro-batches, optimizer and LR step."""
    args = objs.args
    for chunk in objs.model:
        chunk.zero_grad_buffer()
    objs.optimizer.zero_grad()

    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=objs.model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=None,
        forward_only=False,
    )

    # ---- HOOK (b) "before_optimizer_step" ------------------------------------------
    hooks.before_optimizer_step(objs, iteration)

    update_successful, grad_norm, _ = objs.optimizer.step()
    if update_successful:
        objs.scheduler.step(increment=args.global_batch_size)

    loss: Optional[float] = None
    if parallel_state.is_pipeline_last_stage():
        # As Megatron-LM's train_step: sum [loss_sum, tokens] over micro-batches and DP.
        val = torch.vstack([x["lm loss"].view(-1) for x in losses_reduced]).sum(dim=0)
        torch.distributed.all_reduce(val, group=parallel_state.get_data_parallel_group())
        loss = float((val[0] / val[1]).item())
    lr = float(objs.optimizer.param_groups[0]["lr"])
    return StepResult(
        loss=loss,
        grad_norm=None if grad_norm is None else float(grad_norm),
        update_successful=bool(update_successful),
        lr=lr,
    )


# ======================================================================================
# Progress output
# ======================================================================================
class ProgressWriter:
    """Appends one JSON line per iteration to ``$MFT_RUN_DIR/progress/rank{RANK}.jsonl``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._file: Optional[IO[str]] = None
        run_dir = os.environ.get("MFT_RUN_DIR")
        if run_dir:
            path = Path(run_dir) / "progress" / f"rank{rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, iteration: int, consumed_samples: int, result: StepResult) -> None:
        if self._file is None:
            return
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "loss": result.loss,
            "loss_hex": None if result.loss is None else float(result.loss).hex(),
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "time": time.time(),
            "restart_count": self.restart_count,
            "in_process_attempt": in_process.attempt()[0],  # > 0: this process rejoined after a failure
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def is_logging_rank() -> bool:
    """The one rank that prints: last pipeline stage, TP rank 0, DP rank 0."""
    return (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


# ======================================================================================
# Training loop
# ======================================================================================
def train(objs: TrainingObjects, hooks: Optional[TrainingHooks] = None) -> Tuple[int, int]:
    """Run until ``args.train_iters``; returns the final (iteration, consumed_samples)."""
    hooks = hooks or TrainingHooks()
    args = objs.args
    iteration = 0
    consumed_samples = 0

    # ---- HOOK (a) "restore point" --------------------------------------------------
    # May load model/optimizer/scheduler/RNG state and move iteration/consumed_samples;
    # the data iterator is built from consumed_samples afterwards.
    iteration, consumed_samples = hooks.restore(objs, iteration, consumed_samples)
    # one iterator per model chunk with a virtual pipeline: each chunk draws every micro-batch
    chunks = args.virtual_pipeline_model_parallel_size
    data_iterator = [build_iterator(objs, consumed_samples) for _ in range(chunks)] if chunks else \
        build_iterator(objs, consumed_samples)

    for chunk in objs.model:
        chunk.train()
    progress = ProgressWriter(args.rank)
    log = is_logging_rank()
    t_last = time.time()
    before_iteration = getattr(hooks, "before_iteration", None)  # optional HOOK (d)
    try:
        t_iteration = time.time()
        while iteration < args.train_iters:
            # ---- HOOK (d) "before_iteration" ----------------------------------------
            if before_iteration is not None:
                before_iteration(objs, iteration)
            result = train_step(objs, data_iterator, iteration, hooks)
            iteration += 1
            consumed_samples += args.global_batch_size
            assert all(it.consumed_samples == consumed_samples
                       for it in (data_iterator if chunks else [data_iterator]))

            # ---- HOOK (c) "after_iteration" ----------------------------------------
            hooks.after_iteration(objs, iteration, consumed_samples, loss=result.loss)

            progress.write(iteration, consumed_samples, result)
            if args.min_iteration_s:  # pad the iteration (the numbers are the same; only the clock moves)
                time.sleep(max(0.0, args.min_iteration_s - (time.time() - t_iteration)))
            t_iteration = time.time()
            if args.exit_interval and iteration % args.exit_interval == 0 and iteration < args.train_iters:
                if log:
                    print(f"exiting at iteration {iteration} (--exit-interval {args.exit_interval})", flush=True)
                break
            if log and iteration % args.log_interval == 0:
                now = time.time()
                ms = 1000.0 * (now - t_last) / args.log_interval
                t_last = now
                print(
                    f"iteration {iteration:6d}/{args.train_iters} | consumed samples "
                    f"{consumed_samples:8d} | {ms:7.1f} ms/it | lr {result.lr:.4e} | "
                    f"lm loss {result.loss:.6f} | grad norm {result.grad_norm:.4f}",
                    flush=True,
                )
            if getattr(hooks, "stop_requested", False):
                break
    finally:
        progress.close()
    return iteration, consumed_samples


# ======================================================================================
# Final-state digest
# ======================================================================================
def _sha256_tensor(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes."""
    t = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def optimizer_state_tensors(objs: TrainingObjects) -> Dict[str, torch.Tensor]:
    """This rank's fp32 main params and inner Adam state, in a deterministic order.

    Keys ``opt{k}.group{g}.param{j}.{param|exp_avg|exp_avg_sq|step}`` follow the inner torch
    optimizer's ``param_groups`` order, which the DistributedOptimizer builds
    deterministically from the model's parameter order.
    """
    out: Dict[str, torch.Tensor] = {}
    for k, dist_opt in enumerate(objs.optimizer.chained_optimizers):
        inner = dist_opt.optimizer  # torch.optim.AdamW over this rank's shards
        for g, group in enumerate(inner.param_groups):
            for j, main_param in enumerate(group["params"]):
                prefix = f"opt{k}.group{g}.param{j}"
                out[f"{prefix}.param"] = main_param
                for name, value in sorted(inner.state.get(main_param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        out[f"{prefix}.{name}"] = value
    return out


def dump_final_state(objs: TrainingObjects, path: str, progress: Optional[Dict[str, int]] = None) -> str:
    """HOOK: write ``{path}.rank{R}.json`` with sha256 digests of this rank's final state.

    Covers every model parameter (by name), the contiguous param buffers (dense and expert), the
    module buffers (a MoE router's expert bias), every optimizer state tensor (each part of the
    chained optimizer), the scheduler state and all RNG states (every stream of megatron's tracker),
    so two runs can be compared bit for bit. The file format may be replaced by the checkpointing code later.
    """
    if objs.args.overlap_param_gather:  # the last step's all-gather waits for a forward pass that never comes
        for chunk in objs.model:
            chunk.start_param_sync(force_sync=True)
    params: Dict[str, str] = {}
    buffers: Dict[str, str] = {}
    module_buffers: Dict[str, str] = {}
    for c, chunk in enumerate(objs.model):
        for name, p in chunk.module.named_parameters():
            params[f"chunk{c}.{name}"] = _sha256_tensor(p)
        for b, buf in enumerate(chunk.buffers):
            buffers[f"chunk{c}.buffer{b}.param_data"] = _sha256_tensor(buf.param_data)
        for b, buf in enumerate(getattr(chunk, "expert_parallel_buffers", [])):
            buffers[f"chunk{c}.expert_buffer{b}.param_data"] = _sha256_tensor(buf.param_data)
        for name, t in chunk.module.named_buffers():  # e.g. a MoE router's expert_bias
            module_buffers[f"chunk{c}.{name}"] = _sha256_tensor(t)
    optim = {k: _sha256_tensor(v) for k, v in optimizer_state_tensors(objs).items()}
    np_state = np.random.get_state()
    rng = {
        "python": _sha256_json(random.getstate()),
        "numpy": _sha256_json([np_state[0], np_state[1].tolist(), *np_state[2:]]),
        "torch_cpu": _sha256_tensor(torch.get_rng_state()),
        "tracker": {
            name: _sha256_tensor(state)
            for name, state in sorted(tensor_parallel.get_cuda_rng_tracker().get_states().items())
        },
    }
    if torch.cuda.is_available():
        rng["torch_cuda"] = _sha256_tensor(torch.cuda.get_rng_state())
    record = {
        "rank": objs.args.rank,
        "progress": progress or {},  # iteration and consumed samples (the data position)
        "model_params": params,
        "param_buffers": buffers,
        "module_buffers": module_buffers,
        "optimizer": optim,
        "optimizer_nontensor": _sha256_json(objs.optimizer.state_dict()),
        "scheduler": objs.scheduler.state_dict(),
        "rng": rng,
    }
    out = f"{path}.rank{objs.args.rank}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    return out


# ======================================================================================
# Entry point
# ======================================================================================
def shutdown_distributed() -> None:
    """Wait for every rank, then tear down Megatron's groups and the default process group."""
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


class ReferenceCheckpointHooks(TrainingHooks):
    """``--ref-load-dir`` / ``--ref-save-dir`` / ``--ref-save-at`` / ``--ref-stop-after-save`` around
    ``inner`` (the job's other hooks): megatron-core's own distributed checkpoint of the full training
    state (:mod:`megatron_ft.megatron.dist_reference`; collective, every rank runs the same hooks).

    ``restore`` loads ``--ref-load-dir`` first, then lets ``inner`` restore (an in-memory restore, when
    it finds a version, starts from that instead). ``after_iteration`` runs ``inner``'s, then, after
    iteration ``--ref-save-at``, saves into ``--ref-save-dir`` and, with ``--ref-stop-after-save``, asks
    the loop to stop (:attr:`TrainingHooks.stop_requested`)."""

    def __init__(self, inner: Any, args: argparse.Namespace) -> None:
        self.inner = inner
        self.args = args

    def restore(self, objs: TrainingObjects, iteration: int, consumed_samples: int) -> Tuple[int, int]:
        args = self.args
        if args.ref_load_dir:
            from megatron_ft.megatron.dist_reference import load_reference

            iteration, consumed_samples = load_reference(objs, args.ref_load_dir)
            if args.ref_save_at is not None and args.ref_save_at <= iteration:
                raise ValueError(f"--ref-save-at {args.ref_save_at}: the run starts after iteration {iteration} "
                                 f"(--ref-load-dir {args.ref_load_dir}), so it would never save")
            if is_logging_rank():
                print(f"loaded the reference checkpoint {args.ref_load_dir}: starting at iteration {iteration}, "
                      f"consumed samples {consumed_samples}", flush=True)
        return self.inner.restore(objs, iteration, consumed_samples)

    def before_iteration(self, objs: TrainingObjects, iteration: int) -> None:
        if hasattr(self.inner, "before_iteration"):
            self.inner.before_iteration(objs, iteration)

    def before_optimizer_step(self, objs: TrainingObjects, iteration: int) -> None:
        self.inner.before_optimizer_step(objs, iteration)

    def after_iteration(self, objs: TrainingObjects, iteration: int, consumed_samples: int,
                        loss: Optional[float] = None) -> None:
        self.inner.after_iteration(objs, iteration, consumed_samples, loss=loss)
        args = self.args
        if iteration != args.ref_save_at:
            return
        from megatron_ft.megatron.dist_reference import save_reference

        save_reference(objs, args.ref_save_dir, iteration, consumed_samples)
        self.stop_requested = args.ref_stop_after_save
        if is_logging_rank():
            print(f"saved the reference checkpoint of iteration {iteration} (consumed samples {consumed_samples}) "
                  f"into {args.ref_save_dir}" + ("; exiting after it (--ref-stop-after-save)"
                                                 if self.stop_requested else ""), flush=True)

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()


def make_hooks(args: argparse.Namespace) -> TrainingHooks:
    hooks: TrainingHooks = TrainingHooks()
    if args.inmem_ckpt:
        from megatron_ft.megatron.checkpointing import MegatronCheckpointHooks

        hooks = MegatronCheckpointHooks(args)  # type: ignore[assignment]
    if args.inmem_ckpt_profile_iterations > 0:
        from megatron_ft.megatron.profiling import ProfilingHooks

        hooks = ProfilingHooks.from_args(hooks, args)  # type: ignore[assignment]
    if args.ref_load_dir or args.ref_save_dir:  # outermost: the loop reads its stop_requested
        hooks = ReferenceCheckpointHooks(hooks, args)
    return hooks


class Attempts:
    """The training run as attempts of one process (:func:`megatron_ft.trainer.in_process.run`):
    attempt 0 is the run; a later one is the same process rejoining a new round after a peer failed.
    Every attempt builds its groups, model, DDP wrappers and optimizer afresh and restores into them,
    exactly as a fresh trainer of the round does, so every rank calls the same collectives in the same
    order (megatron-core's build makes some: GPTModel ties its embeddings with an all-reduce,
    ``get_megatron_optimizer`` all-gathers its parameter groups). A later attempt whose agent holds a
    version of its rank builds the weights uninitialised (the restore overwrites them; restoring
    nothing then ends the process: ``in_process.check_restored``); a first attempt initialises, so a
    restart from iteration 0 stays bit-exact. What the process keeps is what a fresh one pays for: its
    imports and, on a GPU, its CUDA context. On a GPU the aborted attempt's objects are freed before the
    next is built."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def __call__(self, number: int) -> int:
        args = self.args
        if number:
            import gc

            if torch.distributed.is_initialized():  # the aborted round's groups
                parallel_state.destroy_model_parallel()
                torch.distributed.destroy_process_group()
            if torch.cuda.is_available():  # free the aborted attempt's model and optimizer (in cycles
                gc.collect()  # through DDP's hooks) before building the next on the same GPU; on CPU
                torch.cuda.empty_cache()  # Python's collector does it in its time (a full pass: 0.1-0.3 s)
        init_distributed(args)
        initialise = not (args.inmem_ckpt and in_process.build_uninitialised(
            lambda: agent_holds_version(ftconfig.from_args(args), args.rank)))
        initialise = initialise and not args.ref_load_dir  # the reference checkpoint overwrites every weight
        objs = build_training_objects(args, initialise)
        hooks = make_hooks(args)
        try:
            iteration, consumed_samples = train(objs, hooks)
        finally:
            if hasattr(hooks, "close"):
                hooks.close()
        if args.dump_final_state:
            dump_final_state(objs, args.dump_final_state,
                             {"iteration": iteration, "consumed_samples": consumed_samples})
        shutdown_distributed()
        return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    install_cpu_compat()  # CPU only; a no-op with CUDA
    torch.set_num_threads(1)  # determinism (and 2-core machines)
    if torch.cuda.is_available():  # GPU path: a bit-exact resume needs deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS is first used
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without one warns; the demo compares bytes
    return in_process.run(Attempts(args))


if __name__ == "__main__":
    sys.exit(main())
