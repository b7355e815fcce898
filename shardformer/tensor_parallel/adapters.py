"""Adapter layers around the layers a policy cuts (PEFT's LoRA): seen through, then cut with their base.

PEFT wraps a projection ``q_proj`` as ``q_proj.base_layer`` inside its LoRA layer, so a policy's
names and classes (``q_proj``, ``nn.Linear``, ``Conv1D``) no longer match it: every route (built-in,
plan, derived) would leave the projection whole. While the model is planned and cut, each wrapper is
therefore taken out of the tree and its base layer put back in its place, so the policy sees the
model PEFT was given; afterwards each wrapper goes back around what its base became, and its
adapters are cut the same way. What cannot be cut exactly is refused at plan time, before any
collective, with the wrapper named.

How a kind of wrapper is recognised, checked and cut is the business of its support, which lives
above this package (``shardformer.integrations.peft``) and registers itself here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch.nn as nn

from shardformer.core.config import ShardConfig


class AdapterSupport(Protocol):
    """What the sharder asks of the code that knows a kind of adapter wrapper."""

    def base_of(self, module: nn.Module) -> nn.Module | None:
        """The layer ``module`` wraps, or None if it is no adapter wrapper."""

    def refusal(self, path: str, wrapper: nn.Module, layer, shard_config: ShardConfig) -> str | None:
        """Why the wrapper at ``path`` cannot be cut as the policy's ``layer`` (None: left whole), or None."""

    def adopt(self, wrapper: nn.Module, base: nn.Module, process_group) -> None:
        """Make ``base`` (the sharded layer) the wrapper's base layer and cut its adapters to match."""

    def after_shard(self, model: nn.Module) -> None:
        """Called once a model is sharded (adapters added later must find its parallel layers)."""


_SUPPORT: list[AdapterSupport] = []


def register_adapter_support(support: AdapterSupport) -> None:
    _SUPPORT[:] = [support]


def adapter_wrappers(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(path, wrapper, base)`` of every outermost adapter wrapper below ``model``."""
    found: list[tuple[str, nn.Module, nn.Module]] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{outer}.") for outer, _, _ in found):
            continue  # the wrapper's own parts (its base layer, its adapters)
        base = _base_of(module)
        if base is not None:
            found.append((path, module, base))
    return found


def _base_of(module: nn.Module) -> nn.Module | None:
    if _SUPPORT:
        return _SUPPORT[0].base_of(module)
    # no support loaded: still recognise PEFT's wrappers, to refuse them rather than cut around them
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) and type(module).__module__.startswith("peft.") else None


@dataclass
class SeenThrough:
    """The wrappers taken out of ``model`` while it is planned and cut."""

    model: nn.Module
    wrappers: list[tuple[str, nn.Module, nn.Module]] = field(default_factory=list)

    @classmethod
    def unwrap(cls, model: nn.Module) -> SeenThrough:
        """Put every wrapper's base layer in its place (the wrapper still holds its base; a wrapper around
        wrappers, the innermost base)."""
        found = adapter_wrappers(model)
        if found and not _SUPPORT:
            names = ", ".join(path for path, _, _ in found[:3])
            raise ValueError(
                f"{type(model).__name__} holds adapter layers ({names}) and shardformer's PEFT support is not "
                f"loaded; import shardformer (it loads shardformer.integrations.peft) before sharding"
            )
        peeled = []
        for path, wrapper, base in found:
            while (inner := _base_of(base)) is not None:  # adapters on adapters (PEFT's ParamWrapper pairs)
                base = inner
            model.set_submodule(path, base)
            peeled.append((path, wrapper, base))
        return cls(model, peeled)

    def check(self, replacements, shard_config: ShardConfig) -> None:
        """Refuse, before any collective, a wrapper whose base is cut in a way its adapters cannot follow."""
        layers = {r.path: r.layer for r in replacements}
        for path, wrapper, _ in self.wrappers:
            reason = _SUPPORT[0].refusal(path, wrapper, layers.get(path), shard_config)
            if reason is not None:
                raise ValueError(f"the adapter at {path} ({type(wrapper).__name__}) cannot be sharded: {reason}")

    def restore(self) -> None:
        """Put the wrappers back around their original base layers (sharding failed before cutting)."""
        for path, wrapper, _ in self.wrappers:
            self.model.set_submodule(path, wrapper)

    def rewrap(self, process_group) -> None:
        """Put each wrapper back around what its base became, its adapters cut the same way."""
        for path, wrapper, base in self.wrappers:
            now = self.model.get_submodule(path)
            if now is not base:
                _SUPPORT[0].adopt(wrapper, now, process_group)
            self.model.set_submodule(path, wrapper)
        if _SUPPORT:
            _SUPPORT[0].after_shard(self.model)
