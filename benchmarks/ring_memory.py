"""Ring attention's memory: the peak of a training step per rank against sequence length in both
context-parallel modes, the longest sequence that trains within a per-rank budget, and the transient
of one ring step at 32k tokens.

    .venv/bin/python benchmarks/ring_memory.py [--seqs 2048 4096 8192 16384] [--budget-mib 512]
    SHARDFORMER_CHECKOUT=/path/to/other/checkout .venv/bin/python benchmarks/ring_memory.py ...  # "before"

The model is the issue's shape: a 1-layer Llama, hidden 256, 8 heads (sdpa, fp32, batch 1), cp=2 on 2
gloo ranks. Both modes are measured in the same run (their ratio is the run's own). A step's peak is
the growth of the rank's peak RSS (Linux high-water mark, reset before the step, freed heap returned
with malloc_trim first) over one forward + backward at that length; the larger rank's is reported.
The longest sequence within ``--budget-mib``: the length doubles from the largest measured one that fits
until a step passes the budget, then a bisection narrows it to ``--granularity`` tokens.

The transient of one ring step is what a step allocates beyond the ring's own tensors (queries, keys,
values, output, log-sum-exp, their gradients and the keys in flight, all O(n x head_dim)): measured for
one block at local lengths this machine holds (32 heads of 128, fp32, every pair attending), and
computed from the tile sizes at 32k tokens, cp=2 (16,384 local tokens); next to it the score block
one step held before (batch x heads x n^2 fp32, three of them in backward: scores, probabilities, their
gradient).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys

import torch
import torch.distributed as dist
import transformers as tf

# the checkout to measure (another one, e.g. main before a change, through SHARDFORMER_CHECKOUT)
sys.path.insert(0, os.environ.get("SHARDFORMER_CHECKOUT") or os.path.dirname(os.path.dirname(__file__)))
from shardformer import ShardConfig, shard_model  # noqa: E402
from shardformer.core.comm import all_reduce  # noqa: E402
from shardformer.tools.testing import run_on_ranks  # noqa: E402

MODES = ("ring", "all_to_all")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS, so the growth is this step's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _build(mode: str, args) -> torch.nn.Module:
    config = tf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=256, intermediate_size=args.intermediate, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1 << 20, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).train()
    return shard_model(model, ShardConfig(context_parallel_size=2, context_parallel_mode=mode))


def _step_peak(model, seq: int, vocab: int) -> float:
    """MiB: the larger rank's peak RSS growth over one training step at ``seq`` tokens."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    model.zero_grad(set_to_none=True)
    before = _reset_peak()
    model(input_ids=ids, labels=ids).loss.backward()
    peak = _status_mib("VmHWM") - before
    model.zero_grad(set_to_none=True)
    return float(all_reduce(torch.tensor([peak], dtype=torch.float64), None, op=dist.ReduceOp.MAX).item())


def run_mode(mode: str, args) -> dict:
    model = _build(mode, args)
    _step_peak(model, 64, args.vocab)  # warm-up: lazy buffers, generators
    peaks = {seq: _step_peak(model, seq, args.vocab) for seq in args.seqs}
    probes = dict(peaks)
    fits = [s for s, p in probes.items() if p <= args.budget_mib]
    low, high = (max(fits) if fits else 0), min((s for s, p in probes.items() if p > args.budget_mib), default=None)
    while high is None and low < args.max_seq:  # double until over the budget
        seq = max(2 * low, args.granularity)
        probes[seq] = _step_peak(model, seq, args.vocab)
        low, high = (seq, None) if probes[seq] <= args.budget_mib else (low, seq)
    while high is not None and high - low > args.granularity:
        seq = (low + high) // 2 // args.granularity * args.granularity
        if seq in (low, high):
            break
        probes[seq] = _step_peak(model, seq, args.vocab)
        low, high = (seq, high) if probes[seq] <= args.budget_mib else (low, seq)
    return {"peaks": peaks, "longest": low, "probes": probes}


