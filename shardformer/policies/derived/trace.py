"""What each projection of a model does, read off one recorded forward of a tiny copy.

The model's repeated blocks (the items of a ``ModuleList`` holding several modules of one class:
encoder and decoder layers, vision and text towers) are found from its module tree. One forward
runs under a ``TorchFunctionMode`` that follows, for every tensor inside a block, two facts: does it
still carry the block's **stream** (a block input as wide as a projection reads) without passing
through a projection, and which projections' outputs it was computed from (the nearest ones).
Then, per projection (``nn.Linear`` or transformers' ``Conv1D``):

- it reads the stream: **column** candidate (attention's q / k / v, an MLP's first layer, keys and
  values of cross-attention read from the encoder's states);
- it reads only other projections' outputs: **row** candidate, paired with those projections
  (attention's output projection after q / k / v, an MLP's second layer);
- it reads neither (a projection of position or time embeddings): left whole.

Names never decide: a model whose projections are renamed is traced the same.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

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


def run_hooked(model: nn.Module, inputs: dict, handles: list, mode=None) -> None:
    """One forward of ``model`` without gradients (under ``mode`` if given), then its hooks removed."""
    try:
        with mode or contextlib.nullcontext(), torch.no_grad():
            model(**inputs)
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
    only where its traced projections form attention (:func:`attends`)."""
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


@dataclass
class Flow:
    """A tensor's facts: does it carry the block's stream, and from which projections it was computed."""

    stream: bool = False
    sources: frozenset[str] = frozenset()

    def __or__(self, other: Flow) -> Flow:
        return Flow(self.stream or other.stream, self.sources | other.sources)


class FlowMode(TorchFunctionMode):
    """Propagates :class:`Flow` through every torch function called while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.flows: dict[int, Flow] = {}
        self.alive: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.used: set[int] = set()  # ids of every tensor a function read (parameters are long-lived)

    def get(self, t) -> Flow | None:
        return self.flows.get(id(t)) if torch.is_tensor(t) else None

    def set(self, t: torch.Tensor, flow: Flow) -> None:
        self.flows[id(t)] = flow
        self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.used.update(id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, nn.Parameter))
        flows = [f for t in tree_leaves((args, kwargs)) if (f := self.get(t)) is not None]
        if flows:
            merged = Flow()
            for f in flows:
                merged = merged | f
            for t in tree_leaves(out):
                if torch.is_tensor(t):
                    self.set(t, merged)
        return out


@dataclass
class Trace:
    """Per block path: each projection's input flow (relative suffix -> Flow), in call order."""

    blocks: list[str]
    heads: list[str] = field(default_factory=list)  # pooling heads beside the stacks (:func:`pooling_heads`)
    reads: dict[str, dict[str, Flow]] = field(default_factory=dict)
    leaf_reads: dict[str, dict[str, Flow]] = field(default_factory=dict)  # other leaves with parameters
    # projections never called whose weight the block's code reads itself (``F.linear(x, self.qkv.weight,
    # bias)``: timm's EVA and BEiT attention with a q/v bias): a cut layer cannot stand in for them
    bypassed: dict[str, list[str]] = field(default_factory=dict)


def _leaf_with_params(module: nn.Module) -> bool:
    return not list(module.children()) and any(True for _ in module.parameters(recurse=False))


