"""The embedding split over the tensor-parallel group by vocabulary."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardformer.core.comm import group_rank, group_size, reduce_from_parallel
from shardformer.core.index_check import check_indices
from shardformer.tensor_parallel.slicer import Slicer, shard_spec


def _check_plain(module: nn.Embedding) -> None:
    if module.max_norm is not None or module.sparse:
        raise ValueError(f"{module}: max_norm and sparse embeddings cannot be split; use a dense nn.Embedding")


class VocabParallelEmbedding1D(nn.Module):
    """Rows of the vocabulary split over ranks; each rank looks up the ids it holds, zeros the
    rest, and one all-reduce sums the result. A vocabulary that the group size does not divide is
    padded with zero rows, which no id reaches, so the padding never shows outside the layer.
    """

    def __init__(self, weight: nn.Parameter, process_group=None, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight, self.process_group = weight, process_group
        spec = shard_spec(weight)
        self.num_embeddings = spec.full_size if spec else weight.shape[0]
        self.embedding_dim = weight.shape[1]
        self.padding_idx = padding_idx
        self.vocab_start = spec.start if spec else 0
        self.vocab_end = self.vocab_start + weight.shape[0]
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start
        self._local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < weight.shape[0] else None

    @classmethod
    def from_native(
        cls, module: nn.Embedding, process_group=None, pad_to_multiple: int = 1, **_
    ) -> VocabParallelEmbedding1D:
        _check_plain(module)
        slicer = Slicer(group_rank(process_group), group_size(process_group))
        return cls(slicer.vocab_rows(module.weight, pad_to_multiple), process_group, module.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_indices(
            ids, self.num_embeddings, "input ids",
            "the unsharded embedding raises on them (here they would embed as zeros); use the model's own "
            "tokenizer, or resize the vocabulary (model.resize_token_embeddings) before sharding",
        )  # fmt: skip
        if group_size(self.process_group) == 1:
            return F.embedding(ids, self.weight[: self.num_embeddings], self._local_padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel(out, self.process_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"
