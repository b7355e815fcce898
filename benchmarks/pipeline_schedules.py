"""Every pipeline schedule on the same job, in one run: bubble counted, bubble timed, step time vs 1F1B.

    .venv/bin/python benchmarks/pipeline_schedules.py          # ~3 minutes on a 2-core CPU machine

One spawn of ``pp`` gloo ranks trains a Llama (plan route; 8 layers x 256, vocab 8192) through
``ParallelEngine`` with each schedule in turn (one engine per schedule, built from the same weights,
the same batches and micro-batches; the schedules take turns step by step, so load from elsewhere
hits all alike). Per schedule and rank:

- **counted**: the idle fraction of the step when the schedule's own action lists (torch's
  ``pipeline_order``) are replayed with a forward costing 1 and a backward 2
  (:func:`shardformer.pipeline.bubble.simulate` on `schedule_actions`); ZBV and DualPipeV split the backward into input
  and weight halves (at tp=1 with ZeRO-1/2, as here: the "backward" column says which ran);
- **timed**: 1 - (time the rank spends in its stages' forward and backward) / (step time);
- **step / 1F1B**: the median over rounds of the step time over the same round's 1F1B step (a round
  runs every schedule once, so load from elsewhere hits both alike).
All schedules must train identically: the table shows the largest loss difference from 1F1B.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from datetime import date

import torch
import torch.distributed as dist

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev")


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _timed(stage, busy):
    """Wrap a PipelineStage's compute calls so their time adds to ``busy[0]``."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        inner = getattr(stage, name)

        def run(*a, _inner=inner, **k):
            start = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(stage, name, run)


def run_schedules(args):
    from shardformer import EngineConfig, ParallelEngine, ProcessMesh

    model = build_model(args)
    mesh = ProcessMesh(1, args.pp, 1)
    engines = {}
    for schedule in SCHEDULES:
        cfg = EngineConfig(pp=args.pp, num_microbatches=args.micro, schedule=schedule)
        adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
        engines[schedule] = ParallelEngine(copy.deepcopy(model), adamw, cfg, mesh=mesh)
    times = {s: [] for s in SCHEDULES}
    busy = {s: [] for s in SCHEDULES}
    losses = {s: [] for s in SCHEDULES}
    counters, counted, split = {}, {}, {}
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        turn = SCHEDULES[i % len(SCHEDULES) :] + SCHEDULES[: i % len(SCHEDULES)]
        for schedule in turn:
            engine = engines[schedule]
            dist.barrier()
            if schedule in counters:
                counters[schedule][0] = 0.0
            start = time.perf_counter()
            losses[schedule].append(engine.train_step({"input_ids": ids, "labels": ids}))
            took = time.perf_counter() - start
            if schedule not in counters:  # built at the first step: count its actions, time its stages
                sched = engine._torch_pipeline._built[2]
                counters[schedule] = [0.0]
                for stage in getattr(sched, "_stages", None) or [sched._stage]:
                    _timed(stage, counters[schedule])
                from shardformer.pipeline.bubble import SPLIT_BACKWARD, WHOLE_BACKWARD, schedule_actions, simulate

                actions = schedule_actions(schedule, args.pp, args.micro, engine.config.chunks_per_rank)
                split[schedule] = engine._torch_pipeline.split_backward and schedule in ("zbv", "dualpipev")
                counted[schedule] = simulate(actions, SPLIT_BACKWARD if split[schedule] else WHOLE_BACKWARD)
            elif i >= args.warmup:
                times[schedule].append(took)
                busy[schedule].append(counters[schedule][0])
    return {"times": times, "busy": busy, "losses": losses, "counted": counted, "split": split}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument(
        "--micro", type=int, default=4, help="micro-batches per step (ZBV: >= 2pp-1, DualPipeV: >= 2pp)"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per schedule")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    return parser.parse_args(argv)


def main(argv=None):
    import transformers

    from shardformer.pipeline.bubble import bubble_fraction
    from shardformer.tools.testing import run_on_ranks

    args = parse_args(argv)
    started = time.perf_counter()
    per_rank = run_on_ranks(run_schedules, args.pp, args, timeout=1800, threads_per_rank=1)
    # a step counts at its slowest rank; a rank's timed bubble is its idle share of that step
    steps = {s: [max(ts) for ts in zip(*(r["times"][s] for r in per_rank))] for s in SCHEDULES}
    print(
        f"\n## Pipeline schedules on one job ({date.today()}): Llama through ParallelEngine, pp={args.pp}, "
        f"{args.micro} micro-batches, gloo on CPU\n"
    )
    print(
        "| schedule | chunks per rank | backward | formula | counted (per rank) | timed (per rank) | step (ms) "
        "| step / 1F1B | max loss diff vs 1F1B |"
    )
    print("|---|---:|---|---:|---|---|---:|---:|---:|")
    for s in SCHEDULES:
        chunks = 2 if s in ("interleaved_1f1b", "zbv", "dualpipev") else 1
        timed = [
            statistics.median(1 - b / t for b, t in zip(r["busy"][s], steps[s])) for r in per_rank
        ]  # fmt: skip
        counted = per_rank[0]["counted"][s]
        backward = "split" if per_rank[0]["split"][s] else "whole"
        diff = max(abs(a - b) for a, b in zip(per_rank[-1]["losses"][s], per_rank[-1]["losses"]["1f1b"]))
        fmt = lambda d: " / ".join(f"{d[r]:.2f}" for r in sorted(d))  # noqa: E731
        print(
            f"| {s} | {chunks} | {backward} | {bubble_fraction(s, args.pp, args.micro, chunks):.2f} | {fmt(counted)} | "
            f"{' / '.join(f'{x:.2f}' for x in timed)} | {statistics.median(steps[s]) * 1e3:.0f} | "
            f"{statistics.median(a / b for a, b in zip(steps[s], steps['1f1b'])):.2f} | {diff:.1e} |"
        )
    print(
        f"\nHow it was run: `{' '.join([os.path.basename(sys.executable), *sys.argv])}` on {platform.machine()} with "
        f"{os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}; {args.pp} spawned "
        f"gloo ranks, 1 torch thread each; Llama with {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; "
        f"{args.batch} x {args.seq} tokens per step; AdamW; ZeRO-1; median of {args.steps} steps after "
        f"{args.warmup} warm-up steps, the schedules taking turns. Total {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
