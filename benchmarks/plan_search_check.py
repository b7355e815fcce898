"""The search's cost model checked, not trusted: predicted against measured step time of every layout it ranks.

    .venv/bin/python benchmarks/plan_search_check.py      # 4 gloo ranks, a small Llama; ~5 minutes here

1. ``shardformer.tools.search.search`` ranks the layouts of a small Llama on 4 "GPUs" (this machine's
   gloo ranks, one node); the benchmark keeps, for each mesh (tp, cp and its mode, pp, dp), ZeRO
   stage and checkpointing, the micro-batch choice the search ranks first (1F1B only, no sequence
   parallelism: they would multiply the runs, not the checks).
2. One spawn of 4 ranks measures this machine's constants for the cost model (CPU constants): a
   matrix product's FLOP/s on one thread (the layer's own shapes: efficiency 1 against that), and
   gloo's all-reduce latency (1 float) and bandwidth (16 MiB) between the ranks; then trains every
   kept layout through ``ParallelEngine`` (the same weights and batches), the layouts taking turns
   step by step in groups of 16 (this machine is shared), and takes each one's median step (the
   slowest rank's).
3. The search runs again with the measured constants; the table lists predicted and measured step
   time per layout and the Spearman rank correlation between them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import date

import torch
import torch.distributed as dist

GROUP = 16  # layouts trained side by side


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="gloo ranks (default 4)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-layouts", type=int, default=100, help="measure at most this many (the best ranked first)")
    p.add_argument("--cases", type=int, nargs="*", help="with --paper: which of them (default all)")
    p.add_argument("--count", action="store_true", help="no timing: count the collectives of one step of a few "
                   "layouts (4 ranks), what the cost model's communication terms follow")  # fmt: skip
    p.add_argument("--save", help="write the measured constants and steps to this JSON file")
    p.add_argument("--measured", help="no measurement: predict again for the steps a --save file holds")
    p.add_argument("--paper", action="store_true", help="no measurement: run the search for the issue's example and "
                   "published configurations and show where the published layout ranks")  # fmt: skip
    return p.parse_args(argv)


def save_model(args, folder: str) -> str:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(folder)
    return folder


def chosen_layouts(result, limit: int) -> list:
    """For each mesh, ZeRO stage and checkpointing: the best-ranked micro-batch choice (1F1B, no sp)."""
    seen, out = set(), []
    for c in result.ranked:
        x = c.layout
        key = (x.tp, x.cp, x.cp_mode, x.pp, x.dp, x.zero, x.checkpointing)
        if x.sequence_parallel or x.schedule != "1f1b" or key in seen:
            continue
        seen.add(key)
        out.append(x)
    return out[:limit]


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def constants(args) -> dict:
    """This machine's FLOP/s (one thread, the MLP's product) and gloo's all-reduce alpha and beta."""
    tokens = args.global_batch * args.seq // args.world
    x, w = torch.randn(tokens, args.hidden), torch.randn(args.hidden, 4 * args.hidden)
    for _ in range(3):
        x @ w
    start = time.perf_counter()
    for _ in range(20):
        x @ w
    flops = 2 * tokens * args.hidden * 4 * args.hidden * 20 / (time.perf_counter() - start)
    one, big = torch.zeros(1), torch.zeros(4 * 2**20)
    timings = {}
    for name, t, reps in (("one", one, 200), ("big", big, 5)):
        dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        timings[name] = _max_over_ranks((time.perf_counter() - start) / reps)
    p = args.world
    alpha = timings["one"] / (2 * (p - 1))
    beta = 2 * (p - 1) / p * big.numel() * 4 / max(timings["big"] - 2 * (p - 1) * alpha, 1e-9)
    return {"flops": flops, "alpha": alpha, "beta": beta}


def measure(folder: str, layouts: list, args) -> dict:
    """Every layout's engine built from the same weights, then trained in rounds, ``GROUP`` layouts at a
    time: each round runs one step of every layout of the group, in an order that rotates, so load from
    elsewhere on this shared machine hits them alike. The median over rounds of each layout's step (the
    slowest rank's)."""
    from transformers import AutoConfig, LlamaForCausalLM

    from shardformer import EngineConfig, ParallelEngine

    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    times, measured = [[] for _ in layouts], []
    for group in range(0, len(layouts), GROUP):  # a group's engines at once: all of them would not fit in memory
        engines = {}
        for j in range(group, min(group + GROUP, len(layouts))):
            torch.manual_seed(0)
            model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))  # the same weights for every layout
            engines[j] = ParallelEngine(model, adamw, EngineConfig(**layouts[j].engine_fields("fp32"), prove=False))
        for i in range(args.warmup + args.steps):
            measured.append(constants(args))  # each round: the machine's load now is the layouts' load
            gen = torch.Generator().manual_seed(i)
            ids = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=gen)
            turn = list(engines)
            turn = turn[i % len(turn) :] + turn[: i % len(turn)]
            for j in turn if i % 2 == 0 else reversed(turn):
                dist.barrier()
                start = time.perf_counter()
                engines[j].train_step({"input_ids": ids, "labels": ids})
                took = _max_over_ranks(time.perf_counter() - start)
                if i >= args.warmup:
                    times[j].append(took)
        del engines
        gc.collect()
    found = {k: statistics.median(c[k] for c in measured) for k in measured[0]}
    return {"constants": found, "steps": [statistics.median(t) for t in times]}


