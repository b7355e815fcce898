"""A LayerNorm over features that are split over tensor-parallel ranks.

EVA-02 (base, large) normalizes its MLP's hidden features between the cut column projections and the
row projection (timm's ``SwiGLU`` with ``norm_layer``): each rank holds ``1/tp`` of those features,
and the norm's mean and variance are over all of them. Each rank sums its part (two all-reduces of
one number per token: the mean, then the variance around it) and normalizes its own features with
its slice of the weight and bias. The sums are all-reduced in both directions (every rank's output
depends on every rank's features), so the gradients are the whole norm's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

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
