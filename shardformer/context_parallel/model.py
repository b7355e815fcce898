"""Context parallelism on a (sharded) transformers model: its forward takes the full batch on every
cp rank and runs on this rank's tokens.

A forward pre-hook splits the sequence inputs (`shardformer.context_parallel.layout`), gives
position ids from the GLOBAL positions (the caller's, or those the model derives for the whole
sequence: `shardformer.context_parallel.positions`; rotary and absolute embeddings see the true positions),
passes the whole padding mask (the attention masks are evaluated on global positions), and takes
the labels out: they are shifted on the full sequence first (token ``t`` predicts ``t + 1`` even
across a chunk boundary), then split. A forward hook computes the model's own loss on this rank's
tokens, divided by the token count of the whole batch, and sums it over the cp ranks: every rank
returns the full-sequence loss. Logits stay split (this rank's tokens, in the layout's order)
unless ``gather_output``.

Parameters see only this rank's tokens, so their gradients are summed over the cp ranks: by a hook
per parameter, in backward, unless an optimizer sums them itself (`ContextParallel.
sum_grads_elsewhere`: ParallelEngine's ZeroOptimizer folds the sum into its gradient buckets, one
all-reduce over cp per bucket and step instead of one per parameter and backward). A forward that
continues a cache or asks for one (``generate``), or keeps only the last logits (``logits_to_keep``:
``generate(use_cache=False)``), is not split: every cp rank computes it whole, with the model's
original attention. In training, a split forward's functional dropout draws from this cp rank's own
stream (`shardformer.context_parallel.rng`).

Pipeline stages run parts of the model, mostly without its forward: there each stage's forward is
wrapped (`context_parallel_stage_forward`, ParallelEngine at pp > 1) to split its micro-batch
the same way, and the hooks stand by while it runs.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.masking_utils import find_packed_sequence_indices

from shardformer.context_parallel.attention import IMPLEMENTATION, attach_state, register
from shardformer.context_parallel.checks import is_causal_lm
from shardformer.context_parallel.layout import ZigzagLayout, gather_split, layout_for, split_replicated
from shardformer.context_parallel.positions import hook_rotary, pad_id, whole_positions
from shardformer.context_parallel.rng import RankStream
from shardformer.core.comm import all_reduce, group_rank, group_size, reduce_from_parallel
from shardformer.core.position_limit import check_positions, position_tables
from shardformer.core.record import sharding_of

IGNORE = -100
_SPLIT_IDS = ("input_ids", "token_type_ids")  # [batch, seq] inputs taken like input_ids
_TOKEN_INPUTS = (*_SPLIT_IDS, "inputs_embeds", "attention_mask", "position_ids", "labels", "num_items_in_batch")


@dataclass
class SplitForward:
    """One split forward: where the tokens are, the padding mask, this rank's labels."""

    layout: ZigzagLayout
    padding: torch.Tensor
    labels: torch.Tensor | None
    num_items: torch.Tensor | int | None
    positions: torch.Tensor | None = None  # this rank's position ids, as passed to the model
    whole_positions: torch.Tensor | None = None  # every token's (padded): what rotary embeddings see
    attention_calls: int = 0
    masks: list = field(default_factory=list)  # the SplitMasks this forward built (released at its end)
    rotary_whole: set = field(default_factory=set)  # rotary modules now computing the whole sequence


