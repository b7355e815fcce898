"""The vocab-parallel input embedding of a plan-derived model, in the model's own flavour.

(The LM head, its loss and ``generate`` take the route every sharded model takes:
`shardformer.tensor_parallel.lm_head`.)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D


class ScaledVocabParallelEmbedding1D(VocabParallelEmbedding1D):
    """Vocab-parallel version of an embedding that multiplies its output by ``embed_scale``
    (Gemma's ``sqrt(hidden_size)``), in the model's own way (the scale cast to the weight's dtype)."""

    @classmethod
    def from_native(cls, module: nn.Embedding, process_group=None, **options):
        layer = super().from_native(module, process_group, **options)
        scale = module.embed_scale
        # persistent only where the model's own is: an export must not write a tensor the checkpoint never held
        persistent = "embed_scale" in module.state_dict()
        value = scale.clone() if torch.is_tensor(scale) else torch.tensor(scale)
        layer.register_buffer("embed_scale", value, persistent=persistent)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def embedding_layer(module: nn.Module) -> type[nn.Module] | None:
    """Our vocab-parallel class for an input embedding, or None if its forward is not one we know."""
    if type(module) is nn.Embedding:
        return VocabParallelEmbedding1D
    if isinstance(module, nn.Embedding) and hasattr(module, "embed_scale"):
        return ScaledVocabParallelEmbedding1D
    return None
