"""Where a sharded model first parts from the unsharded one: every module's output recorded in
both, the sharded ones gathered back (split dim, fused blocks and padding from the layer's
ShardSpec), compared in call order. Used by ``verify`` and by the proof of a derived policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from shardformer.core.compare import ATOL, RTOL, gather_like, max_error
from shardformer.core.shard_spec import shard_spec


@dataclass
class Divergence:
    module: str
    cls: str
    error: float
    shape: tuple
    before: str | None = None  # the submodule whose input already differed: the parent's own code is wrong

    def __str__(self) -> str:
        name = f"{self.module or '(the model)'} ({self.cls})"
        if self.before is None:
            return f"{name}: its output {list(self.shape)} differs by up to {self.error:.3g}; every module before it matches"
        return (
            f"{name}, in its own forward code: the input {list(self.shape)} it passes to {self.before} differs by "
            f"up to {self.error:.3g}, while every submodule before it matches"
        )


def first_tensor(out) -> torch.Tensor | None:
    """A model's main output: the tensor itself, ``logits`` of a ModelOutput, else its first tensor (also
    inside a tuple: a backbone's ``feature_maps``)."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict):  # ModelOutput: logits first when there is a loss in front
        if torch.is_tensor(out.get("logits")):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for item in out:
            found = first_tensor(item) if isinstance(item, (tuple, list)) else item
            if torch.is_tensor(found):
                return found
    return None


class ActivationRecorder:
    """Forward hooks on every module: ``(name, output)`` in completion order (inner modules first)."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[tuple[str, torch.Tensor, int, torch.Tensor | None]] = []
        self.classes = {name: type(m).__name__ for name, m in model.named_modules()}
        self.handles = [m.register_forward_hook(self._hook(name, m)) for name, m in model.named_modules()]

    def _hook(self, name: str, module: nn.Module):
        weight = getattr(module, "weight", None)
        spec = shard_spec(weight) if torch.is_tensor(weight) else None
        n_cast = (spec.blocks or spec.n_cast) if spec is not None else 1  # fused Q/K/V: gathered back block by block
        if spec is not None and spec.splits:  # replicated key/value heads: the layout itself
            n_cast = spec

        def hook(_module, inputs, output):
            t = first_tensor(output)
            if t is not None and t.is_floating_point():
                x = first_tensor(inputs)
                x = x.detach().clone() if x is not None and x.is_floating_point() else None
                self.calls.append((name, t.detach().clone(), n_cast, x))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def first_divergence(ref: ActivationRecorder, sharded: ActivationRecorder, group) -> Divergence | None:
    """Gather every sharded activation (the same collectives on every rank) and compare in order.

    When the first diverging module's input already differs, no module computed the difference:
    the code of its parent between submodules did, and the parent is named.
    """
    seen: dict[str, int] = {}
    by_call = {}
    for name, t, n_cast, x in sharded.calls:
        k = seen[name] = seen.get(name, -1) + 1
        by_call[(name, k)] = (t, n_cast, x)
    seen.clear()
    first = None
    for name, expected, _, expected_in in ref.calls:
        k = seen[name] = seen.get(name, -1) + 1
        if (name, k) not in by_call:
            continue
        local, n_cast, local_in = by_call[(name, k)]
        full = gather_like(local, expected.shape, group, n_cast)  # every rank gathers: no early exit
        if full is None or first is not None:
            continue
        err, ok = max_error(full, expected, ATOL, RTOL)
        if not ok:
            first = Divergence(name, sharded.classes.get(name, "?"), err, tuple(expected.shape))
            full_in = (
                None if local_in is None or expected_in is None else gather_like(local_in, expected_in.shape, group)
            )
            if full_in is not None and not max_error(full_in, expected_in, ATOL, RTOL)[1]:
                parent, _, child = name.rpartition(".")
                first = Divergence(
                    parent, sharded.classes.get(parent, "?"), max_error(full_in, expected_in, 0, 0)[0],
                    tuple(expected_in.shape), before=child,
                )  # fmt: skip
    return first
