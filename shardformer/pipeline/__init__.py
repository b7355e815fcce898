"""Pipeline parallelism: pipeline specs (how a family splits into stages), schedules (GPipe, 1F1B)."""

from shardformer.pipeline.families import BUILTIN_SPECS, pipeline_spec_for
from shardformer.pipeline.schedule import SCHEDULES
from shardformer.pipeline.spec import PipelineSpec, balanced_split, check_split, local_layers, stage_of

__all__ = [
    "BUILTIN_SPECS",
    "SCHEDULES",
    "PipelineSpec",
    "balanced_split",
    "check_split",
    "local_layers",
    "pipeline_spec_for",
    "stage_of",
]
