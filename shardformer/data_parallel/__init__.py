"""Low-level ZeRO (stage 1 and 2): shard optimizer states and gradients over data-parallel ranks."""

from shardformer.data_parallel.grad_norm import global_grad_norm
from shardformer.data_parallel.loss_scaler import DynamicLossScaler
from shardformer.data_parallel.optimizer import DEFAULT_BUCKET_SIZE, ZeroOptimizer

__all__ = ["DEFAULT_BUCKET_SIZE", "DynamicLossScaler", "ZeroOptimizer", "global_grad_norm"]
