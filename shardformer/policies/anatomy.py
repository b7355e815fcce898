"""A model's anatomy, found in one place: its repeated layer stack(s), what runs before them
(embeddings), what runs after them (final norm, head) and the final norm.

Every technique that works on the layer stack reads it from here: pipeline stages, sequence
parallelism, context parallelism (`stack_anatomy`), activation checkpointing and ZeRO-3's
per-layer wrapping. Three sources, first that
answers wins:

1. the model's family record (`shardformer.models`: ``layers``, ``final_norm``);
2. transformers' ``base_model_pp_plan`` (`shardformer.pipeline.from_plan`);
3. the structure: the stacks the derived route finds (`shardformer.policies.derived.blocks.repeated_blocks`),
   one ``ModuleList`` of blocks of one class per stack.

The stacks need only the module tree. What runs before and after a stack is read off one forward of
a tiny copy (`ends_of`: the order in which modules start and finish around the stack), cached
per class and architecture; it is what the pipeline split and the structural final norm need.
"""

from __future__ import annotations

import torch.nn as nn

from shardformer.context_parallel.anatomy import StackAnatomy
from shardformer.core.study_memo import once_per_study
from shardformer.pipeline.from_plan import final_norm_from_pp_plan, spec_from_pp_plan
from shardformer.policies.anatomy_ends import AnatomyError, ends_of, tiny_for
from shardformer.policies.copies import copy_key
from shardformer.policies.derived.blocks import repeated_blocks


def _models():
    import shardformer.models as models  # the records import this package: read them when asked

    return models


@once_per_study
def stacks(model: nn.Module) -> tuple[str, ...]:
    """Paths of ``model``'s repeated layer stacks: the family's or the pp plan's one stack, else every
    ``ModuleList`` / ``Sequential`` the structure finds (one for a decoder or an encoder, two for an
    encoder-decoder, one per tower), outermost first in module order."""

    family = _models().family_of(model)
    if family is not None:
        return (family.layers_path(model),)
    spec = spec_from_pp_plan(model)
    if spec is not None:
        return (spec.layers,)
    found: list[str] = []
    for block in repeated_blocks(model):
        parent = block.rpartition(".")[0]
        if parent not in found:
            found.append(parent)
    return tuple(found)


def layer_stack(model: nn.Module) -> str | None:
    """The path of ``model``'s one layer stack, or None when it has none or several (an encoder-decoder,
    two towers: each technique that needs one stack says so)."""
    return one_stack(stacks(model))


def one_stack(found: tuple[str, ...]) -> str | None:
    """The stack of ``found`` when there is exactly one, else None."""
    return found[0] if len(found) == 1 else None


def final_norm(model: nn.Module, structural: bool = True) -> str | None:
    """The path of the norm ``model`` applies to its layer stack's output before anything else reads it:
    the family's, else the pp plan's, else (``structural``) the first module after the stack in a forward
    of a tiny copy when it is a norm (sequence parallelism uses it only for a per-token norm, and checks
    what it reads at run time); None when none is found."""

    family = _models().family_of(model)
    if family is not None:
        return family.final_norm_path(model)
    if spec_from_pp_plan(model) is not None:
        return final_norm_from_pp_plan(model)
    layers = layer_stack(model)
    if not structural or layers is None:
        return None
    try:
        return ends_of(model, layers).final_norm
    except AnatomyError:
        return None


def stack_anatomy(model: nn.Module) -> StackAnatomy:
    """What context parallelism reads of ``model``'s anatomy: its stacks, what runs after its one stack
    (read off a tiny copy when asked, `ends_of`), and how to build that copy."""
    found = stacks(model)
    return StackAnatomy(found, lambda: ends_of(model, found[0]).after, lambda: tiny_for(model), copy_key(model, 1))
