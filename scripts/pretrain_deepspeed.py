#!/usr/bin/env python3
"""A small deterministic DeepSpeed pretraining job on CPU (gloo), for megatron-ft's DeepSpeed tier.

A tiny next-token model (embedding, ``--layers`` residual MLP blocks with dropout, LM head) on
megatron-ft's synthetic token data, trained with ``deepspeed.initialize`` (ZeRO ``--zero-stage``
0-3) or the pipeline engine (``--pipeline``: 2 stages, ZeRO 0/1). Run it under torchrun or
``megatron-ft launch``::

    DS_ACCELERATOR=cpu megatron-ft launch --nodes 1 --nproc-per-node 2 --config job.yaml -- \
        scripts/pretrain_deepspeed.py --zero-stage 3 --iters 20 --inmem-ckpt --save-dir /tmp/ds-ckpt

With ``--inmem-ckpt`` the job calls ``megatron_ft.deepspeed.enable_inmem_ckpt(engine)``, then
``engine.load_checkpoint(save_dir)`` once (resuming iteration and data position from the
returned client state) and ``engine.save_checkpoint(save_dir, client_state=...)`` after every
iteration. Without it, no checkpoint is taken (the uninterrupted reference).

Data order: sample ``i`` of the stream depends only on ``(seed, i)``; iteration ``it`` uses
samples ``[it*G, (it+1)*G)`` with ``G = micro_batch * grad_accum * dp``, micro-batch ``m`` of
data-parallel rank ``d`` taking ``mb`` consecutive samples at ``it*G + (m*dp + d)*mb``. The
position (consumed samples) is saved in the checkpoint's client state.

``$MFT_RUN_DIR/progress/rank{R}.jsonl`` gets one line per iteration (pid, iteration, loss as
float hex). ``--dump-final-state P`` writes ``P.rank{R}.json``: sha256 digests of the rank's
parameters (its ZeRO-3 partition), the optimizer's full state dict (fp32 partitions and Adam
moments), LR scheduler, RNG (python, numpy, torch) and the data position, for bit-exact
comparison.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ft.testing.data import SyntheticTokenDataset  # noqa: E402
from megatron_ft.trainer import in_process  # noqa: E402
from megatron_ft.trainer.distributed import init_process_group  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--pipeline", action="store_true", help="DeepSpeed pipeline engine, 2 stages (ZeRO 0/1)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--inmem-ckpt", action="store_true", help="save/load through megatron-ft every iteration")
    p.add_argument("--save-dir", default=None, help="DeepSpeed checkpoint directory (only `latest` is written)")
    p.add_argument("--iter-sleep", type=float, default=0.0,
                   help="seconds to sleep after each iteration (pacing, so an external kill lands mid-run)")
    p.add_argument("--dump-final-state", default=None, help="write PATH.rank{R}.json with final-state digests")
    return p.parse_args(argv)


# ---------------------------------------------------------------- model


class Embed(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Head(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class TinyLM(torch.nn.Module):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.layers = torch.nn.Sequential(Embed(args.vocab, args.hidden),
                                          *[Block(args.hidden, args.dropout) for _ in range(args.layers)],
                                          Head(args.vocab, args.hidden))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.layers(tokens), labels)


def build_model(args: argparse.Namespace):
    if not args.pipeline:
        return TinyLM(args)
    from deepspeed.pipe import LayerSpec, PipelineModule

    specs = [LayerSpec(Embed, args.vocab, args.hidden)]
    specs += [LayerSpec(Block, args.hidden, args.dropout) for _ in range(args.layers)]
    specs += [LayerSpec(Head, args.vocab, args.hidden)]
    return PipelineModule(layers=specs, num_stages=2, loss_fn=lm_loss, partition_method="uniform")


# ---------------------------------------------------------------- data


class Batches:
    """Micro-batches of one data-parallel rank from ``consumed_samples`` on (resumable)."""

    def __init__(self, ds: SyntheticTokenDataset, mb: int, gas: int, dp: int, dp_rank: int, consumed: int):
        self.ds, self.mb, self.gas, self.dp, self.dp_rank = ds, mb, gas, dp, dp_rank
        self.consumed = consumed

    @property
    def global_batch(self) -> int:
        return self.mb * self.gas * self.dp

    def micro(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.consumed + (m * self.dp + self.dp_rank) * self.mb
        seqs = torch.stack([torch.from_numpy(self.ds.sequence(i)) for i in range(start, start + self.mb)])
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def iteration(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = [self.micro(m) for m in range(self.gas)]
        self.consumed += self.global_batch
        return out


# ---------------------------------------------------------------- digests


def _sha_tensor(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sha_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def final_state(engine, batches: Batches, iteration: int) -> dict:
    from megatron_ft.capture import tree as codec

    params = {}
    for name, p in engine.module.named_parameters():
        params[name] = _sha_tensor(p.ds_tensor if hasattr(p, "ds_tensor") else p.data)
    enc = codec.Encoder()
    tree = enc.encode(engine.optimizer.state_dict(), "optimizer")
    np_state = np.random.get_state()
    return {
        "params": params,
        "optimizer": {"tree": _sha_json(tree), "tensors": [_sha_tensor(t) for t in enc.tensors]},
        "lr_scheduler": _sha_json(codec.Encoder().encode(engine.lr_scheduler.state_dict())
                                  if engine.lr_scheduler is not None else None),
        "rng": {"python": _sha_json(random.getstate()),
                "numpy": _sha_json([np_state[0], np_state[1].tolist(), *np_state[2:]]),
                "torch": _sha_tensor(torch.get_rng_state())},
        "progress": {"iteration": iteration, "consumed_samples": batches.consumed,
                     "global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples)},
    }


# ---------------------------------------------------------------- main


class Progress:
    def __init__(self, rank: int):
        self.f = None
        run_dir = os.environ.get("MFT_RUN_DIR")
        if run_dir:
            os.makedirs(os.path.join(run_dir, "progress"), exist_ok=True)
            self.f = open(os.path.join(run_dir, "progress", f"rank{rank}.jsonl"), "a", encoding="utf-8")
        self.rank = rank

    def write(self, rec: dict) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "time": time.time(),
                                     "in_process_attempt": in_process.attempt()[0], **rec}) + "\n")
            self.f.flush()


def fresh_deepspeed_state() -> Callable[[], None]:
    """DeepSpeed keeps process-wide state a second engine in the same process must not inherit: its
    process groups in module globals (``deepspeed.utils.groups``: the world, data, model and expert
    groups), and ZeRO-3's numbering of parameters (``zero.Init.param_id``) and modules (the counter
    ``DeepSpeedZeRoOffload._register_deepspeed_module`` keeps in its default argument), which every rank
    must assign alike (ZeRO-3 checks the module order across ranks at each forward). Called before the
    first attempt, returns what puts all of it back as it was then; a later attempt (an in-process
    restart, :mod:`megatron_ft.trainer.in_process`) calls that after the aborted round's default group
    is gone, so its engine is numbered and grouped as a fresh process's. (DeepSpeed 0.19.)"""
    import deepspeed.utils.groups as groups
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    start = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(groups).items()
             if k.startswith("_") and k[1:2].isupper() and (v is None or isinstance(v, dict))}
    module_count = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]  # the list [n]
    counters = (Init.param_id, list(module_count))

    def reset() -> None:
        for k, v in start.items():
            setattr(groups, k, dict(v) if isinstance(v, dict) else v)
        Init.param_id = counters[0]
        module_count[:] = counters[1]

    return reset


