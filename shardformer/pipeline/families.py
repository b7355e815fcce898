"""Pipeline specs of the built-in families: which modules go where, and each family's stage forward.

The stage forwards re-run the model's own forward from its parts, without KV cache: embeddings on
the first stage, this stage's layers (:func:`local_layers`), norm and head with the loss on the last.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, ImageClassifierOutput, MaskedLMOutput

from shardformer.pipeline.from_plan import spec_from_pp_plan
from shardformer.pipeline.spec import PipelineSpec, local_layers, stage_of
from shardformer.policies.lm_heads import token_loss


def gpt2_lm_stage_forward(model, hidden, inputs):
    """One pipeline stage of GPT2LMHeadModel on a micro-batch."""
    t = model.transformer
    stage, num_stages = stage_of(model)
    ids = inputs.get("input_ids")
    seq = ids.shape[-1] if ids is not None else hidden.shape[1]
    position_ids = inputs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq, device=(ids if ids is not None else hidden).device).unsqueeze(0)
    if stage == 0:
        hidden = t.wte(ids) + t.wpe(position_ids)
        if inputs.get("token_type_ids") is not None:
            hidden = hidden + t.wte(inputs["token_type_ids"])
        hidden = t.drop(hidden)
    mask = inputs.get("attention_mask")
    if mask is not None and mask.ndim < 4:
        mask = mask.view(hidden.shape[0], -1)
    mask = create_causal_mask(
        config=t.config, inputs_embeds=hidden, attention_mask=mask, past_key_values=None, position_ids=position_ids
    )
    for block in local_layers(model, t.h):
        hidden = block(hidden, None, mask, None, use_cache=False, position_ids=position_ids)
    if stage < num_stages - 1:
        return hidden
    logits = model.lm_head(t.ln_f(hidden))
    loss = None
    if inputs.get("labels") is not None:
        loss = model.loss_function(logits, inputs["labels"], vocab_size=model.config.vocab_size)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


def bert_mlm_stage_forward(model, hidden, inputs):
    """One pipeline stage of BertForMaskedLM on a micro-batch."""
    b = model.bert
    stage, num_stages = stage_of(model)
    if stage == 0:
        hidden = b.embeddings(
            input_ids=inputs.get("input_ids"),
            token_type_ids=inputs.get("token_type_ids"),
            position_ids=inputs.get("position_ids"),
        )
    mask, _ = b._create_attention_masks(
        attention_mask=inputs.get("attention_mask"),
        encoder_attention_mask=None,
        embedding_output=hidden,
        encoder_hidden_states=None,
        past_key_values=None,
    )
    for layer in local_layers(model, b.encoder.layer):
        hidden = layer(hidden, mask)
    if stage < num_stages - 1:
        return hidden
    logits = model.cls(hidden)
    labels = inputs.get("labels")
    loss = None if labels is None else token_loss(logits, labels, model.cls.predictions.decoder)
    return MaskedLMOutput(loss=loss, logits=logits)


def vit_classification_stage_forward(model, hidden, inputs):
    """One pipeline stage of ViTForImageClassification on a micro-batch."""
    v = model.vit
    stage, num_stages = stage_of(model)
    if stage == 0:
        pixels = inputs["pixel_values"]
        dtype = v.embeddings.patch_embeddings.projection.weight.dtype
        hidden = v.embeddings(pixels.to(dtype), interpolate_pos_encoding=inputs.get("interpolate_pos_encoding"))
    mask = create_bidirectional_mask(config=v.config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"))
    for layer in local_layers(model, v.layers):
        hidden = layer(hidden, mask)
    if stage < num_stages - 1:
        return hidden
    logits = model.classifier(v.layernorm(hidden)[:, 0, :])
    labels = inputs.get("labels")
    loss = None if labels is None else model.loss_function(labels, logits, model.config)
    return ImageClassifierOutput(loss=loss, logits=logits)


def timm_vit_stage_forward(model, hidden, inputs):
    """One pipeline stage of timm's VisionTransformer (input ``x``); returns logits: the engine needs
    a loss_fn."""
    stage, num_stages = stage_of(model)
    if stage == 0:
        hidden = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(inputs["x"]))))
    for block in local_layers(model, model.blocks):
        hidden = block(hidden)
    if stage < num_stages - 1:
        return hidden
    return model.forward_head(model.norm(hidden))


# Keyed by class name (found anywhere in the model's MRO, so a class swapped in by inject_policy
# still finds its family) to keep timm an import the engine does not need.
BUILTIN_SPECS: dict[str, PipelineSpec] = {
    # wte is tied to lm_head: on both end stages
    "GPT2LMHeadModel": PipelineSpec(
        layers="transformer.h",
        stage_forward=gpt2_lm_stage_forward,
        first=("transformer.wpe",),
        last=("transformer.ln_f", "lm_head"),
        shared=("transformer.wte",),
    ),
    # word embeddings are tied to the MLM decoder: on both end stages
    "BertForMaskedLM": PipelineSpec(
        layers="bert.encoder.layer",
        stage_forward=bert_mlm_stage_forward,
        first=tuple(f"bert.embeddings.{n}" for n in ("position_embeddings", "token_type_embeddings", "LayerNorm")),
        last=("cls", "bert.pooler"),
        shared=("bert.embeddings.word_embeddings",),
    ),
    "ViTForImageClassification": PipelineSpec(
        layers="vit.layers",
        stage_forward=vit_classification_stage_forward,
        first=("vit.embeddings",),
        last=("vit.layernorm", "vit.pooler", "classifier"),
    ),
    "VisionTransformer": PipelineSpec(
        layers="blocks",
        stage_forward=timm_vit_stage_forward,
        first=("patch_embed", "cls_token", "reg_token", "pos_embed", "pos_drop", "patch_drop", "norm_pre"),
        last=("norm", "attn_pool", "fc_norm", "head_drop", "head"),
    ),
}


def builtin_spec(model: nn.Module) -> PipelineSpec | None:
    """The hand-written spec of ``model``'s family, if it has one."""
    for cls in type(model).__mro__:
        if cls.__name__ in BUILTIN_SPECS:
            return BUILTIN_SPECS[cls.__name__]
    return None


def pipeline_spec_for(model: nn.Module) -> PipelineSpec:
    """The built-in pipeline spec of ``model``'s class, or an error naming what to do instead."""
    builtin = builtin_spec(model)
    if builtin is not None:
        return builtin
    derived = spec_from_pp_plan(model)  # transformers' own base_model_pp_plan
    if derived is not None:
        return derived
    raise NotImplementedError(
        f"no built-in pipeline split for {type(model).__name__} (built-in: {', '.join(sorted(BUILTIN_SPECS))}); "
        f"pass ParallelEngine(..., pipeline=PipelineSpec(layers=..., first=..., last=..., shared=..., "
        f"stage_forward=...)) or use pp=1"
    )
