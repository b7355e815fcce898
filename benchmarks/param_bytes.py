"""Parameter bytes per rank after tensor-parallel sharding, for real-size configs (no weights: meta device).

.venv/bin/python benchmarks/param_bytes.py [--tp 2]
"""

import argparse

import torch
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.tools.testing import run_on_ranks

MODELS = {
    "GPT2LMHeadModel (gpt2, 124M)": lambda: tf.GPT2LMHeadModel(tf.GPT2Config()),
    "BertForMaskedLM (bert-base)": lambda: tf.BertForMaskedLM(tf.BertConfig()),
    "ViTForImageClassification (vit-base)": lambda: tf.ViTForImageClassification(tf.ViTConfig()),
}


def _bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _measure(name, tp):
    with torch.device("meta"):
        model = MODELS[name]()
    full = _bytes(model)
    model = shard_model(model, ShardConfig(tensor_parallel_size=tp))
    replicated = sum(p.numel() * p.element_size() for p in model.parameters() if not hasattr(p, "shard_spec"))
    return full, _bytes(model), replicated


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {tf.__version__}, tp={args.tp}, fp32\n")
    print("| model | unsharded (MB) | per rank (MB) | per rank / unsharded | replicated part per rank (MB) |")
    print("|---|---:|---:|---:|---:|")
    for name in MODELS:
        full, local, replicated = run_on_ranks(_measure, args.tp, name, args.tp)[0]
        print(f"| {name} | {full / 1e6:.1f} | {local / 1e6:.1f} | {local / full:.3f} | {replicated / 1e6:.1f} |")


if __name__ == "__main__":
    main()
