"""Data parallelism: low-level ZeRO (stage 1 and 2: optimizer states and gradients sharded over the
data-parallel ranks), and ZeRO-3 (parameters too) on PyTorch's FSDP2."""

from shardformer.data_parallel.fsdp import fully_shard_model
from shardformer.data_parallel.fsdp_optimizer import FullyShardedOptimizer
from shardformer.data_parallel.grad_norm import global_grad_norm
from shardformer.data_parallel.loss_scaler import DynamicLossScaler
from shardformer.data_parallel.optimizer import DEFAULT_BUCKET_SIZE, ZeroOptimizer

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "DynamicLossScaler",
    "FullyShardedOptimizer",
    "ZeroOptimizer",
    "fully_shard_model",
    "global_grad_norm",
]
