"""A list of one module per head beside heads cut over tp (StableLM's per-head q/k LayerNorms).

The module owning the list runs its i-th module on its i-th head; on a rank holding heads
``[r * n, (r + 1) * n)`` it must run modules ``r * n ...`` on its heads ``0 ...``. `HeadModules`
keeps every module registered whole on every rank (names, state dict and export are the unsharded
model's) and hands the owner, which iterates or indexes the list, this rank's modules only. Each runs
on its parameters as passed through one node that sums every module's gradient over the ranks
(`shardformer.tensor_parallel.regions.copy_all_to_parallel`: this rank's heads' part, zeros for
the others), so the replicated weights get the whole gradient on every rank and stay equal.
"""

from __future__ import annotations

import torch.nn as nn
from torch.func import functional_call

from shardformer.core.comm import group_rank, group_size
from shardformer.tensor_parallel.regions import copy_all_to_parallel


class HeadModules(nn.ModuleList):
    """An ``nn.ModuleList`` of per-head modules that shows the owner this rank's heads' modules only."""

    group = None
    window: tuple[int, int] = (0, 0)  # (first head on this rank, heads on this rank)

    @classmethod
    def from_native(cls, module: nn.ModuleList, process_group=None, **_) -> nn.Module:
        world = group_size(process_group)
        if world == 1:
            return module
        if type(module) is not nn.ModuleList or len(module) % world:
            raise ValueError(f"HeadModules cuts an nn.ModuleList of a multiple of {world} modules, not {module!r}")
        count = len(module) // world
        module.__class__ = cls
        module.group, module.window = process_group, (group_rank(process_group) * count, count)
        return module

    def _mine(self) -> list[nn.Module]:
        every = list(self._modules.values())
        names = [[name for name, _ in m.named_parameters()] for m in every]
        passed = iter(copy_all_to_parallel([p for m in every for p in m.parameters()], self.group))
        own = [dict(zip(these, passed)) for these in names]  # every module's, in the list's order
        first, count = self.window
        return [_Run(every[i], own[i]) for i in range(first, first + count)]

    def __iter__(self):
        return iter(self._mine())

    def __len__(self) -> int:
        return self.window[1]

    def __getitem__(self, index):
        return self._mine()[index]


class _Run:
    """A module called on the given parameters (the gradient-summing node's outputs) instead of its own."""

    def __init__(self, module: nn.Module, params: dict) -> None:
        self.module, self.params = module, params

    def __call__(self, *args, **kwargs):
        return functional_call(self.module, self.params, args, kwargs)
