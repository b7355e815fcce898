"""Tensor-parallel training step: shardformer vs PyTorch's parallelize_module (DTensor) vs unsharded.

GPT-2 and BERT of a few tens of millions of parameters, built from a config with one seed. Each
variant runs in fresh processes: the unsharded model in 1 process with 2 threads, the tp=2 variants
in 2 gloo ranks with 1 thread each (same total threads). Reported: median time of a forward +
backward step with the LM loss, peak RSS growth per rank over the steps, and max |logits - unsharded
logits| on the same batch. Memory: the peak RSS over the steps (Linux's high-water mark, reset
just before them) minus the RSS when they start.

PyTorch's tensor parallel rejects transformers' Conv1D, so for its GPT-2 run every Conv1D is first
converted to an equivalent nn.Linear, and the plan is the hand-written Colwise/Rowwise one a user
would write (c_attn colwise: a contiguous split of the fused Q|K|V weight).

    .venv/bin/python benchmarks/tp_bench.py [--steps 5] [--batch 4] [--seq 128]
"""

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.tensor_parallel.layers import VocabParallelLMHead1D, gather_from_parallel
from shardformer.tools.testing import run_on_ranks

VOCAB = 8192


def build(family):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=512, n_layer=6, n_head=8, n_positions=256, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return tf.GPT2LMHeadModel(cfg).train()
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                        intermediate_size=2048, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return tf.BertForMaskedLM(cfg).train()


def batch(batch_size, seq):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _conv1d_to_linear(model):
    from transformers.pytorch_utils import Conv1D

    for name, m in list(model.named_modules()):
        if isinstance(m, Conv1D):
            lin = nn.Linear(m.nx, m.nf)
            lin.weight.data.copy_(m.weight.data.t())
            lin.bias.data.copy_(m.bias.data)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, lin)


def _dtensor(model, family):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    if family == "gpt2":
        _conv1d_to_linear(model)
        plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}  # fmt: skip
        for block in model.transformer.h:
            parallelize_module(block, mesh, plan)
            block.attn.split_size = block.attn.embed_dim = block.attn.embed_dim // tp
            block.attn.num_heads //= tp
    else:
        plan = {"attention.self.query": ColwiseParallel(), "attention.self.key": ColwiseParallel(),
                "attention.self.value": ColwiseParallel(), "attention.output.dense": RowwiseParallel(),
                "intermediate.dense": ColwiseParallel(), "output.dense": RowwiseParallel()}  # fmt: skip
        for layer in model.bert.encoder.layer:
            parallelize_module(layer, mesh, plan)
            layer.attention.self.num_attention_heads //= tp
            layer.attention.self.all_head_size //= tp
    return model


def _status_mib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak_rss_mib():
    """Reset the process's peak RSS (Linux) so the steps' peak is not hidden by building the model."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _run(family, variant, steps, batch_size, seq):
    model = build(family)
    inputs = batch(batch_size, seq)
    with torch.no_grad():
        reference = model(**inputs).logits
    if variant == "shardformer":
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size(), gather_output=True))
    elif variant == "parallelize_module":
        model = _dtensor(model, family)
    with torch.no_grad():
        logits = model(**inputs).logits
        if logits.shape[-1] != VOCAB:
            logits = gather_from_parallel(logits, None, VOCAB)
    delta = (logits - reference).abs().max().item()
    del reference, logits
    if variant == "shardformer":  # logits were gathered only for the comparison; training keeps them split
        for m in model.modules():
            if isinstance(m, VocabParallelLMHead1D):
                m.gather_output = False
    before = _reset_peak_rss_mib()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(**inputs).loss.backward()
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = _status_mib("VmHWM") - before
    return statistics.median(times[1:] or times), peak, delta


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {platform.machine()}, {os.cpu_count()} cores; "
          f"batch {args.batch} x {args.seq} tokens, {args.steps} steps (median of all but the first)\n")  # fmt: skip
    print("| model | variant | processes x threads | step (ms) | vs unsharded | peak RSS growth / rank (MiB) "
          "| vs unsharded | max abs logits diff |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for family in ("gpt2", "bert"):
        params = sum(p.numel() for p in build(family).parameters()) / 1e6
        base = run_on_ranks(_run, 1, family, "unsharded", args.steps, args.batch, args.seq, threads_per_rank=2)[0]
        rows = [("unsharded", "1 x 2", base)]
        for variant in ("shardformer", "parallelize_module"):
            try:
                per_rank = run_on_ranks(_run, 2, family, variant, args.steps, args.batch, args.seq, threads_per_rank=1)
                rows.append((variant, "2 x 1", (max(r[0] for r in per_rank), max(r[1] for r in per_rank),
                                                 max(r[2] for r in per_rank))))  # fmt: skip
            except Exception as e:  # a peer that cannot run this model is reported, not hidden
                rows.append((variant, "2 x 1", None))
                print(f"<!-- {family} {variant} failed: {str(e).splitlines()[-1][:200]} -->")
        for variant, procs, r in rows:
            name = f"{family} ({params:.1f}M)"
            if r is None:
                print(f"| {name} | {variant} | {procs} | failed | | | | |")
                continue
            t, mem, delta = r
            print(f"| {name} | {variant} | {procs} | {t * 1e3:.0f} | {t / base[0]:.2f} | {mem:.0f} | "
                  f"{mem / base[1]:.2f} | {delta:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
