"""The global gradient norm over tp x pp x dp, computed from each rank's gradient shards.

Each rank holds a 1/dp shard of its (tp, pp) slice of the model's gradients. Summing squared
norms over the dp group gives the norm of that slice. Then, over the tensor-parallel group,
gradients of tp-sharded params (``shard_spec(p) is not None``) are different pieces of one tensor
and are summed, while replicated params hold the same gradient on every tp rank and are counted
once (tp rank 0's copy). Finally pipeline stages hold disjoint params and are summed.
"""

from __future__ import annotations

import math

import torch

from shardformer.core import comm
from shardformer.core.shard_spec import replica_weights
from shardformer.data_parallel.layout import ParamSlot
from shardformer.tensor_parallel.slicer import shard_spec


def global_grad_norm(
    slots: list[ParamSlot],
    dp_group,
    tp_group=comm.LOCAL,
    pp_group=comm.LOCAL,
) -> tuple[float, bool]:
    """Return ``(total L2 norm, found_inf)`` of the master gradients; the same on every rank.

    ``found_inf`` is True when any gradient on any rank of the three groups is inf or NaN.
    Groups as `shardformer.core.comm` takes them: None is the default group, ``comm.LOCAL`` an
    absent dimension (no tensor / pipeline parallelism).
    """
    device = slots[0].master.device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for slot in slots:
        grad = slot.master.grad
        if grad is None:
            continue
        spec = shard_spec(slot.param)
        weights = None if spec is None else replica_weights(spec, slot.param.shape)
        if weights is not None:  # pieces held by several tp ranks (replicated key/value heads) count once
            flat = weights.flatten().to(device)
            # the master is this dp rank's piece [rank * shard_numel, ...) of the flattened parameter
            start = comm.group_rank(dp_group) * slot.shard_numel if slot.shard_numel < slot.numel else 0
            flat = torch.nn.functional.pad(flat, (0, max(0, start + grad.numel() - flat.numel())))
            sq = (grad.detach().to(torch.float64).flatten().square() * flat[start : start + grad.numel()]).sum()
        else:
            sq = torch.linalg.vector_norm(grad, 2, dtype=torch.float64).square()
        if spec is not None:
            sharded += sq
        else:
            replicated += sq
    return reduce_norm_stats(sharded, replicated, dp_group, tp_group, pp_group)


def reduce_norm_stats(sharded: torch.Tensor, replicated: torch.Tensor, dp_group, tp_group, pp_group):
    """``(norm, found_inf)`` from this rank's squared sums over its dp shards of tp-sharded and of
    tp-replicated gradients (float64 scalars): summed over dp, over tp (replicated ones from tp
    rank 0 only) and over the pipeline stages. A collective on the three groups."""
    # [tp-sharded sum, replicated sum, non-finite count]; inf/NaN can also arise from a
    # non-finite replicated gradient on a tp rank other than 0, so it is counted separately.
    nonfinite = (~torch.isfinite(sharded + replicated)).to(torch.float64)
    stats = torch.stack([sharded, replicated, nonfinite])
    comm.all_reduce(stats, dp_group)
    if comm.group_rank(tp_group) != 0:
        stats[1] = 0.0
    comm.all_reduce(stats, tp_group)
    comm.all_reduce(stats, pp_group)
    total_sq, inf_count = (stats[0] + stats[1]).item(), stats[2].item()
    found_inf = inf_count > 0 or not math.isfinite(total_sq)
    # sqrt keeps inf as inf and NaN as NaN, so an overflowed step reports a non-finite norm.
    return math.sqrt(total_sq) if total_sq >= 0 else total_sq, found_inf


def clip_master_grads(slots: list[ParamSlot], total_norm: float, max_norm: float) -> None:
    """Scale gradients by ``max_norm / (total_norm + 1e-6)`` when below 1, as torch's clip_grad_norm_ does."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for slot in slots:
            if slot.master.grad is not None:
                slot.master.grad.mul_(coef)
