"""The built-in policy for a model, chosen by its class."""

from __future__ import annotations

import importlib

import torch.nn as nn

from shardformer.policies.base import Policy
from shardformer.policies.tp_plan import TpPlanPolicy, has_tp_plan

# class name -> (module, policy class name); each policy module is imported only when its family is
# sharded, so sharding a GPT-2 never imports timm
_POLICIES: dict[str, tuple[str, str]] = {
    **{
        name: ("shardformer.policies.bert", "BertPolicy")
        for name in (
            "BertModel",
            "BertForNextSentencePrediction",
            "BertForSequenceClassification",
            "BertForMultipleChoice",
            "BertForTokenClassification",
            "BertForQuestionAnswering",
        )
    },
    "BertForMaskedLM": ("shardformer.policies.bert", "BertForMaskedLMPolicy"),
    "BertForPreTraining": ("shardformer.policies.bert", "BertForPreTrainingPolicy"),
    "BertLMHeadModel": ("shardformer.policies.bert", "BertLMHeadModelPolicy"),
    **{
        name: ("shardformer.policies.gpt2", "GPT2Policy")
        for name in (
            "GPT2Model",
            "GPT2ForSequenceClassification",
            "GPT2ForTokenClassification",
            "GPT2ForQuestionAnswering",
        )
    },
    "GPT2LMHeadModel": ("shardformer.policies.gpt2", "GPT2LMHeadPolicy"),
    "GPT2DoubleHeadsModel": ("shardformer.policies.gpt2", "GPT2DoubleHeadsPolicy"),
    **{
        name: ("shardformer.policies.vit", "ViTPolicy")
        for name in ("ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling")
    },
    "VisionTransformer": ("shardformer.policies.timm_vit", "TimmViTPolicy"),
}


def supported_models() -> list[str]:
    return sorted(_POLICIES)


def get_autopolicy(model: nn.Module) -> Policy:
    """A fresh instance of the built-in policy for ``model``'s class, else one derived from the
    model's transformers tensor-parallel plan, else a ValueError listing the built-ins."""
    name = type(model).__name__
    if name not in _POLICIES:
        if has_tp_plan(model):  # built-ins first; then the model's own tensor-parallel plan
            return TpPlanPolicy()
        raise ValueError(
            f"no built-in policy for {name}; supported: {', '.join(supported_models())}, and any transformers "
            f"model whose config has a base_model_tp_plan. For another model, "
            f"write a Policy subclass and pass it: shard_model(model, config, policy=MyPolicy())"
        )
    module, cls = _POLICIES[name]
    return getattr(importlib.import_module(module), cls)()
