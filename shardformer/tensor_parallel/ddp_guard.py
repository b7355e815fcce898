"""A tensor-parallel model refuses ``DistributedDataParallel``.

DDP over the ranks of a tp group is always wrong: its start-up broadcast copies rank 0's weight
slices over the other ranks' and it averages gradients of different slices. transformers' ``Trainer``
(through accelerate) wraps any multi-process model in DDP, so this is where a plain Trainer on a
sharded model stops, before the first step. DDP's constructor reads the names it should leave alone
from ``module._ddp_params_and_buffers_to_ignore``; reading ours raises.
"""

from __future__ import annotations

import torch.nn as nn


class _RefuseDDP:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def __iter__(self):
        raise RuntimeError(
            f"{self.model_name} is tensor-parallel (sharded by shardformer) and cannot be wrapped in "
            f"DistributedDataParallel: DDP would copy rank 0's weight slices over the other ranks'. Train it with "
            f"shardformer.integrations.ShardedTrainer instead of transformers.Trainer, or with ParallelEngine"
        )


def refuse_ddp(model: nn.Module) -> None:
    model._ddp_params_and_buffers_to_ignore = _RefuseDDP(type(model).__name__)