class ContextParallel:
    """The context-parallel state of one model (``sharding_of(model).context_parallel``)."""

    def __init__(self, model: nn.Module, group, mode: str, plan, gather_output: bool) -> None:
        self.group, self.mode, self.original, self.gather_output = group, mode, plan.original, gather_output
        self.position_rule, self.pad_id, self.name = plan.positions, pad_id(model), type(model).__name__
        self.position_tables = position_tables(model)  # each rank reads other positions: checked before the split
        self.stream = RankStream(group_rank(group))  # functional dropout: each rank's tokens their own masks
        self.world = group_size(group)
        self.causal_lm = is_causal_lm(model)
        self.proven = False  # shard_model proved the split on a tiny copy of the instance (policies/context_proof.py)
        self.current: SplitForward | None = None  # set while a split forward runs
        self.grad_split = False  # the latest forward under autograd was split
        self.stage_split = False  # a pipeline stage split its micro-batch itself (split_stage): hooks stand by
        self._hooked: set[int] = set()
        self._summed_elsewhere: set[int] = set()  # ids of parameters an optimizer sums over cp itself
        self._signature = inspect.signature(model.forward)

    def sum_grads_elsewhere(self, params) -> None:
        """The caller sums these parameters' gradients over the cp group itself (after backward, in
        buckets); their hooks leave them as this rank computed them. Such a model refuses a forward
        under autograd that is not split (each rank's gradient would be whole, and summed cp times)."""
        self._summed_elsewhere.update(id(p) for p in params)

    # -- forward hooks ------------------------------------------------------------------------------

    def before(self, model: nn.Module, args, kwargs):
        if self.stage_split:  # the last stage's model forward, on inputs split_stage split already
            return None
        self.current = None
        self.stream.leave()  # a split forward that raised left its stream on
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        for name, p in self._signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                bound.update(bound.pop(name, {}))
        split = splits(bound)
        if torch.is_grad_enabled():
            if not split and self._summed_elsewhere:
                raise ValueError(
                    "context parallelism: a forward with a cache (past_key_values or use_cache=True) or with "
                    "logits_to_keep is not split, "
                    "so every cp rank computes the whole gradient, but this model's optimizer sums gradients over "
                    "the cp ranks (ParallelEngine); train without a cache (use_cache=False), or run it under "
                    "torch.no_grad()"
                )
            self.grad_split = split
            self._hook_new_parameters(model)
        if not split:
            return (), bound
        kw = self._split(bound)
        self.stream.enter(model.training, self.current.padding.device)
        return (), kw

    def after(self, model: nn.Module, _args, _kwargs, output):
        if self.stage_split:
            return None
        current, self.current = self.current, None
        if current is None:
            return None
        self.stream.leave()
        for mask in current.masks:
            mask.release()
        _check_attention_ran(model, current)
        return self._finish(model, output, current)

    @contextmanager
    def split_stage(self, model: nn.Module, inputs: dict):
        """A pipeline stage on this rank's tokens of a micro-batch: yields the split inputs (the stage
        forward runs on them; received hidden states are already this rank's tokens) and a function
        that turns the last stage's output into the full-sequence loss, as a model forward does.
        Every stage of a cp rank splits the same way, so the hidden states between stages match."""
        if torch.is_grad_enabled():
            self.grad_split = True
            self._hook_new_parameters(model)
        kw = self._split(dict(inputs))
        current = self.current
        self.stage_split = True
        self.stream.enter(model.training, current.padding.device)
        try:
            yield kw, partial(self._finish, model, current=current)
            _check_attention_ran(model, current)
        finally:
            self.stream.leave()
            self.stage_split, self.current = False, None
            for mask in current.masks:
                mask.release()

    def _finish(self, model: nn.Module, output, current: SplitForward):
        """The loss over the whole batch from this rank's logits; the logits gathered if asked."""
        logits = output.get("logits") if self.causal_lm and hasattr(output, "get") else None
        if current.labels is not None and logits is None:
            raise ValueError(
                f"context parallelism: {type(model).__name__}'s last stage returned no logits to compute the "
                f"loss of its labels on"
            )
        if current.labels is not None:
            local = model.loss_function(
                logits=logits,
                labels=current.labels,
                vocab_size=model.config.get_text_config().vocab_size,
                num_items_in_batch=current.num_items,
                shift_labels=current.labels,
            )
            output["loss"] = reduce_from_parallel(local.contiguous(), self.group)  # backward: each rank its tokens
        if self.gather_output and logits is not None:
            output["logits"] = gather_split(logits, current.layout, self.group)
        return output

    def gather(self, x: torch.Tensor, full_len: int) -> torch.Tensor:
        """The whole sequence (in order) of a split output ``x`` of a ``full_len``-token forward."""
        return gather_split(x, layout_for(full_len, self.group), self.group)

    # -- the split ---------------------------------------------------------------------------------

    def _split(self, kw: dict) -> dict:
        ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
        source = ids if ids is not None else embeds
        name = type(self).__name__
        if source is None:
            raise ValueError(f"{name}: context parallelism splits input_ids or inputs_embeds; the forward got neither")
        batch, length = source.shape[:2]
        refused = {
            "return_dict=False": kw.get("return_dict") is False,
            "output_attentions=True": bool(kw.get("output_attentions")),
            "shift_labels": kw.get("shift_labels") is not None,
        }
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ValueError(
                f"context parallelism cannot split a forward with {', '.join(bad)}; pass the batch's input_ids "
                f"(or inputs_embeds), attention_mask, position_ids and labels only"
            )
        refuse_other_inputs(kw)
        layout = layout_for(length, self.group)
        device = source.device
        mask = kw.get("attention_mask")
        if mask is not None and tuple(mask.shape) != (batch, length):
            raise ValueError(
                f"context parallelism takes a 2D attention_mask [batch, seq] = {(batch, length)}, got "
                f"{tuple(mask.shape)}; a custom 4D mask cannot be split"
            )
        positions = kw.get("position_ids")
        if positions is not None and mask is None and find_packed_sequence_indices(positions) is not None:
            raise ValueError(
                "context parallelism: position_ids restart inside a row (packed sequences) without an attention_mask; "
                "the packed-sequence mask transformers infers from them cannot be split, pass unpacked rows"
            )
        padding = torch.ones(batch, length, dtype=torch.bool, device=device) if mask is None else mask.bool()
        padding = layout.pad(padding, False)
        if positions is None:  # the ones the model derives for the whole sequence
            positions = whole_positions(self.position_rule, self.name, self.pad_id, ids, mask, batch, length, device)
        check_positions(self.position_tables, positions)  # on every rank alike, before any rank's collective
        kw["position_ids"] = layout.take(positions)
        kw["attention_mask"] = padding  # whole: masks are evaluated at global positions
        for key in _SPLIT_IDS:
            if kw.get(key) is not None:
                kw[key] = layout.take(kw[key])
        if embeds is not None:
            kw["inputs_embeds"] = split_replicated(embeds, layout, self.group)
        labels, num_items = kw.pop("labels", None), kw.pop("num_items_in_batch", None)
        if labels is not None:
            if not self.causal_lm:
                raise ValueError("context parallelism computes the loss of causal language models only")
            shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]  # on the whole sequence, before the split
            if num_items is None:
                num_items = (shifted != IGNORE).sum()
            labels = layout.take(shifted, IGNORE)
        if "use_cache" in self._signature.parameters or _takes_kwargs(self._signature):
            kw["use_cache"] = False
        self.current = SplitForward(layout, padding, labels, num_items, kw["position_ids"], layout.pad(positions))
        return kw

    # -- gradients ---------------------------------------------------------------------------------

    def _hook_new_parameters(self, model: nn.Module) -> None:
        """Every trainable parameter (adapters added after sharding too) sums its gradient over cp."""
        for p in model.parameters():
            if p.requires_grad and id(p) not in self._hooked:
                p.register_hook(partial(self._reduce_grad, id(p)))
                self._hooked.add(id(p))

    def _reduce_grad(self, param_id: int, grad: torch.Tensor) -> torch.Tensor:
        if not self.grad_split or param_id in self._summed_elsewhere:
            return grad
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), self.group)


