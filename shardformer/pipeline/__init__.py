"""Pipeline parallelism: pipeline specs (how a model splits into stages; a family's own spec is in its
record, `shardformer.models`), specs from transformers' ``base_model_pp_plan``, schedules (GPipe, 1F1B)."""

from shardformer.pipeline.schedule import SCHEDULES
from shardformer.pipeline.spec import PipelineSpec, balanced_split, check_split, local_layers, stage_of

__all__ = [
    "SCHEDULES",
    "PipelineSpec",
    "balanced_split",
    "check_split",
    "local_layers",
    "stage_of",
]
