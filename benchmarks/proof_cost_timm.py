"""What proving a route costs for a timm model (no transformers config): seconds and memory per rank.

A timm model has no config to scale down, so the proof (and the derived route's trace) runs on a
copy of the model with each repeated stack cut to two blocks, at the model's own widths
(:mod:`shardformer.policies.copies`). Here ``vit_large_patch16_224`` (pretrained=False: 304M
parameters, 24 blocks of width 1024) on each rank times choosing its route — the family's built-in
policy, and the derived route forced (trace, simulated cuts, then the proof) — cold and cached, and
reports the peak resident memory each added (VmHWM) over the resident memory before it.

    .venv/bin/python benchmarks/proof_cost_timm.py [--tp 2] [--model vit_large_patch16_224] [--routes derived]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.proof_cost import time_choose  # noqa: E402


def _rank(name: str, tp: int, wanted_routes: list[str]) -> list[tuple]:
    import timm
    import torch

    from shardformer.policies.routes import candidate_routes

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for wanted in wanted_routes:
        routes = [r for r in candidate_routes(model) if r.name == wanted]
        rows.append((name, params, *time_choose(model, tp, routes)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="vit_large_patch16_224")
    # one route per run measures its memory alone (a later row starts from what the allocator kept)
    parser.add_argument("--routes", default="built-in policy,derived")
    args = parser.parse_args()
    import platform

    import timm
    import torch

    from shardformer.tools.testing import run_on_ranks

    results = run_on_ranks(_rank, args.tp, args.model, args.tp, args.routes.split(","), timeout=1800)
    print(
        f"proof cost at tp={args.tp} ({args.tp} gloo processes, {os.cpu_count()} CPU cores, {platform.processor() or 'cpu'}; "
        f"torch {torch.__version__}, timm {timm.__version__})\n"
    )
    print(
        "| model | parameters | route | proven | first shard_model (s) | cached (s) | peak memory added per rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in zip(*results):
        name, params, route, proven = row[0][:4]
        cold, warm, mem = max(r[4] for r in row), max(r[5] for r in row), max(r[6] for r in row)
        print(f"| {name} | {params / 1e6:.0f}M | {route} | {proven} | {cold:.2f} | {warm:.3f} | {mem:.0f} |")
    print(f"\nresident before (the model itself, per rank): {max(r[7] for r in results[0]):.0f} MiB")


if __name__ == "__main__":
    main()
