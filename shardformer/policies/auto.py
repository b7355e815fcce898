"""The policy for a model with none given: its family's (a record in :mod:`shardformer.models`),
else one derived from the model's own transformers tensor-parallel plan, else one derived from the
model's structure (proven on a tiny copy by ``shard_model`` before use)."""

from __future__ import annotations

import torch.nn as nn

from shardformer.models import family_of, model_class_name, supported_models
from shardformer.policies.derived import DerivedPolicy, derived_model
from shardformer.policies.tp_plan import TpPlanPolicy, has_tp_plan
from shardformer.tensor_parallel.policy import Policy

__all__ = ["get_autopolicy", "supported_models"]


def get_autopolicy(model: nn.Module) -> Policy:
    """A fresh instance of the built-in policy for ``model``'s class, else one derived from the
    model's transformers tensor-parallel plan, else one derived from its structure, else a
    ValueError listing the built-ins."""
    family = family_of(model)
    if family is not None:
        return family.policies[model_class_name(model)]()
    if has_tp_plan(model):  # built-ins first; then the model's own tensor-parallel plan
        return TpPlanPolicy(tower_policy=DerivedPolicy)  # a vision tower the plan leaves whole: derived
    if derived_model(model):  # then the model's own structure
        return DerivedPolicy()
    raise ValueError(
        f"no built-in policy for {type(model).__name__}; supported: {', '.join(supported_models())}, and any "
        f"transformers model whose config has a base_model_tp_plan or whose blocks can be traced. For another model, "
        f"write a Policy subclass and pass it: shard_model(model, config, policy=MyPolicy())"
    )
