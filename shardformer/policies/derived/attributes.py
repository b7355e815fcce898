"""The ints a module's code reads that count heads or equal a cut width, and the values one rank holds
of them (divided by tp, or one head of fewer heads than ranks): what a cut makes per-rank beside the
weights. `.simulate` tries them in every subset; `.policy.DerivedPolicy` sets them.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from shardformer.tensor_parallel.detect import attributes_read, int_attributes, is_head_count
from shardformer.tensor_parallel.policy import divide as divide_by


def attribute_candidates(parent: nn.Module, widths: set[int], tp: int) -> list[str]:
    """Ints the parent's subtree reads in forward that count heads or equal a cut width (relative
    dotted names; ``config.X`` for the module's config)."""
    found = []
    for rel, module in parent.named_modules():
        read = attributes_read(type(module))
        prefix = f"{rel}." if rel else ""
        for name, value in int_attributes(module).items():
            counts = is_head_count(name) or value in widths
            if (read is None or name in read) and value > 1 and splits_over(name, value, tp) and counts:
                found.append(prefix + name)
        config = getattr(module, "config", None)
        if config is not None and read is not None and rel == "":
            for name in sorted(r[7:] for r in read if r.startswith("config.")):
                value = getattr(config, name, None)
                if (
                    type(value) is int
                    and value > 1
                    and splits_over(name, value, tp)
                    and (is_head_count(name) or value in widths)
                ):
                    found.append(f"config.{name}")
    return found


def splits_over(name: str, value: int, tp: int) -> bool:
    """``value`` splits over tp, or counts fewer heads than ranks (replicated: one per rank)."""
    return value % tp == 0 or (is_head_count(name) and tp % value == 0)


def per_rank_value(name: str, value: int, tp: int, where: str) -> int:
    """The count or width one rank holds: ``value / tp``, or one head of fewer heads than ranks."""
    if value % tp and is_head_count(name) and tp % value == 0:
        return 1
    return divide_by(value, tp, where)


def per_rank_attributes(root: nn.Module, names, tp: int) -> dict[str, object]:
    """``{dotted path below root: per-rank value}`` for each named int of ``root``'s subtree divided
    by ``tp``; a count read as ``config.X`` gives its module a copy of the config (``module.config``)."""
    values: dict[str, object] = {}
    for dotted in sorted(names):
        owner, _, name = dotted.rpartition(".")
        if owner == "config" or owner.endswith(".config"):
            module_path = owner[: -len("config")].rstrip(".")
            local = values.setdefault(owner, copy.copy(root.get_submodule(module_path).config))
            setattr(local, name, per_rank_value(name, getattr(local, name), tp, dotted))
        else:
            values[dotted] = per_rank_value(name, getattr(root.get_submodule(owner), name), tp, dotted)
    return values


def apply_attributes(root: nn.Module, names, tp: int) -> None:
    for dotted, value in per_rank_attributes(root, names, tp).items():
        owner, _, name = dotted.rpartition(".")
        setattr(root.get_submodule(owner), name, value)
