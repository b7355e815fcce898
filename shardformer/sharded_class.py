"""What a sharded transformers model needs for vocab-parallel logits, with its class name unchanged.

- its class gains :class:`~shardformer.generation.ParallelGeneration`: ``generate`` gathers the
  logits and takes tp rank 0's tokens;
- where the model would hand vocab-parallel logits ``[..., vocab / tp]`` to transformers' own
  causal-LM or masked-LM loss (which reshapes them by the full vocabulary and fails, or worse), its
  ``loss_function`` becomes the same loss on the vocab-parallel cross-entropy over the head's
  process group. Set once, as a plain attribute (transformers' own setter), so torch.compile traces
  it like any other. A loss the policy injected itself is left alone.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

from shardformer.generation import ParallelGeneration
from shardformer.layers import VocabParallelLMHead1D
from shardformer.policies.lm_heads import causal_lm_loss, token_loss


def masked_lm_loss(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, *, head, **_
) -> torch.Tensor:
    """transformers' ForMaskedLMLoss on vocab-parallel logits: every position predicts its own label
    (transformers' signature, ``head`` bound by keyword)."""
    if num_items_in_batch is None:
        return token_loss(logits, labels, head, ignore_index)
    return token_loss(logits, labels, head, ignore_index, reduction="sum") / num_items_in_batch


_CLASSES: dict[type, type] = {}


def adapt_class(model: nn.Module) -> None:
    """Route a transformers model's LM loss and ``generate`` through its vocab-parallel head, keeping
    ``type(model).__name__`` (checkpoints name the transformers class it derives from)."""
    cls = type(model)
    if not hasattr(cls, "loss_function"):
        return
    _route_loss(model)
    if issubclass(cls, ParallelGeneration) or not callable(getattr(model, "_get_logits_processor", None)):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (ParallelGeneration, cls), {"__qualname__": cls.__qualname__})
    model.__class__ = _CLASSES[cls]


def _route_loss(model: nn.Module) -> None:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, VocabParallelLMHead1D):
        return
    own = model.loss_function
    if own is ForCausalLMLoss:
        model.loss_function = partial(causal_lm_loss, head=head)
    elif own is ForMaskedLMLoss:
        model.loss_function = partial(masked_lm_loss, head=head)
