"""Which policy cuts a model: the routes in order, each proven before it is used.

A route proposes a cut: the model family's hand-written policy, transformers' own tensor-parallel
plan, or the cut derived from the model's structure. Each in turn is resolved against the user's
model (every refusal before any collective), then proven on a tiny copy (`.proof`); the first
that proves exact is used. A route that cannot cut the model, or whose proof fails, hands over to
the next; when none is left the model is refused, naming each route's reason (the first diverging
module where a proof ran). ``ShardConfig(prove=False)`` takes the first route that resolves,
unproven, with a warning.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.nn as nn

from shardformer.core.config import ShardConfig
from shardformer.core.instance import study_instance
from shardformer.core.record import build_mesh
from shardformer.core.refusal import DATA_PARALLEL, POLICY, Refusal, has_convolutions, indent, parts_of
from shardformer.models import family_of, model_class_name, supported_models
from shardformer.policies.derived import DerivedPolicy, NotDerivableError, NotProvenError, derive, derived_model
from shardformer.policies.derived.blocks import blocks_to_cut, is_projection
from shardformer.policies.derived.policy import with_pooling_heads
from shardformer.policies.proof import prove
from shardformer.policies.tp_plan import TpPlanPolicy, UnsupportedStyleError, has_tp_plan
from shardformer.policies.tp_plan.policy import plan_leaves_whole
from shardformer.tensor_parallel.policy import NoCut, Policy
from shardformer.tensor_parallel.sharder import ModelSharder

logger = logging.getLogger("shardformer")

BUILT_IN, PLAN, DERIVED, CUSTOM = "built-in policy", "tp plan", "derived", "custom policy"
NONE = "none: tp=1"  # no route cuts the model and at tp=1 none needs to: it is kept whole
# what a route raises when it cannot cut this model: the next route is tried (anything else is the
# user's input, raised as it is)
ROUTE_ERRORS = (NotDerivableError, UnsupportedStyleError, NotImplementedError)


@dataclass
class Route:
    name: str
    make: Callable[[], Policy]  # a fresh policy (one for the user's model, one for the tiny copy)
    leaves_whole: list[str] = field(default_factory=list)  # projections inside cut blocks a plan does not name

    def heads(self, model: nn.Module, tp: int) -> int | None:
        """The tiny copy's query heads (the derived route may have found its cut on a wider copy)."""
        if self.name != DERIVED or not blocks_to_cut(model) and has_convolutions(model):
            return None  # a convnet's channel cut counts no heads
        return derive(model, tp).heads


def candidate_routes(model: nn.Module) -> list[Route]:
    """The routes that may cut ``model``, in the order they are tried."""
    routes = []
    family = family_of(model)
    if family is not None:
        routes.append(Route(BUILT_IN, with_pooling_heads(family.policies[model_class_name(model)])))
    plan = Route(PLAN, lambda: TpPlanPolicy(tower_policy=DerivedPolicy)) if has_tp_plan(model) else None
    if plan is not None:  # a vision tower the plan leaves whole is derived
        plan.leaves_whole = plan_leaves_whole(model)
    if plan is not None and not plan.leaves_whole:
        routes.append(plan)
    if derived_model(model):
        routes.append(Route(DERIVED, DerivedPolicy))
    if plan is not None and plan.leaves_whole:  # a plan for part of each block: the derived cut first
        routes.append(plan)
    return routes


def route_of(policy: Policy, model: nn.Module) -> Route:
    """The route a policy the user passed belongs to (a library route is proven like an automatic
    one; the user's own Policy subclass is the user's word)."""
    fresh = lambda: copy.copy(policy)  # noqa: E731 - set_model and argument_policy rewrite its state
    family = family_of(model)
    built_in = family.policies.get(model_class_name(model)) if family is not None else None
    if built_in is not None and type(policy) in (built_in, with_pooling_heads(built_in)):
        return Route(BUILT_IN, fresh)
    if type(policy) is DerivedPolicy:
        return Route(DERIVED, fresh)
    if type(policy) is TpPlanPolicy:
        return Route(PLAN, fresh)
    return Route(CUSTOM, fresh)


def no_route_error(model: nn.Module) -> Refusal:
    """The error for a model no route applies to: a convolutional network is pointed at data
    parallelism (no policy cuts a convolution), any other at a Policy of its own."""
    name = type(model).__name__
    if has_convolutions(model):
        return Refusal(
            f"no route cuts {name}: it has no built-in policy, no tp plan and no stack of repeated blocks with "
            f"projections to cut; its layers are convolutions, which tensor parallelism does not cut",
            DATA_PARALLEL,
        )
    foreign = _unknown_matrices(model)
    if foreign:
        return Refusal(
            f"no route cuts {name}: its matrices are held by "
            + ", ".join(f"{cls} ({path})" for cls, path in foreign.items())
            + ", module classes tensor parallelism does not cut (it cuts nn.Linear, transformers' Conv1D and "
            "nn.Embedding); quantization-aware layers and the like run whole on every rank",
            DATA_PARALLEL,
            POLICY,
        )
    return Refusal(
        f"no built-in policy for {name}; supported: {', '.join(supported_models())}, and any transformers model "
        f"whose config has a base_model_tp_plan or whose blocks can be traced",
        POLICY,
    )


