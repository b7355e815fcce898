"""The experts of a mixture-of-experts model in a plan: how many, their share of the parameters, and
what one rank holds.

Counts come from the config (``num_local_experts``, ``num_experts``, ``n_routed_experts``,
``moe_num_experts``; shared experts from ``n_shared_experts``) and the parameter names of the sharded
model (a path component ``experts`` is a routed expert's, ``shared_expert(s)`` a shared one's), so
the share is what was really cut. Under expert-internal tensor parallelism every rank holds every
expert of its layers, each cut over tp; ``ep`` (expert parallelism: experts spread over ep ranks)
divides the experts per rank and is 1 until the engine takes it.
"""

from __future__ import annotations

import math

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
ROUTED, SHARED = "experts", ("shared_expert", "shared_experts")


def num_experts(config) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def _kind(name: str) -> str | None:
    parts = name.split(".")
    if any(p in SHARED for p in parts):
        return "shared"
    return "routed" if ROUTED in parts else None


def _layer(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[: parts.index(ROUTED)]) if ROUTED in parts else ""


def expert_lines(params, config, tp: int, ep: int = 1) -> list[str]:
    """Lines for ``shardformer plan``: ``params`` are the plan's ``(name, full shape, rank shape)``."""
    experts = num_experts(config)
    if not experts:
        return []
    if experts % ep:
        raise ValueError(f"ep={ep} does not divide the {experts} experts of a MoE layer")
    count = math.prod
    full = {"routed": 0, "shared": 0, None: 0}
    rank = {"routed": 0, "shared": 0, None: 0}
    moe_layers = set()
    for name, full_shape, rank_shape in params:
        kind = _kind(name)
        full[kind] += count(full_shape)
        rank[kind] += count(rank_shape) // (ep if kind == "routed" else 1)
        if kind == "routed":
            moe_layers.add(_layer(name))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    per_token = getattr(text, "num_experts_per_tok", None)
    shared = getattr(text, "n_shared_experts", None)
    total_full, total_rank = sum(full.values()), sum(rank.values())
    lines = [
        f"experts: {experts} routed per MoE layer"
        + (f" ({per_token} per token)" if per_token else "")
        + (f" + {shared} shared" if shared else "")
        + f", in {len(moe_layers)}"
        + (f" of {layers}" if layers else "")
        + " layers",
        f"  routed experts' parameters: {full['routed']:,} of {total_full:,} unsharded "
        f"({full['routed'] / max(total_full, 1):.1%}); {rank['routed']:,} of {total_rank:,} per rank "
        f"({rank['routed'] / max(total_rank, 1):.1%})",
    ]
    if full["shared"]:
        lines.append(f"  shared experts' parameters: {full['shared']:,} unsharded, {rank['shared']:,} per rank")
    cut = f", each cut over tp={tp} (expert-internal tensor parallelism)" if tp > 1 else ", whole"
    spread = f" (1/{ep} of them: ep={ep})" if ep > 1 else ""
    lines.append(f"  per rank: {experts // ep} experts of each MoE layer{spread}{cut}")
    return lines
