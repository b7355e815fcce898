"""ZeRO-3 (FSDP2) against ZeRO-1, ZeRO-2, a DDP-like replicated run and the unsharded model: bytes per rank
and step time, all in one spawn.

    .venv/bin/python benchmarks/zero3_bench.py            # tp=2 x dp=2 on 4 gloo ranks, ~1 minute here

Every method trains the same GPT-2 (built from a config, same seed) through the same global batches
with AdamW, at tensor parallelism ``--tp`` and data parallelism ``--dp``:

- ``unsharded``: the whole model on one process (plain AdamW), measured on every rank;
- ``replicated (DDP-like)``: this rank's tp shard with plain AdamW, gradients all-reduced over dp
  (what DDP holds; DDP itself refuses a tensor-parallel model);
- ``ZeRO-1``, ``ZeRO-2``, ``ZeRO-3``: ``ParallelEngine`` with ``EngineConfig(zero_stage=...)``.

Bytes are read from the tensors each rank holds: parameters (a DTensor's local shard) and the
optimizer (states plus fp32 master copies) after a step; gradients as the optimizer steps (after
backward and the reduction): ``param.grad`` (ZeRO-3: its dp shard) plus ZeRO-1/2's fp32 reduction
buffers (``ZeroOptimizer.gradient_bytes()``: ZeRO-1 keeps its full-size buckets, ZeRO-2 only its
1/dp rows, having released ``param.grad``). Ratios are against the replicated run (= the
unsharded model per tp shard) measured in the same spawn. Step time: the methods take turns step by
step (order reversed every other step), median over the steps; ratio against ZeRO-2.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

METHODS = ("replicated", "zero1", "zero2", "zero3")
NAMES = {
    "unsharded": "unsharded model (one process)",
    "replicated": "replicated over dp (DDP-like)",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3 (FSDP2)",
}


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def _local_bytes(t) -> int:
    from shardformer.data_parallel.fsdp import local_bytes

    return local_bytes(t)


def grad_bytes(model, optimizer=None) -> int:
    """Gradient bytes this rank holds now: ``param.grad`` (local shards), or a ZeroOptimizer's count
    of ``param.grad`` and its fp32 reduction buffers."""
    if hasattr(optimizer, "gradient_bytes"):
        return sum(optimizer.gradient_bytes().values())
    params = {id(p): p for p in model.parameters()}.values()
    return sum(_local_bytes(p.grad) for p in params if p.grad is not None)


def measure(model, optimizer_bytes: int, grads: int) -> dict[str, int]:
    params = {id(p): p for p in model.parameters()}.values()
    return {"params": sum(_local_bytes(p) for p in params), "grads": grads, "optimizer": optimizer_bytes}


def state_bytes(optim) -> int:
    return sum(_local_bytes(v) for st in optim.state.values() for v in st.values() if torch.is_tensor(v))


class Replicated:
    """This rank's tp shard with a plain AdamW; gradients averaged over dp by one all-reduce each."""

    def __init__(self, args, mesh):
        from shardformer import ShardConfig, shard_model

        self.model = shard_model(build_model(args), ShardConfig(tensor_parallel_size=args.tp, mesh=mesh))
        self.opt, self.mesh = adamw(self.model.parameters()), mesh

    def train_step(self, batch):
        mesh = self.mesh
        per = batch["input_ids"].shape[0] // mesh.dp_size
        ids = batch["input_ids"][mesh.dp_rank * per : (mesh.dp_rank + 1) * per]
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=mesh.dp_group)
            p.grad.div_(mesh.dp_size)
        self.grads = grad_bytes(self.model)
        self.opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh.dp_group)
        return value.item() / mesh.dp_size

    def bytes(self):
        return measure(self.model, state_bytes(self.opt), self.grads)


class Engine:
    def __init__(self, args, mesh, stage):
        from shardformer import EngineConfig, ParallelEngine

        cfg = EngineConfig(tp=args.tp, dp=args.dp, zero_stage=stage)
        self.engine = ParallelEngine(build_model(args), adamw, cfg, mesh=mesh)
        optimizer, step = self.engine.optimizer, self.engine.optimizer.step

        def counted_step(*args, **kwargs):  # the gradients as the optimizer steps: after the reduction
            self.grads = grad_bytes(self.engine.model, optimizer)
            return step(*args, **kwargs)

        optimizer.step = counted_step

    def train_step(self, batch):
        return self.engine.train_step(batch)

    def bytes(self):
        return measure(self.engine.model, sum(self.engine.optimizer.state_bytes().values()), self.grads)


def unsharded_bytes(args, batch) -> dict[str, int]:
    model = build_model(args)
    opt = adamw(model.parameters())
    model(**batch).loss.backward()
    grads = grad_bytes(model)
    opt.step()
    return measure(model, state_bytes(opt), grads)


def run(args):
    from shardformer import ProcessMesh

    mesh = ProcessMesh(args.tp, 1, args.dp)
    trainers = {"replicated": Replicated(args, mesh)}
    trainers.update({f"zero{s}": Engine(args, mesh, s) for s in (1, 2, 3)})
    times = {m: [] for m in METHODS}
    losses = {}
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        batch = {"input_ids": ids, "labels": ids}
        for method in METHODS if i % 2 == 0 else METHODS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            losses[method] = trainers[method].train_step(batch)
            if i >= args.warmup:
                times[method].append(time.perf_counter() - start)
    out = {m: {"bytes": trainers[m].bytes(), "step_s": statistics.median(times[m]), "loss": losses[m]} for m in METHODS}
    out["unsharded"] = {"bytes": unsharded_bytes(args, batch), "step_s": None, "loss": None}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    from shardformer.tools.testing import run_on_ranks

    world = args.tp * args.dp
    results = run_on_ranks(run, world, args, timeout=1200, threads_per_rank=1)
    mine = results[0]  # rank 0 (tp rank 0, dp rank 0); every rank holds the same sizes up to padding
    base = mine["replicated"]["bytes"]
    z2 = mine["zero2"]["step_s"]
    print(
        f"GPT-2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}, tp={args.tp} x dp={args.dp} on {world} "
        f"gloo ranks (1 thread each), global batch {args.batch} x {args.seq} tokens, AdamW fp32; "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
    )
    print("| method | parameters / rank (MiB) | vs replicated | gradients / rank (MiB) | vs replicated "
          "| optimizer / rank (MiB) | vs replicated | step (ms) | vs ZeRO-2 | last loss |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method in ("unsharded", *METHODS):
        r = mine[method]
        cells = []
        for kind in ("params", "grads", "optimizer"):
            cells += [f"{r['bytes'][kind] / 2**20:.2f}", f"{r['bytes'][kind] / base[kind]:.3f}"]
        step = "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.0f}"
        ratio = "-" if r["step_s"] is None else f"{r['step_s'] / z2:.2f}"
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        print(f"| {NAMES[method]} | {' | '.join(cells)} | {step} | {ratio} | {loss} |")
    ratio = mine["zero3"]["bytes"]["params"] / base["params"]
    worst = max(r["zero3"]["bytes"]["params"] / r["replicated"]["bytes"]["params"] for r in results)
    print(f"ZeRO-3 parameters per rank / unsharded per tp shard: {ratio:.4f} (largest over ranks {worst:.4f})")


if __name__ == "__main__":
    main()
