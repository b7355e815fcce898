"""How a model was sharded: one typed record, ``model.shardformer``, written by the sharder.

Everything that later needs the layout (the pipeline split, the stage forwards, checkpoints, the
engine) reads it from this record instead of from loose attributes with defaults: a model that was
not sharded has no record, and `sharding_of` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from shardformer.core.config import ShardConfig
from shardformer.core.hf_save import route_save_pretrained
from shardformer.core.mesh import ProcessMesh

ATTRIBUTE = "shardformer"


@dataclass(frozen=True)
class ShardedModelInfo:
    """The layout a sharded model runs in.

    mesh: the (pp, dp, tp) process mesh, or None when a tp group was given directly (or one process).
    tp_group: the tensor-parallel group the layers communicate over (None: one process).
    stage, num_stages: this rank's pipeline stage; layers: the global indices of the transformer
    layers this stage holds (None: all of them). pipeline: the PipelineSpec the stage was cut by.
    """

    shard_config: ShardConfig
    policy: Any
    mesh: ProcessMesh | None
    tp_group: Any
    stage: int = 0
    num_stages: int = 1
    layers: tuple[int, ...] | None = None
    pipeline: Any = None
    sequence_parallel: Any = None  # the model's SequenceParallel state (None: plain tensor parallelism)
    context_parallel: Any = None  # the model's ContextParallel state (None: the sequence is not split)
    forward_agreement: Any = None  # the check that tp/cp peers run one batch (core/forward_agreement.py)
    # which route's policy cut it ("built-in policy", "tp plan", "derived", "custom policy"; "none: tp=1": kept whole)
    route: str | None = None
    proven: bool = False  # whether that route was proven exact on a tiny copy before the cut
    experts: Any = None  # the ExpertLayout of expert parallelism (None: experts not split by ep)
    study: Any = None  # the ModelStudy made before the cut (shardformer/study.py): instance, stacks, routes, experts

    @classmethod
    def unsharded(cls) -> ShardedModelInfo:
        """The record of a model that is split into pipeline stages without tensor parallelism."""
        return cls(ShardConfig(), policy=None, mesh=None, tp_group=None)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1


def build_mesh(shard_config: ShardConfig) -> tuple[ProcessMesh | None, Any]:
    """The mesh and tp group a model is sharded over, built once (group creation is collective).

    A tp group given in the config is used as it is (no mesh); one process needs neither; otherwise
    the config's mesh is used, or a new `ProcessMesh` is built from its sizes.
    """
    if shard_config.tensor_parallel_process_group is not None:
        return None, shard_config.tensor_parallel_process_group
    if not dist.is_initialized():
        return None, None
    mesh = shard_config.mesh or ProcessMesh(
        shard_config.tensor_parallel_size,
        shard_config.pipeline_parallel_size,
        shard_config.data_parallel_size,
        shard_config.context_parallel_size,
        shard_config.expert_parallel_size,
    )
    return mesh, mesh.tp_group


def attach(model: nn.Module, info: ShardedModelInfo) -> None:
    """Record ``info`` on ``model`` (a plain attribute: not a submodule, not in the state dict); its
    ``save_pretrained`` now writes the whole model."""
    object.__setattr__(model, ATTRIBUTE, info)
    route_save_pretrained(model)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model.__dict__.get(ATTRIBUTE), ShardedModelInfo)


def sharding_of(model: nn.Module) -> ShardedModelInfo:
    """The record of a sharded model, or an error saying the model was never sharded."""
    info = model.__dict__.get(ATTRIBUTE)
    if not isinstance(info, ShardedModelInfo):
        raise ValueError(
            f"{type(model).__name__} was not sharded by shardformer (it has no `model.shardformer` record); "
            f"shard it first with shard_model(model, ShardConfig(...)) or ParallelEngine"
        )
    return info


def with_stage(model: nn.Module, stage: int, num_stages: int, layers, pipeline) -> ShardedModelInfo:
    """Record that ``model`` now holds only pipeline stage ``stage`` (its ``layers``)."""
    info = replace(sharding_of(model), stage=stage, num_stages=num_stages, layers=tuple(layers), pipeline=pipeline)
    attach(model, info)
    return info
