"""Stacks a route leaves whole: handed to the derived route, or refused.

A vision-language model's tp plan covers its language model only: the vision tower (LLaVA's CLIP,
Gemma 3's SigLIP) would stay whole on every rank without a word. After a route has chosen its
layers, every stack of repeated blocks with no cut layer inside is found; each sits in a sub-model
of its own (a ``PreTrainedModel`` with its own config), which the derived route cuts, and which
``shard_model`` proves on a tiny copy of that sub-model before use. A stack with no such sub-model
around it is refused, naming it. (``DerivedPolicy.cut_tower`` cuts one.)
"""

from __future__ import annotations

import torch.nn as nn

from shardformer.policies.derived.blocks import repeated_blocks
from shardformer.policies.derived.derive import NotDerivableError


def _is_sub_model(module: nn.Module) -> bool:
    return getattr(module, "config", None) is not None and hasattr(module, "post_init")


def uncovered_blocks(model: nn.Module, cut_paths, idle=()) -> list[str]:
    """Blocks of the repeated stacks with no path of ``cut_paths`` inside any of their blocks (a
    stack the route leaves whole; a hybrid's mamba or conv layers between cut attention layers are
    the route's choice), leaving out blocks listed in ``idle`` (they never run)."""
    cut = list(cut_paths)
    stacks: dict[str, list[str]] = {}
    for block in repeated_blocks(model):
        stacks.setdefault(block.rpartition(".")[0], []).append(block)
    whole = []
    for blocks in stacks.values():
        if not any(p.startswith(b + ".") for b in blocks for p in cut):
            whole += [b for b in blocks if b not in idle]
    return whole


def towers(model: nn.Module, cut_paths) -> list[str]:
    """The sub-models holding the stacks ``cut_paths`` leave whole (the innermost ``PreTrainedModel``
    around each, with nothing cut inside it); NotDerivableError for a stack with none."""
    cut = list(cut_paths)
    modules = dict(model.named_modules())
    found: list[str] = []
    for block in uncovered_blocks(model, cut):
        parts = block.split(".")
        owner = None
        for depth in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:depth])
            if _is_sub_model(modules[path]):
                owner = path
                break
        if owner is None or any(p.startswith(owner + ".") for p in cut):
            raise NotDerivableError(
                f"{block} ({type(modules[block]).__name__}) is a repeated block that the "
                f"{'plan' if cut else 'route'} leaves whole, and it sits in no sub-model of its own "
                f"to derive a cut for; shardformer does not leave a stack unsharded without a word"
            )
        if owner not in found:
            found.append(owner)
    return found
