"""``shard_model``: the one-liner. Picks the policy (the model family's, or one derived from
transformers' own plan) and the layer stack (the family's anatomy), then lets the sharder cut."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from shardformer.core.config import ShardConfig
from shardformer.core.record import build_mesh, sharding_of
from shardformer.core.versions import warn_if_untested
from shardformer.models import final_norm, layer_stack
from shardformer.policies.auto import get_autopolicy
from shardformer.policies.derived import prove
from shardformer.policies.tp_plan import TpPlanPolicy
from shardformer.tensor_parallel.adapters import SeenThrough
from shardformer.tensor_parallel.policy import Policy
from shardformer.tensor_parallel.sharder import ModelSharder


def shard_model(model: nn.Module, shard_config: ShardConfig | None = None, policy: Policy | None = None) -> nn.Module:
    """Shard ``model`` in place for tensor parallelism and return it.

    ``policy`` defaults to the built-in policy for the model's class (BERT, GPT-2, ViT, timm ViT),
    else one derived from the model's transformers tensor-parallel plan, else one derived from the
    model's structure and proven on a tiny copy of it first (exact, or refused with the first
    diverging module). The sharded model records
    how it was sharded in ``model.shardformer`` (a ShardedModelInfo).

    PEFT LoRA layers in the model (or a ``PeftModel``, whose wrapped model is sharded) are seen
    through: their base layers are cut by the policy, and their adapters the same way.
    """
    warn_if_untested()  # once per process: a transformers or timm release the suite did not run on
    shard_config = shard_config or ShardConfig()
    target = _wrapped_model(model)
    adapters = SeenThrough.unwrap(target)  # PEFT's LoRA layers: the policy sees the layers they wrap
    try:
        _shard(target, shard_config, policy, adapters)
    except BaseException:
        adapters.restore()
        raise
    adapters.rewrap(sharding_of(target).tp_group)  # the adapters cut like their base layers
    return model


def _wrapped_model(model: nn.Module) -> nn.Module:
    """The model a PEFT model (``PeftModel``: ``get_base_model()``) wraps, which is what gets sharded;
    any other model itself."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def _shard(model: nn.Module, shard_config: ShardConfig, policy: Policy | None, adapters: SeenThrough) -> nn.Module:
    policy = policy or get_autopolicy(model)
    sharder = ModelSharder(
        model, policy, shard_config, layers=layer_stack(model), adapters=adapters, final_norm=final_norm(model)
    )
    if isinstance(policy, TpPlanPolicy) and shard_config.tensor_parallel_size > 1:
        sharder.plan()  # every refusal first, before any collective
        parts = policy.proven_parts()  # derived cuts: the whole model, or the towers a plan leaves whole
        if parts:
            mesh, _ = build_mesh(shard_config)  # once: the proof and the model use the same tp group
            if mesh is not None:
                sharder.shard_config = dataclasses.replace(shard_config, mesh=mesh)
            for part in parts:
                prove(model, sharder.shard_config, part)
    return sharder.shard()
