"""The ``torch.optim.Optimizer`` surface a wrapping optimizer shares with the optimizer it wraps, so
LR schedulers and step hooks work on the wrapper (ZeroOptimizer, FullyShardedOptimizer)."""

from __future__ import annotations

from collections import OrderedDict

import torch

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def share_surface(wrapper: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's very objects (schedulers
    edit the group dicts); the wrapper gets hook dicts of its own and torch's step counting."""
    wrapper.defaults = optimizer.defaults
    wrapper.param_groups = optimizer.param_groups
    wrapper.state = optimizer.state
    for name in _HOOK_DICTS:
        setattr(wrapper, name, OrderedDict())
    wrapper._patch_step_function()
