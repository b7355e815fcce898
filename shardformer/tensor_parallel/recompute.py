"""Activation checkpointing that recomputes exactly: the tensor-parallel dropout masks are replayed.

``torch.utils.checkpoint`` restores the global RNG before it recomputes a layer, but the seeded
dropout layers of a sharded model draw from their own generators (so tp ranks agree on replicated
activations): recomputed naively, they would draw fresh masks, and the gradients would belong to
a different forward. Here each checkpointed call remembers the generator states its dropouts had
when the forward ran, and the recompute runs from those states (then puts the later states back),
as Megatron-LM's checkpoint does with its RNG tracker.

Two ways in: ``model.gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()`` on a
sharded transformers model (the sharder installs `replay_in_hf_checkpointing`), and
`checkpoint_layers` for any list of layers (timm, custom models); `checkpoint_activations`
picks one of the two for the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from shardformer.tensor_parallel.detect import call_optional
from shardformer.tensor_parallel.layers.dropout import SeededDropout


def seeded_dropouts(module: nn.Module) -> list[SeededDropout]:
    return [m for m in module.modules() if isinstance(m, SeededDropout)]


def replaying(function: Callable, dropouts: list[SeededDropout]) -> Callable:
    """``function`` whose second and later calls (the recompute) see the dropout RNG of the first."""
    first: list | None = None

    def run(*args, **kwargs):
        nonlocal first
        if first is None:
            first = [d.rng_snapshot() for d in dropouts]
            return function(*args, **kwargs)
        later = [d.rng_snapshot() for d in dropouts]
        for d, state in zip(dropouts, first):
            d.rng_restore(state)
        try:
            return function(*args, **kwargs)
        finally:
            for d, state in zip(dropouts, later):
                d.rng_restore(state)

    return run


def checkpoint_replaying(checkpoint_func: Callable, dropouts: list[SeededDropout], function, *args, **kwargs):
    """``checkpoint_func(function, *args)`` with the dropout masks replayed in the recompute."""
    if not dropouts:
        return checkpoint_func(function, *args, **kwargs)
    return checkpoint_func(replaying(function, dropouts), *args, **kwargs)


def _wrap_hf_funcs(model: nn.Module) -> None:
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None and not (isinstance(func, partial) and func.func is checkpoint_replaying):
            module._gradient_checkpointing_func = partial(checkpoint_replaying, func, seeded_dropouts(module))


def replay_in_hf_checkpointing(model: nn.Module) -> None:
    """Make transformers' activation checkpointing on ``model`` replay the seeded dropout masks,
    whether it was enabled before sharding or is enabled later."""
    original = getattr(model, "_set_gradient_checkpointing", None)
    if original is None:
        return  # not a transformers model

    # An instance attribute shadows PreTrainedModel's method; same parameters, so transformers
    # still takes its current (not the legacy ``value=``) path.
    def _set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint, every_n_layers=1):
        original(enable=enable, gradient_checkpointing_func=gradient_checkpointing_func, every_n_layers=every_n_layers)
        _wrap_hf_funcs(model)

    object.__setattr__(model, "_set_gradient_checkpointing", _set_gradient_checkpointing)
    _wrap_hf_funcs(model)


def checkpoint_layers(layers: Iterable[nn.Module], use_reentrant: bool = False) -> None:
    """Recompute each layer's forward in backward (its activations are not kept), replaying its
    dropout masks. The forward is replaced on the instance: parameter names do not change."""
    func = partial(checkpoint, use_reentrant=use_reentrant)
    for layer in layers:
        if layer is None or "forward" in layer.__dict__:
            continue  # off this pipeline stage, or already wrapped
        forward, dropouts = layer.forward, seeded_dropouts(layer)

        def checkpointed(*args, _forward=forward, _dropouts=dropouts, _layer=layer, **kwargs):
            if not _layer.training:
                return _forward(*args, **kwargs)
            return checkpoint_replaying(func, _dropouts, partial(_forward, **kwargs), *args)

        layer.forward = checkpointed


def checkpoint_activations(model: nn.Module, layers: str | None, check_only: bool = False) -> None:
    """What the engine's ``activation_checkpointing`` turns on: transformers models use their own
    per-layer checkpointing (the sharder made it replay the dropout masks); other models get their layer
    stack at path ``layers`` wrapped, and are refused without one. ``check_only``: refuse, change nothing."""
    if getattr(model, "supports_gradient_checkpointing", False):
        if not check_only:  # transformers 5.23 renamed gradient_checkpointing_enable
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            if call_optional(model, "get_input_embeddings") is not None:
                enable()
                return
            # a later pipeline stage: no embedding to hook (transformers would log that it "does not
            # expose input embeddings"), and its input arrives from the previous stage requiring grad
            model.enable_input_require_grads = lambda: None
            try:
                enable()
            finally:
                del model.enable_input_require_grads
    elif layers is not None:
        if not check_only:
            checkpoint_layers(model.get_submodule(layers))
    else:
        raise ValueError(
            f"activation_checkpointing: {type(model).__name__} has no transformers checkpointing and no "
            f"pipeline spec naming its layers; pass pipeline=PipelineSpec(layers=..., ...) to ParallelEngine"
        )


def recomputed_modules(model: nn.Module, layers: str | None) -> list[str]:
    """The paths of the modules whose forward `checkpoint_activations` runs again in the backward: in a
    transformers model, its checkpointing layers (``GradientCheckpointingLayer``), and the modules carrying
    transformers' ``gradient_checkpointing`` flag with none of those inside (an older stack that checkpoints
    the blocks it loops over); else the layer stack at ``layers``."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return [layers] if layers is not None else []
    flagged = [(path, m) for path, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]
    layer_kind = [path for path, m in flagged if _checkpointing_layer(m)]
    return layer_kind + [
        path
        for path, m in flagged
        if not _checkpointing_layer(m) and not any(_checkpointing_layer(inner) for inner in m.modules())
    ]


def _checkpointing_layer(module: nn.Module) -> bool:
    # by name: transformers' GradientCheckpointingLayer (modeling_layers, 4.52+) runs its own call checkpointed
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)
