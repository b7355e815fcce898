"""The tiny copy a cut is derived on, and the inputs it runs on: the whole model's, or, for a sub-model
(a vision or audio tower a plan leaves whole), the ones the whole tiny model passes it."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from shardformer.core.inputs import make_inputs
from shardformer.policies.copies import instance_copy, two_blocks
from shardformer.policies.derived.simulate import record_calls


def has_config(model: nn.Module) -> bool:
    """A transformers model (a config to scale down), not a timm model or a plain module."""
    return hasattr(getattr(model, "config", None), "to_dict")


def tiny_with_inputs(model: nn.Module, tp: int, tower: str = "", heads: int | None = None, seed: int = 0):
    """The tiny copy of ``model`` (of its sub-model at ``tower``) and inputs for it (``seed``); for a model
    with no transformers config (timm, a plain module), the model itself with each repeated stack cut to
    two blocks (`shardformer.policies.copies`). A tower's inputs are the ones it receives in one forward
    of the whole tiny model (patches and their grid, an attention mask over images: what the wrapper
    computes), or, where that forward does not reach it, the recipe's inputs for the tower alone; None
    where those do not run it either (a token classifier's unused vision tower, an audio tower the
    recipe's inputs give no audio for)."""
    if not has_config(model):
        tiny = two_blocks(model).eval()
        return tiny, make_inputs(tiny, seed=seed)
    whole = instance_copy(model, tp, heads=heads)
    if not tower:
        return whole, make_inputs(whole, seed=seed)
    sub = whole.get_submodule(tower)
    try:
        recorded = _inputs_of(whole, tower, make_inputs(whole, seed=seed))
    except Exception:  # noqa: BLE001 - a wrapper the recipe cannot run: the tower's own inputs
        recorded = None
    if recorded is not None:
        return sub, recorded
    try:
        alone = make_inputs(sub, seed=seed)
    except Exception:  # noqa: BLE001 - no inputs for the tower alone: it is not run
        return sub, None
    return sub, alone if runs(sub, alone) else None


def _inputs_of(whole: nn.Module, tower: str, inputs: dict) -> dict | None:
    """The keyword arguments the module at ``tower`` is first called with in ``whole(**inputs)``."""
    seen = record_calls(whole, [tower], inputs).get(tower)
    if seen is None:
        return None
    args, kwargs, _ = seen
    bound = inspect.signature(whole.get_submodule(tower).forward).bind_partial(*args, **kwargs).arguments
    extra = bound.pop("kwargs", None)  # a **kwargs parameter binds as one dict
    return bound | (extra if isinstance(extra, dict) else {})


def runs(model: nn.Module, inputs: dict) -> bool:
    """Whether ``model`` itself (in eval mode, its modes restored) runs on ``inputs``; not on the meta device."""
    if any(t.device.type == "meta" for t in model.parameters()):
        return False
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.no_grad():
            model.eval()(**inputs)
        return True
    except Exception:  # noqa: BLE001 - any failure: the inputs, not the cut
        return False
    finally:
        for module, mode in modes.items():
            module.training = mode
