"""ShardConfig: what a user says about how to shard; it checks itself and names what is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardformer.core.comm import group_size
from shardformer.core.mesh import resolve_sizes

# The one table of training precisions (parameter dtypes) the engine, the examples and the CLI accept.
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_SEED = 1024  # base seed of the tensor-parallel dropout RNG


@dataclass
class ShardConfig:
    """How to shard a model.

    tensor_parallel_size, pipeline_parallel_size, data_parallel_size:
        parallel sizes; ``data_parallel_size`` defaults to world // (tp * pp).
    tensor_parallel_process_group:
        use this group for tensor parallelism instead of building a mesh (its size is the tp size).
    gather_output:
        gather the vocab-parallel LM head's logits to the full (true) vocabulary. Off by default so
        training never holds full-vocabulary logits; ``generate()`` gathers on its own either way.
    vocab_pad_multiple:
        pad the vocabulary to a multiple of ``vocab_pad_multiple * tp`` (1: just enough to divide).
    seed:
        base seed of the tensor-parallel dropout layers (each layer adds its index).
    sequence_parallel:
        Megatron sequence parallelism: between attention and MLP blocks each tp rank keeps its
        ``1/tp`` of the sequence (norms, dropout, residuals), for less activation memory at the
        same communication volume. Needs a model whose layer stack is known (the built-in
        families and models with transformers' plans); a no-op at tp=1.
    overlap_communication:
        a column-parallel layer's backward starts its input-gradient all-reduce and computes its
        weight gradient meanwhile (same result; False runs them one after the other, for comparison).
    mesh:
        an existing :class:`~shardformer.ProcessMesh` to shard over (its tp group); default: one is
        built from the sizes when the model is sharded.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int | None = None
    tensor_parallel_process_group: Any = None
    gather_output: bool = False
    vocab_pad_multiple: int = 1
    seed: int = DEFAULT_SEED
    sequence_parallel: bool = False
    overlap_communication: bool = True
    mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        group = self.tensor_parallel_process_group
        if group is not None:
            size = group_size(group)
            if self.tensor_parallel_size not in (1, size):
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} disagrees with the size {size} of "
                    f"tensor_parallel_process_group; leave tensor_parallel_size out or make them equal"
                )
            self.tensor_parallel_size = size
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "vocab_pad_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ShardConfig.{name}={value!r} must be a positive integer")
        dp = self.data_parallel_size
        if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1):
            raise ValueError(f"ShardConfig.data_parallel_size={dp!r} must be a positive integer or None")
        for name in ("gather_output", "sequence_parallel", "overlap_communication"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ShardConfig.{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.seed, int):
            raise ValueError(f"ShardConfig.seed={self.seed!r} must be an integer")

    def check_world(self) -> None:
        """Raise (before any collective) if the sizes do not fit the processes that were started."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.tensor_parallel_process_group is not None:
            return
        if not dist.is_initialized() and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise RuntimeError(
                f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                f"{self.pipeline_parallel_size} needs that many processes, but torch.distributed is not "
                f"initialised; start the script with `shardformer run --nproc_per_node N` and call "
                f"shardformer.init_distributed()"
            )
        resolve_sizes(world, self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size)
        mesh = self.mesh
        if mesh is not None and (mesh.tp_size, mesh.pp_size) != (
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
        ):
            raise ValueError(
                f"ShardConfig.mesh {mesh} does not match tensor_parallel_size={self.tensor_parallel_size}, "
                f"pipeline_parallel_size={self.pipeline_parallel_size}; give the mesh's sizes or leave mesh out"
            )
