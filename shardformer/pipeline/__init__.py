"""Pipeline parallelism: stage split, schedules (GPipe, 1F1B), and the tp x pp x ZeRO training engine."""

from shardformer.pipeline.engine import EngineConfig, ParallelEngine, split_batch
from shardformer.pipeline.schedule import SCHEDULES
from shardformer.pipeline.split import balanced_split, check_split

__all__ = ["SCHEDULES", "EngineConfig", "ParallelEngine", "balanced_split", "check_split", "split_batch"]
