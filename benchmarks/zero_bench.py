"""ZeroOptimizer (stage 1 and 2) vs torch's ZeroRedundancyOptimizer and plain DDP + AdamW.

    .venv/bin/python benchmarks/zero_bench.py            # ~3 minutes on a 2-core CPU machine

Each method trains the same small GPT-2 (built from a config, same seed, same data) on 2 gloo
ranks. Step time: all methods live in one spawn and take turns step by step (the order reversed
every other step), so load from elsewhere on a shared machine hits them alike; the median over
the steps of ``--repeats`` such spawns is reported. Memory: each method in its own spawn, so that
its peak is its own: optimizer memory (the wrapped optimizer's states plus, for ZeroOptimizer, the
fp32 master shards of half-precision models) and the peak resident-memory growth over the model
alone. Every number is also given as a ratio to DDP measured in the same run. The final loss
shows all methods train the same model the same way.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shardformer.data_parallel import DEFAULT_BUCKET_SIZE  # noqa: E402

METHODS = {
    "ddp": "DDP + AdamW",
    "torch_zero": "DDP + torch ZeroRedundancyOptimizer(AdamW)",
    "zero1": "ZeroOptimizer(AdamW) stage 1",
    "zero1_no_overlap": "ZeroOptimizer(AdamW) stage 1, overlap_communication=False",
    "zero2": "ZeroOptimizer(AdamW) stage 2",
    "zero2_no_overlap": "ZeroOptimizer(AdamW) stage 2, overlap_communication=False",
    "zero2_release": "ZeroOptimizer(AdamW) stage 2, release_grads",
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.seq,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def build_trainer(method, model, bucket_size):
    """Return (module to call, step function, optimizer-memory function) for ``method``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardformer.data_parallel import ZeroOptimizer

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)

    def state_bytes(optim):
        return sum(
            v.numel() * v.element_size() for st in optim.state.values() for v in st.values() if torch.is_tensor(v)
        )

    if method in ("ddp", "torch_zero"):
        ddp = DDP(model)
        if method == "ddp":
            opt = adamw(model.parameters())
            memory = lambda: state_bytes(opt)
        else:
            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01
            )
            memory = lambda: state_bytes(opt.optim)

        def step(loss):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return ddp, step, memory

    zero = ZeroOptimizer(
        adamw(model.parameters()),
        stage=1 if method.startswith("zero1") else 2,
        overlap_communication=not method.endswith("no_overlap"),  # on by default
        release_grads=method == "zero2_release",
        model=model,
        bucket_size=bucket_size,
    )

    def step(loss):
        zero.backward(loss)
        zero.step()
        zero.zero_grad()

    return model, step, lambda: sum(zero.state_bytes().values())


def _ids(step, rank, args):
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)


