"""Activation memory per rank of a GPT-2 training step: unsharded, tp=2, tp=2 with sequence parallelism
and / or activation checkpointing.

    .venv/bin/python benchmarks/activation_memory.py [--seq 1024] [--batch 2] [--layers 4]

Activation memory is what the forward leaves alive for the backward: the resident memory right
after the loss is computed minus the resident memory just before the forward (Linux RSS, with
glibc returning large blocks to the system at once: MALLOC_MMAP_THRESHOLD_). Each variant runs in
fresh processes, one thread per rank; ratios are against plain tp=2 measured in the same run. The
step's loss and gradients are checked equal across variants (activation checkpointing recomputes
exactly), so the memory saved is not bought with a different computation. Next to each measurement
stands ``shardformer plan``'s estimate from the config (shardformer.tools.activation_estimate) and its
relative error.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.distributed as dist
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shardformer import ShardConfig, shard_model  # noqa: E402
from shardformer.tools.activation_estimate import estimate_activations  # noqa: E402
from shardformer.tools.testing import run_on_ranks  # noqa: E402

VOCAB = 8192


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _step(variant: str, layers: int, batch: int, seq: int, attn: str = "eager", dropout: float = 0.1):
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=VOCAB,
        n_positions=seq,
        n_embd=256,
        n_layer=layers,
        n_head=8,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attn
    model = tf.GPT2LMHeadModel(config).train()
    if variant != "unsharded":
        sequence_parallel = "sequence parallel" in variant
        model = shard_model(model, ShardConfig(dist.get_world_size(), sequence_parallel=sequence_parallel))
    if variant.endswith("checkpointing"):
        model.activation_checkpointing_enable()
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids[:, :16], labels=ids[:, :16]).loss.backward()  # warm-up: lazy buffers, generators
    model.zero_grad(set_to_none=True)
    before = _rss_mib()
    loss = model(input_ids=ids, labels=ids).loss
    held = _rss_mib() - before
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    tp = dist.get_world_size() if variant != "unsharded" else 1
    estimate = estimate_activations(
        model.config,
        batch,
        seq,
        tp,
        sequence_parallel="sequence parallel" in variant,
        checkpointing=variant.endswith("checkpointing"),
    )
    return held, loss.item(), grad_norm.item(), estimate.total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attn", default="eager", choices=("eager", "sdpa"))
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # spawned ranks inherit it
    shape = (args.layers, args.batch, args.seq, args.attn, args.dropout)
    rows = {}
    variants = (
        ("unsharded", 1),
        ("tp=2", 2),
        ("tp=2 + sequence parallel", 2),
        ("tp=2 + activation checkpointing", 2),
        ("tp=2 + sequence parallel + activation checkpointing", 2),
    )
    for name, ranks in variants:
        per_rank = run_on_ranks(_step, ranks, name, *shape, threads_per_rank=1, timeout=900)
        rows[name] = (max(r[0] for r in per_rank), *per_rank[0][1:])  # the larger rank; rank 0's loss and norm
    base = rows["tp=2"][0]
    plain = rows["tp=2"][1:3]
    for name, row in rows.items():  # the same computation: same dropout masks, exact recompute
        if name.startswith("tp=2 +"):
            assert all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(plain, row[1:3])), (name, plain, row)
    print(f"GPT-2 {args.layers} layers x 256 hidden, 8 heads, vocab {VOCAB}, batch {args.batch} x {args.seq} tokens, "
          f"{args.attn} attention, dropout {args.dropout}; torch {torch.__version__}, transformers {tf.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores\n")  # fmt: skip
    checkpointed = rows["tp=2 + activation checkpointing"][0]
    print("| variant | activation memory / rank (MiB) | vs tp=2 | vs tp=2 + checkpointing "
          "| `shardformer plan` estimate (MiB) | error | loss | grad norm (rank 0) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (held, loss, norm, estimate) in rows.items():
        print(f"| {name} | {held:.0f} | {held / base:.2f} | {held / checkpointed:.2f} | {estimate:.0f} "
              f"| {estimate / held - 1:+.1%} | {loss:.6f} | {norm:.6f} |")  # fmt: skip


if __name__ == "__main__":
    main()
