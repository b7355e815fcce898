"""Policies derived from transformers' own tensor-parallel plans (``base_model_tp_plan``)."""

from shardformer.policies.tp_plan.policy import TpPlanPolicy, has_tp_plan, model_tp_plan
from shardformer.policies.tp_plan.styles import UnsupportedStyleError

__all__ = ["TpPlanPolicy", "UnsupportedStyleError", "has_tp_plan", "model_tp_plan"]
