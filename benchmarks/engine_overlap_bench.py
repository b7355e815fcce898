"""Each communication overlap of ParallelEngine switched on and off, in one run.

    .venv/bin/python benchmarks/engine_overlap_bench.py          # ~2 minutes on a 2-core CPU machine

Two settings, each on 2 gloo ranks training GPT-2 (4 layers x 256, vocab 8192) through
``ParallelEngine``:

- ``zero``: dp=2, ZeRO stage 2, ``EngineConfig(overlap_grad_reduce=...)`` (buckets reduced during
  backward vs all at the step);
- ``pp``: pp=2 on our p2p schedules (1F1B, 4 micro-batches), ``EngineConfig(overlap_p2p=...)``
  (receives posted one schedule step early vs when needed).

On and off live in one spawn (two engines over the same ranks, built from the same weights) and
take turns step by step, the order reversed every other step, so load from elsewhere hits both
alike; the median step of ``--repeats`` such spawns is reported, and the median of the ratios of
neighbouring on / off steps. Both
must train identically: the table shows the largest loss difference between them (0 expected).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from zero_bench import build_model  # noqa: E402 - the same GPT-2 (this folder is on the path: run as a script)

SETTINGS = {
    "zero": ("dp=2, ZeRO-2: gradient buckets reduced during backward", "overlap_grad_reduce"),
    "pp": ("pp=2, p2p 1F1B x 4 micro-batches: receives posted early", "overlap_p2p"),
}


def engine_config(setting, overlap, args):
    from shardformer import EngineConfig

    if setting == "zero":
        return EngineConfig(dp=2, zero_stage=2, overlap_grad_reduce=overlap)
    return EngineConfig(pp=2, backend="p2p", num_microbatches=args.micro, overlap_p2p=overlap)


def run_setting(setting, args):
    from shardformer import ParallelEngine, ProcessMesh

    model = build_model(args)
    engines = {}
    for overlap in (True, False):
        cfg = engine_config(setting, overlap, args)
        mesh = ProcessMesh(cfg.tp, cfg.pp, cfg.dp)
        adamw = lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)  # noqa: E731
        engines[overlap] = ParallelEngine(copy.deepcopy(model), adamw, cfg, mesh=mesh)
    times, losses = {True: [], False: []}, {True: [], False: []}
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        for overlap in (True, False) if i % 2 == 0 else (False, True):
            dist.barrier()
            start = time.perf_counter()
            losses[overlap].append(engines[overlap].train_step({"input_ids": ids, "labels": ids}))
            if i >= args.warmup:
                times[overlap].append(time.perf_counter() - start)
    return {"times": times, "losses": losses}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {list(SETTINGS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and spawn")
    parser.add_argument("--repeats", type=int, default=2, help="spawns per setting (their steps pooled)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global sequences per step (split over dp)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches of the pp setting")
    return parser.parse_args(argv)


def main(argv=None):
    import transformers

    from shardformer.tools.testing import run_on_ranks

    args = parse_args(argv)
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"--settings takes names from {list(SETTINGS)}; got {unknown}")
    started = time.perf_counter()
    rows = []
    for setting in settings:
        times, diff = {True: [], False: []}, 0.0
        for _ in range(args.repeats):
            per_rank = run_on_ranks(run_setting, 2, setting, args, timeout=900, threads_per_rank=1)
            for overlap in (True, False):  # each step counts at its slowest rank
                times[overlap] += [max(ts) for ts in zip(*(r["times"][overlap] for r in per_rank))]
            diff = max([diff] + [abs(a - b) for a, b in zip(per_rank[0]["losses"][True], per_rank[0]["losses"][False])])
        on, off = statistics.median(times[True]), statistics.median(times[False])
        # neighbouring steps share the machine's load: the median of their ratios is the steadier figure
        paired = statistics.median(a / b for a, b in zip(times[True], times[False]))
        print(f"  {setting}: on {[round(t * 1e3) for t in times[True]]}", file=sys.stderr)
        print(f"  {setting}: off {[round(t * 1e3) for t in times[False]]}", file=sys.stderr)
        rows.append((setting, on, off, paired, diff))

    print("\n## Communication overlap on vs off: GPT-2 through ParallelEngine, 2 gloo ranks on CPU\n")
    print("| setting | switch | step on (ms) | step off (ms) | on / off (paired steps) | max loss difference |")
    print("|---|---|---:|---:|---:|---:|")
    for setting, on, off, paired, diff in rows:
        what, switch = SETTINGS[setting]
        print(f"| {what} | `{switch}` | {on * 1e3:.0f} | {off * 1e3:.0f} | {paired:.2f} | {diff:.1e} |")
    print(
        f"\nHow it was run: `{' '.join([os.path.basename(sys.executable), *sys.argv])}` on {platform.machine()} with "
        f"{os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}; 2 spawned gloo "
        f"ranks, 1 torch thread each; GPT-2 with {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
        f"{args.vocab}; {args.batch} x {args.seq} tokens per step (global); AdamW; step = median of {args.repeats} x "
        f"{args.steps} steps after {args.warmup} warm-up steps, on and off taking turns in one spawn. "
        f"Total {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
