"""shardformer: tensor, pipeline and ZeRO parallelism for HuggingFace and timm models."""

from shardformer.config import ShardConfig
from shardformer.engine import EngineConfig, ParallelEngine
from shardformer.mesh import ProcessMesh, init_distributed, launch_from_torch
from shardformer.pipeline import PipelineSpec
from shardformer.policies import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, get_autopolicy
from shardformer.rng import seed
from shardformer.sharder import ModelSharder, shard_model
from shardformer.topology import ShardedModelInfo, sharding_of
from shardformer.verify import verify  # the function; the module stays importable as shardformer.verify

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
