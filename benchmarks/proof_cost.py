"""What proving a route costs: seconds and memory per rank before a 7B-class model is cut.

``shard_model`` proves every route on a tiny copy of the model (:mod:`shardformer.policies.proof`):
the user's config scaled down (two layers, a few heads), so the cost does not grow with the model.
Here the model is a 7B-class config on the meta device (no weights held), and each rank times
choosing its route (resolving the plan against the model, building and running the tiny copy
sharded against unsharded, one all-reduce) — once cold and once cached (a second model of the same
class and architecture in the same process) — and reports the peak resident memory the proof added
(VmHWM) over the resident memory before it.

    .venv/bin/python benchmarks/proof_cost.py [--tp 2] [--models llama2-7b,qwen2-7b,opt-6.7b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.load_bench import _status_mib  # noqa: E402

CONFIGS = {
    "llama2-7b": ("LlamaForCausalLM", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                           num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "qwen2-7b": ("Qwen2ForCausalLM", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                          num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)),
    "opt-6.7b": ("OPTForCausalLM", dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                                        num_attention_heads=32, vocab_size=50272, word_embed_proj_dim=4096)),
}  # fmt: skip


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident size
        f.write("5")


def time_choose(model, tp: int, routes) -> tuple:
    """``(route name, proven, cold s, cached s, peak MiB the cold run added, resident MiB before)``:
    choosing ``model``'s route among ``routes`` twice in this process, first cold, then cached."""
    from shardformer import ShardConfig
    from shardformer.policies.anatomy import final_norm, layer_stack
    from shardformer.policies.routes import choose

    args = dict(layers=layer_stack(model), adapters=None, final_norm=final_norm(model))
    times, added = [], 0.0
    for run in ("cold", "cached"):
        _reset_peak()
        before = _status_mib("VmRSS")
        start = time.perf_counter()
        _, _, route, proven = choose(model, ShardConfig(tensor_parallel_size=tp), routes, args)
        times.append(time.perf_counter() - start)
        if run == "cold":
            added = _status_mib("VmHWM") - before
    return route.name, proven, times[0], times[1], added, before


def _rank(names: list[str], tp: int) -> list[tuple]:
    import torch
    import transformers as tf

    from shardformer.policies.routes import candidate_routes

    rows = []
    for name in names:
        cls_name, sizes = CONFIGS[name]
        cls = getattr(tf, cls_name)
        with torch.device("meta"):
            model = cls(cls.config_class(**sizes))
        params = sum(p.numel() for p in model.parameters())
        rows.append((name, params, *time_choose(model, tp, candidate_routes(model))[:5]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--models", default=",".join(CONFIGS))
    args = parser.parse_args()
    import platform

    import torch
    import transformers

    from shardformer.tools.testing import run_on_ranks

    names = args.models.split(",")
    results = run_on_ranks(_rank, args.tp, names, args.tp, timeout=900)
    print(
        f"proof cost at tp={args.tp} ({args.tp} gloo processes, {os.cpu_count()} CPU cores, {platform.processor() or 'cpu'}; "
        f"torch {torch.__version__}, transformers {transformers.__version__})\n"
    )
    print(
        "| model | parameters | route | proven | first shard_model (s) | cached (s) | peak memory added per rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in zip(*results):
        name, params, route, proven = row[0][:4]
        cold = max(r[4] for r in row)
        warm = max(r[5] for r in row)
        mem = max(r[6] for r in row)
        print(f"| {name} | {params / 1e9:.1f}B | {route} | {proven} | {cold:.2f} | {warm:.3f} | {mem:.0f} |")


if __name__ == "__main__":
    main()
