"""Inference with the KV cache: prefill and decode tokens/s, collectives per decoded token, KV cache per rank.

    .venv/bin/python benchmarks/inference_bench.py [--prompt 64] [--new 32] [--reps 5]

Greedy ``generate()`` (KV cache on, sdpa attention) of a GPT-2 and a Llama built from configs, saved
with ``save_pretrained`` and loaded with ``from_pretrained``, at batch 1 and 8, in one job of 2 gloo
ranks with one thread each:

- unsharded: every rank runs its own copy at the same time (the cores are loaded as under tp);
- shardformer tp=1 and tp=2: ``shard_model(model, ShardConfig(tensor_parallel_size=...))``, no
  policy given (the Llama's policy is derived from its own tp plan);
- transformers tp=2 (Llama only; GPT-2 has no tp plan): ``from_pretrained(path,
  distributed_config=DistributedConfig(tp_plan="auto"))``, the same as ``tp_plan="auto"``, needs
  ``accelerate`` (``pip install -e ".[bench]"``).

Prefill is the first forward of ``generate`` (prompt tokens / its time); decode is everything after
it (new tokens after the first / the time to the end of ``generate``). Variants are interleaved and
repeated; each figure is the median over the repeats, and ratios are against the unsharded model
and transformers' tp measured in the same run. Every variant's tokens are checked equal to the
unsharded model's. Collectives per decoded token are the gloo operations torch's profiler sees
(ours and transformers' alike), generate with ``1 + k`` new tokens minus generate with 1, over k;
for shardformer they are also counted with ``CollectiveCounter`` and must agree. The Megatron
minimum at tp > 1: the vocab-parallel embedding's all-reduce, 2 all-reduces per layer (attention
out, MLP out) and the LM head's all-gather of the last position's logits. KV cache: the bytes of the
cache's key and value tensors on rank 0 after generating at batch 8.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist
import transformers as tf
from torch.profiler import ProfilerActivity, profile
from transformers.distributed import DistributedConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shardformer import ShardConfig, shard_model  # noqa: E402
from shardformer.tensor_parallel.layers import CollectiveCounter  # noqa: E402
from shardformer.tools.testing import run_on_ranks  # noqa: E402

BATCHES = (1, 8)
MODELS = {
    "GPT-2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=8192, n_embd=512, n_layer=4, n_head=8, n_positions=512, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ),
    "Llama": lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    ),
}  # fmt: skip


def _load(variant: str, path: str) -> torch.nn.Module:
    if variant == "transformers tp=2":
        return tf.AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    if variant.startswith("shardformer"):
        model = shard_model(model, ShardConfig(tensor_parallel_size=int(variant[-1])))
    return model.eval()


class _Stopwatch:
    """Times the first forward of a ``generate`` (prefill) and the rest of it (decode)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.marks: list[float] = []
        self.hooks = [
            model.register_forward_pre_hook(self._mark),
            model.register_forward_hook(self._mark),
        ]

    def _mark(self, *_) -> None:
        if len(self.marks) < 2:  # only the prefill's start and end
            self.marks.append(time.perf_counter())

    def run(self, fn):
        self.marks.clear()
        out = fn()
        end = time.perf_counter()
        return self.marks[1] - self.marks[0], end - self.marks[1], out

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _generate(model, ids, new, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, **kwargs,
        )  # fmt: skip


def _gloo_ops(model, ids, new) -> Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _generate(model, ids, new)
    return Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))


def _per_token(before: Counter, after: Counter, tokens: int) -> dict[str, float]:
    return {op: n / tokens for op, n in (after - before).items()}


