"""Policies: the Policy API for custom models (defined in `shardformer.tensor_parallel.policy`,
the sharder's input), the automatic choice (``auto``) and policies derived from transformers' own
tensor-parallel plans (``tp_plan``). Hand-written families' policies live in their records
(`shardformer.models`)."""

from shardformer.policies.auto import get_autopolicy, supported_models
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, divide

__all__ = [
    "Argument",
    "Col_Layer",
    "Dropout_Layer",
    "Layer",
    "Policy",
    "Row_Layer",
    "divide",
    "get_autopolicy",
    "supported_models",
]
