"""Tensor-parallel layers; each has ``from_native(module, process_group, ...)``."""

from shardformer.core.comm import CollectiveCounter, reduce_from_parallel
from shardformer.tensor_parallel.layers.dropout import DropoutForParallelInput, DropoutForReplicatedInput
from shardformer.tensor_parallel.layers.embedding import VocabParallelEmbedding1D
from shardformer.tensor_parallel.layers.linear import Linear1D_Col, Linear1D_Row, VocabParallelLMHead1D
from shardformer.tensor_parallel.layers.loss import vocab_parallel_cross_entropy
from shardformer.tensor_parallel.regions import (
    SharedInputCopy,
    copy_to_parallel,
    gather_from_parallel,
    split_to_parallel,
)

__all__ = [
    "CollectiveCounter",
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "Linear1D_Col",
    "Linear1D_Row",
    "SharedInputCopy",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "copy_to_parallel",
    "gather_from_parallel",
    "reduce_from_parallel",
    "split_to_parallel",
    "vocab_parallel_cross_entropy",
]
