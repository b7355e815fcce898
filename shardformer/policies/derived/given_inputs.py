"""Where the tensors given to a model go, followed through one forward of a tiny copy: the embeddings
that look up the caller's token ids, and the block inputs the model computes once outside its repeated
blocks (ALiBi) and hands to every block whole.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardformer.policies.derived.blocks import repeated_blocks, run_hooked

_SAME_VALUES = {
    torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.contiguous, torch.Tensor.to,
    torch.Tensor.__getitem__, torch.Tensor.unsqueeze, torch.Tensor.squeeze, torch.Tensor.clone,
}  # fmt: skip


class _GivenValues(TorchFunctionMode):
    """Follows the caller's tensors through reshapes and indexing (CLIP's ``input_ids.view(...)``)."""

    def __init__(self, given: list[torch.Tensor]) -> None:
        super().__init__()
        self.ids = {id(t) for t in given}
        self.alive = list(given)  # ids stay unique while the forward runs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _SAME_VALUES and args and id(args[0]) in self.ids and torch.is_tensor(out):
            self.ids.add(id(out))
            self.alive.append(out)
        return out


def input_embeddings(model: nn.Module, inputs: dict, token_ids: list[torch.Tensor]) -> list[str]:
    """Paths of the ``nn.Embedding`` modules that look up ``token_ids`` (tensors of ``inputs``), reshaped
    or not (a text tower's token embedding, a plain LM's), and not ids the model computes (positions)."""
    mode = _GivenValues([t for t in token_ids if torch.is_tensor(t)])
    found: list[str] = []
    handles = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding):

            def seen(_m, args, path=path):
                if args and id(args[0]) in mode.ids and path not in found:
                    found.append(path)

            handles.append(module.register_forward_pre_hook(seen))
    run_hooked(model, inputs, handles, mode)
    return found


class _MadeInBlocks(TorchFunctionMode):
    """Remembers every tensor computed while one of the repeated blocks runs."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.made: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth:
            for t in tree_leaves(out):
                if torch.is_tensor(t):
                    self.made[id(t)] = t
        return out


def inputs_from_outside(model: nn.Module, path: str, inputs: dict) -> set[str | int]:
    """Keys (kwarg names, positions) of the tensors handed to ``path``'s first call that were not
    computed inside a repeated block: the model computes them once and hands them to every block
    whole (ALiBi), where a tensor an earlier block computed is already this rank's share."""
    mode = _MadeInBlocks()
    found: set[str | int] = set()
    seen = []

    def enter(*_):
        mode.depth += 1

    def leave(*_):
        mode.depth -= 1

    def first_call(_m, args, kwargs):
        if not seen:
            seen.append(True)
            for key, t in [*enumerate(args), *kwargs.items()]:
                if torch.is_tensor(t) and id(t) not in mode.made:
                    found.add(key)

    modules = dict(model.named_modules())
    handles = [modules[path].register_forward_pre_hook(first_call, with_kwargs=True)]
    for block in repeated_blocks(model):
        handles += [modules[block].register_forward_pre_hook(enter), modules[block].register_forward_hook(leave)]
    run_hooked(model, inputs, handles, mode)
    return found
