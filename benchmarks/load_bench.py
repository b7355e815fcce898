"""Peak memory per rank: shard-on-load (``load_sharded``) vs load-then-shard (``from_pretrained`` + ``shard_model``).

A GPT-2 built from a config (no download; ~500 MB of fp32 weights at the default size) is saved
once as a HuggingFace folder; then each way of loading runs in its own fresh spawn of ``--tp``
gloo ranks, and every rank reports its peak resident memory (VmHWM) and its resident memory
before loading (after imports and building a tiny model of the class, so library code is already
resident), so the table shows both the whole peak and the part loading added.

    .venv/bin/python benchmarks/load_bench.py [--tp 2] [--layers 12] [--hidden 768]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _rank_load(mode: str, path: str, tp: int) -> dict:
    import torch
    import transformers as tf

    from shardformer import ShardConfig, shard_model
    from shardformer.checkpoint import load_sharded

    # Import-time memory (transformers loads the GPT-2 modules lazily, ~180 MiB) is the same for both
    # ways: pay it before measuring by building a tiny model of the class.
    tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, n_positions=8))
    gc.collect()
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    if mode == "shard-on-load":
        model = load_sharded("GPT2LMHeadModel", path, ShardConfig(tensor_parallel_size=tp))
    else:
        model = shard_model(tf.GPT2LMHeadModel.from_pretrained(path), ShardConfig(tensor_parallel_size=tp))
    seconds = time.perf_counter() - start
    gc.collect()
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with torch.no_grad():  # the model works
        model(input_ids=torch.tensor([[1, 2, 3]]))
    return {"before": before, "peak": _status_mib("VmHWM"), "after": _status_mib("VmRSS"), "params": held,
            "seconds": seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    args = parser.parse_args()

    import torch
    import transformers as tf

    from shardformer.tools.testing import run_on_ranks

    config = tf.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.hidden // 64,
                           vocab_size=args.vocab, n_positions=1024)  # fmt: skip
    path = tempfile.mkdtemp(prefix="sf-load-bench-")
    try:
        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(config)
        size_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        model.save_pretrained(path)
        del model
        gc.collect()
        results = {}
        for mode in ("load-then-shard", "shard-on-load"):
            results[mode] = run_on_ranks(_rank_load, args.tp, mode, path, args.tp, timeout=600, threads_per_rank=1)
    finally:
        shutil.rmtree(path, ignore_errors=True)

    print(f"## Peak RSS per rank: shard-on-load vs load-then-shard (GPT-2, {size_mib:.0f} MiB fp32, tp={args.tp})\n")
    print(f"Run: `.venv/bin/python benchmarks/load_bench.py --tp {args.tp} --layers {args.layers} "
          f"--hidden {args.hidden}` on {platform.machine()} / {os.cpu_count()} CPUs, gloo, "
          f"torch {torch.__version__}, transformers {tf.__version__}; one fresh spawn per mode.\n")  # fmt: skip
    print(
        "| mode | rank | RSS before load (MiB) | peak RSS (MiB) | added by loading (MiB) | params held (MiB) | load s |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, ranks in results.items():
        for rank, r in enumerate(ranks):
            print(f"| {mode} | {rank} | {r['before']:.0f} | {r['peak']:.0f} | {r['peak'] - r['before']:.0f} | "
                  f"{r['params']:.0f} | {r['seconds']:.1f} |")  # fmt: skip
    base, new = results["load-then-shard"], results["shard-on-load"]
    peak_ratio = max(r["peak"] for r in new) / max(r["peak"] for r in base)
    added_ratio = max(r["peak"] - r["before"] for r in new) / max(r["peak"] - r["before"] for r in base)
    print(
        f"\nshard-on-load / load-then-shard, worst rank: peak RSS **{peak_ratio:.2f}x**, "
        f"memory added by loading **{added_ratio:.2f}x** (expected <= 0.6x)"
    )


if __name__ == "__main__":
    main()
