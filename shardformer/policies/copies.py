"""Copies of a model with no transformers config to scale down (timm, plain modules): the model
itself with each repeated stack cut to two blocks (same widths, same code, dropout off).

Two blocks are the fewest that show a stack's per-block rule twice (what one block hands the next);
the widths stay the user's, so every count and width the code reads is the one it reads on the user's
model. The derived route traces this copy, and the proof runs it sharded against unsharded.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

KEEP = 2  # blocks kept of each repeated stack


def repeated_stacks(model: nn.Module) -> list[str]:
    """Paths of the stacks :func:`~shardformer.policies.derived.trace.repeated_blocks` finds whose
    blocks are all of one class and one shape (a stack of mixed classes, or of stages that widen as
    ConvNeXt's do, is kept whole in a copy: the layers after it read the last item's width)."""
    from shardformer.policies.derived.trace import repeated_blocks

    stacks: list[str] = []
    for block in repeated_blocks(model):
        stack = block.rpartition(".")[0]
        if stack and stack not in stacks:
            stacks.append(stack)
    return [s for s in stacks if len({_shape(m) for m in model.get_submodule(s)}) == 1]


def _shape(block: nn.Module) -> tuple:
    return type(block), tuple((name, tuple(p.shape)) for name, p in block.named_parameters())


@contextlib.contextmanager
def stacks_cut(model: nn.Module):
    """``model`` with each of its repeated stacks holding its first two blocks, restored on exit."""
    saved = {path: model.get_submodule(path) for path in repeated_stacks(model)}
    saved = {path: stack for path, stack in saved.items() if len(stack) > KEEP}
    for path, stack in saved.items():
        kept = list(stack)[:KEEP]
        _set(model, path, type(stack)(*kept) if isinstance(stack, nn.Sequential) else nn.ModuleList(kept))
    try:
        yield model
    finally:
        for path, stack in saved.items():
            _set(model, path, stack)


def two_blocks(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose repeated stacks keep two blocks, with dropout off (both copies the
    proof compares compute one function); of a model on the meta device (``shardformer plan``), a
    real copy with random weights (:func:`materialize`)."""
    with stacks_cut(model):
        tiny = copy.deepcopy(model)
    no_dropout(tiny)
    if any(t.device.type == "meta" for t in (*tiny.parameters(), *tiny.buffers())):
        materialize(tiny)
    return tiny


def materialize(model: nn.Module) -> None:
    """``model``, built on the meta device, on the cpu with random weights: what a derivation needs
    (the cut depends on the code and the sizes, not on the values). Each module's own
    ``reset_parameters`` sets what it has (norms at one), and timm's ``init_non_persistent_buffers``
    the tables it computes when built (relative position indices), which the meta device left empty."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
        for buffer in model.buffers():
            buffer.zero_()
    for module in model.modules():
        for name in ("reset_parameters", "init_non_persistent_buffers"):
            init = getattr(module, name, None)
            if callable(init):
                init()


def no_dropout(model: nn.Module) -> None:
    """Every dropout module of ``model`` at probability 0 (a head's ``classifier_dropout`` that the
    config does not name, and so the recipe cannot zero, included)."""
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):  # its attention dropout is a float, not a module
            module.dropout = 0.0
        if "Drop" in type(module).__name__:
            for name in ("p", "drop_prob"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.0)


def architecture(model: nn.Module) -> str:
    """A cache key for the two-block copy: every module's class and sizes in order, and the plain
    settings each module holds (a flag its forward reads, such as timm's ``fused_attn``), so that two
    models cut alike only when they compute alike at any depth."""
    with stacks_cut(model):
        settings = [
            (path, name, value)
            for path, module in model.named_modules()
            for name, value in sorted(vars(module).items())
            if not name.startswith("_") and name != "training" and isinstance(value, _SETTINGS)
        ]
        return repr(model) + repr(settings)


_SETTINGS = (bool, int, float, str, tuple, type(None))


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)
