"""The ints a module's code reads that count heads or equal a cut width, and the values one rank holds
of them (divided by tp, or one head of fewer heads than ranks): what a cut makes per-rank beside the
weights. `.simulate` tries them in every subset; `.policy.DerivedPolicy` sets them.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap

import torch.nn as nn

from shardformer.tensor_parallel.detect import attributes_read, int_attributes, is_head_count, is_index
from shardformer.tensor_parallel.policy import divide as divide_by


def attribute_candidates(parent: nn.Module, widths: set[int], tp: int) -> list[str]:
    """Ints the parent's subtree reads in forward that count heads or equal a cut width (relative
    dotted names; ``config.X`` for the module's config)."""
    found = []
    for rel, module in parent.named_modules():
        read = attributes_read(type(module))
        prefix = f"{rel}." if rel else ""
        for name, value in int_attributes(module).items():
            counts = is_head_count(name) or (value in widths and not is_index(name))
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
                    and (is_head_count(name) or (value in widths and not is_index(name)))
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


def rebuilt_counts(block: nn.Module, divide) -> set[str]:
    """``parent.config.X`` for each count and width a cut module's class builds itself from, where its
    parent builds it again from ``self.config`` while running (BigBird's attention switches to full
    attention at short sequences: a new module from the config, holding the cut projections), so that
    the rebuilt module counts the rank's heads."""
    found = set()
    for dotted in divide:
        owner, _, name = dotted.rpartition(".")
        if owner == "config" or owner.endswith(".config") or not owner:
            continue
        module = block.get_submodule(owner)
        value, parent = getattr(module, name), owner.rpartition(".")[0]
        config = getattr(block.get_submodule(parent), "config", None)
        if config is None or not _builds_from_config(type(block.get_submodule(parent))):
            continue
        for field in _config_reads(type(module)) | {name}:
            # the count itself, a width equal to it, and the heads a width counts (its head size kept)
            if getattr(config, field, None) == value or (field in _config_reads(type(module)) and is_head_count(field)):
                found.add(f"{parent}.config.{field}".lstrip("."))
        # the module there now counts those heads too (it runs at other inputs: BigBird's block-sparse one)
        heads = {getattr(config, f.rpartition(".")[2]) for f in found if is_head_count(f.rpartition(".")[2])}
        found |= {f"{owner}.{n}" for n, v in int_attributes(module).items() if is_head_count(n) and v in heads}
    return found


@functools.cache
def _builds_from_config(cls: type) -> bool:
    """Whether a method of ``cls`` other than ``__init__`` calls something with ``self.config``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(
        isinstance(call, ast.Call) and any(_is_self_config(a) for a in call.args)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name != "__init__"
        for call in ast.walk(fn)
    )


def _is_self_config(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "config" and getattr(node.value, "id", None) == "self"


@functools.cache
def _config_reads(cls: type) -> frozenset[str]:
    """The ``config.X`` that ``cls.__init__`` reads (what a module built from a config takes from it)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and getattr(n.value, "id", None) == "config"
    )
