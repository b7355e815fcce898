"""Reshapes to the stream's width, read off the input, made to this rank's share of it.

Much attention code (timm's BEiT, EVA, CaiT and others) merges its heads back with
``x.transpose(1, 2).reshape(B, N, C)``, ``C`` read off the input (``B, N, C = x.shape``). Under
tensor parallelism the input stays whole while a rank holds ``1/tp`` of the heads, so that reshape
asks for ``tp`` times the elements there are. While such a module runs, `LocalWidths` turns a
``reshape`` / ``view`` whose sizes hold ``C`` and ask for exactly ``tp`` times the tensor's elements
into the same reshape with ``C / tp`` in that place: the merge of this rank's heads. Code that splits
its heads with the head count itself beside a width read off the input (BLIP's
``reshape(b, n, 3, self.num_heads, embed_dim // self.num_heads)``, its count left whole so that the
quotient stays one head's width) asks for ``tp`` times the elements too: where no size is ``C``, the
last size equal to one of the module's head counts ``H`` becomes ``H / tp``. Nothing else changes (a
reshape that fits runs as written). It is chosen by the simulation only where no cut of
the module as written is exact, and the proof compares the module so run, cut, with it whole.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from shardformer.core.comm import group_size

_RESHAPES = {torch.Tensor.reshape, torch.Tensor.view, torch.reshape}


def _sizes(args: tuple) -> tuple[list[int] | None, bool]:
    """The sizes a reshape call asks for (after the tensor), and whether they came as one sequence."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args, packed = tuple(args[0]), True
    else:
        packed = False
    if not args or not all(type(s) is int for s in args):  # a dtype view, symbolic sizes: not a reshape to rewrite
        return None, packed
    return list(args), packed


def local_sizes(
    t: torch.Tensor, sizes: list[int], width: int, tp: int, heads: tuple[int, ...] = ()
) -> list[int] | None:
    """``sizes`` with the last ``width`` in it (else the last of the head counts ``heads``) divided by
    ``tp``, when that, and not ``sizes``, fits ``t``."""
    if -1 in sizes or math.prod(sizes) == t.numel() or math.prod(sizes) != tp * t.numel():
        return None
    found = [width] if width in sizes else [h for h in heads if h in sizes and h % tp == 0]
    if not found:
        return None
    at = max(len(sizes) - 1 - sizes[::-1].index(size) for size in found)
    return [*sizes[:at], sizes[at] // tp, *sizes[at + 1 :]]


class LocalWidths(TorchFunctionMode):
    """Rewrites reshapes to ``width`` into reshapes to ``width / tp`` where only that fits (see above)."""

    def __init__(self, width: int, tp: int, heads: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.width, self.tp, self.heads = width, tp, heads

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RESHAPES and len(args) >= 2 and torch.is_tensor(args[0]):
            sizes, packed = _sizes(args[1:])
            local = None if sizes is None else local_sizes(args[0], sizes, self.width, self.tp, self.heads)
            if local is not None:
                args = (args[0], local) if packed else (args[0], *local)
        return func(*args, **kwargs)


def _forward_in_local_widths(self, *args, **kwargs):
    width, tp, heads = self.shardformer_local_width
    with LocalWidths(width, tp, heads):
        return type(self).forward(self, *args, **kwargs)


def run_in_local_widths(module: nn.Module, width: int, tp: int, heads: tuple[int, ...] = ()) -> None:
    """``module``'s forward, from now on, under `LocalWidths` for ``width`` and the whole head counts
    ``heads`` (a bound method: copies keep it)."""
    module.shardformer_local_width = (width, tp, heads)
    module.forward = types.MethodType(_forward_in_local_widths, module)


class LocalWidthsLayer:
    """A policy layer: the module keeps its weights; its forward runs under `LocalWidths` for
    ``width`` and ``heads`` (set on the subclass `local_widths_layer` makes) over the group's size."""

    width = 0
    heads: tuple[int, ...] = ()

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        if group_size(process_group) > 1:
            run_in_local_widths(module, cls.width, group_size(process_group), cls.heads)
        return module


def local_widths_layer(width: int, heads: tuple[int, ...] = ()) -> type[LocalWidthsLayer]:
    return type("LocalWidthsLayer", (LocalWidthsLayer,), {"width": width, "heads": heads})
