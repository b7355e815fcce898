"""Tensor-parallel layers; each has ``from_native(module, process_group, ...)``."""

from shardformer.layers.comm import (
    CollectiveCounter,
    SharedInputCopy,
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    split_to_parallel,
)
from shardformer.layers.dropout import DropoutForParallelInput, DropoutForReplicatedInput
from shardformer.layers.embedding import Embedding1D, VocabParallelEmbedding1D
from shardformer.layers.linear import Linear1D_Col, Linear1D_Row, VocabParallelLMHead1D
from shardformer.layers.loss import vocab_parallel_cross_entropy

__all__ = [
    "CollectiveCounter",
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "Embedding1D",
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
