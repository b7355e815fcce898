"""shardformer: tensor, pipeline and ZeRO parallelism for HuggingFace and timm models.

The public API. The code is grouped by technique (core, tensor_parallel, pipeline, data_parallel)
and by model family (models); docs/development.md ("How the code is organised") walks the folders.
"""

from shardformer import checkpoint  # noqa: F401 - registers the export a sharded model's save_pretrained uses
from shardformer.api import shard_model
from shardformer.core.config import ShardConfig
from shardformer.core.mesh import ProcessMesh, init_distributed, launch_from_torch
from shardformer.core.record import ShardedModelInfo, sharding_of
from shardformer.core.rng import seed
from shardformer.engine import EngineConfig, ParallelEngine
from shardformer.integrations import peft as _peft  # noqa: F401 - registers LoRA support with the sharder
from shardformer.pipeline import PipelineSpec
from shardformer.policies import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, get_autopolicy
from shardformer.tensor_parallel.sharder import ModelSharder
from shardformer.tools.verify import verify  # the function; the module is shardformer.tools.verify

__all__ = [
    "Argument",
    "Col_Layer",
    "Dropout_Layer",
    "EngineConfig",
    "Layer",
    "ModelSharder",
    "ParallelEngine",
    "PipelineSpec",
    "Policy",
    "ProcessMesh",
    "Row_Layer",
    "ShardConfig",
    "ShardedModelInfo",
    "get_autopolicy",
    "init_distributed",
    "launch_from_torch",
    "seed",
    "shard_model",
    "sharding_of",
    "verify",
]
