"""Running statistics (BatchNorm's running mean and variance) under data parallelism: refused where a
sharded step would not update them as the unsharded model does.

A training step is the unsharded model's gradient accumulation over the batch's ``dp x num_microbatches``
chunks: the parameters are exact whatever the norm (each chunk normalised by its own batch statistics, as
in the unsharded chain). A norm that tracks running statistics in training mode also updates them once per
forward, chunk after chunk. On one rank the micro-batches run in the chunks' order (the same chain); but a
data-parallel or context-parallel rank chains only its own part of the batch, and activation checkpointing
runs each forward twice. Those routes are refused before the first step, naming the modules and the fixes.
"""

from __future__ import annotations

import torch.nn as nn

FREEZE = (
    "freeze their statistics before sharding: set `module.track_running_stats = False` on each (training then "
    "normalises each chunk by its own batch statistics, as the unsharded model's gradient accumulation does, and "
    "eval uses the running statistics as they are), or replace them by frozen ones "
    "(timm.layers.freeze_batch_norm_2d(model)); `module.eval()` alone does not last, as every training step "
    "calls model.train(). Or, if statistics over the whole data-parallel batch will do, convert them with "
    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=mesh.dp_group) (accelerators only): that "
    "is not the unsharded model's chain of updates"
)


def tracking_modules(model: nn.Module) -> list[str]:
    """The names of the modules that update running statistics when ``model`` trains, judged after ``model.train()`` as a training step runs it (a ``train`` that keeps a norm in eval is
    respected); every module's training flag is put back. SyncBatchNorm counts as the user's choice."""
    flags = {module: module.training for module in model.modules()}
    try:
        model.train()
        return [name for name, module in model.named_modules() if _updates_statistics(module)]
    finally:
        for module, flag in flags.items():
            module.training = flag


def _updates_statistics(module: nn.Module) -> bool:
    return (
        module.training
        and getattr(module, "track_running_stats", False)
        and getattr(module, "running_mean", None) is not None
        and not isinstance(module, nn.SyncBatchNorm)
    )


def check_split_statistics(model: nn.Module, who: str, splits: dict[str, int]) -> None:
    """Refuses ``model`` where some rank count of ``splits`` ({"dp": 2, ...}, each splitting the batch) is above
    1 and a norm updates running statistics in training: each rank would chain only its own part of the batch."""
    split = {name: size for name, size in splits.items() if size > 1}
    names = tracking_modules(model) if split else []
    if names:
        sizes = ", ".join(f"{name}={size}" for name, size in split.items())
        raise ValueError(
            f"{who} at {sizes}: {_listed(model, names)} update running statistics in training mode, and each "
            f"rank would update them from its own part of the batch, so their running_mean / running_var (what "
            f"eval reads) would differ between ranks and from the unsharded model's; {FREEZE}"
        )


def check_recomputed_statistics(model: nn.Module, who: str, recomputed: list[str]) -> None:
    """Refuses a norm that updates running statistics in training inside the modules at paths ``recomputed``
    ("" for the whole model), those activation checkpointing recomputes: their forward runs again in the backward."""
    inside = [
        name
        for name in tracking_modules(model)
        if any(not path or name == path or name.startswith(path + ".") for path in recomputed)
    ]
    if inside:
        shown = ", ".join(recomputed[:3]) + (f" and {len(recomputed) - 3} more" if len(recomputed) > 3 else "")
        raise ValueError(
            f"{who} with activation checkpointing: {_listed(model, inside)} update running statistics in training "
            f"mode inside the recomputed modules ({shown or 'the whole model'}), and the recomputation would "
            f"update them a second time; turn activation checkpointing off, or {FREEZE}"
        )


def _listed(model: nn.Module, names: list[str]) -> str:
    kinds = sorted({type(model.get_submodule(name)).__name__ for name in names})
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{len(names)} {'/'.join(kinds)} module{'s' if len(names) > 1 else ''} ({shown})"
