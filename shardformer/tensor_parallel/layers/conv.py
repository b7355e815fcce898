"""Convolutions cut over channels, Megatron-style: a column conv writes this rank's output channels, the
per-channel work after it (batch norms, activations, depthwise and grouped convs) runs on those channels
alone, and a row conv reads them and all-reduces its partial sums (its bias added once, after the sum).

Each layer keeps the module it replaces (its class, its other attributes, its state-dict names): the
weight and bias are swapped for this rank's shards and the class for a subclass whose forward adds the
collective, so a convolution with its own forward (timm's padded or weight-standardised ones) keeps it
where that is exact (a column: each output channel is computed on its own).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from shardformer.core.comm import group_rank, group_size, reduce_from_parallel
from shardformer.core.shard_spec import make_shard_param
from shardformer.tensor_parallel.regions import copy_to_parallel
from shardformer.tensor_parallel.slicer import Slicer

PLAIN_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _cut(module: nn.Module, process_group, dim: int, bias: bool) -> Slicer:
    """``module``'s weight (and bias, if ``bias``) replaced by this rank's shard along ``dim``."""
    slicer = Slicer(group_rank(process_group), group_size(process_group))
    module.weight = make_shard_param(module.weight, slicer.spec(module.weight.shape, dim))
    if bias and module.bias is not None:
        module.bias = make_shard_param(module.bias, slicer.spec(module.bias.shape, 0))
    return slicer


@functools.cache
def _subclass(mixin: type, base: type) -> type:
    return type(f"{mixin.__name__}{base.__name__}", (mixin, base), {})


class ConvColumn:
    """Output channels cut: ``y_r = conv(x, W_r) + b_r``; no collective forward, the input gradient
    all-reduced backward (the input is whole on every rank)."""

    process_group = None

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        if module.groups != 1:
            raise ValueError(f"a column convolution reads every input channel (groups=1), not groups={module.groups}")
        _cut(module, process_group, 0, bias=True)
        module.out_channels //= group_size(process_group)
        module.__class__ = _subclass(cls, type(module))
        module.process_group = process_group
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_parallel(x, self.process_group))


class ConvRow:
    """Input channels cut: ``y = sum_r conv(x_r, W_r) + b``, one all-reduce forward, none backward. Only
    torch's own convolutions: a subclass's forward may read the weight across input channels."""

    process_group = None

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        if type(module) not in PLAIN_CONVS or module.groups != 1:
            raise ValueError(f"a row convolution is torch's own with groups=1, not {type(module).__name__}")
        _cut(module, process_group, 1, bias=False)
        module.in_channels //= group_size(process_group)
        module.__class__ = _subclass(cls, type(module))
        module.process_group = process_group
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(self._conv_forward(x, self.weight, None), self.process_group)
        if self.bias is None:
            return y
        return y + self.bias.view(-1, *(1,) * (y.dim() - 2))


class ConvGroups:
    """A grouped convolution (depthwise: one group per channel) between a column and a row: each rank
    runs its own groups on its own channels, no collective."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        tp = group_size(process_group)
        if module.groups % tp:
            raise ValueError(f"{module.groups} groups do not split over tensor_parallel_size={tp}")
        _cut(module, process_group, 0, bias=True)
        module.in_channels, module.out_channels, module.groups = (
            module.in_channels // tp,
            module.out_channels // tp,
            module.groups // tp,
        )
        return module
