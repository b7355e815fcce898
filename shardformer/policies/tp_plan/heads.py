"""Per-rank sizes a sharded attention (or MLP) reads, and fused projections cut block by block.

Read from the model itself: which head-count attributes a module's code reads (``self.X`` or
``self.config.X``, through the sharder's one reader), and the block layout of a fused projection from the config's head counts.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from shardformer.tensor_parallel.detect import attributes_read
from shardformer.tensor_parallel.policy import divide

# Sizes that count heads (or features made of heads): a rank runs 1/tp of them.
HEAD_COUNTS = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_heads",
    "n_kv_heads",
    "all_head_size",
)


KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def per_rank_count(name: str, value: int, tp: int, where: str) -> int:
    """A head count on one rank: ``value / tp``; key/value heads fewer than ranks are replicated, one per rank."""
    if name in KV_COUNTS and value < tp and tp % value == 0:
        return 1
    return divide(value, tp, where)


def per_rank_attributes(path: str, module: nn.Module, tp: int, groups: int | None = None) -> dict[str, object]:
    """``{dotted attribute: per-rank value}`` for the head counts ``module``'s code reads (the one
    reader: `shardformer.tensor_parallel.detect.attributes_read`). ``groups``: the query heads
    per key/value head on a rank when key/value heads are replicated (``num_key_value_groups``).

    A count read through ``self.config`` gets the module its own copy of the config holding the
    per-rank values (the model's config, shared with embeddings and heads, stays global).
    """
    read = attributes_read(type(module))
    reads = (lambda name: True) if read is None else read.__contains__
    attrs: dict[str, object] = {}
    for name in HEAD_COUNTS:
        value = getattr(module, name, None)
        if isinstance(value, int) and reads(name):
            attrs[f"{path}.{name}" if path else name] = per_rank_count(name, value, tp, f"{path}.{name}")
    if groups is not None and isinstance(getattr(module, "num_key_value_groups", None), int):
        attrs[f"{path}.num_key_value_groups" if path else "num_key_value_groups"] = groups
    via_config = [name for name in HEAD_COUNTS if read is not None and f"config.{name}" in read]
    config = getattr(module, "config", None)
    if via_config and config is not None:
        local = copy.copy(config)
        for name in via_config:
            setattr(local, name, per_rank_count(name, getattr(config, name), tp, f"config.{name} (read by {path})"))
        attrs[f"{path}.config" if path else "config"] = local
    return attrs


def replicated_kv(config, tp: int) -> bool:
    """Whether key/value heads are fewer than ranks (each rank then holds the one its queries use)."""
    sizes = head_sizes(config)
    return sizes is not None and sizes[1] < tp and tp % sizes[1] == 0


def head_sizes(config) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head dim) from a text config, or None if it has no heads."""
    try:
        heads = getattr(config, "num_attention_heads", None)
    except Exception:  # noqa: BLE001 - per-layer configs (Dots3 Note's) refuse a global head count: none to read
        return None
    if not isinstance(heads, int):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    try:
        head_dim = getattr(config, "head_dim", None)
        # 0 is no width (Glm5Next's: its latent attention rotates none), and no cause to guess one from the hidden
        # size, which would mark replicated projections as sized like its heads
        head_dim = head_dim if head_dim == 0 else head_dim or config.hidden_size // heads
    except Exception:  # noqa: BLE001 - per-layer configs refuse a global head_dim
        head_dim = None
    return heads, kv, head_dim


def check_heads(config, tp: int) -> None:
    """Query heads must split over tp; key/value heads split over it, or (fewer than ranks) replicate evenly."""
    sizes = head_sizes(config)
    if sizes is None:
        return
    heads, kv, _ = sizes
    divide(heads, tp, "num_attention_heads")
    if kv % tp and tp % kv:
        raise ValueError(
            f"num_key_value_heads={kv} neither divides by tensor_parallel_size={tp} nor divides it "
            f"(num_attention_heads={heads}): key/value heads are split over ranks, or replicated when fewer; "
            f"use a tensor_parallel_size that {kv} divides or that divides {kv}"
        )


def fused_blocks(name: str, module: nn.Linear, config) -> tuple[int, ...] | None:
    """The blocks of a fused projection whose forward splits its output in place:
    ``[Q | K | V]`` (sizes from the head counts) or ``[gate | up]`` (two halves). None: not fused."""
    out = module.out_features
    sizes = head_sizes(config)
    if sizes is not None and sizes[2] and "qkv" in name:
        heads, kv, head_dim = sizes
        if out == (heads + 2 * kv) * head_dim:
            return heads * head_dim, kv * head_dim, kv * head_dim
    if "gate_up" in name and out % 2 == 0:
        return out // 2, out // 2
    return None
