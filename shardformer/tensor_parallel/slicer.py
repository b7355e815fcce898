"""The slicer: cuts a layer's weights and biases for one tensor-parallel rank, by the kind of layer
they belong to, and tags each shard with its `shardformer.core.shard_spec.ShardSpec`.

The layout math (``ShardSpec``, slicing and merging) lives in `shardformer.core.shard_spec`;
gathering shards over ranks in `shardformer.core.comm`. Both are re-exported here.
"""

from __future__ import annotations

import torch

from shardformer.core.comm import gather_tensor
from shardformer.core.shard_spec import (
    ShardSpec,
    make_shard_param,
    make_spec,
    merge_shards,
    round_up,
    shard_spec,
    slice_tensor,
)

__all__ = [
    "ShardSpec",
    "Slicer",
    "gather_tensor",
    "make_shard_param",
    "make_spec",
    "merge_shards",
    "round_up",
    "shard_spec",
    "slice_tensor",
]


class Slicer:
    """Cuts weights and biases for one tensor-parallel rank, by the kind of layer they belong to.

    ``reversed`` means the weight is stored ``[in, out]`` (transformers' ``Conv1D``) rather than
    ``nn.Linear``'s ``[out, in]``. ``n_cast`` is the number of fused blocks (3 for Q/K/V), or their
    sizes when they differ.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def spec(
        self, shape, dim: int, n_cast: int | tuple[int, ...] = 1, pad_to_multiple: int | None = None, head_width=None
    ) -> ShardSpec:
        return make_spec(shape, dim, self.rank, self.world_size, n_cast, pad_to_multiple, head_width)

    def column_weight(
        self, weight: torch.Tensor, reversed: bool = False, n_cast=1, pad_to_multiple=None, head_width=None
    ):
        """Output features split: dim 0 of ``[out, in]``, dim 1 of ``[in, out]``."""
        spec = self.spec(weight.shape, 1 if reversed else 0, n_cast, pad_to_multiple, head_width)
        return make_shard_param(weight, spec)

    def column_bias(self, bias: torch.Tensor, n_cast=1, pad_to_multiple=None, head_width=None):
        return make_shard_param(bias, self.spec(bias.shape, 0, n_cast, pad_to_multiple, head_width))

    def row_weight(self, weight: torch.Tensor, reversed: bool = False):
        """Input features split: dim 1 of ``[out, in]``, dim 0 of ``[in, out]``."""
        return make_shard_param(weight, self.spec(weight.shape, 0 if reversed else 1))

    def vocab_rows(self, weight: torch.Tensor, pad_to_multiple: int = 1):
        """Vocabulary (dim 0) split, padded so every rank holds the same number of rows."""
        return make_shard_param(weight, self.spec(weight.shape, 0, 1, pad_to_multiple))

    def hidden_columns(self, weight: torch.Tensor):
        """Embedding dimension (dim 1) split."""
        return make_shard_param(weight, self.spec(weight.shape, 1))
