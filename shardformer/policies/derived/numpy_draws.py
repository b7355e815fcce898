"""Modules whose code draws from numpy's global generator per head in training (BigBird's block-sparse
attention picks each head's random blocks with ``np.random``, head after head): cut by heads, a rank
would draw the first heads' patterns for its own, so it computes something else. In eval the draws
are constant and the cut is exact; in training its forward is refused with the module and the fix.
"""

from __future__ import annotations

import functools
import inspect

import torch.nn as nn

from shardformer.core.refusal import Refusal


@functools.cache
def draws_from_numpy(cls: type) -> bool:
    """Whether the code of ``cls`` (or a base outside torch) draws from ``np.random``."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")):
            continue
        try:
            if "np.random." in inspect.getsource(klass):
                return True
        except (OSError, TypeError):
            continue
    return False


class NoTrainingDraws:
    """The module as it is, with a check before each forward: in training it refuses (its draws per
    head would be another head's on every rank but the first)."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        module.register_forward_pre_hook(_refuse_in_training)
        return module


def _refuse_in_training(module: nn.Module, _args) -> None:
    if module.training:
        raise Refusal(
            f"{type(module).__name__} draws each head's random pattern from numpy's generator, head after "
            f"head, in training: cut by heads, each rank would draw the first heads' patterns for its own "
            f"(not the unsharded model's computation); it is exact in eval",
            "train with its full attention (BigBird: model.set_attention_type('original_full'), or "
            "config.attention_type='original_full'), or shard it for inference (model.eval())",
        )
