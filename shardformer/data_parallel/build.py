"""The optimizer the engine steps with, built from the user's factory ``params -> Optimizer`` over this
rank's shards: `shardformer.data_parallel.fsdp_optimizer.FullyShardedOptimizer` at zero_stage=3
(FSDP2 shards the model itself), else ZeRO-1/2 over the data-parallel group
(`shardformer.data_parallel.ZeroOptimizer`), split in two at ep > 1 (dense parameters over dp,
experts over the ranks holding the same ones).

The expert-parallel optimizer is passed in: ``expert_parallel`` sits above ``data_parallel`` in the
package order (it shards with ZeroOptimizer), so this module cannot import it; the engine, above both,
hands it over. Which ZeRO runs, and with which settings, is decided here in one place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from shardformer.core.config import EngineConfig
from shardformer.data_parallel.fsdp import GradHooks
from shardformer.data_parallel.fsdp_optimizer import FullyShardedOptimizer
from shardformer.data_parallel.optimizer import ZeroOptimizer
from shardformer.pipeline.tied import TiedGrads


def check_factory(factory) -> None:
    """Refuse an optimizer where a factory is due (before anything is sharded)."""
    if factory is not None and (not callable(factory) or isinstance(factory, torch.optim.Optimizer)):
        raise TypeError(
            "optimizer must be a factory `params -> Optimizer` (e.g. lambda p: torch.optim.AdamW(p, lr=1e-4)): "
            "the parameters it steps exist only after sharding"
        )


def build_optimizer(
    factory: Callable[..., torch.optim.Optimizer] | None,
    model: nn.Module,
    params: list[nn.Parameter],
    mesh,
    config: EngineConfig,
    *,
    grad_hooks: GradHooks,
    tied: TiedGrads,
    expert_optimizer: Callable,
):
    """The optimizer over ``params`` (``model``'s trainable ones, sharded and split), or None without a
    ``factory`` (an inference engine). ``grad_hooks``: what `fully_shard_model` returned (ZeRO-3);
    ``tied``: the tied weights this rank holds; ``expert_optimizer``: ``(factory, params, mesh, stage,
    **zero_kwargs)``, the optimizer at ep > 1 (expert_parallel's ExpertParallelOptimizer)."""
    if factory is None:
        return None
    if config.zero_stage == 3:
        return FullyShardedOptimizer(
            factory(params), model, mesh.dp_shard_group, tp_group=mesh.tp_group, pp_group=mesh.pp_group,
            grad_hooks=grad_hooks, counted_elsewhere=tied.counted_elsewhere,
        )  # fmt: skip
    zero_kwargs = dict(
        tp_group=mesh.tp_group,
        pp_group=mesh.pp_group,
        counted_elsewhere=tied.counted_elsewhere,  # tied weights count once in the norm: the first holder's copy
        overlap_communication=config.overlap_grad_reduce,
        backwards_per_step=config.num_microbatches,  # one backward per micro-batch
        late_grads=tied.late,  # summed over the stages after backward (or used by two chunks)
        # cp ranks computed parts of the same sequences: ZeRO sums their gradients bucket by bucket
        sum_group=mesh.cp_group if config.cp > 1 else None,
        release_grads=config.zero_stage == 2,  # ZeRO-2 keeps only its 1/dp row of each reduced gradient
    )
    if mesh.ep_size > 1:  # dense parameters over dp, experts over the ranks holding the same ones
        optimizer = expert_optimizer(factory, params, mesh, config.zero_stage, **zero_kwargs)
    else:
        # hybrid sharding: states sharded over the shard group, gradients also averaged over the replicas
        optimizer = ZeroOptimizer(
            factory(params), mesh.dp_shard_group, config.zero_stage, model=model,
            replicate_group=mesh.dp_replicate_group if mesh.dp_replicate_size > 1 else None, **zero_kwargs,
        )  # fmt: skip
    if config.cp > 1:
        model.shardformer.context_parallel.sum_grads_elsewhere(params)
    return optimizer
