"""The experts of a mixture-of-experts model in a plan: how many, their share of the parameters, and
what one rank holds.

The experts are found as expert parallelism finds them (`shardformer.expert_parallel.sizing.expert_sizing`:
the stacked-experts module of each MoE layer, its expert count, top-k), before the model is cut; the
shares come from the plan's parameters (full and rank shapes) under those modules, so they are what
tensor parallelism really cut. Under expert-internal tensor parallelism every rank holds every
expert of its layers, each cut over tp; at an expert-parallel size ``ep`` (the sizing's) each rank
holds ``1/ep`` of them, whole or cut.
"""

from __future__ import annotations

import math

SHARED = ("shared_expert", "shared_experts")  # a shared expert's module, beside the routed ones


def expert_lines(params, sizing, tp: int, tokens: int | None = None, width: int = 4) -> list[str]:
    """Lines for ``shardformer plan``: ``params`` are the plan's ``(name, full shape, rank shape)`` (rank
    shapes after tp and ep), ``sizing`` the model's ``ExpertSizing`` (None for a dense model: no lines);
    ``tokens`` per micro-batch and rank, ``width`` bytes per value: the exchange's bytes at ep > 1."""
    if sizing is None:
        return []
    routed = tuple(path + "." for path in sizing.paths)
    full = {"routed": 0, "shared": 0, "other": 0}
    rank = dict(full)
    for name, full_shape, rank_shape in params:
        kind = "routed" if name.startswith(routed) else "shared" if set(name.split(".")) & set(SHARED) else "other"
        full[kind] += math.prod(full_shape)
        rank[kind] += math.prod(rank_shape)
    total_full, total_rank = sum(full.values()), sum(rank.values())
    lines = [
        f"experts: {sizing.experts} routed per MoE layer (top-{sizing.top_k}), in {len(sizing.paths)} layers",
        f"  routed experts' parameters: {full['routed']:,} of {total_full:,} unsharded "
        f"({full['routed'] / max(total_full, 1):.1%}); {rank['routed']:,} of {total_rank:,} per rank "
        f"({rank['routed'] / max(total_rank, 1):.1%})",
    ]
    if full["shared"]:
        lines.append(f"  shared experts' parameters: {full['shared']:,} unsharded, {rank['shared']:,} per rank")
    cut = f", each cut over tp={tp} (expert-internal tensor parallelism)" if tp > 1 else ", whole"
    spread = f" (1/{sizing.ep} of them: ep={sizing.ep})" if sizing.ep > 1 else ""
    lines.append(f"  per rank: {sizing.per_rank} experts of each MoE layer{spread}{cut}")
    if sizing.ep > 1 and tokens:
        sent = sizing.exchange_bytes(tokens, width)
        per_layer = sent / len(sizing.paths)
        lines.append(
            f"  all-to-all: {per_layer / 2**20:,.1f} MiB sent per rank per MoE layer and micro-batch "
            f"({sent / 2**20:,.1f} MiB over all {len(sizing.paths)}; a pipeline stage sends its layers' share): "
            f"{tokens:,} tokens x top-{sizing.top_k}, dispatch and combine, forward and backward, routing spread evenly"
        )
    return lines