def _kv_cache_bytes(model, ids, new) -> int:
    cache = _generate(model, ids, new, return_dict_in_generate=True).past_key_values
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return sum(local(t).numel() * local(t).element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _job(name: str, path: str, prompt: int, new: int, reps: int) -> dict:
    variants = ["unsharded", "shardformer tp=1", "shardformer tp=2"] + (
        ["transformers tp=2"] if name == "Llama" else []
    )
    models = {v: _load(v, path) for v in variants}
    vocab = models["unsharded"].config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(1, vocab, (b, prompt), generator=g) for b in BATCHES}
    result = {"layers": models["unsharded"].config.num_hidden_layers, "variants": {}}
    expected = {b: _generate(models["unsharded"], prompts[b], new) for b in BATCHES}
    for v, model in models.items():
        for b in BATCHES:
            got = _generate(model, prompts[b], new)  # warm-up, and the same tokens as unsharded
            assert torch.equal(got, expected[b]), f"{name} {v} batch {b}: tokens differ from the unsharded model's"
        k = 4
        gloo = _per_token(_gloo_ops(model, prompts[1], 1), _gloo_ops(model, prompts[1], 1 + k), k)
        ours = None
        if v.startswith("shardformer"):
            with CollectiveCounter() as one:
                _generate(model, prompts[1], 1)
            with CollectiveCounter() as more:
                _generate(model, prompts[1], 1 + k)
            ours = _per_token(one.counts, more.counts, k)
        result["variants"][v] = {"gloo": gloo, "counter": ours, "kv": _kv_cache_bytes(model, prompts[8], new)}
    times = {(v, b): ([], []) for v in models for b in BATCHES}
    watches = {v: _Stopwatch(m) for v, m in models.items()}
    for _ in range(reps):
        for v, model in models.items():
            for b in BATCHES:
                dist.barrier()  # ranks start together: no rank's wait for its peer is timed
                prefill, decode, _ = watches[v].run(lambda m=model, b=b: _generate(m, prompts[b], new))
                times[v, b][0].append(prefill)
                times[v, b][1].append(decode)
    for v, b in times:
        prefill, decode = (statistics.median(t) for t in times[v, b])
        result["variants"][v][b] = (b * prompt / prefill, b * (new - 1) / decode)
    return result


def _minimum(variant: str, layers: int) -> dict[str, int]:
    return {} if variant.endswith("tp=1") or variant == "unsharded" else {"all_reduce": 1 + 2 * layers, "all_gather": 1}


def _ops(counts: dict[str, float]) -> str:
    return " + ".join(f"{n:g} {op.replace('gloo:', '')}" for op, n in sorted(counts.items())) or "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--new", type=int, default=32, help="new tokens per sequence")
    parser.add_argument("--reps", type=int, default=5, help="timed repeats (median)")
    args = parser.parse_args()
    results = {}
    for name, build in MODELS.items():
        with tempfile.TemporaryDirectory() as path:
            torch.manual_seed(0)
            build().save_pretrained(path)
            ranks = run_on_ranks(
                _job, 2, name, path, args.prompt, args.new, args.reps, threads_per_rank=1, timeout=1200
            )
        results[name] = ranks[0]
    print(f"greedy generate, prompt {args.prompt} + {args.new} new tokens, KV cache, sdpa, fp32; 2 gloo ranks x 1 "
          f"thread; median of {args.reps}; {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, transformers {tf.__version__}\n")  # fmt: skip
    print(
        "| model | variant | batch | prefill tok/s | vs unsharded | decode tok/s | vs unsharded | vs transformers tp=2 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        theirs = r["variants"].get("transformers tp=2")
        for v, row in r["variants"].items():
            for b in BATCHES:
                (pre, dec), (pre0, dec0) = row[b], r["variants"]["unsharded"][b]
                vs_tf = f"{dec / theirs[b][1]:.2f}" if theirs else "-"
                print(
                    f"| {name} | {v} | {b} | {pre:,.0f} | {pre / pre0:.2f} | {dec:,.0f} | {dec / dec0:.2f} | {vs_tf} |"
                )
    print("\n| model | variant | collectives / decoded token (profiler) | CollectiveCounter | minimum "
          "| KV cache / rank, batch 8 (MiB) | vs unsharded |")  # fmt: skip
    print("|---|---|---|---|---|---:|---:|")
    for name, r in results.items():
        kv0 = r["variants"]["unsharded"]["kv"]
        for v, row in r["variants"].items():
            counter = "-" if row["counter"] is None else _ops(row["counter"])
            minimum = _minimum(v, r["layers"])
            print(f"| {name} | {v} | {_ops(row['gloo'])} | {counter} | {_ops(minimum)} | {row['kv'] / 2**20:.2f} "
                  f"| {row['kv'] / kv0:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
