"""The study of the model the user passed: one record, made once, before anything is cut.

``shard_model`` and ``ParallelEngine`` build it first and hand it down; each technique reads what it
needs from it as data: the instance (what it adds to its class, the key every verdict holds), its
layer stacks and final norm, what runs around its stack (context parallelism), the
routes that may cut it (tensor parallelism), where its experts go (expert parallelism), and the
pipeline spec it is split by (pipeline parallelism). The questions the techniques ask again deeper
down (the repeated blocks, the stacks, the instance) are answered once per model while the study's
block is open (`shardformer.core.study_memo.studied_once`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from shardformer.context_parallel.anatomy import StackAnatomy
from shardformer.core.config import ShardConfig
from shardformer.core.instance import Instance, study_instance
from shardformer.core.record import build_mesh
from shardformer.expert_parallel import ExpertLayout, check_expert_parallel, plan_expert_parallel
from shardformer.models import family_spec
from shardformer.pipeline.spec import PipelineSpec
from shardformer.policies.anatomy import final_norm, one_stack, stack_anatomy, stacks
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from shardformer.policies.routes import Route, candidate_routes, route_of
from shardformer.tensor_parallel.policy import Policy


@dataclass
class ModelStudy:
    """What every technique asks of one model, asked once (fields a technique that is off does not need
    are None)."""

    instance: Instance  # what the user's instance adds to its class; its key is in every verdict
    stacks: tuple[str, ...]  # the repeated layer stacks (an encoder-decoder's two)
    routes: list[Route]  # tensor parallelism: the routes tried in order (the user's policy alone, if given)
    final_norm: str | None  # sequence parallelism ends at it
    stack_anatomy: StackAnatomy | None = None  # context parallelism: the stacks and what runs after them
    experts: ExpertLayout | None = None  # expert parallelism: where the experts go (found and proven)

    @property
    def layer_stack(self) -> str | None:
        """The one stack, or None (none, or several: each technique that needs one says so)."""
        return one_stack(self.stacks)

    def sharder_args(self, **more) -> dict:
        """What the tensor-parallel sharder reads of the model."""
        found = dict(layers=self.layer_stack, final_norm=self.final_norm, **more)
        if self.stack_anatomy is not None:
            found["stack_anatomy"] = self.stack_anatomy
        return found


def study_model(model: nn.Module, shard_config: ShardConfig, policy: Policy | None = None) -> ModelStudy:
    """The study of ``model`` for ``shard_config`` (every rank calls it: the experts' place is proven over
    the mesh `with_expert_mesh` put in the config). Call it inside
    `shardformer.core.study_memo.studied_once`."""
    instance = study_instance(model)  # first, before anything is cut: every copy and verdict reads it
    study = ModelStudy(
        instance=instance,
        stacks=stacks(model),
        routes=candidate_routes(model) if policy is None else [route_of(policy, model)],
        # the structural final norm needs a forward of a tiny copy: only sequence parallelism reads it
        final_norm=final_norm(model, structural=shard_config.sequence_parallel),
    )
    if shard_config.context_parallel_size > 1:  # context parallelism checks the stack and what runs after it
        study.stack_anatomy = stack_anatomy(model)
    if shard_config.expert_parallel_size > 1:  # found and proven on the model as the user gave it
        study.experts = plan_expert_parallel(model, shard_config.mesh, shard_config.prove)
    return study


def with_expert_mesh(model: nn.Module, shard_config: ShardConfig) -> ShardConfig:
    """``shard_config`` with the mesh built once where expert parallelism needs one (group creation is
    collective: the experts' proof and the cut use the same groups), after the experts were found
    (before any collective: a model without them is refused first)."""
    if shard_config.expert_parallel_size == 1:
        return shard_config
    check_expert_parallel(model, shard_config.expert_parallel_size)
    shard_config.check_world()
    if shard_config.mesh is not None:
        return shard_config
    return dataclasses.replace(shard_config, mesh=build_mesh(shard_config)[0])


def pipeline_spec(model: nn.Module, pp: int, given: PipelineSpec | None) -> PipelineSpec | None:
    """The spec ``model`` is split by: the given one, else at pp > 1 the first route proven exact
    (family spec, pp plan, anatomy), else its family's (pp=1: only the stage forward is read)."""
    if given is not None:
        return given
    return pipeline_spec_for(model) if pp > 1 else family_spec(model)
