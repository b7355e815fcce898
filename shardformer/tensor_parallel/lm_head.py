"""The vocab-parallel LM head's one route: losses on vocab-parallel logits, ``generate``, and the one
class swap every sharded transformers model gets.

A vocab-parallel head gives each rank logits over its slice of the vocabulary ``[..., vocab / tp]``.
transformers' own losses reshape logits by the full vocabulary, and picking tokens from a slice would
give each rank different tokens. So, once a model is sharded, `adapt_class`

- routes the model's ``loss_function``, where it is transformers' causal-LM or masked-LM loss and the
  head is vocab-parallel, to the same loss on the vocab-parallel cross-entropy over the head's
  process group (set once, with transformers' own setter, so torch.compile traces it like any
  other; a loss the policy injected is left alone);
- swaps the class of a model that can generate for ``VocabParallel<Name>`` (one cached class per
  original class), which adds `ParallelGeneration`: ``generate`` gathers the logits of every
  vocab-parallel head for the call and, when sampling or when the logits do not come from a head it
  gathers, appends `AgreeOnTokens` after every other logits processor and warper: tp rank 0
  picks each token (argmax, or a draw with the RNG state the model's own draw would use) and
  broadcasts it, so every rank keeps the same token and no rank reaches EOS alone.

Greedy decoding through a gathered vocab-parallel head needs no broadcast: the all-gather hands
every rank the same bytes, and the processors and argmax that follow are deterministic, so each
decoded token costs the Megatron minimum (the embedding's all-reduce, two per layer, the head's
all-gather). Models whose loss is computed inline (BERT's MLM heads, GPT-2's double heads) get a
forward of their own from their policy (``inject_policy``), built on `token_loss`.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from contextlib import ExitStack, contextmanager
from functools import partial, update_wrapper

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss, ForMaskedLMLoss

from shardformer.core.comm import VirtualGroup, broadcast, gather_tensor, group_size
from shardformer.core.record import is_sharded, sharding_of
from shardformer.core.shard_spec import shard_spec, slice_tensor
from shardformer.tensor_parallel.detect import call_optional
from shardformer.tensor_parallel.layers import VocabParallelLMHead1D, vocab_parallel_cross_entropy

# -- losses on vocab-parallel logits ----------------------------------------------------------------


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


def forward_like(original):
    """Decorator for a forward that replaces ``original`` (a model class's forward): it shows
    ``original``'s signature, since transformers' Trainer keeps only the batch columns the signature
    names (``forward(*args, **kwargs)`` would lose ``input_ids``), and it receives every argument by
    keyword however the caller passed it (``labels`` given by position is still the labels)."""
    signature = inspect.signature(original)
    var_positional = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_POSITIONAL]
    var_keyword = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if var_positional:
        raise TypeError(f"forward_like: {original.__qualname__} takes *{var_positional[0]}, which has no keyword")

    def decorate(forward):
        def by_keyword(self, *args, **kwargs):
            if args:
                kwargs = signature.bind_partial(self, *args, **kwargs).arguments
                kwargs.pop(next(iter(signature.parameters)))  # self
                for name in var_keyword:
                    kwargs.update(kwargs.pop(name, {}))
            return forward(self, **kwargs)

        update_wrapper(by_keyword, forward, updated=())
        del by_keyword.__wrapped__  # unwrapping must not skip this forward (accelerate unwraps forwards)
        by_keyword.__doc__ = forward.__doc__ or original.__doc__
        by_keyword.__signature__ = signature
        return by_keyword

    return decorate


@contextmanager
def gathered_logits(head: VocabParallelLMHead1D):
    """Temporarily gather the head's logits (generation picks tokens over the whole vocabulary)."""
    before = head.gather_output
    head.gather_output = True
    try:
        yield
    finally:
        head.gather_output = before


def masked_lm_loss(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, *, head, **_
) -> torch.Tensor:
    """transformers' ForMaskedLMLoss on vocab-parallel logits: every position predicts its own label
    (transformers' signature, ``head`` bound by keyword)."""
    if num_items_in_batch is None:
        return token_loss(logits, labels, head, ignore_index)
    return token_loss(logits, labels, head, ignore_index, reduction="sum") / num_items_in_batch


_ROUTED = {ForCausalLMLoss: causal_lm_loss, ForMaskedLMLoss: masked_lm_loss}


def loss_function_of(model: nn.Module):
    """``model.loss_function`` as transformers resolves it, without the warning its property logs
    (once per process, so once per rank) when the class name names no loss (``GPT2LMHeadModel``:
    ``loss_type=None``, the causal-LM default). A class with its own property is asked directly."""
    if getattr(type(model), "loss_function", None) is not PreTrainedModel.loss_function:
        return getattr(model, "loss_function", None)
    own = model.__dict__.get("_loss_function")
    if own is not None:
        return own
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) or LOSS_MAPPING["ForCausalLM"]


