"""The parallel sizes against the processes started: (pp, dp, tp) from the world size, and the
expert-parallel size and the hybrid-sharding replicas drawn from the data-parallel ranks. ShardConfig, EngineConfig, the mesh and
``plan`` check them here, before any collective."""

from __future__ import annotations

import math

from shardformer.core.checkers import check_positive_int


def resolve_sizes(
    world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1
) -> tuple[int, int, int]:
    """Check the parallel sizes against the world size and return (pp, dp, tp).

    ``dp`` defaults to ``world_size // (tp * cp * pp)``.
    """
    check_positive_int("tensor_parallel_size", tp)
    check_positive_int("pipeline_parallel_size", pp)
    check_positive_int("data_parallel_size", dp, optional=True)
    check_positive_int("context_parallel_size", cp)
    named = f"tensor_parallel_size={tp} x " + (f"context_parallel_size={cp} x " if cp > 1 else "")
    if dp is None:
        if world_size % (tp * cp * pp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by {named}pipeline_parallel_size={pp} = "
                f"{tp * cp * pp}; launch a multiple of {tp * cp * pp} processes or change the sizes"
            )
        dp = world_size // (tp * cp * pp)
    if pp * dp * cp * tp != world_size:
        raise ValueError(
            f"pipeline_parallel_size={pp} x data_parallel_size={dp} x {named.removesuffix(' x ')} "
            f"= {pp * dp * cp * tp}, but the world size is {world_size}; make the product equal the number "
            f"of processes"
        )
    return pp, dp, tp


def check_expert_divides(ep: int, dp: int, setting: str = "expert_parallel_size") -> None:
    """Expert-parallel ranks are drawn from the data-parallel ranks: ``ep`` must divide ``dp``."""
    if dp % ep:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(
            f"{setting}={ep} does not divide data_parallel_size={dp}: expert-parallel ranks are data-parallel "
            f"ranks; pick ep in {divisors} or launch {ep // math.gcd(ep, dp)} times as many data-parallel ranks"
        )


def check_replicate_divides(replicate: int, dp: int, setting: str = "EngineConfig.dp_replicate", ep: int = 1) -> None:
    """Hybrid sharding: ``dp = dp_replicate x dp_shard``, so ``replicate`` must be a positive divisor of ``dp``;
    expert-parallel groups (``ep`` consecutive dp ranks) sit inside a shard group, so ``ep`` divides dp_shard."""
    check_positive_int(setting, replicate)
    if dp % replicate:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(
            f"{setting}={replicate} does not divide data_parallel_size={dp}: the dp ranks are dp_replicate "
            f"replicas of dp_shard ranks each (dp = dp_replicate x dp_shard); pick dp_replicate in {divisors}"
        )
    if (dp // replicate) % ep:
        fits = [r for r in range(1, dp + 1) if dp % r == 0 and (dp // r) % ep == 0]
        raise ValueError(
            f"{setting}={replicate} with expert_parallel_size={ep}: the experts are split over ep consecutive ranks "
            f"of a shard group, so ep must divide dp_shard={dp // replicate}; pick dp_replicate in {fits}"
        )
