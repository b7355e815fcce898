"""The cut halves of a LoRA adapter (``y += B(A(x)) * scaling``) beside a parallel base layer.

A column-parallel base computes this rank's output features from the whole input: its adapter keeps
``A`` whole and cuts ``B`` by output features exactly as the base's weight is cut (fused blocks,
replicated key/value heads), so each rank adds its own slice of ``B(A(x))``. A row-parallel base
computes a partial sum from this rank's input features: its adapter cuts ``A`` by input features,
and ``A_r x_r`` is a partial sum of ``A x`` too, so it is all-reduced (``r`` numbers per token)
before the whole ``B`` runs on it.

Both halves are ``nn.Linear``-like modules (``weight``, ``bias`` None, ``in_features``,
``out_features``: local sizes) that PEFT's LoRA layer calls and merges unchanged, since
``B_r @ A`` (column) and ``B @ A_r`` (row) are this rank's slices of the full ``B @ A``. They load a
state dict holding the full tensor (a saved adapter) by cutting it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardformer.core.comm import reduce_from_parallel
from shardformer.core.shard_spec import ShardSpec, make_shard_param, shard_spec, slice_tensor
from shardformer.tensor_parallel.regions import copy_to_parallel, sum_replicas


class _LoraHalf(nn.Module):
    """One cut half: a weight ``[out, in]`` tagged with its ShardSpec, no bias."""

    def __init__(self, weight: nn.Parameter, process_group) -> None:
        super().__init__()
        self.weight, self.bias, self.process_group = weight, None, process_group
        self.out_features, self.in_features = weight.shape

    @classmethod
    def cut(cls, full: nn.Module, base_spec: ShardSpec, dim: int, process_group):
        """This rank's half from PEFT's full ``nn.Linear`` half, cut along ``dim`` like the base's
        weight was cut along its ``base_spec.dim`` (the same blocks, padding and replicas)."""
        if getattr(full, "bias", None) is not None:
            raise ValueError("a LoRA half with a bias (lora_bias=True) cannot be cut; set lora_bias=False")
        spec = dataclasses.replace(base_spec, dim=dim)
        weight = make_shard_param(full.weight, spec)
        if spec.splits and weight.requires_grad:  # pieces held by several ranks: gradients summed
            weight.register_hook(functools.partial(sum_replicas, spec=spec, group=process_group))
        return cls(weight, process_group).to(full.weight.device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """A saved adapter holds the full tensor: keep this rank's cut of it (a local one loads as is)."""
        key = prefix + "weight"
        if key not in state_dict:
            missing.append(key)
            return
        value, spec = state_dict[key], shard_spec(self.weight)
        full_shape = list(self.weight.shape)
        full_shape[spec.dim] = spec.full_size
        if list(value.shape) == full_shape:
            value = slice_tensor(value, spec)
        if value.shape != self.weight.shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, expected the full "
                f"{tuple(full_shape)} or this rank's {tuple(self.weight.shape)}"
            )
            return
        with torch.no_grad():
            self.weight.copy_(value)

    def extra_repr(self) -> str:
        spec = shard_spec(self.weight)
        return f"in={self.in_features}, out={self.out_features} (cut along dim {spec.dim} of {spec.full_size})"


class LoraColumnB(_LoraHalf):
    """``B`` beside a column-parallel base: this rank's output features of ``B``. Its input ``A(x)`` is
    replicated, and each rank's backward gives only its features' part of that input's gradient, so
    the gradient is all-reduced there (``r`` numbers per token): ``A`` gets the whole gradient on every
    rank, and so does ``x`` through ``A``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel(h, self.process_group), self.weight)


class LoraRowA(_LoraHalf):
    """``A`` beside a row-parallel base: this rank's input features of ``A``; the partial sums are
    all-reduced, so ``B`` (whole) sees ``A x`` on every rank and the adapter's output is added after
    the base's all-reduce, as the base's bias is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_parallel(F.linear(x, self.weight), self.process_group)
