"""The Policy API: how a model family is cut, described as data the sharder carries out.

A policy maps module classes to an `Argument`: attributes to rewrite on each instance (head
counts, split sizes: per-rank values) and functions returning layer descriptors, whose suffixes are
paths relative to that module. Layer families group the descriptors by role.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from shardformer.tensor_parallel.layers import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    Linear1D_Col,
    Linear1D_Row,
)


@dataclass
class Layer:
    """A submodule to replace. ``suffix``: its path below the policy's module class;
    ``replace_layer``: the parallel class (built with ``from_native``); ``ignore``: the suffix may be
    missing; ``reversed``: the weight is stored ``[in, out]`` (transformers' Conv1D); ``n_cast``: fused
    blocks along the split dimension (3 for Q/K/V), or their sizes when they differ (``(q, kv, kv)``)."""

    suffix: str
    replace_layer: type[nn.Module] | None = None
    ignore: bool = False
    reversed: bool = False
    n_cast: int | tuple[int, ...] = 1


@dataclass
class Col_Layer(Layer):  # noqa: N801 - the seed shardformer API's name
    """Output features (or vocabulary rows of an embedding) split over ranks."""

    weight: str = "weight"
    bias: str | None = "bias"
    gather_output: bool = False
    replace_layer: type[nn.Module] | None = Linear1D_Col
    head_width: int | tuple[int, ...] | None = None  # heads not to cut (per block): fewer than ranks are replicated


@dataclass
class Row_Layer(Layer):  # noqa: N801
    """Input features split over ranks; the output is all-reduced."""

    weight: str = "weight"
    bias: str | None = "bias"
    replace_layer: type[nn.Module] | None = Linear1D_Row


@dataclass
class Dropout_Layer(Layer):  # noqa: N801
    """Dropout with tensor-parallel RNG: ``parallel_input`` when each rank holds different features."""

    p: str = "p"
    parallel_input: bool = False
    replace_layer: type[nn.Module] | None = None

    def __post_init__(self) -> None:
        if self.replace_layer is None:
            self.replace_layer = DropoutForParallelInput if self.parallel_input else DropoutForReplicatedInput


@dataclass
class Argument:
    """What to do to every instance of one module class."""

    attr_dict: dict[str, Any] = field(default_factory=dict)
    param_funcs: list[Callable[[], list[Layer]]] = field(default_factory=list)


def divide(value: int, tp: int, what: str) -> int:
    """``value // tp``, or a ValueError naming ``what`` and the sizes that would work."""
    if value % tp != 0:
        fits = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"{what}={value} is not divisible by tensor_parallel_size={tp}; use a tensor_parallel_size "
            f"that divides it: {fits}"
        )
    return value // tp


class Policy:
    """Base class of all policies. Subclass it for a model that has no built-in policy.

    Override `argument_policy` (required) and, where they apply, `inject_policy`,
    `binding_policy` and the layer families used in the arguments.
    """

    model: nn.Module | None = None

    def set_model(self, model: nn.Module) -> None:
        """Called by the sharder first, for policies that read sizes off the model (timm has no config)."""
        self.model = model

    def argument_policy(self, model_config, shard_config) -> dict[type[nn.Module], Argument]:
        raise NotImplementedError(f"{type(self).__name__} must implement argument_policy(model_config, shard_config)")

    def inject_policy(self) -> tuple[type[nn.Module], type[nn.Module]] | None:
        """``(OriginModel, CustomModel)``: instances of the first become the second (a subclass
        whose ``forward`` works on shards, e.g. with a vocab-parallel loss)."""
        return None

    def binding_policy(self) -> dict[str, str] | None:
        """``{"source.weight": "target.weight"}``: parameters tied in the original model stay one
        Parameter after sharding (the target is bound to the source's shard)."""
        return None

    def sequence_parallel_entries(self) -> list[str] | None:
        """Blocks of a transformer layer (suffixes relative to it) whose input sequence parallelism
        gathers: the ones holding the column-parallel layers, with the residual add outside them.
        None (default): each child of the layer that holds a column-parallel layer."""
        return None

    @staticmethod
    def attn_in() -> list[Layer]:
        return []

    @staticmethod
    def attn_out() -> list[Layer]:
        return []

    @staticmethod
    def mlp_in() -> list[Layer]:
        return []

    @staticmethod
    def mlp_out() -> list[Layer]:
        return []

    @staticmethod
    def embedding() -> list[Layer]:
        return []

    @staticmethod
    def unembedding() -> list[Layer]:
        return []


class NoCut(Policy):
    """The policy of a model kept whole: it cuts nothing. At ``tensor_parallel_size=1`` nothing needs
    cutting, so a model no route can cut still trains with data parallelism, ZeRO and pipelines."""

    def argument_policy(self, model_config, shard_config) -> dict[type[nn.Module], Argument]:
        return {}
