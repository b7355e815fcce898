"""What the tp/cp input check (shardformer/core/forward_agreement.py) costs a training step.

    .venv/bin/python benchmarks/forward_agreement_bench.py [--layers 4] [--seq 256] [--batch 4] [--steps 30]

A GPT-2 (hidden 256, vocabulary 8192) on 2 gloo ranks, one thread each, at tp=2 and at cp=2: the
median time of a training step (forward, backward, SGD) with the check off (the baseline, measured in
the same run), on its default (every forward compared: a checksum of the inputs and one fixed-size
all-gather, read back once), and with ``ShardConfig(forward_agreement_every=10)`` (the others bind
the arguments and count). The variants alternate step by step in one process, so machine load hits
them alike; ratios are against "off". Then the pieces alone: one comparison, and the hook on a
forward that is not compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shardformer import ShardConfig, shard_model  # noqa: E402
from shardformer.tools.testing import run_on_ranks  # noqa: E402

VARIANTS = ("off", "every forward (default)", "every 10th")


def _run(parallel: str, layers: int, seq: int, batch: int, steps: int) -> dict:
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=8192, n_positions=seq, n_embd=256, n_layer=layers, n_head=8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    size = {"tp": "tensor_parallel_size", "cp": "context_parallel_size"}[parallel]
    model = shard_model(tf.GPT2LMHeadModel(config).train(), ShardConfig(**{size: 2}))
    agreement = model.shardformer.forward_agreement
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 8192, (batch, seq), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    group = agreement.block_group if parallel == "cp" else agreement.tp_group
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(steps + 2):  # two warm-up rounds
        for variant in VARIANTS:
            agreement.in_forward = variant != "off"
            agreement.every = 10 if variant == "every 10th" else 1
            dist.barrier()
            start = time.perf_counter()
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            elapsed = time.perf_counter() - start
            if step >= 2:
                times[variant].append(elapsed)
    result = {v: statistics.median(t) for v, t in times.items()}
    # the pieces alone: one comparison, and the hook on a forward that is not compared (bind + count)
    agreement.in_forward, agreement.every = True, 10
    for name, call in (("one comparison", lambda: agreement.check(model, inputs, group, count=1)),
                       ("hook, not compared", lambda: agreement.before(model, (), inputs))):  # fmt: skip
        pieces = []
        for _ in range(50):
            agreement.returned.update(tp=1, block=1)  # not due: 1 forward returned since the last compared
            dist.barrier()
            start = time.perf_counter()
            call()
            pieces.append(time.perf_counter() - start)
        result[name] = statistics.median(pieces)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    a = parser.parse_args()
    print(f"GPT-2 hidden 256, {a.layers} layers, batch {a.batch} x {a.seq} tokens, 2 gloo ranks, {a.steps} steps each")
    print("| layout | check | median step (ms) | ratio to off |")
    print("|---|---|---|---|")
    for parallel in ("tp", "cp"):
        result = run_on_ranks(_run, 2, parallel, a.layers, a.seq, a.batch, a.steps, threads_per_rank=1, timeout=900)
        median = {v: max(r[v] for r in result) for v in VARIANTS}  # a step lasts as long as its slowest rank
        for variant in VARIANTS:
            ratio = median[variant] / median["off"]
            print(f"| {parallel}=2 | {variant} | {median[variant] * 1e3:.1f} | {ratio:.3f} |")
        for piece in ("one comparison", "hook, not compared"):
            slowest = max(r[piece] for r in result)
            print(f"| {parallel}=2 | {piece}, alone | {slowest * 1e3:.3f} | {slowest / median['off']:.4f} |")


if __name__ == "__main__":
    main()
