"""The inputs a user gives for a model the recipe cannot feed (``ShardConfig.example_inputs``), and the
float features inferred where a plain module's first operation makes the shape plain.

The example inputs ride on the model (an attribute its deep copies keep: the two-block copies that derive
and prove its cut are copies of the instance), and are part of the instance's key, so no verdict proven
on other inputs is reused."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

ATTRIBUTE = "_shardformer_example_inputs"
SIDE = 16  # the inferred images' height and width (and a 1-d or 3-d convolution's lengths)


def pass_them(names: list[str]) -> str:
    """The fix that names the argument, for a forward whose inputs ``names`` the recipe cannot make."""
    given = ", ".join(f"'{name}': tensor" for name in names)
    return (
        f"pass the forward's inputs as example_inputs: shard_model(model, ShardConfig(..., example_inputs={{{given}}})) "
        f"or EngineConfig(..., example_inputs=...) (a dict of keyword arguments or a tuple of positional ones; a "
        f"small batch does)"
    )


def give_example_inputs(model: nn.Module, inputs) -> None:
    """Put ``inputs`` (a dict of keyword arguments or a tuple of positional ones; None: nothing) on
    ``model`` as keyword arguments of its forward; a TypeError names the forward's parameters when
    they do not bind."""
    if inputs is None:
        return
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(**inputs) if isinstance(inputs, dict) else signature.bind(*inputs)
    except TypeError as e:
        raise TypeError(
            f"example_inputs do not fit {type(model).__name__}.forward{signature}: {e}; give a dict of its keyword "
            f"arguments or a tuple of its positional ones"
        ) from None
    if any(signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL for name in bound.arguments):
        raise TypeError(
            f"example_inputs fill {type(model).__name__}.forward{signature}'s *args, which shardformer cannot "
            f"pass by name; give a forward with named parameters"
        )
    kwargs = dict(bound.arguments)
    kwargs.update(kwargs.pop(_var_keyword(signature), None) or {})  # **kwargs binds as one dict
    setattr(model, ATTRIBUTE, kwargs)


def _var_keyword(signature: inspect.Signature) -> str | None:
    return next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def given_inputs(model: nn.Module, batch: int) -> dict | None:
    """The example inputs ``model`` carries (None: none given), with the batch cut (or repeated) to
    ``batch`` where the batch dimension is plain: the first dimension of every tensor is one size, and
    no tensor has that size anywhere else (a square mask over a sequence-first input: left as given)."""
    given = getattr(model, ATTRIBUTE, None)
    if given is None:
        return None
    tensors = [v for v in given.values() if torch.is_tensor(v) and v.dim() > 0]
    lead = {t.shape[0] for t in tensors}
    plain = len(lead) == 1 and all(t.shape[1:].count(t.shape[0]) == 0 for t in tensors)
    rows = torch.arange(batch) % next(iter(lead)) if plain else None
    return {k: _rows(v, rows) for k, v in given.items()}


def _rows(value, rows: torch.Tensor | None):
    if not torch.is_tensor(value):
        return value
    return value.clone() if rows is None or value.dim() == 0 else value[rows].clone()  # the user's stay untouched


def key(model: nn.Module) -> tuple:
    """What the example inputs add to the instance's key: each one's name, shape, dtype and sum."""
    given = getattr(model, ATTRIBUTE, None) or {}
    return tuple(
        (k, tuple(v.shape), str(v.dtype), None if v.is_meta else float(v.double().sum()))
        if torch.is_tensor(v)
        else (k, repr(v))
        for k, v in sorted(given.items())
    )


def inferred_features(model: nn.Module, batch: int, seq: int, g: torch.Generator) -> torch.Tensor | None:
    """Float inputs for a plain module whose first module holding weights (in the order it registers them)
    is a Linear (``[batch, seq, in_features]``) or a convolution (``[batch, in_channels, 16, ...]``); None
    for any other (nn.MultiheadAttention holds its input projection itself: its inputs' layout is not plain)."""
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Linear):
        return torch.randn(batch, seq, first.in_features, generator=g)
    if isinstance(first, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        spatial = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(first)]
        return torch.randn(batch, first.in_channels, *[SIDE] * spatial, generator=g)
    return None
