"""Column-parallel backward with and without overlap of the input gradient's all-reduce.

With ``ShardConfig.overlap_communication`` (the default) a column-parallel layer's backward starts
the all-reduce of its input gradient and computes its weight gradient while it runs; without, one
after the other. tp=2 GPT-2 (4 layers x 256, vocabulary 8192, dropout 0; the layers that overlap are
c_attn, mlp.c_fc and the LM head), forward + backward with the LM loss, batch 4 x 128, 2 gloo ranks
with 1 thread each. In the same processes the two settings alternate step by step (so load on the
machine hits both alike); reported: median step times and on / off, and the losses and gradients of
both (they must agree exactly).

    .venv/bin/python benchmarks/overlap_bench.py [--steps 20] [--batch 4] [--seq 128]
"""

import argparse
import os
import platform
import statistics

import torch
import torch.distributed as dist
import transformers as tf
from compile_bench import batch, build, timed_step

from shardformer import ShardConfig, shard_model
from shardformer.tensor_parallel.layers import Linear1D_Col
from shardformer.tools.testing import run_on_ranks


def _set_overlap(columns, overlap):
    for m in columns:
        m.overlap_communication = overlap


def _loss_and_grads(model, inputs):
    loss = model(**inputs).loss
    loss.backward()
    out = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def _run(steps, batch_size, seq):
    model = shard_model(build(), ShardConfig(tensor_parallel_size=dist.get_world_size()))
    inputs = batch(batch_size, seq)
    columns = [m for m in model.modules() if isinstance(m, Linear1D_Col)]
    results = {}
    for overlap in (True, False):  # also the warm-up
        _set_overlap(columns, overlap)
        results[overlap] = _loss_and_grads(model, inputs)
    same = all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    times = {True: [], False: []}
    for step in range(steps):
        for overlap in (True, False) if step % 2 == 0 else (False, True):
            _set_overlap(columns, overlap)
            times[overlap].append(timed_step(model, inputs)[0])
    overlapping = sum(m.input_copy is None or m.input_copy.reads_alone(m) for m in columns)
    return statistics.median(times[True]), statistics.median(times[False]), same, overlapping, len(columns)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {platform.machine()}, {os.cpu_count()} cores; "
          f"GPT-2 4 x 256 at tp=2 (2 ranks x 1 thread), batch {args.batch} x {args.seq}, fwd + bwd, median of "
          f"{args.steps} alternating steps each\n")  # fmt: skip
    per_rank = run_on_ranks(_run, 2, args.steps, args.batch, args.seq, threads_per_rank=1, timeout=1800)
    on, off = max(r[0] for r in per_rank), max(r[1] for r in per_rank)
    same = all(r[2] for r in per_rank)
    overlapping, columns = per_rank[0][3:]
    print("| overlap_communication | column layers overlapping | step (ms) | vs off | loss and gradients |")
    print("|---|---:|---:|---:|---|")
    print(f"| off | 0 of {columns} | {off * 1e3:.0f} | 1.00 | |")
    print(f"| on | {overlapping} of {columns} | {on * 1e3:.0f} | {on / off:.2f} | "
          f"{'identical to off' if same else 'DIFFER from off'} |")  # fmt: skip


if __name__ == "__main__":
    main()