COUNTED = [dict(tp=4), dict(tp=2, dp=2), dict(tp=2, dp=2, activation_checkpointing=True), dict(dp=4, zero_stage=1),
           dict(dp=4, zero_stage=2), dict(dp=4, zero_stage=3), dict(dp=4, zero_stage=3, activation_checkpointing=True),
           dict(dp=4, zero_stage=3, num_microbatches=2), dict(tp=2, dp=2, zero_stage=3),
           dict(dp=4, dp_replicate=2, zero_stage=3), dict(pp=2, dp=2, zero_stage=3, num_microbatches=2),
           dict(cp=2, dp=2),
           dict(cp=2, cp_mode="all_to_all", dp=2), dict(cp=4)]  # fmt: skip


def count(folder: str, args) -> list:
    """Each of ``COUNTED``'s layouts: one step (after one) under ``CollectiveCounter``, calls and bytes by
    collective and group."""
    from transformers import AutoConfig, LlamaForCausalLM

    from shardformer import EngineConfig, ParallelEngine
    from shardformer.core.comm import CollectiveCounter

    ids = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=torch.Generator().manual_seed(0))
    out = []
    for fields in COUNTED:
        torch.manual_seed(0)
        model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
        engine = ParallelEngine(
            model, lambda p: torch.optim.AdamW(p, lr=1e-4), EngineConfig(**fields, precision="fp32", prove=False)
        )  # fmt: skip
        mesh = engine.mesh
        groups = (("tp", mesh.tp_group), ("cp", mesh.cp_group), ("dp", mesh.dp_shard_group),
                  ("dp replicas", mesh.dp_replicate_group), ("pp", mesh.pp_group))  # fmt: skip
        names = {id(g): name for name, g in groups if g is not None}
        engine.train_step({"input_ids": ids, "labels": ids})
        with CollectiveCounter() as counter:
            engine.train_step({"input_ids": ids, "labels": ids})
        calls: dict[str, list[int]] = {}
        for (op, _, nbytes), group in zip(counter.calls, counter.groups):
            seen = calls.setdefault(f"{op} over {names.get(id(group), 'world')}", [0, 0])
            seen[0], seen[1] = seen[0] + 1, seen[1] + nbytes
        out.append((fields, calls))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


# (what, model, GPUs, GPUs per node, GPU, memory GiB, seq, sequences per step, the published layout)
PUBLISHED = [
    ("issue 47: full fine-tuning, found by hand in 7 invocations", "llama3-70b", 16, 8, "h100", 80, 4096, 32,
     dict(tp=8, pp=1, dp=2, zero=3, checkpointing=True)),
    ("torchtitan llama3_70b.toml (its preset: 64 A100; TP 8, FSDP, full AC, local batch 8)", "llama3-70b", 64, 8,
     "a100", 80, 8192, 64, dict(tp=8, pp=1, dp=8, zero=3, checkpointing=True)),
    ("torchtitan llama3_405b.toml (its preset: 128 H100; TP 8, FSDP, full AC, batch 2)", "llama3-405b", 128, 8,
     "h100", 80, 8192, 32, dict(tp=8, pp=1, dp=16, zero=3, checkpointing=True)),
    ("Llama 3 paper, Table 4 (Meta): 8,192 H100, TP 8, PP 16, DP 64, seq 8192, 16M tokens", "llama3-405b", 8192,
     8, "h100", 80, 8192, 2048, dict(tp=8, pp=16, dp=64, cp=1)),
]  # fmt: skip


def paper(args) -> None:
    """The search on paper for the issue's example and published layouts: the top, and where the published one ranks."""
    from shardformer.tools.search import search, size
    from shardformer.tools.search_report import seconds, why_lost

    print(f"\n## The search on published configurations ({date.today()}): bf16, 10% headroom, cost model constants "
          f"of `shardformer/tools/search_cost.py` (no simulation)\n")  # fmt: skip
    print("| configuration | layouts (fit) | search's #1 | its step, tokens/s | published layout: rank, step | why |")
    print("|---|---:|---|---|---|---|")
    cases = [PUBLISHED[i] for i in args.cases] if args.cases else PUBLISHED
    for what, model, gpus, per_node, hw, memory, seq, batch, mine in cases:
        started = time.perf_counter()
        result = search(model, gpus, memory * 2**30, seq=seq, global_batch=batch, gpus_per_node=per_node,
                        hardware=hw, simulate=False, prove=False, top=10**6, keep_all=True,
                        schedules=("1f1b", "interleaved_1f1b"))  # fmt: skip
        best = result.ranked[0] if result.ranked else None
        matching = lambda c, mine=mine: all(getattr(c.layout, k) == v for k, v in mine.items())  # noqa: E731
        rank = next((i for i, c in enumerate(result.ranked, 1) if matching(c)), None)
        published = result.ranked[rank - 1] if rank else min(filter(matching, result.over), key=lambda c: c.peak)
        where = (f"#{rank} of {len(result.ranked):,}, {seconds(published.cost.step)} ({size(published.peak)})" if rank
                 else f"over the memory: {size(published.peak)} per GPU")  # fmt: skip
        why = why_lost(best, published).split(": ", 1)[-1] if best and rank != 1 else "it is the search's choice"
        top = f"{best.layout.short()} ({size(best.peak)})" if best else "nothing fits"
        speed = f"{seconds(best.cost.step)}, {best.cost.tokens_per_s:,.0f}" if best else ""
        print(f"| {what} | {result.enumerated:,} ({result.fit_closed_form:,}) | {top} | {speed} | {where} | {why} |")
        print(f"search took {time.perf_counter() - started:.0f} s", file=sys.stderr)