def trace(model: nn.Module, inputs: dict) -> Trace:
    """One forward of ``model`` on ``inputs``, following the flows inside every repeated block."""
    blocks = repeated_blocks(model)
    result = Trace(blocks, pooling_heads(model))
    mode = FlowMode()
    handles = []
    current: list[str] = []

    def enter_block(path: str, block: nn.Module):
        widths = {in_width(m) for m in block.modules() if is_projection(m)}

        def hook(_m, args, kwargs):
            mode.flows.clear()
            current.append(path)
            result.reads.setdefault(path, {})
            result.leaf_reads.setdefault(path, {})
            for t in tree_leaves((args, kwargs)):
                if torch.is_tensor(t) and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] in widths:
                    mode.set(t, Flow(stream=True))

        return hook

    def leave_block(_m, _args, _out):
        current.pop()

    def leaf_hooks(block_path: str, rel: str, module: nn.Module):
        reads = result.reads if is_projection(module) else result.leaf_reads

        def before(_m, args):
            if current and current[-1] == block_path:
                x = next((t for t in tree_leaves(args) if torch.is_tensor(t)), None)
                flow = mode.get(x) or Flow()
                reads[block_path][rel] = reads[block_path].get(rel, Flow()) | flow

        def after(_m, _args, out):
            if current and current[-1] == block_path and is_projection(module):
                for t in tree_leaves(out):
                    if torch.is_tensor(t):
                        mode.set(t, Flow(sources=frozenset([rel])))

        return before, after

    modules = dict(model.named_modules())
    for path in blocks + result.heads:
        block = modules[path]
        handles.append(block.register_forward_pre_hook(enter_block(path, block), with_kwargs=True))
        handles.append(block.register_forward_hook(leave_block))
        for rel, m in block.named_modules():
            if rel and (is_projection(m) or _leaf_with_params(m)):
                before, after = leaf_hooks(path, rel, m)
                handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    run_hooked(model, inputs, handles, mode)
    for path in blocks + result.heads:
        result.bypassed[path] = [
            rel
            for rel, m in modules[path].named_modules()
            if rel and is_projection(m) and rel not in result.reads.get(path, {}) and id(m.weight) in mode.used
        ]
    return result


@dataclass
class Group:
    """Column projections that feed one row projection, relative to their block."""

    cols: tuple[str, ...]
    row: str


def pair(
    reads: dict[str, Flow], replicated_columns: bool = False, after_rows: bool = False
) -> tuple[list[Group], list[str]]:
    """The column/row groups of one block's projections, and the projections left whole (with why).
    ``replicated_columns``: a row may also read a projection of a tensor every rank holds whole (timm's
    Swin-V2 relative position MLP, one value per head): that projection is one more column of the group,
    cut by its outputs. ``after_rows``: a projection reading only rows' outputs (whole on every rank
    after the row's all-reduce) reads the stream: a pooling head's MLP after its attention, with no
    residual around the attention to carry the stream on."""
    groups, whole = _pair(reads, replicated_columns)
    while after_rows:
        rows = {g.row for g in groups}
        fed = {rel: Flow(stream=True) for rel, f in reads.items() if not f.stream and f.sources and f.sources <= rows}
        if not fed:
            break
        reads = {**reads, **fed}
        groups, whole = _pair(reads, replicated_columns)
    return groups, whole


def _pair(reads: dict[str, Flow], replicated_columns: bool) -> tuple[list[Group], list[str]]:
    cols = {rel for rel, f in reads.items() if f.stream}
    rows = {rel: f.sources for rel, f in reads.items() if not f.stream and f.sources}
    replicated = {
        rel for rel, f in reads.items() if replicated_columns and not f.stream and not _from_columns(rel, reads, cols)
    }
    groups = [Group(tuple(sorted(src)), row) for row, src in rows.items() if src & cols and src <= cols | replicated]
    used: dict[str, int] = defaultdict(int)
    for g in groups:
        for c in g.cols:
            used[c] += 1
    # a column feeding two rows, or a row fed by a non-column, is not a plain pair: left whole
    groups = [g for g in groups if all(used[c] == 1 for c in g.cols)]
    paired = {c for g in groups for c in g.cols} | {g.row for g in groups}
    return groups, [rel for rel in reads if rel not in paired]


def _from_columns(rel: str, reads: dict[str, Flow], cols: set[str], seen: frozenset[str] = frozenset()) -> bool:
    """Whether the input of projection ``rel`` was computed, through any projections, from a column's output."""
    sources = reads[rel].sources - seen
    return bool(sources & cols) or any(
        _from_columns(s, reads, cols, seen | {rel}) for s in sources if s in reads and s not in cols
    )


def mixed_rows(reads: dict[str, Flow], groups: list[Group]) -> list[str]:
    """Projections computed from columns' outputs that no group holds (CaiT's talking heads: a
    projection across the heads between q/k and the output projection): no cut over heads computes them."""
    cols = {rel for rel, f in reads.items() if f.stream}
    grouped = {g.row for g in groups} | {c for g in groups for c in g.cols}
    return [rel for rel, f in reads.items() if not f.stream and rel not in grouped and _from_columns(rel, reads, cols)]


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
