"""The route of the layout ``shardformer plan --search`` chose, proven before it is printed.

On ``tp`` local gloo processes each rank builds the model on the meta device and runs ``shard_model``
with the layout's tensor-parallel size and sequence parallelism, exactly as the job would: it picks a
route (built-in policy, tp plan, derived) and proves it on the model's tiny copy (sharded against
unsharded: outputs, loss, every gradient) before cutting. The answer names the route proven, or why
none was. The pipeline route (stage split and its stand-ins) was proven on a tiny copy while the
search sized pipeline layouts (`shardformer.policies.anatomy_pipeline.pipeline_spec_for`).
"""

from __future__ import annotations

import torch.distributed as dist

from shardformer.api import shard_model
from shardformer.core.config import ShardConfig
from shardformer.core.record import sharding_of
from shardformer.policies.routes import NoExactRouteError
from shardformer.tools.plan import build_meta_model
from shardformer.tools.search_space import Layout
from shardformer.tools.testing import RankError, run_on_ranks


def prove_route(model: str, layout: Layout, model_class: str | None = None, timeout: float = 600.0) -> str:
    """One line: the route ``shard_model`` proves for ``layout``'s tp (and sequence parallelism)."""
    if layout.tp == 1:
        return "tp=1: nothing is cut, so there is no tensor-parallel route to prove"
    try:
        route = run_on_ranks(_route_on_rank, layout.tp, model, model_class, layout.sequence_parallel, timeout=timeout)[
            0
        ]
    except RankError as e:
        return f"NOT PROVEN at tp={layout.tp}: {str(e).strip().splitlines()[-1]}"
    sp = " with sequence parallelism" if layout.sequence_parallel else ""
    return f"route '{route}' proven exact on a tiny copy at tp={layout.tp}{sp} (shard_model's own proof, gloo ranks)"


def _route_on_rank(model: str, model_class: str | None, sequence_parallel: bool) -> str:
    meta = build_meta_model(model, model_class)
    config = ShardConfig(tensor_parallel_size=dist.get_world_size(), sequence_parallel=sequence_parallel)
    try:
        sharded = shard_model(meta, config)
    except NoExactRouteError as e:
        raise RuntimeError(f"no route is exact: {e}") from None
    record = sharding_of(sharded)
    if not record.proven:
        raise RuntimeError(f"route '{record.route}' cut the model without a proof")
    return record.route
