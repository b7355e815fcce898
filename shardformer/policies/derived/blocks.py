"""The structure the derived route reads off a model's module tree: its projections (``nn.Linear`` or
transformers' ``Conv1D``), its repeated blocks (the items of a ``ModuleList`` holding several modules of
one class: encoder and decoder layers, vision and text towers) and the pooling heads beside them.
Names never decide: a model whose modules are renamed is read the same.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.nn as nn

from shardformer.core.refusal import has_convolutions
from shardformer.core.study_memo import once_per_study
from shardformer.tensor_parallel.layers.linear import is_conv1d


def is_projection(module: nn.Module) -> bool:
    """``nn.Linear``, a leaf subclass of it (Falcon's ``FalconLinear``: the cut layers compute the plain
    product in its place, which the proof confirms), or transformers' ``Conv1D``."""
    return (isinstance(module, nn.Linear) and not list(module.children())) or is_conv1d(module)


def in_width(module: nn.Module) -> int:
    return module.in_features if isinstance(module, nn.Linear) else module.weight.shape[0]


def out_width(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else module.weight.shape[1]


def value_at(root: nn.Module, dotted: str):
    """The attribute at a dotted path below ``root`` (``attn.num_heads``, ``attn.config.n_head``)."""
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def run_hooked(model: nn.Module, inputs: dict, handles: list, mode=None):
    """One forward of ``model`` without gradients (under ``mode`` if given), then its hooks removed; its output."""
    try:
        with mode or contextlib.nullcontext(), torch.no_grad():
            return model(**inputs)
    finally:
        for h in handles:
            h.remove()


@once_per_study  # asked by the derivation, the plan, the copies and the anatomy: answered once
def repeated_blocks(model: nn.Module) -> list[str]:
    """Paths of the items of every ``ModuleList`` or ``Sequential`` that holds at least two modules of
    one class with projections inside, outermost stacks only (experts inside a layer belong to their
    layer), except a ``Sequential`` of stages that each hold such a stack (Swin's stages of blocks)
    or are one (CSATv2's stages, each a ``Sequential`` of blocks), and a ``ModuleList`` of stacks
    (Twins', VOLO's): the blocks inside them are the repeated blocks."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or any(
            name == b or name.startswith(b + ".") for b in found
        ):
            continue
        like = _like_blocks(module, name)
        items = [module[int(p.rpartition(".")[2])] for p in like]
        # a ModuleList of stages only where each is a stack itself (Twins', VOLO's): a ModuleList of
        # layers holding a stack (experts) is a stack of layers
        stage = _is_stage if isinstance(module, nn.Sequential) else _is_stack
        if like and all(stage(item) for item in items):
            continue  # stages of blocks: the blocks are found inside each stage
        found += like
    return found


def blocks_to_cut(model: nn.Module) -> list[str]:
    """The blocks tensor parallelism cuts by their class's rule: the repeated blocks, else the lone
    blocks (`lone_blocks`). Pipeline parallelism reads `repeated_blocks` alone: a lone block is no stack
    of stages."""
    return repeated_blocks(model) or lone_blocks(model)


def lone_blocks(model: nn.Module) -> list[str]:
    """Paths of the one item of a ``ModuleList`` or ``Sequential`` holding two projections or more and no
    convolution, outermost only: ALBERT's one layer group, which its forward applies
    ``num_hidden_layers`` times (the weights shared by every application). Cut once, each application
    runs on the cut weights and the gradients add up over them as in the whole model."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) != 1:
            continue
        if any(name == b or name.startswith(f"{b}.") for b in found):
            continue
        item = module[0]
        inside = list(item.modules())
        if list(item.children()) and sum(map(is_projection, inside)) >= 2 and not has_convolutions(item):
            found.append(f"{name}.0" if name else "0")
    return found


def _like_blocks(stack: nn.Module, name: str) -> list[str]:
    """Paths of the items of ``stack`` that share a class with another item and hold projections."""
    classes = defaultdict(list)
    for index, item in enumerate(stack):
        if any(is_projection(m) for m in item.modules()) and list(item.children()):
            classes[type(item)].append(f"{name}.{index}" if name else str(index))
    return [path for paths in classes.values() if len(paths) >= 2 for path in paths]


def pooling_heads(model: nn.Module) -> list[str]:
    """Paths of the modules beside the repeated stacks that may pool with attention of their own (SigLIP's
    head: an ``nn.MultiheadAttention`` whose query is a learned probe; timm's ``AttentionPoolLatent``):
    outside every block, a child of the model or of a module holding a stack, with an
    ``nn.MultiheadAttention`` or three projections or more inside. Candidates: the derivation cuts one
    only where its traced projections form attention (`attends`)."""
    blocks = repeated_blocks(model)
    if not blocks:
        return []
    found = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if not name or any(f"{b}.".startswith(f"{name}.") or name.startswith(f"{b}.") for b in blocks):
            continue  # a block, inside one, or holding one
        if parent and not any(b.startswith(f"{parent}.") for b in blocks):
            continue  # not beside a stack (inside a head found already, an embedding module's parts)
        inside = list(module.modules())
        if any(isinstance(m, nn.MultiheadAttention) for m in inside) or sum(map(is_projection, inside)) >= 3:
            found.append(name)
    return found


def attends(groups: list, attention: set[str]) -> bool:
    """A head's projections form attention: an ``nn.MultiheadAttention``, or a row projection reading
    two column projections or more (queries and keys / values); an MLP alone is not a pooling head."""
    return bool(attention) or any(len(g.cols) >= 2 for g in groups)


def _is_stage(item: nn.Module) -> bool:
    """A stage: it holds a stack of like blocks, or is one."""
    return _holds_stack(item) or _is_stack(item)


def _is_stack(item: nn.Module) -> bool:
    return isinstance(item, (nn.ModuleList, nn.Sequential)) and bool(_like_blocks(item, ""))


def _holds_stack(module: nn.Module) -> bool:
    return any(
        isinstance(m, (nn.ModuleList, nn.Sequential)) and _like_blocks(m, "") for _, m in module.named_modules() if _
    )


def own_weights(block: nn.Module) -> dict[str, list[str]]:
    """``{class name: paths}`` of the leaves in ``block`` that hold a matrix of their own and are no
    projection (JetMoE's ``JetMoeParallelExperts``: experts' weights multiplied by the module's own code)."""
    found: dict[str, list[str]] = {}
    for rel, m in block.named_modules():
        matrices = any(p.dim() >= 2 for p in m.parameters(recurse=False))
        if rel and matrices and not list(m.children()) and not is_projection(m) and not isinstance(m, nn.Embedding):
            found.setdefault(type(m).__name__, []).append(rel)
    return found
