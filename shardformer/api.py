"""``shard_model``: the one-liner. Picks the first route that proves exact on a tiny copy (the model
family's policy, transformers' own plan, the derived cut: `shardformer.policies.routes`) and the
layer stack (the model's anatomy, `shardformer.policies.anatomy`), then lets the sharder cut."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from shardformer.core.config import ShardConfig
from shardformer.core.example_inputs import give_example_inputs
from shardformer.core.instance import guard_attention
from shardformer.core.record import attach, sharding_of
from shardformer.core.study_memo import studied_once
from shardformer.core.versions import warn_if_untested
from shardformer.expert_parallel import split_experts
from shardformer.pipeline.spec import PipelineSpec
from shardformer.policies.context_proof import require_context_parallel, with_mesh
from shardformer.policies.routes import choose
from shardformer.study import study_model, with_expert_mesh
from shardformer.tensor_parallel.adapters import SeenThrough
from shardformer.tensor_parallel.policy import Policy


def shard_model(model: nn.Module, shard_config: ShardConfig | None = None, policy: Policy | None = None) -> nn.Module:
    """Shard ``model`` in place for tensor parallelism and return it.

    With ``policy`` None the routes are tried in order: the built-in policy for the model's class
    (BERT, GPT-2, ViT, timm ViT), the model's transformers tensor-parallel plan, a cut derived from
    the model's structure. Each is proven on a tiny copy of the model before it is used (outputs,
    loss and every gradient against the unsharded copy); the first exact one cuts the model, and when
    none is, the model is refused naming each route's first diverging module. A library policy
    passed as ``policy`` is proven the same way (refused, not replaced); your own Policy subclass is
    used as written. ``ShardConfig(prove=False)`` skips the proofs (with a warning). The sharded
    model records how it was sharded, the route and whether it was proven, in ``model.shardformer``
    (a ShardedModelInfo).

    PEFT LoRA layers in the model (or a ``PeftModel``, whose wrapped model is sharded) are seen
    through: their base layers are cut by the policy, and their adapters the same way.

    ``pipeline_parallel_size > 1`` is refused before any collective: ``shard_model`` does not split a
    model into stages (every rank would hold every layer and train a copy of the others' work);
    ``ParallelEngine(model, optimizer, EngineConfig(pp=...))`` does.
    """
    shard_config = shard_config or ShardConfig()
    pp = shard_config.pipeline_parallel_size
    if pp > 1:
        raise ValueError(
            f"train in pipeline stages with ParallelEngine(model, optimizer, EngineConfig(pp={pp}, tp=...)), or use "
            f"ShardConfig(pipeline_parallel_size=1): shard_model does not split a model into stages, so at "
            f"pipeline_parallel_size={pp} every rank would hold every layer and train a copy of the others' work"
        )
    return shard_before_split(model, shard_config, policy, None)


def shard_before_split(
    model: nn.Module, shard_config: ShardConfig, policy: Policy | None, pipeline: PipelineSpec | None
) -> nn.Module:
    """`shard_model` for a caller that keeps one pipeline stage of ``model`` right after, by
    ``pipeline`` (ParallelEngine): the model is cut for tensor parallelism over a mesh with pp > 1. A
    spec is required at pp > 1, so that no model is left whole on a pipeline mesh."""
    if shard_config.pipeline_parallel_size > 1 and not isinstance(pipeline, PipelineSpec):
        raise TypeError(f"shard_before_split at pipeline_parallel_size > 1 needs the PipelineSpec, not {pipeline!r}")
    warn_if_untested()  # once per process: a transformers or timm release the suite did not run on
    target = _wrapped_model(model)
    give_example_inputs(target, shard_config.example_inputs)  # before the study: its copies and key carry them
    adapters = SeenThrough.unwrap(target)  # PEFT's LoRA layers: the policy sees the layers they wrap
    try:
        with studied_once():  # the instance is studied once: its tiny copy, derivation, proofs and anatomy
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
    shard_config = with_expert_mesh(model, shard_config)  # before any other collective
    study = study_model(model, shard_config, policy)  # every technique below reads this one study
    sharder_args = study.sharder_args(adapters=adapters)
    sharder, plan, route, proven = choose(model, shard_config, study.routes, sharder_args, chosen=policy is not None)
    context_proven = False
    if plan.attention is not None:  # cp > 1: the split of the instance proven at the user's tp x cp before the cut
        sharder.shard_config = with_mesh(sharder.shard_config)
        context_proven = require_context_parallel(model, sharder.shard_config, route)
    sharder.shard(plan)
    if context_proven:
        sharding_of(model).context_parallel.proven = True
    if study.experts is not None:
        split_experts(model, study.experts)
    record = sharding_of(model)
    attach(
        model,
        dataclasses.replace(record, route=route.name, proven=proven, experts=study.experts, study=study),
    )
    if record.context_parallel is None:  # context parallelism sets it itself, forward by forward
        guard_attention(model)  # the attention implementation stays the one proven
    return model
