"""torch.compile speed-up of a tp=2 sharded model against that of the unsharded model.

GPT-2 (4 layers x 256, vocabulary 8192, dropout 0), a forward + backward step with the LM loss on a
batch of 4 x 128 tokens, 1 thread per process: the unsharded model in 1 process, the tp=2 sharded
model in 2 gloo ranks. In each process the eager and the compiled step alternate (so load on the
machine hits both alike); reported: median step times and compiled / eager. A sharded model that
dynamo has to break into pieces keeps little of the compiler's gain, so the two ratios should
agree (the issue asks within 0.05). Dynamo's graph count of each is printed alongside.

    .venv/bin/python benchmarks/compile_bench.py [--steps 10] [--backend inductor] [--batch 4] [--seq 128]
"""

import argparse
import os
import platform
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import transformers as tf
from torch._dynamo.testing import CompileCounterWithBackend

from shardformer import ShardConfig, shard_model
from shardformer.tools.testing import run_on_ranks

VOCAB = 8192


def build():
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=4, n_head=8, n_positions=256, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return tf.GPT2LMHeadModel(cfg).train()


def batch(batch_size, seq):
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def timed_step(model, inputs) -> float:
    start = time.perf_counter()
    loss = model(**inputs).loss
    loss.backward()
    if dist.is_initialized():
        dist.barrier()  # the step ends when every rank is done
    elapsed = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    return elapsed, loss.item()


def _run(backend, steps, batch_size, seq):
    model, inputs = build(), batch(batch_size, seq)
    if dist.is_initialized() and dist.get_world_size() > 1:
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    start = time.perf_counter()
    _, compiled_loss = timed_step(compiled, inputs)  # compiles forward and backward
    compile_s = time.perf_counter() - start
    _, eager_loss = timed_step(model, inputs)
    eager, fast = [], []
    for _ in range(steps):
        eager.append(timed_step(model, inputs)[0])
        fast.append(timed_step(compiled, inputs)[0])
    return statistics.median(eager), statistics.median(fast), counter.frame_count, compile_s, eager_loss, compiled_loss


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor" if shutil.which("g++") else "aot_eager")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {platform.machine()}, {os.cpu_count()} cores; "
          f"GPT-2 4 x 256, batch {args.batch} x {args.seq}, fwd + bwd, backend {args.backend}, 1 thread per "
          f"process, median of {args.steps} alternating eager / compiled steps\n")  # fmt: skip
    print("| model | processes | graphs | compile (s) | eager step (ms) | compiled step (ms) | compiled / eager "
          "| loss eager | loss compiled |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for name, world in (("unsharded", 1), ("tp=2 sharded", 2)):
        per_rank = run_on_ranks(
            _run, world, args.backend, args.steps, args.batch, args.seq, threads_per_rank=1, timeout=1800
        )
        eager, fast = max(r[0] for r in per_rank), max(r[1] for r in per_rank)
        graphs, compile_s, eager_loss, compiled_loss = per_rank[0][2:]
        ratios[name] = fast / eager
        print(f"| GPT-2 {name} | {world} | {graphs} | {compile_s:.0f} | {eager * 1e3:.0f} | {fast * 1e3:.0f} "
              f"| {ratios[name]:.2f} | {eager_loss:.4f} | {compiled_loss:.4f} |")  # fmt: skip
    gap = ratios["tp=2 sharded"] - ratios["unsharded"]
    print(f"\ncompiled / eager, sharded minus unsharded: {gap:+.2f}")


if __name__ == "__main__":
    main()
