"""The class a sharded model gets: its own class plus what vocab-parallel logits need, name unchanged.

- :class:`~shardformer.generation.ParallelGeneration`: ``generate`` gathers the logits and takes
  tp rank 0's tokens;
- :class:`VocabParallelLoss`: where the model would hand vocab-parallel logits ``[..., vocab / tp]``
  to transformers' own causal-LM or masked-LM loss (which reshapes them by the full vocabulary and
  fails, or worse), the same loss is computed by the vocab-parallel cross-entropy over the head's
  process group. A loss the policy injected itself is left alone.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

from shardformer.generation import ParallelGeneration
from shardformer.layers import VocabParallelLMHead1D
from shardformer.policies.lm_heads import causal_lm_loss, token_loss


def masked_lm_loss(logits, labels, head, num_items_in_batch=None, ignore_index=-100, **_) -> torch.Tensor:
    """transformers' ForMaskedLMLoss on vocab-parallel logits: every position predicts its own label."""
    if num_items_in_batch is None:
        return token_loss(logits, labels, head, ignore_index)
    return token_loss(logits, labels, head, ignore_index, reduction="sum") / num_items_in_batch


class VocabParallelLoss:
    @property
    def loss_function(self):
        own = super().loss_function
        get_head = getattr(self, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if not isinstance(head, VocabParallelLMHead1D) or head.gather_output:
            return own
        if own is ForCausalLMLoss:
            return partial(causal_lm_loss, head=head)
        if own is ForMaskedLMLoss:
            return partial(masked_lm_loss, head=head)
        return own

    @loss_function.setter
    def loss_function(self, value):
        self._loss_function = value


_CLASSES: dict[type, type] = {}


def adapt_class(model: nn.Module) -> None:
    """Give a transformers model that can generate or compute a loss the mixins above, keeping
    ``type(model).__name__`` (checkpoints name the transformers class it derives from)."""
    cls = type(model)
    if issubclass(cls, ParallelGeneration) or not hasattr(cls, "loss_function"):
        return
    if cls not in _CLASSES:
        mixins = (
            (ParallelGeneration, VocabParallelLoss)
            if callable(getattr(model, "_get_logits_processor", None))
            else (VocabParallelLoss,)
        )
        _CLASSES[cls] = type(cls.__name__, (*mixins, cls), {"__qualname__": cls.__qualname__})
    model.__class__ = _CLASSES[cls]