def refuse_other_inputs(arguments: dict) -> None:
    """A split forward takes the token inputs only. A model merges other inputs (image or audio
    features) into the sequence at the positions of their tokens, which only the whole sequence
    holds: each rank would place them differently (one rank's check of the feature count fails while
    the other waits in attention). Refused here, before anything communicates; the inputs are the
    same on every cp rank, so every rank refuses alike."""
    other = [k for k, v in arguments.items() if k not in _TOKEN_INPUTS and _holds_tensor(v)]
    if other:
        raise ValueError(
            f"context parallelism cannot split a forward with {', '.join(other)}: it splits the token inputs "
            f"only (input_ids or inputs_embeds, token_type_ids, attention_mask, position_ids, labels), and a model "
            f"merges other inputs (image or audio features) into the sequence at the positions of their tokens, "
            f"which no rank holds whole; pass text only, or shard with context_parallel_size=1"
        )


def _holds_tensor(value) -> bool:
    return torch.is_tensor(value) or (isinstance(value, (list, tuple)) and any(map(torch.is_tensor, value)))


def splits(arguments: dict) -> bool:
    """Whether a forward with these arguments (by keyword) runs split: it neither continues a cache
    nor asks for one, nor keeps only the last positions' logits (generate without a cache); such a
    forward runs whole on every cp rank."""
    cache = arguments.get("past_key_values", arguments.get("cache"))  # transformers 5.24 names it `cache`
    return cache is None and not arguments.get("use_cache") and arguments.get("logits_to_keep") in (None, 0)


def _check_attention_ran(model: nn.Module, current: SplitForward) -> None:
    if current.attention_calls == 0:
        raise ValueError(
            f"context parallelism: {type(model).__name__}'s forward ran on a split sequence without calling "
            f"transformers' attention interface, so its attention saw only this rank's tokens; shard it with "
            f"context_parallel_size=1"
        )


def _takes_kwargs(signature: inspect.Signature) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def context_parallel_stage_forward(stage_forward):
    """A pipeline spec's stage forward on this cp rank's tokens (every stage splits the micro-batch
    the same way; the last one's loss is the full-sequence loss of `ContextParallel.after`)."""

    def forward(model: nn.Module, hidden, inputs: dict):
        info = sharding_of(model)
        with info.context_parallel.split_stage(model, inputs) as (split, finish):
            out = stage_forward(model, hidden, split)
            return finish(out) if info.is_last_stage else out

    return forward


def apply_context_parallel(model: nn.Module, group, mode: str, plan, gather_output: bool) -> ContextParallel:
    """Install context parallelism on ``model`` (already sharded for tensor parallelism); ``plan``:
    what `shardformer.context_parallel.checks.check_context_parallel` found."""
    register()
    state = ContextParallel(model, group, mode, plan, gather_output)
    model.set_attn_implementation(IMPLEMENTATION)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")}
    for config in configs.values():  # modules holding their own copy (tp's per-module local configs)
        if config._attn_implementation != IMPLEMENTATION:
            config._attn_implementation = IMPLEMENTATION
    attach_state(configs.values(), state)
    hook_rotary(model, state)
    model.register_forward_pre_hook(state.before, with_kwargs=True)
    model.register_forward_hook(state.after, with_kwargs=True)
    return state