def main(argv=None) -> int:
    args = parse_args(argv)
    import deepspeed  # noqa: F401  (before the first attempt: what fresh_deepspeed_state records)

    reset = fresh_deepspeed_state()

    def attempt(number: int) -> int:
        if number:
            if dist.is_initialized():
                dist.destroy_process_group()
            reset()
        return train(args)

    return in_process.run(attempt)


def train(args: argparse.Namespace) -> int:
    """One attempt of the run: groups, model, engine, restore, the loop."""
    rank, world = init_process_group("gloo")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    model = build_model(args)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                      "warmup_num_steps": 5}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    # dropout masks differ per rank (and depend on the restored RNG)
    torch.manual_seed(args.seed + 1000 * (rank + 1))
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    dp, dp_rank = int(engine.seq_dp_world_size), 0
    if dp > 1:
        from deepspeed.utils import groups

        dp_rank = groups._get_sequence_data_parallel_rank()
    ds = SyntheticTokenDataset(vocab_size=args.vocab, seq_length=args.seq_length, seed=args.seed)
    iteration, consumed = 0, 0
    if args.inmem_ckpt:
        from megatron_ft.deepspeed import enable_inmem_ckpt

        if not args.save_dir:
            raise SystemExit("--inmem-ckpt needs --save-dir")
        ce = enable_inmem_ckpt(engine)
        path, client = engine.load_checkpoint(args.save_dir)
        if path is not None:
            iteration, consumed = int(client["iteration"]), int(client["consumed_samples"])
            if int(engine.global_steps) != iteration:
                raise RuntimeError(f"restored global_steps {engine.global_steps} != iteration {iteration}")
            if rank == 0:
                print(f"[pretrain_deepspeed] resumed at iteration {iteration} ({path})", flush=True)
    batches = Batches(ds, args.micro_batch, args.grad_accum, dp, dp_rank, consumed)
    progress = Progress(rank)
    try:
        iteration = train_loop(args, engine, batches, progress, iteration)
    finally:  # also when the attempt is aborted: the checkpointer's agent connection and engine
        if args.inmem_ckpt:
            ce.ckpt.close()
    if args.dump_final_state:
        state = final_state(engine, batches, iteration)
        os.makedirs(os.path.dirname(os.path.abspath(args.dump_final_state)), exist_ok=True)
        with open(f"{args.dump_final_state}.rank{rank}.json", "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def train_loop(args, engine, batches: "Batches", progress: "Progress", iteration: int) -> int:
    """Iterations until ``args.iters``; returns the last one's number."""
    while iteration < args.iters:
        micro = batches.iteration()
        if args.pipeline:
            loss = float(engine.train_batch(iter(micro)))
        else:
            total = 0.0
            for tokens, labels in micro:
                out = engine(tokens, labels)
                engine.backward(out)
                engine.step()
                total += float(out)
            loss = total / len(micro)
        iteration += 1
        if args.inmem_ckpt:
            engine.save_checkpoint(args.save_dir, client_state={"iteration": iteration, "consumed_samples": batches.consumed})
        progress.write({"iteration": iteration, "loss_hex": loss.hex()})
        if args.iter_sleep:
            time.sleep(args.iter_sleep)
    return iteration


if __name__ == "__main__":
    sys.exit(main())
