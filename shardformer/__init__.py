"""shardformer: tensor, pipeline and ZeRO parallelism for HuggingFace and timm models."""

from shardformer.mesh import ProcessMesh, init_distributed, launch_from_torch

__all__ = ["ProcessMesh", "init_distributed", "launch_from_torch"]
