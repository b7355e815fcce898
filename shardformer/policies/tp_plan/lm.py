"""Our extras on a plan-derived model: vocab-parallel embedding, LM head and loss, and generate.

transformers' causal LMs compute their loss through ``self.loss_function(logits, labels, ...)``:
the injected subclass returns the vocab-parallel cross-entropy there, so no rank ever holds
full-vocabulary logits in training (``generate`` gathers the logits for every sharded model:
:mod:`shardformer.generation`).
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn as nn

from shardformer.layers import VocabParallelEmbedding1D
from shardformer.policies.lm_heads import causal_lm_loss


class ScaledVocabParallelEmbedding1D(VocabParallelEmbedding1D):
    """Vocab-parallel version of an embedding that multiplies its output by ``embed_scale``
    (Gemma's ``sqrt(hidden_size)``), in the model's own way (the scale cast to the weight's dtype)."""

    @classmethod
    def from_native(cls, module: nn.Embedding, process_group=None, **options):
        layer = super().from_native(module, process_group, **options)
        scale = module.embed_scale
        layer.register_buffer("embed_scale", scale.clone() if torch.is_tensor(scale) else torch.tensor(scale))
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


def uses_loss_function(model_class: type) -> bool:
    """The head's forward computes its loss through ``self.loss_function`` (so ours can replace it)."""
    try:
        return "self.loss_function(" in inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return False


class _VocabParallelCausalLM:
    """Mixed in front of a transformers causal LM class whose LM head is vocab-parallel."""

    @property
    def loss_function(self):
        return partial(causal_lm_loss, head=self.get_output_embeddings())


_SUBCLASSES: dict[type, type] = {}


def vocab_parallel_class(origin: type) -> type:
    """``origin`` with the vocab-parallel loss (one class per origin)."""
    if origin not in _SUBCLASSES:
        name = f"VocabParallel{origin.__name__}"
        _SUBCLASSES[origin] = type(name, (_VocabParallelCausalLM, origin), {"__module__": __name__})
    return _SUBCLASSES[origin]
