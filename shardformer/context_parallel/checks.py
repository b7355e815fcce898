"""What context parallelism can split exactly, checked before anything is cut or any group exists."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardformer.context_parallel.anatomy import StackAnatomy, anatomy_problem
from shardformer.context_parallel.positions import position_rule, takes_position_ids

# attention layer kinds whose masks transformers' create_*_mask functions describe
MASKED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
ORIGINAL_IMPLEMENTATIONS = ("sdpa", "eager")
_CAUSAL_LM_CLASSES = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def is_causal_lm(model: nn.Module) -> bool:
    return any(cls.__name__ in _CAUSAL_LM_CLASSES for cls in type(model).__mro__)


@dataclass(frozen=True)
class ContextParallelPlan:
    """What a model needs under context parallelism, found before anything is cut."""

    original: str  # its attention implementation (attention falls back to it when a forward is not split)
    positions: str | None  # how it derives position ids (a rule of positions.RULES; None: not known)


def check_context_parallel(model: nn.Module, shard_config, anatomy: StackAnatomy | None = None) -> ContextParallelPlan:
    """Raise if ``model`` cannot run with the config's context parallelism; return its plan. ``anatomy``:
    what the model's anatomy says of its layer stack (`shardformer.policies.anatomy.stack_anatomy`),
    checked when given (shard_model and ``shardformer plan`` give it)."""
    cp, mode = shard_config.context_parallel_size, shard_config.context_parallel_mode
    name = type(model).__name__
    why = None
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    if not isinstance(model, PreTrainedModel):
        why = "it is not a transformers model, and attention is split through transformers' attention interface"
    elif not getattr(model, "_supports_attention_backend", False):
        why = (
            "its attention does not go through transformers' attention interface (_supports_attention_backend is False)"
        )
    elif getattr(config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model (cross attention reads another sequence)"
    elif not (is_causal_lm(model) or model.base_model is model):
        why = (
            "only causal language models and base models are split: the loss or head of this class reads "
            "tokens across the sequence (pooling, spans, choices)"
        )
    elif getattr(text, "output_router_logits", False):
        why = "its router auxiliary loss is computed over the whole batch at once (output_router_logits=True)"
    elif set(getattr(text, "layer_types", None) or ()) - MASKED_LAYER_TYPES:
        kinds = sorted(set(text.layer_types) - MASKED_LAYER_TYPES)
        why = f"its layers of type {kinds} mix tokens outside attention (recurrent or convolutional state)"
    elif not takes_position_ids(model):
        why = "its forward takes no position_ids, so the split tokens cannot be given their positions in the sequence"
    elif config._attn_implementation not in ORIGINAL_IMPLEMENTATIONS:
        why = (
            f"it was loaded with attn_implementation={config._attn_implementation!r}; load it with "
            f"attn_implementation='sdpa' or 'eager'"
        )
    elif anatomy is not None:
        why = anatomy_problem(model, anatomy)  # one layer stack, per-token modules after it
    if why is not None:
        raise ValueError(f"context_parallel_size={cp}: {name} cannot be split over the sequence: {why}")
    heads = getattr(text, "num_attention_heads", None)
    tp = shard_config.tensor_parallel_size
    if mode == "all_to_all" and isinstance(heads, int) and heads % (tp * cp) != 0:
        raise ValueError(
            f"context_parallel_mode='all_to_all' gives every rank whole attention heads, but {name} has "
            f"{heads} heads, which tensor_parallel_size={tp} x context_parallel_size={cp} = {tp * cp} does not "
            f"divide; use context_parallel_mode='ring' (any head count) or other sizes"
        )
    if mode == "ring":
        refuse_ring_softmax_changes(model)
    return ContextParallelPlan(config._attn_implementation, position_rule(model))


def refuse_ring_softmax_changes(model: nn.Module) -> None:
    """The ring merges its blocks with a plain online softmax: logit soft-capping and attention sinks
    change that softmax. Attention modules keep them on themselves (``attn_logit_softcapping``, a
    ``sinks`` parameter) and pass them to the attention interface as ``softcap`` / ``s_aux``, where
    the ring would refuse them at the first step; refused here, when the model is sharded."""
    for module in model.modules():
        passed = []
        if getattr(module, "attn_logit_softcapping", None) is not None:
            passed.append("softcap")
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            passed.append("s_aux")
        if passed:
            raise ValueError(
                f"context_parallel_mode='ring' cannot compute {type(module).__name__}'s attention with "
                f"{', '.join(passed)} exactly; use context_parallel_mode='all_to_all'"
            )
