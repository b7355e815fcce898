"""Collectives per training step of sharded models, counted, against Megatron's theoretical minimum.

Minimum per step at tp > 1: 2 all-reduces forward and 2 backward per transformer layer (each of the
size of the layer's activations), 1 forward for a vocab-parallel embedding, 1 backward for the LM
head's input, and the vocab-parallel loss's 3 all-reduces of one number per token.

    .venv/bin/python benchmarks/comm_bench.py [--tp 2] [--batch 4] [--seq 128]
"""

import argparse

import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.tensor_parallel.layers import CollectiveCounter
from shardformer.tools.testing import run_on_ranks


def build(family):
    torch.manual_seed(0)
    if family == "GPT2LMHeadModel":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=8192, n_embd=256, n_layer=4, n_head=8))
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                                            num_attention_heads=8, intermediate_size=1024))  # fmt: skip


def _count(family, batch, seq):
    model = shard_model(build(family), ShardConfig(tensor_parallel_size=dist.get_world_size()))
    ids = torch.randint(0, 8192, (batch, seq), generator=torch.Generator().manual_seed(1))
    with CollectiveCounter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    tokens = batch * seq
    minimum_calls = 4 * layers + 1 + 1 + 3
    minimum_bytes = 4 * (tokens * hidden * (4 * layers + 2) + 3 * tokens)
    return len(counter.calls), counter.bytes, minimum_calls, minimum_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {tf.__version__}, tp={args.tp}, batch {args.batch} x {args.seq}\n")
    print("| model | collectives / step | minimum | ratio | bytes / step | minimum bytes | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for family in ("GPT2LMHeadModel", "BertForMaskedLM"):
        calls, nbytes, min_calls, min_bytes = run_on_ranks(_count, args.tp, family, args.batch, args.seq)[0]
        print(f"| {family} (4 layers) | {calls} | {min_calls} | {calls / min_calls:.2f} | {nbytes:,} | {min_bytes:,} "
              f"| {nbytes / min_bytes:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
