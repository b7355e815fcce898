"""The stage forward of a model that is not split (pp=1) and has no pipeline spec: the model's own
forward; and which stage forward a batch runs (a batch of ``inputs_embeds`` runs the model's own)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch.nn as nn

from shardformer.pipeline.stage_view import taken_inputs


def whole_model_forward(model: nn.Module, hidden, inputs: dict):
    """The stage forward of an unsplit model (pp=1) that has no pipeline spec: its own forward, given
    the inputs it takes (a timm model's ``x``, not the ``loss_fn``'s targets), in training without a KV
    cache (a recomputed layer would find its keys already in the cache: CpmAnt, GPT-NeoX-Japanese under
    activation checkpointing), as the pipeline stages run."""
    inputs = taken_inputs(type(model).forward, inputs)
    if model.training and "use_cache" not in inputs and "use_cache" in inspect.signature(model.forward).parameters:
        inputs = {**inputs, "use_cache": False}
    return model(**inputs)


def forward_for_batch(batch: dict, stage_forward: Callable, pp: int) -> Callable:
    """The stage forward for ``batch``: ``stage_forward``, but a pipeline spec's forward embeds ``input_ids``
    itself, so a batch of ``inputs_embeds`` runs the model's own forward (pp=1) or is refused (pp > 1)."""
    embeds = sorted(k for k, v in batch.items() if k.endswith("inputs_embeds") and v is not None)
    if not embeds:
        return stage_forward
    both = [k for k in embeds if batch.get(k.replace("inputs_embeds", "input_ids")) is not None]
    if both:
        ids = both[0].replace("inputs_embeds", "input_ids")
        raise ValueError(
            f"the batch holds both {ids} and {both[0]}; pass only one of them (the model itself refuses both)"
        )
    if pp > 1:
        raise ValueError(
            f"the batch holds {embeds[0]} at pipeline_parallel_size={pp}: the first stage "
            f"embeds input_ids itself; pass input_ids, or run at pipeline_parallel_size=1, where the model's "
            f"own forward takes {embeds[0]}"
        )
    return whole_model_forward
