"""Argument checks for ZeroOptimizer: fail early with the bad value and the fix, never hang."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardformer.core import comm
from shardformer.core.config import ZERO_STAGES, check_positive_int, is_positive_int
from shardformer.data_parallel.loss_scaler import DynamicLossScaler


def check_arguments(
    optimizer, stage, bucket_size, release_grads, reduce_dtype, loss_scaler, model, backwards_per_step=1
) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"ZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; build e.g. "
            f"torch.optim.AdamW(model.parameters()) first and pass it in"
        )
    if hasattr(optimizer, "reducer") and hasattr(optimizer, "slots"):
        raise TypeError("this optimizer is already a ZeroOptimizer; wrap the plain torch optimizer only once")
    if stage not in ZERO_STAGES:
        raise ValueError(
            f"stage={stage!r} is not supported; use stage=1 (shard optimizer states) or stage=2 (also "
            f"shard reduced gradients). Stage 3 (sharded parameters) runs on FSDP2: EngineConfig(zero_stage=3), "
            f"or shardformer.data_parallel.fsdp.fully_shard_model with FullyShardedOptimizer"
        )
    if not is_positive_int(bucket_size):
        raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements, e.g. 2**23")
    check_positive_int(
        "backwards_per_step",
        backwards_per_step,
        why="the number of backward passes (micro-batches) each step accumulates, 1 without gradient accumulation",
    )
    if release_grads and stage != 2:
        raise ValueError(
            f"release_grads=True needs stage=2 (got stage={stage}): stage 1 writes the averaged "
            f"gradient back into param.grad, so there is nothing to release"
        )
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(
            f"reduce_dtype={reduce_dtype!r} must be a floating torch.dtype (torch.float32, torch.bfloat16, ...) or None"
        )
    if not (loss_scaler is None or loss_scaler == "auto" or isinstance(loss_scaler, DynamicLossScaler)):
        raise TypeError(f"loss_scaler={loss_scaler!r} must be 'auto', None or a DynamicLossScaler")
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already has state for {len(optimizer.state)} params (it has stepped); "
            f"wrap it before its first step. To resume, wrap a fresh one and call load_full_state_dict()"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call shardformer.init_distributed() before building "
            "ZeroOptimizer (or start the script with `shardformer run`)"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; move the model to one")
    if model is not None:
        mine = {id(p) for p in params}
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in mine]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(
                f"{len(missing)} trainable parameters of the model are not in the optimizer: {shown}. Build the "
                f"optimizer over model.parameters(), or set requires_grad=False on parameters you freeze"
            )


def check_same_on_all_ranks(model_params, stage, bucket_size, overlap, backwards_per_step, dp_group) -> None:
    """One small collective: every dp rank must wrap the same parameter shapes with the same options.

    A mismatch would otherwise surface as a hang or a shape error deep inside a reduce-scatter.
    """
    if dist.get_world_size(dp_group) == 1:
        return
    flat = [p for params in model_params for p in params]
    shapes_checksum = sum((i + 1) * (p.numel() + 7 * p.dim()) for i, p in enumerate(flat)) % (2**31 - 1)
    fields = {
        "number of params": len(flat),
        "total elements": sum(p.numel() for p in flat),
        "param shapes checksum": shapes_checksum,
        "param groups": len(model_params),
        "stage": stage,
        "bucket_size": bucket_size,
        "overlap_communication": int(overlap),
        "backwards_per_step": backwards_per_step,
    }
    device = flat[0].device if flat[0].device.type != "meta" else "cpu"  # a job simulated on meta (tools/simulate)
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    both = torch.cat([mine, -mine])
    comm.all_reduce(both, dp_group, op=dist.ReduceOp.MAX)
    high, low = both[: len(fields)].tolist(), (-both[len(fields) :]).tolist()
    differ = [f"{name} ({lo} vs {hi})" for name, lo, hi in zip(fields, low, high) if lo != hi]
    if differ:
        raise ValueError(
            f"data-parallel ranks disagree on {', '.join(differ)}; every rank of dp_group must build the same "
            f"model and optimizer and pass the same ZeroOptimizer options"
        )
