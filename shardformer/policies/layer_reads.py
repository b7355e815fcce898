"""What the layers of a stack read, besides the hidden states, from modules outside it.

DeBERTa-v2's encoder normalises its relative position embeddings once (``encoder.LayerNorm`` applied to
``encoder.rel_embeddings.weight``) and hands the result to every layer. No stage boundary can pass that
on, and a stage that does not hold those modules would read a dropped module in their place: every stage
runs layers, so every stage holds them (`PipelineSpec.every`), and their gradients are summed over
the stages. They are found by value, in one forward of the tiny copy: a tensor layer 1 is handed besides
the hidden states that is the output of a module with weights outside the stack, and the modules whose
output or weights that module reads, followed back the same way. Only modules with weights are followed
(a rotary embedding reads the hidden states for their dtype alone); the split is proven afterwards.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if torch.is_tensor(t)]


class LayerReads:
    """Hooks on ``tiny``'s modules outside its ``stacks`` (and not above them) that keep what each one is
    called with and returns; `every` reads them after a forward. ``remove()`` takes the hooks off."""

    def __init__(self, tiny: nn.Module, stacks: tuple[str, ...]) -> None:
        above = {".".join(s.split(".")[:n]) for s in stacks for n in range(len(s.split(".")))}
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        for path, module in tiny.named_modules():
            if path in above or any(path == s or path.startswith(s + ".") for s in stacks):
                continue
            if not any(True for _ in module.parameters()):
                continue  # it runs on every stage as the model calls it: nothing to place

            def pre(_m, args, kwargs, p=path):
                self.inputs.setdefault(p, []).extend(_tensors((args, kwargs)))

            def post(_m, _args, out, p=path):
                self.outputs.setdefault(p, []).extend(_tensors(out))

            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(post))
        self.params = {id(p): name for name, p in tiny.named_parameters()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def every(self, received, hidden, placed: list[str]) -> list[str]:
        """The paths of ``placed`` whose output or weights reach a layer beside the hidden states
        (``received``: the ``(args, kwargs)`` layer 1 is called with; ``hidden``: its hidden states)."""
        wanted = {id(t) for t in _tensors(received) if t is not hidden}
        found: set[str] = set()
        seen: set[int] = set()
        while wanted:
            seen |= wanted
            reads: set[int] = set()
            for path, outs in self.outputs.items():
                if path not in found and any(id(t) in wanted for t in outs):
                    found.add(path)
                    reads |= {id(t) for t in self.inputs.get(path, [])}
            found |= {self.params[i].rpartition(".")[0] for i in wanted if i in self.params}
            wanted = reads - seen
        return [p for p in placed if any(f == p or f.startswith(p + ".") for f in found)]


def untied(model: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` less those holding a weight tied to one outside them (an input embedding tied to the
    head: the first and the last stage hold it as ``shared``, not every stage)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)

    def params(path: str) -> list[nn.Parameter]:
        try:
            return list(model.get_submodule(path).parameters())
        except AttributeError:
            return [model.get_parameter(path)]  # one the model holds itself (timm's cls_token)

    return [
        path for path in paths if all(n == path or n.startswith(path + ".") for p in params(path) for n in names[id(p)])
    ]
