"""Context parallelism: activation memory per rank against sequence length, cp=1 vs cp=2 (ring and
all-to-all), and the step time of ring vs all-to-all, on a Llama-like model (sdpa attention).

    .venv/bin/python benchmarks/cp_bench.py [--seqs 1024 2048] [--hidden 1024] [--layers 2] [--steps 2]

Activation memory is what the forward leaves alive for the backward: resident memory right after
the loss minus just before the forward (Linux RSS, glibc returning large blocks at once:
MALLOC_MMAP_THRESHOLD_), the larger of the ranks. Step time: median forward + backward over
``--steps`` steps after a warm-up, one thread per rank. Each variant runs in fresh processes;
ratios are against cp=1 measured in the same run, and every variant's loss is checked equal to
cp=1's (the same computation, split).
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
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shardformer import ShardConfig, shard_model  # noqa: E402
from shardformer.tools.testing import run_on_ranks  # noqa: E402

VOCAB = 8192


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _step(mode: str | None, seq: int, hidden: int, layers: int, steps: int):
    torch.manual_seed(0)
    heads = hidden // 64
    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq, attention_dropout=0.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(config).train()
    if mode is not None:
        model = shard_model(model, ShardConfig(context_parallel_size=dist.get_world_size(), context_parallel_mode=mode))
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids[:, :64], labels=ids[:, :64]).loss.backward()  # warm-up: lazy buffers
    model.zero_grad(set_to_none=True)
    before = _rss_mib()
    loss = model(input_ids=ids, labels=ids).loss
    held = _rss_mib() - before
    loss.backward()
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    return held, loss.item(), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # spawned ranks inherit it
    print(f"Llama-like: {args.layers} layers x {args.hidden} hidden, {args.hidden // 64} heads, vocab {VOCAB}, "
          f"batch 1, sdpa, fp32; torch {torch.__version__}, transformers {tf.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores, 1 thread per rank\n")  # fmt: skip
    print("| tokens | variant | activation memory / rank (MiB) | vs cp=1 | step time (s) | vs cp=1 | loss |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for seq in args.seqs:
        rows = {}
        for name, mode, ranks in (("cp=1", None, 1), ("cp=2 ring", "ring", 2), ("cp=2 all_to_all", "all_to_all", 2)):
            per_rank = run_on_ranks(
                _step, ranks, mode, seq, args.hidden, args.layers, args.steps, threads_per_rank=1, timeout=1800
            )
            rows[name] = (max(r[0] for r in per_rank), per_rank[0][1], max(r[2] for r in per_rank))
        base_mem, base_loss, base_time = rows["cp=1"]
        for name, (held, loss, seconds) in rows.items():
            assert abs(loss - base_loss) <= 1e-4 * max(1.0, abs(base_loss)), (name, loss, base_loss)
            print(f"| {seq} | {name} | {held:.0f} | {held / base_mem:.2f} | {seconds:.2f} | "
                  f"{seconds / base_time:.2f} | {loss:.5f} |")  # fmt: skip
        ring, a2a = rows["cp=2 ring"][2], rows["cp=2 all_to_all"][2]
        print(f"|  | ring / all_to_all step time | | | {ring / a2a:.2f} | | |")


if __name__ == "__main__":
    main()
