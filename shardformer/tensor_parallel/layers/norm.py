"""A LayerNorm over features that are split over tensor-parallel ranks.

EVA-02 (base, large) normalizes its MLP's hidden features between the cut column projections and the
row projection (timm's ``SwiGLU`` with ``norm_layer``): each rank holds ``1/tp`` of those features,
and the norm's mean and variance are over all of them. Each rank sums its part (two all-reduces of
one number per token: the mean, then the variance around it) and normalizes its own features with
its slice of the weight and bias. The sums are all-reduced in both directions (every rank's output
depends on every rank's features), so the gradients are the whole norm's. `NormOverRanks` does the
same for a gated RMS norm whose one group spans the ranks (Mamba-2 with one group), as it is written.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from shardformer.core.comm import all_reduce, group_rank, group_size
from shardformer.tensor_parallel.slicer import Slicer


def splits_features(module: nn.Module) -> bool:
    """A LayerNorm this layer can stand in for: over one dimension, with a weight (and maybe a bias)."""
    return (
        isinstance(module, nn.LayerNorm)
        and len(module.normalized_shape) == 1
        and module.elementwise_affine
        and not list(module.children())
    )


class _SumOverRanks(torch.autograd.Function):
    """The sum over ranks, in the forward and (every rank's output reads it) in the backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


def _sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOverRanks.apply(x, group)


def normalize(x, weight, bias, eps: float, size: int, total) -> torch.Tensor:
    """LayerNorm of ``x``'s features (a part of ``size`` features) with ``total`` summing over the parts."""
    dtype = x.dtype
    x = x.float()
    mean = total(x.sum(dim=-1, keepdim=True)) / size
    centred = x - mean
    var = total(centred.square().sum(dim=-1, keepdim=True)) / size
    out = centred * torch.rsqrt(var + eps) * weight.float()
    return (out if bias is None else out + bias.float()).to(dtype)


class SplitLayerNorm(nn.Module):
    """LayerNorm of features split over the ranks of ``process_group`` (see the module's text)."""

    def __init__(self, module: nn.LayerNorm, process_group=None) -> None:
        super().__init__()
        slicer = Slicer(group_rank(process_group), group_size(process_group))
        self.process_group, self.eps, self.size = process_group, module.eps, module.normalized_shape[0]
        self.weight = slicer.column_bias(module.weight)
        self.bias = None if module.bias is None else slicer.column_bias(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(
            x, self.weight, self.bias, self.eps, self.size, lambda t: _sum_over_ranks(t, self.process_group)
        )

    @classmethod
    def from_native(cls, module: nn.LayerNorm, process_group=None, **_) -> SplitLayerNorm:
        return cls(module, process_group)


def is_mean_over_last(func, args, kwargs) -> bool:
    """Whether a torch function call takes the mean over its tensor's last dimension."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return func in (torch.Tensor.mean, torch.mean) and torch.is_tensor(args[0]) and dim in (-1, args[0].dim() - 1)


class _MeanOverRanks(TorchFunctionMode):
    """Means over the last dimension taken over every rank's equal part of it (all-reduced both ways)."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_mean_over_last(func, args, kwargs):
            return _sum_over_ranks(out, self.group) / group_size(self.group)
        return out


def _forward_over_ranks(module: nn.Module, *args, group, **kwargs):
    with _MeanOverRanks(group):
        return type(module).forward(module, *args, **kwargs)


class NormOverRanks:
    """A policy layer for a gated RMS norm whose one group of channels spans the ranks (a Mamba-2
    mixer with ``n_groups=1``: each rank holds ``1/tp`` of the heads it normalises together). The norm
    runs as written on this rank's channels, its group size (``width``, set on the subclass
    `norm_over_ranks_layer` makes) made this rank's share, and its variance, a mean over the last
    dimension, is the mean of the ranks' means: one all-reduce of one number per token, both ways."""

    width = 0

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        tp = group_size(process_group)
        if tp > 1:
            if getattr(module, "group_size", None) == cls.width:
                module.group_size = cls.width // tp
            bound = functools.partial(_forward_over_ranks, group=process_group)
            module.forward = types.MethodType(bound, module)  # a bound method: copies keep it
        return module


def norm_over_ranks_layer(width: int) -> type[NormOverRanks]:
    return type("NormOverRanks", (NormOverRanks,), {"width": width})
