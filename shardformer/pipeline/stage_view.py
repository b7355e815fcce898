"""Running a pipeline stage through the model's own public forward.

A stage holds only its layers and the modules of its ends (`PipelineSpec.keep_stage` sets the
others to None). While a stage runs, `stage_view` fills those holes: the layers of other
stages become pass-throughs (layer indices stay global, as per-layer attention types need), the
modules this stage dropped become identities, and the stage's ``stand_ins`` take given places (on a
later stage, the module whose output the first stage hands on answers with the hidden states this
stage received). The model's own forward (or its base model's) then runs the stage: masks, position
ids and the head's loss come out as the model computes them, with nothing of its internals copied.

`own_forward` is that forward without a second call of the model: a stage runs inside the
engine's call of the model (FSDP2's root hooks), or beside it, and the model's hooks stay out of it.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn as nn

from shardformer.core.record import sharding_of
from shardformer.pipeline.skeleton import Identity, StandIn, skeleton_of


class PassThrough(StandIn):
    """Stands in for another stage's layer: returns the hidden states unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class Returns(StandIn):
    """Stands in for a module whose output this stage already has (the hidden states it received):
    whatever it is called with, it answers with that output."""

    def __init__(self, output) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output


def own_forward(model: nn.Module):
    """``model``'s class forward, bound to it: the model's forward without its ``__call__`` hooks (and
    without a forward the engine set on the instance to route FSDP2's root call through the stage)."""
    return type(model).forward.__get__(model)


def taken_inputs(forward, inputs: dict) -> dict:
    """The inputs ``forward`` takes by name (all of them where it takes ``**kwargs``): the others (a
    ``loss_fn``'s targets beside a timm model's ``x``) are for the loss only."""
    params = inspect.signature(forward).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return inputs
    return {k: v for k, v in inputs.items() if k in params}


def _holes(model: nn.Module) -> dict[str, nn.Module]:
    """{path: stand-in} for the modules this stage does not hold."""
    info = sharding_of(model)
    spec = info.pipeline
    if spec is None:  # never cut into stages: every module is here
        return {}
    holes: dict[str, nn.Module] = {path: PassThrough() for path in spec.layer_paths(model) if _absent(model, path)}
    for path in spec.dropped(model, info.layers):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if name in parent._modules:  # a parameter (timm's cls_token) is read by no forward of this stage
            holes[path] = Identity()
    return holes


def _absent(model: nn.Module, path: str) -> bool:
    parent_path, _, name = path.rpartition(".")
    return model.get_submodule(parent_path)._modules[name] is None


@contextmanager
def stand_in(model: nn.Module, modules: dict[str, nn.Module | torch.Tensor]):
    """``modules`` at their paths in ``model`` while the block runs (parameter names do not change); a
    tensor stands in for a parameter (the zeros a later stage reads for timm's ``cls_token``)."""
    kept = []
    try:
        for path, module in modules.items():
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            slots = parent._parameters if torch.is_tensor(module) else parent._modules  # None: a hidden module
            kept.append((slots, name, slots[name]))
            skeleton = skeleton_of(model, path) if isinstance(module, StandIn) else None
            if skeleton is not None and "skeleton" not in module.__dict__:
                module.__dict__["skeleton"] = skeleton  # not a submodule: the stage's parameters stay its own
                module.__dict__["path"] = path
            slots[name] = module
        yield
    finally:
        for slots, name, module in reversed(kept):
            slots[name] = module


@contextmanager
def stage_view(model: nn.Module, stand_ins: dict[str, nn.Module | torch.Tensor] | None = None):
    """The stage's model as a whole model while the block runs: other stages' layers as pass-throughs,
    the modules this stage dropped as identities, and ``stand_ins`` at their paths."""
    with stand_in(model, {**_holes(model), **(stand_ins or {})}):
        yield
