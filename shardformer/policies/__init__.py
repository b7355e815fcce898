"""Policies: how each model family is sharded. ``base`` holds the API for custom policies."""

from shardformer.policies.auto import get_autopolicy, supported_models
from shardformer.policies.base import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, divide

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