def run_timing(methods, args):
    """Every method in one spawn, one step of each in turn (the order reversed every other step):
    their ratios are measured under the same load, which on a shared machine is what changes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers = {m: build_trainer(m, build_model(args), args.bucket_size) for m in methods}
    times = {m: [] for m in methods}
    losses = {}
    for i in range(args.warmup + args.steps):
        ids = _ids(i, rank, args)
        for method in methods if i % 2 == 0 else methods[::-1]:
            module, step, _ = trainers[method]
            dist.barrier()
            start = time.perf_counter()
            loss = module(input_ids=ids, labels=ids).loss
            step(loss)
            if i >= args.warmup:
                times[method].append(time.perf_counter() - start)
            losses[method] = loss.detach().reshape(1).clone()
    for loss in losses.values():
        dist.all_reduce(loss)
    return {m: {"step_s": times[m], "final_loss": losses[m].item() / world} for m in methods}


def run_memory(method, args):
    """One method in its own spawn, so that its peak resident memory is its own."""
    rank = dist.get_rank()
    model = build_model(args)
    baseline = rss_bytes()
    module, step, optimizer_memory = build_trainer(method, model, args.bucket_size)
    for i in range(args.warmup + 1):
        ids = _ids(i, rank, args)
        step(module(input_ids=ids, labels=ids).loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "optimizer_bytes": optimizer_memory(),
        "peak_rss_growth": max(peak - baseline, 0),
        "params": sum(p.numel() for p in model.parameters()),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method and timing spawn")
    parser.add_argument("--repeats", type=int, default=2, help="timing spawns (their steps pooled)")
    parser.add_argument("--warmup", type=int, default=2)
    # Few tokens per step: the optimizer and gradient traffic, not activations, dominate.
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE, help="ZeroOptimizer bucket (elements)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {list(METHODS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    return parser.parse_args(argv)


def main(argv=None):
    import transformers

    from shardformer.tools.testing import run_on_ranks

    args = parse_args(argv)
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or "ddp" not in methods:
        raise SystemExit(
            f"--methods must include 'ddp' (the baseline) and only names from {list(METHODS)}; got {unknown or methods}"
        )
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.ranks)
    # Large blocks come from mmap and go back on free, so peak RSS tracks live tensors rather than
    # what glibc's heap happens to keep (which otherwise differs from method to method by ~100 MiB).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    started = time.perf_counter()
    results = {}
    for method in methods:
        per_rank = run_on_ranks(run_memory, args.ranks, method, args, timeout=600, threads_per_rank=threads)
        results[method] = {
            "optimizer_bytes": max(r["optimizer_bytes"] for r in per_rank),
            "peak_rss_growth": max(r["peak_rss_growth"] for r in per_rank),
            "params": per_rank[0]["params"],
        }
    times = {m: [] for m in methods}
    for _ in range(args.repeats):
        per_rank = run_on_ranks(run_timing, args.ranks, methods, args, timeout=900, threads_per_rank=threads)
        for method in methods:
            # ranks wait on each other: each step counts at its slowest rank
            times[method] += [max(ts) for ts in zip(*(r[method]["step_s"] for r in per_rank))]
            results[method]["final_loss"] = per_rank[0][method]["final_loss"]
    for method in methods:
        results[method]["step_s"] = statistics.median(times[method])
        print(f"  {method}: steps (ms) {[round(t * 1e3) for t in times[method]]}", file=sys.stderr, flush=True)

    base = results["ddp"]
    mib = 1 / 2**20
    print(f"\n## ZeRO benchmark: GPT-2 ({base['params'] / 1e6:.2f} M params), {args.ranks} ranks, gloo on CPU\n")
    print(
        "| method | step time (ms) | vs DDP | optimizer memory / rank (MiB) | vs DDP | peak RSS growth / rank (MiB) | vs DDP | final loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method, r in results.items():
        print(
            f"| {METHODS[method]} | {r['step_s'] * 1e3:.0f} | {r['step_s'] / base['step_s']:.2f} "
            f"| {r['optimizer_bytes'] * mib:.1f} | {r['optimizer_bytes'] / base['optimizer_bytes']:.2f} "
            f"| {r['peak_rss_growth'] * mib:.0f} | {r['peak_rss_growth'] / max(base['peak_rss_growth'], 1):.2f} "
            f"| {r['final_loss']:.4f} |"
        )
    print(
        f"\nHow it was run: `{' '.join([os.path.basename(sys.executable), *sys.argv])}` on {platform.machine()} with "
        f"{os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}, Python "
        f"{platform.python_version()}; {args.ranks} spawned gloo ranks, {threads} torch thread(s) each; GPT-2 with "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}; {args.batch} x {args.seq} "
        f"tokens per rank per step; ZeroOptimizer bucket {args.bucket_size} elements; step time = median of "
        f"{args.repeats} x {args.steps} steps (after {args.warmup} warm-up steps), all methods in one spawn taking "
        f"turns step by step; memory from one spawn per method. Optimizer memory = AdamW states (+ fp32 master shards for ZeroOptimizer); peak RSS growth = "
        f"peak resident memory minus resident memory once the model is built (MALLOC_MMAP_THRESHOLD_="
        f"{os.environ['MALLOC_MMAP_THRESHOLD_']}). Total {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
