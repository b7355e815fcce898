"""The policy for a model with none given: the first of its candidate routes (its family's record in
`shardformer.models`, else its transformers tensor-parallel plan, else the cut derived from its
structure). A hypothesis only: ``shard_model`` proves each route on a tiny copy before use and takes
the next when one is not exact (`shardformer.policies.routes`)."""

from __future__ import annotations

import torch.nn as nn

from shardformer.models import supported_models
from shardformer.policies.routes import candidate_routes, no_route_error
from shardformer.tensor_parallel.policy import Policy

__all__ = ["get_autopolicy", "supported_models"]


def get_autopolicy(model: nn.Module) -> Policy:
    """A fresh instance of the first candidate route's policy for ``model`` (unproven), else a
    ValueError listing the built-ins."""
    routes = candidate_routes(model)
    if not routes:
        raise no_route_error(model)
    return routes[0].make()