def routes_loss(model: nn.Module) -> bool:
    """Whether `adapt_class` can route ``model``'s loss through a vocab-parallel head: its
    forward computes the loss through ``self.loss_function``, and that is transformers' causal-LM or
    masked-LM loss. Otherwise a vocab-parallel head must gather its logits."""
    try:
        calls = "self.loss_function(" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return calls and loss_function_of(model) in _ROUTED


def decoder_inputs_from_labels(model: nn.Module):
    """How an encoder-decoder builds its decoder inputs from labels: its
    ``prepare_decoder_input_ids_from_labels`` (T5, BART, Marian), else its module's
    ``shift_tokens_right(labels, pad_token_id, decoder_start_token_id)`` (Whisper); None if neither."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return lambda labels: prepare(labels=labels)
    # the model's own modeling module (the sharded class is a subclass defined here)
    modules = (sys.modules.get(cls.__module__) for cls in type(model).__mro__)
    shift = next((f for m in modules if callable(f := getattr(m, "shift_tokens_right", None))), None)
    config = model.config
    pad, start = getattr(config, "pad_token_id", None), getattr(config, "decoder_start_token_id", None)
    if callable(shift) and list(inspect.signature(shift).parameters)[:3] == [
        "input_ids", "pad_token_id", "decoder_start_token_id"
    ] and isinstance(pad, int) and isinstance(start, int):  # fmt: skip
        return lambda labels: shift(labels, pad, start)
    return None


def seq2seq_routable(model: nn.Module) -> bool:
    """Whether an encoder-decoder's loss can be taken over from its inline cross-entropy: it builds
    its decoder inputs from labels in a way we can call (`decoder_inputs_from_labels`)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_encoder_decoder", False)) and decoder_inputs_from_labels(model) is not None


class Seq2SeqVocabParallelLoss:
    """Mixed into an encoder-decoder whose head stays vocab-parallel: given ``labels``, the decoder
    inputs are built from them as the model does, the model runs without them (its inline
    cross-entropy would take the vocabulary slice for the whole), and the loss is the vocab-parallel
    cross-entropy of the head's logits (mean over the labels not ignored, as the model's own)."""

    def forward(self, labels=None, **kwargs):  # every argument by keyword: see vocab_parallel_class
        if labels is None:
            return super().forward(**kwargs)
        if kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
            kwargs["decoder_input_ids"] = decoder_inputs_from_labels(self)(labels)
        out = super().forward(**kwargs)
        logits = out["logits"] if isinstance(out, dict) else out[0]
        loss = token_loss(logits, labels, self.get_output_embeddings())
        return with_loss(out, loss, kwargs.get("return_dict"))


def _cut_final_logits_bias(model: nn.Module, head: VocabParallelLMHead1D) -> None:
    """BART's and Marian's ``final_logits_bias`` ``[1, vocab]``, added to the logits: this rank's
    vocabulary slice, tagged with the head's layout (export and gathers put it back whole)."""
    bias = getattr(model, "final_logits_bias", None)
    spec = shard_spec(head.weight)
    if not torch.is_tensor(bias) or spec is None or bias.shape[-1] != spec.full_size:
        return
    local_spec = dataclasses.replace(spec, dim=bias.dim() - 1)
    local = slice_tensor(bias.detach(), local_spec)
    local.shard_spec = local_spec
    model.register_buffer("final_logits_bias", local, persistent=True)


@contextmanager
def _whole_final_logits_bias(model: nn.Module):
    """The whole ``final_logits_bias`` while the head's logits are gathered (collective over tp)."""
    bias = getattr(model, "final_logits_bias", None)
    spec = shard_spec(bias) if torch.is_tensor(bias) else None
    if spec is None:
        yield
        return
    model.register_buffer("final_logits_bias", gather_tensor(bias, spec, tp_group_of(model)), persistent=True)
    try:
        yield
    finally:
        model.register_buffer("final_logits_bias", bias, persistent=True)


