"""Every rank agrees: one rank's result or error told to all, every rank's error gathered and reported once."""

from __future__ import annotations

import torch.distributed as dist

from shardformer.checkpoint.errors import CheckpointError


def rank_zero_result(rank: int, work, group=None):
    """``work()`` on global rank 0, its result or error message broadcast to every rank (over ``group``)."""
    box = [None]
    if rank == 0:
        try:
            box = [(work(), None)]
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            box = [(None, str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=group)
    result, error = box[0]
    if error is not None:
        raise CheckpointError(error)
    return result


def gather(value, group=None) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def report(errors: list[str | None]) -> str:
    """The same text on every rank: each distinct problem once, with the ranks that hit it."""
    by_text: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error:
            by_text.setdefault(error, []).append(rank)
    return "\n  ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}" for e, r in by_text.items())


def message(e: Exception, path: str) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{path}: {type(e).__name__}: {e}"