def step_transient(n: int, heads: int = 32, head_dim: int = 128) -> float:
    """MiB: the measured peak RSS growth of one ring step (forward tiles, then backward tiles) over one
    block of ``n`` queries and ``n`` keys, beyond its inputs and outputs (this checkout's blocks)."""
    # imported here: a checkout measured "before" (SHARDFORMER_CHECKOUT) has no blocks module
    from shardformer.context_parallel.blocks import finite, tile_backward, tile_forward, tile_rows

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, head_dim, generator=g) for _ in range(4))
    out, lse, dq, dk, dv = (torch.zeros_like(q), torch.zeros(1, heads, n), *(torch.zeros_like(q) for _ in range(3)))
    rows_per_tile = tile_rows(1, n)
    before = _reset_peak()
    for start in range(0, n, rows_per_tile):
        rows = slice(start, start + rows_per_tile)
        out[:, :, rows], lse[:, :, rows] = tile_forward(q[:, :, rows], k, v, None, head_dim**-0.5)
    lse = finite(lse)
    for start in range(0, n, rows_per_tile):
        rows = slice(start, start + rows_per_tile)
        t = (do[:, :, rows], q[:, :, rows], k, v, out[:, :, rows].contiguous(), lse[:, :, rows].contiguous())
        dq[:, :, rows] += tile_backward(*t, None, head_dim**-0.5, None, (dk, dv))
    return _status_mib("VmHWM") - before


def computed_transient(n: int, heads: int = 32, kv_heads: int = 32, head_dim: int = 128) -> tuple[float, float]:
    """MiB at ``n`` local tokens, from the tile sizes: (now, the score blocks one step held before). Now:
    the largest tile's mask and bias, six float32 tensors of the tile's rows x heads x head_dim (its
    output, the merge's temporaries, the backward's query gradients), and the backward kernel's key and
    value gradients with its buffers for them, one span of keys at a time (`TILE_BYTES`)."""
    # imported here: a checkout measured "before" has no blocks module
    from shardformer.context_parallel.blocks import TILE_BYTES, tile_rows

    rows = min(tile_rows(1, n), n)
    now = min(TILE_BYTES, rows * n * 5) + 6 * rows * heads * head_dim * 4 + TILE_BYTES
    return now / 2**20, 3 * heads * n * n * 4 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--budget-mib", type=float, default=512.0, help="per-rank peak of a training step")
    parser.add_argument("--granularity", type=int, default=1024, help="tokens: resolution of the longest length")
    parser.add_argument("--max-seq", type=int, default=1 << 17, help="stop doubling here")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--transient-seqs", type=int, nargs="*", default=[1024, 2048, 4096], help="local tokens")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    rows = {mode: run_on_ranks(run_mode, 2, mode, args, threads_per_rank=1, timeout=args.timeout)[0] for mode in MODES}
    print(f"1-layer Llama, hidden 256, 8 heads, intermediate {args.intermediate}, vocab {args.vocab}, sdpa, fp32, "
          f"batch 1, cp=2; torch {torch.__version__}; checkout {sys.path[0]}\n")  # fmt: skip
    print("Peak memory per rank of a training step (MiB, peak RSS growth)\n")
    print("| mode | " + " | ".join(f"seq {s}" for s in args.seqs) + " |")
    print("|---|" + "---:|" * len(args.seqs))
    for mode in MODES:
        print(f"| {mode} | " + " | ".join(f"{rows[mode]['peaks'][s]:.0f}" for s in args.seqs) + " |")
    ratio = [rows["ring"]["peaks"][s] / rows["all_to_all"]["peaks"][s] for s in args.seqs]
    print("| ring / all_to_all | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    print(f"\nLongest sequence within {args.budget_mib:.0f} MiB per rank (multiples of {args.granularity} tokens)\n")
    print("| mode | longest sequence | peak at it (MiB) |")
    print("|---|---:|---:|")
    for mode in MODES:
        longest = rows[mode]["longest"]
        print(f"| {mode} | {longest} | {rows[mode]['probes'].get(longest, float('nan')):.0f} |")
    if os.environ.get("SHARDFORMER_CHECKOUT") or not args.transient_seqs:
        return  # the transient is this checkout's blocks
    print("\nTransient of one ring step, 32 heads of 128, fp32, batch 1 (MiB; local tokens = sequence / cp)\n")
    print("| local tokens | measured | computed from the tiles | score blocks before |")
    print("|---:|---:|---:|---:|")
    for n in args.transient_seqs:
        now, before = computed_transient(n)
        print(f"| {n} | {step_transient(n):.0f} | {now:.0f} | {before:.0f} |")
    now, before = computed_transient(16384)
    print(f"| 16384 (32k tokens, cp=2) | — | {now:.0f} | {before:.0f} |")


if __name__ == "__main__":
    main()
