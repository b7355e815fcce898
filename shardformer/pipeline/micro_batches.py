"""A batch cut along dim 0: over the data-parallel ranks, and into the micro-batches a pipeline
schedule runs (gradient accumulation in training; in inference they only fill the stages)."""

from __future__ import annotations

import torch


def split_batch(batch: dict, parts: int, what: str) -> list[dict]:
    """Split every tensor of ``batch`` along dim 0 into ``parts`` equal chunks (others are copied)."""
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.ndim > 0}
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors must share one batch size (dim 0); got sizes {sorted(sizes)}")
    size = sizes.pop()
    if size % parts != 0:
        raise ValueError(
            f"batch size {size} does not divide into {what}={parts}; use a batch size that is a multiple of {parts}"
        )
    step = size // parts
    return [
        {k: v[i * step : (i + 1) * step] if torch.is_tensor(v) and v.ndim > 0 else v for k, v in batch.items()}
        for i in range(parts)
    ]


def inference_micro_batches(batch: dict, most: int) -> int:
    """Micro-batches for an inference pass: up to ``most``, as many as divide the batch (in inference they
    only pipeline the stages; any count gives the same outputs)."""
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.ndim > 0}
    if len(sizes) != 1:
        return most  # split_batch names the sizes
    size = sizes.pop()
    return max(n for n in range(1, min(size, most) + 1) if size % n == 0)
