"""ZeroOptimizer (stage 1 and 2) vs torch's ZeroRedundancyOptimizer and plain DDP + AdamW.

    .venv/bin/python benchmarks/zero_bench.py            # ~2 minutes on a 2-core CPU machine

Each method trains the same small GPT-2 (built from a config, same seed, same data) on 2 gloo
ranks for a few steps, in its own spawn so that its peak memory is its own. Reported per rank:
median step time, optimizer memory (the wrapped optimizer's states plus, for ZeroOptimizer, the
fp32 master shards of half-precision models), and the peak resident-memory growth over the model alone; every number is
also given as a ratio to DDP measured in the same run. The final loss shows all methods train
the same model the same way.
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
from shardformer.zero import DEFAULT_BUCKET_SIZE  # noqa: E402

METHODS = {
    "ddp": "DDP + AdamW",
    "torch_zero": "DDP + torch ZeroRedundancyOptimizer(AdamW)",
    "zero1": "ZeroOptimizer(AdamW) stage 1",
    "zero2": "ZeroOptimizer(AdamW) stage 2",
    "zero2_overlap": "ZeroOptimizer(AdamW) stage 2, overlap + release_grads",
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

    from shardformer.zero import ZeroOptimizer

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

    stage = 1 if method == "zero1" else 2
    overlap = method == "zero2_overlap"
    zero = ZeroOptimizer(
        adamw(model.parameters()),
        stage=stage,
        overlap_communication=overlap,
        release_grads=overlap,
        model=model,
        bucket_size=bucket_size,
    )

    def step(loss):
        zero.backward(loss)
        zero.step()
        zero.zero_grad()

    return model, step, lambda: sum(zero.state_bytes().values())


def run_method(method, args):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args)
    baseline = rss_bytes()
    module, step, optimizer_memory = build_trainer(method, model, args.bucket_size)
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(10_000 * i + rank)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        loss = module(input_ids=ids, labels=ids).loss
        step(loss)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
    loss_sum = loss.detach().reshape(1).clone()
    dist.all_reduce(loss_sum)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "step_s": statistics.median(times),
        "optimizer_bytes": optimizer_memory(),
        "peak_rss_growth": max(peak - baseline, 0),
        "final_loss": loss_sum.item() / world,
        "params": sum(p.numel() for p in model.parameters()),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per method and round")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all methods (fastest round kept)")
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

    from shardformer.testing import run_on_ranks

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
    # Rounds alternate the order of methods and each method keeps its fastest round: on a shared
    # machine, load from elsewhere only ever adds time.
    for round_index in range(args.repeats):
        for method in methods if round_index % 2 == 0 else methods[::-1]:
            per_rank = run_on_ranks(run_method, args.ranks, method, args, timeout=600, threads_per_rank=threads)
            measured = {
                "step_s": max(r["step_s"] for r in per_rank),  # ranks wait on each other: the slowest counts
                "optimizer_bytes": max(r["optimizer_bytes"] for r in per_rank),
                "peak_rss_growth": max(r["peak_rss_growth"] for r in per_rank),
                "final_loss": per_rank[0]["final_loss"],
                "params": per_rank[0]["params"],
            }
            print(f"  round {round_index} {method}: {measured}", file=sys.stderr, flush=True)
            best = results.setdefault(method, measured)
            best["step_s"] = min(best["step_s"], measured["step_s"])
            best["peak_rss_growth"] = max(best["peak_rss_growth"], measured["peak_rss_growth"])

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
        f"tokens per rank per step; ZeroOptimizer bucket {args.bucket_size} elements; step time = median of {args.steps} steps after {args.warmup} warm-up steps, "
        f"best of {args.repeats} rounds in alternating order; each method in its own spawn. Optimizer memory = AdamW states (+ fp32 master shards for ZeroOptimizer); peak RSS growth = "
        f"peak resident memory minus resident memory once the model is built (MALLOC_MMAP_THRESHOLD_="
        f"{os.environ['MALLOC_MMAP_THRESHOLD_']}). Total {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
