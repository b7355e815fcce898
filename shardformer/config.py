"""ShardConfig: what a user says about how to shard; it checks itself and names what is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


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
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int | None = None
    tensor_parallel_process_group: Any = None
    gather_output: bool = False
    vocab_pad_multiple: int = 1
    seed: int = 1024
    mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        group = self.tensor_parallel_process_group
        if group is not None:
            from shardformer.layers.comm import group_size

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
        if not isinstance(self.gather_output, bool):
            raise ValueError(f"ShardConfig.gather_output={self.gather_output!r} must be True or False")
        if not isinstance(self.seed, int):
            raise ValueError(f"ShardConfig.seed={self.seed!r} must be an integer")

    def check_world(self) -> None:
        """Raise (before any collective) if the sizes do not fit the processes that were started."""
        from shardformer.mesh import resolve_sizes

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

    def tp_group(self):
        """The tensor-parallel process group (building the process mesh on first use)."""
        if self.tensor_parallel_process_group is not None:
            return self.tensor_parallel_process_group
        if not dist.is_initialized():
            return None  # one process: the layers see a group of size 1
        if self.mesh is None:
            from shardformer.mesh import ProcessMesh

            self.mesh = ProcessMesh(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size)
        return self.mesh.tp_group