# -- generate ---------------------------------------------------------------------------------------


class AgreeOnTokens:
    """Logits processor: tp rank 0 chooses each next token, every rank gets scores selecting it alone.

    The returned scores are ``-inf`` except at the chosen token (0), so ``output_scores`` of a
    sharded ``generate`` show the choice rather than the distribution.
    """

    def __init__(self, group, do_sample: bool) -> None:
        self.group, self.do_sample = group, do_sample

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.do_sample:
            devices = [scores.device] if scores.device.type != "cpu" else []
            # fork: the model's own draw that follows consumes the same state, as it would unsharded
            with torch.random.fork_rng(devices=devices, device_type=scores.device.type):
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = scores.argmax(dim=-1)
        broadcast(tokens, self.group)
        chosen = torch.full_like(scores, float("-inf"))
        chosen.scatter_(1, tokens.unsqueeze(1), 0.0)
        return chosen


def tp_group_of(model: nn.Module):
    """The tensor-parallel group of a sharded model (None if it has none)."""
    return sharding_of(model).tp_group if is_sharded(model) else None


class ParallelGeneration:
    """Mixed into a sharded model's class by `vocab_parallel_class`: see the module docstring."""

    def generate(self, *args, **kwargs):
        if is_sharded(self) and sharding_of(self).experts is not None:
            # ep ranks decode their own prompts but exchange tokens every step: a rank done early keeps
            # stepping (transformers' synced_gpus) until every rank is, or its peers would wait on it
            kwargs.setdefault("synced_gpus", True)
        with ExitStack() as stack:
            for head in self.modules():
                if isinstance(head, VocabParallelLMHead1D):
                    stack.enter_context(gathered_logits(head))
            stack.enter_context(_whole_final_logits_bias(self))
            return super().generate(*args, **kwargs)

    def _get_logits_processor(self, generation_config, *args, **kwargs):
        # transformers appends the warpers (temperature, top-k, top-p) after user processors: only
        # here does ours run last, on the distribution the token is actually drawn from
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        group = tp_group_of(self)
        single_beam = (generation_config.num_beams or 1) == 1
        sampled = bool(generation_config.do_sample)
        if group is None or isinstance(group, VirtualGroup) or group_size(group) == 1 or not single_beam:
            return processors
        if sampled or not isinstance(self.get_output_embeddings(), VocabParallelLMHead1D):
            processors.append(AgreeOnTokens(group, sampled))
        return processors


# -- the class swap ---------------------------------------------------------------------------------

_CLASSES: dict[type, type] = {}


def vocab_parallel_class(cls: type, seq2seq_loss: bool = False) -> type:
    """``VocabParallel<Name>``: ``cls`` with `ParallelGeneration` (and, for an encoder-decoder
    whose head stays vocab-parallel, `Seq2SeqVocabParallelLoss`); one class per kind."""
    key = (cls, seq2seq_loss)
    if key not in _CLASSES:
        name = cls.__name__ if cls.__name__.startswith("VocabParallel") else f"VocabParallel{cls.__name__}"
        mixins = (ParallelGeneration, Seq2SeqVocabParallelLoss) if seq2seq_loss else (ParallelGeneration,)
        namespace = {"__module__": __name__, "__qualname__": name}
        if seq2seq_loss:  # the mixin's forward, seen with the model's own signature
            namespace["forward"] = forward_like(cls.forward)(Seq2SeqVocabParallelLoss.forward)
        _CLASSES[key] = type(name, (*mixins, cls), namespace)
    return _CLASSES[key]


def adapt_class(model: nn.Module) -> None:
    """Route a sharded transformers model's LM loss and ``generate`` through its vocab-parallel head."""
    cls = type(model)
    if not hasattr(cls, "loss_function"):
        return
    head = call_optional(model, "get_output_embeddings")
    loss_function = loss_function_of(model)
    if isinstance(head, VocabParallelLMHead1D) and loss_function in _ROUTED:
        model.loss_function = partial(_ROUTED[loss_function], head=head)
    seq2seq = isinstance(head, VocabParallelLMHead1D) and not head.gather_output and seq2seq_routable(model)
    if seq2seq and not isinstance(model, Seq2SeqVocabParallelLoss):
        _cut_final_logits_bias(model, head)
    if not issubclass(cls, ParallelGeneration) and callable(getattr(model, "_get_logits_processor", None)):
        model.__class__ = vocab_parallel_class(cls, seq2seq)