def _unknown_matrices(model: nn.Module) -> dict[str, str]:
    """``{class name: first path}`` of the modules holding a matrix (a 2-D weight) that are neither a
    projection nor an embedding (IBert's quantization-aware ``QuantLinear`` and ``QuantEmbedding``)."""
    found: dict[str, str] = {}
    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        known = is_projection(module) or isinstance(module, nn.Embedding)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and not known:
            found.setdefault(type(module).__name__, path)
    return found


class NoExactRouteError(NotProvenError):
    """No route cuts the model exactly (each route's reason is in the message)."""


def choose(model: nn.Module, shard_config: ShardConfig, routes: list[Route], sharder_args: dict, chosen=False):
    """``(sharder, plan, route, proven)``: the sharder (and its resolved plan, for ``sharder.shard``) of
    the first of ``routes`` that resolves against ``model`` and proves exact at the config's tp (every route is tried in order), else
    `NoExactRouteError`. The route the user ``chosen`` is proven and refused, never replaced. At
    tp=1 a model no route cuts is kept whole (`NONE`): data parallelism and ZeRO need no cut."""
    tp = shard_config.tensor_parallel_size
    if not routes and tp == 1:
        return _kept_whole(model, shard_config, sharder_args, "no policy, tp plan or blocks to derive a cut from")
    if not routes:
        raise no_route_error(model)
    reasons = []
    mesh_config = None
    for route in routes:
        sharder = ModelSharder(model, route.make(), mesh_config or shard_config, **sharder_args)
        try:
            plan = sharder.plan()  # every refusal first, before any collective
        except ROUTE_ERRORS as e:
            # the one route's own refusal, its fix first (a plain module's); at tp=1 the model is kept whole
            if chosen or (len(routes) == 1 and tp > 1):
                raise
            reasons.append((route.name, *parts_of(e)))
            continue
        if tp == 1 and not plan.replacements and not chosen:  # the route would cut nothing: say so
            return _kept_whole(model, shard_config, sharder_args, f"the {route.name} route replaces no layer")
        if tp == 1 or route.name == CUSTOM:
            return sharder, plan, route, False
        if not shard_config.prove:
            logger.warning(
                "%s sharded on the %s route WITHOUT proof (ShardConfig(prove=False)): nothing checked that it "
                "computes what the unsharded model computes; run `shardformer verify` on it",
                type(model).__name__,
                route.name,
            )
            _warn_partial(model, route, reasons)
            return sharder, plan, route, False
        if mesh_config is None:  # once: the proofs and the model use the same tp group
            mesh, _ = build_mesh(shard_config)
            mesh_config = dataclasses.replace(shard_config, mesh=mesh) if mesh is not None else shard_config
            sharder.shard_config = mesh_config
        try:
            heads = route.heads(model, tp)
        except NotDerivableError as e:
            reasons.append((route.name, *parts_of(e)))
            continue
        why = prove(model, mesh_config, route.name, route.make, heads)
        if why is None:
            _info(
                "%s: the %s route proven at tp=%d on a tiny copy (outputs, loss and every gradient exact)",
                type(model).__name__,
                route.name,
                tp,
            )
            _warn_partial(model, route, reasons)
            return sharder, plan, route, True
        reasons.append((route.name, f"not exact on a tiny copy at tensor_parallel_size={tp} ({why})", (POLICY,)))
        logger.info(
            "%s: the %s route is not exact on a tiny copy (%s); trying the next route",
            type(model).__name__,
            route.name,
            why,
        )
    if tp == 1:  # every route refused to plan: nothing needs cutting at tp=1
        why = "; ".join(f"{name}: {reason.splitlines()[0][:200]}" for name, reason, _ in reasons)
        return _kept_whole(model, shard_config, sharder_args, why)
    tried = "\n  ".join(f"{name}: {indent(reason)}" for name, reason, _ in reasons)
    instance = study_instance(model)
    own = f"\nEach proof ran what this instance adds to its class: {instance.describe()}" if instance.extras else ""
    raise NoExactRouteError(
        f"no route shards {type(model).__name__} exactly at tensor_parallel_size={tp}; shardformer refuses rather "
        f"than compute something else. Routes tried:\n  {tried}{own}",
        *(fix for _, _, fixes in reasons for fix in fixes),
    )


def _kept_whole(model: nn.Module, shard_config: ShardConfig, sharder_args: dict, why: str):
    """``choose``'s answer at tp=1 for a model no route cuts: the sharder of `NoCut` (the record,
    the RNG and the forward checks every sharded model has; no layer replaced)."""
    sharder = ModelSharder(model, NoCut(), shard_config, **sharder_args)
    plan = sharder.plan()
    _info(
        "%s: nothing cut at tensor_parallel_size=1 (%s); kept whole, as data parallelism and ZeRO need",
        type(model).__name__,
        why,
    )
    return sharder, plan, Route(NONE, NoCut), False


def _info(message: str, *args) -> None:
    """An INFO line from the first rank only (every rank reaches the same verdict)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message, *args)


def _warn_partial(model: nn.Module, route: Route, reasons: list[tuple]) -> None:
    """A plan that leaves projections inside its blocks whole is used: say which."""
    whole = route.leaves_whole
    if whole and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "%s: its tp plan cuts only part of each block: %d projections stay whole on every rank (%s%s); the "
            "derived route could not cut the model (%s). Exact, but those weights are not split",
            type(model).__name__,
            len(whole),
            ", ".join(whole[:3]),
            " ..." if len(whole) > 3 else "",
            "; ".join(reason for _, reason, _ in reasons) or "not tried",
        )
