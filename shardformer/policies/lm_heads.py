"""Vocab-parallel LM heads: the losses on vocab-parallel logits, a ``generate`` that gathers them,
and the model subclasses the built-in policies inject (``inject_policy``), all in one place.

HuggingFace computes LM losses on full-vocabulary logits (``view(-1, vocab_size)``); on a sharded
model the logits are ``[..., vocab / tp]`` per rank, so these functions compute the same losses with
:func:`~shardformer.layers.vocab_parallel_cross_entropy`. When the head gathers its output, the
ordinary fp32 cross-entropy is used.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers.models.bert import modeling_bert as hf_bert
from transformers.models.gpt2 import modeling_gpt2 as hf_gpt2

from shardformer.layers import VocabParallelLMHead1D, vocab_parallel_cross_entropy


def token_loss(logits, labels, head: VocabParallelLMHead1D, ignore_index=-100, reduction="mean"):
    """Cross-entropy of (possibly vocab-parallel) logits from ``head`` against ``labels``."""
    labels = labels.to(logits.device)
    if head.gather_output:
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        )
    return vocab_parallel_cross_entropy(logits, labels, head.process_group, head.vocab_size, ignore_index, reduction)


def causal_lm_loss(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, *, head, **_
) -> torch.Tensor:
    """transformers' ForCausalLMLoss on vocab-parallel logits: tokens < n predict token n.

    The signature is transformers' own (some models pass ``vocab_size`` positionally; the head knows
    the true vocabulary), with ``head`` bound by keyword: ``partial(causal_lm_loss, head=lm_head)``."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if num_items_in_batch is None:
        return token_loss(logits, shift_labels, head, ignore_index)
    loss = token_loss(logits, shift_labels, head, ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def with_loss(output, loss, return_dict) -> object:
    """Put ``loss`` into a model output built without labels (first in a tuple, as HF does)."""
    if loss is not None:
        output["loss"] = loss
    if return_dict is False:
        items = output.to_tuple()
        return items if loss is None else (loss, *[v for k, v in output.items() if k != "loss"])
    return output


@contextmanager
def gathered_logits(head: VocabParallelLMHead1D):
    """Temporarily gather the head's logits (generation picks tokens over the whole vocabulary)."""
    before = head.gather_output
    head.gather_output = True
    try:
        yield
    finally:
        head.gather_output = before


# -- the model subclasses the built-in policies inject ------------------------------------------
# Only where transformers computes the loss outside ``loss_function`` (inline cross-entropy): every
# sharded model's class already routes ``loss_function`` and ``generate`` through the vocab-parallel
# head (shardformer.sharded_class), so GPT2LMHeadModel and BertLMHeadModel need nothing here.


class VocabParallelGPT2DoubleHeadsModel(hf_gpt2.GPT2DoubleHeadsModel):
    """GPT2DoubleHeadsModel whose LM loss runs on vocab-parallel logits (mc_loss is unchanged)."""

    def forward(self, *args, labels=None, return_dict=None, **kwargs):
        output = super().forward(*args, return_dict=True, **kwargs)
        loss = None
        if labels is not None:
            loss = token_loss(output.logits[..., :-1, :], labels[..., 1:], self.lm_head)
        return with_loss(output, loss, return_dict)


class VocabParallelBertForMaskedLM(hf_bert.BertForMaskedLM):
    def forward(self, *args, labels=None, return_dict=None, **kwargs):
        output = super().forward(*args, return_dict=True, **kwargs)
        loss = None if labels is None else token_loss(output.logits, labels, self.cls.predictions.decoder)
        return with_loss(output, loss, return_dict)


class VocabParallelBertForPreTraining(hf_bert.BertForPreTraining):
    def forward(self, *args, labels=None, next_sentence_label=None, return_dict=None, **kwargs):
        output = super().forward(*args, return_dict=True, **kwargs)
        loss = None
        if labels is not None and next_sentence_label is not None:  # as transformers: both or no loss
            mlm = token_loss(output.prediction_logits, labels, self.cls.predictions.decoder)
            nsp = F.cross_entropy(output.seq_relationship_logits.view(-1, 2), next_sentence_label.view(-1))
            loss = mlm + nsp
        return with_loss(output, loss, return_dict)