def main(argv=None):
    import transformers

    from shardformer.tools.search import search
    from shardformer.tools.search_cost import Hardware
    from shardformer.tools.search_space import Layout
    from shardformer.tools.testing import run_on_ranks

    args = parse_args(argv)
    if args.paper:
        return paper(args)
    if args.count:
        folder = save_model(args, tempfile.mkdtemp(prefix="plan_search_check_"))
        print(f"\n## Collectives of one step, rank 0 ({date.today()}): Llama {args.layers} x {args.hidden}, "
              f"{args.global_batch} x {args.seq} tokens, fp32\n\n| layout | collective | calls | bytes |\n|---|---|---:|---:|")  # fmt: skip
        for fields, calls in run_on_ranks(count, 4, folder, args, timeout=1800, threads_per_rank=1)[0]:
            for what, (n, nbytes) in sorted(calls.items()):
                print(f"| {fields} | {what} | {n} | {nbytes:,} |")
        return None
    started = time.perf_counter()
    folder = save_model(args, tempfile.mkdtemp(prefix="plan_search_check_"))
    options = dict(seq=args.seq, global_batch=args.global_batch, gpus_per_node=args.world, precision="fp32",
                   simulate=False, prove=False, device="cpu", top=10**6, schedules=("1f1b",))  # fmt: skip
    first = search(folder, args.world, 64 * 2**30, hardware="h100", **options)
    layouts = chosen_layouts(first, args.max_layouts)
    if args.measured:  # the same model and layouts, measured before: only the prediction is new
        with open(args.measured) as f:
            found = json.load(f)
        layouts = [Layout(**x) for x in found["layouts"]]
    else:
        found = run_on_ranks(measure, args.world, folder, layouts, args, timeout=3600, threads_per_rank=1)[0]
        found["layouts"], found["load"] = [asdict(x) for x in layouts], os.getloadavg()
    if args.save:
        with open(args.save, "w") as f:
            json.dump(found, f, indent=1)
    c = found["constants"]
    cpu = Hardware("this CPU, measured", c["flops"], 1.0, c["beta"], c["alpha"], c["beta"], c["alpha"])
    ranked = {x.layout: x for x in search(folder, args.world, 64 * 2**30, hardware=cpu, **options).ranked}
    predicted = [ranked[x].cost.step for x in layouts]
    measured = found["steps"]
    rho = spearman(predicted, measured)
    print(
        f"\n## The search's cost model against measured steps ({date.today()}): Llama {args.layers} x {args.hidden}, "
        f"{args.world} gloo ranks on CPU\n"
    )
    print(
        f"Load average when measured (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in found.get('load', ()))}. "
        f"Constants measured in the same spawn (medians over its rounds): {c['flops'] / 1e9:.1f} GFLOP/s per rank (one thread), all-reduce "
        f"alpha {c['alpha'] * 1e6:.0f} us, beta {c['beta'] / 1e9:.2f} GB/s. **Spearman rank correlation, predicted vs "
        f"measured: {rho:.2f}** over {len(layouts)} layouts.\n"
    )
    print("| predicted rank | layout | predicted step (ms) | measured step (ms) | measured / predicted |")
    print("|---:|---|---:|---:|---:|")
    order = sorted(range(len(layouts)), key=lambda i: predicted[i])
    for n, i in enumerate(order, 1):
        print(
            f"| {n} | {layouts[i].short()} | {predicted[i] * 1e3:.0f} | {measured[i] * 1e3:.0f} | "
            f"{measured[i] / predicted[i]:.2f} |"
        )
    print(
        f"\nHow it was run: `{' '.join([os.path.basename(sys.executable), *sys.argv])}` on {platform.machine()} with "
        f"{os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}; {args.world} spawned "
        f"gloo ranks, 1 torch thread each; {args.global_batch} x {args.seq} tokens per step, fp32, AdamW; median of "
        f"{args.steps} steps after {args.warmup} warm-up steps (the slowest rank's). "
        f"Total {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
