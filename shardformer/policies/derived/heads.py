"""Per-head tensors beside a group's projections, tried when no plain cut is exact.

A parameter of a leaf beside the projections with one dimension as long as a head count is cut with
the heads (T5's relative attention bias ``[buckets, heads]``); a list of one module per head (StableLM's
per-head LayerNorms) shows each rank its heads' modules (`shardformer.tensor_parallel.layers.per_head.HeadModules`); a tensor handed to the group's module
with such a dimension (ALiBi: BLOOM's ``[batch x heads, 1, s]``, MPT's ``[heads, 1, s]``) is cut to the
rank's heads on the way in, when the model computes it outside the blocks (`HeadInputs`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from shardformer.core.comm import group_rank, group_size
from shardformer.policies.derived.blocks import is_projection
from shardformer.tensor_parallel.detect import int_attributes, is_head_count
from shardformer.tensor_parallel.layers.norm import splits_features

MAX_HEAD_OPTIONS = 16


@dataclass(frozen=True)
class HeadCut:
    """A tensor cut by heads along ``dim`` (each rank keeps its heads' contiguous share). ``heads``:
    dim 0 holds batch × heads flattened, heads inner (BLOOM's ALiBi ``[b·H, 1, s]``); the attribute
    (a dotted path relative to the block) that counts those heads."""

    dim: int
    heads: str = ""


def slice_heads(t: torch.Tensor, cut: HeadCut, heads: int, rank: int, tp: int) -> torch.Tensor:
    """This rank's heads of a per-head tensor (``heads``: the head count when ``cut.heads`` is set)."""
    if cut.heads:
        grouped = t.view(-1, heads, *t.shape[1:])
        return grouped.narrow(1, rank * (heads // tp), heads // tp).reshape(-1, *t.shape[1:])
    size = t.shape[cut.dim] // tp
    return t.narrow(cut.dim, rank * size, size)


def head_counts(parent: nn.Module, tp: int, config=None) -> dict[int, str]:
    """``{value: dotted name}`` of the head counts the parent's subtree holds (dividing by tp), then those
    of the configs its modules keep (``self.config``) and of the model's (text) ``config``: GPT-OSS's and
    Parakeet's attention keep no head count of their own, yet hold per-head parameters (``sinks``,
    ``bias_u``) as long as ``config.num_attention_heads``."""
    counts: dict[int, str] = {}
    for rel, module in parent.named_modules():
        for name, value in int_attributes(module).items():
            if is_head_count(name) and value > 1 and value % tp == 0:
                counts.setdefault(value, f"{rel}.{name}" if rel else name)
    held = [
        (f"{rel}.config" if rel else "config", m.config) for rel, m in parent.named_modules() if hasattr(m, "config")
    ]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for prefix, conf in [*held, *([("config", text)] if text is not None else [])]:
        for name, value in getattr(conf, "__dict__", {}).items():
            if is_head_count(name) and type(value) is int and value > 1 and value % tp == 0:
                counts.setdefault(value, f"{prefix}.{name}")
    return counts


def _head_param_options(parent: nn.Module, counts: dict[int, str]) -> dict[str, dict[str, int]]:
    """Parameters of non-projection leaves with exactly one dimension as long as a head count."""
    found: dict[str, dict[str, int]] = {}
    for rel, module in parent.named_modules():
        if is_projection(module):
            continue
        for name, param in module.named_parameters(recurse=False):
            dims = [d for d, n in enumerate(param.shape) if n in counts]
            if len(dims) == 1:
                found.setdefault(rel, {})[name] = dims[0]
    return found


CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def depthwise_options(parent: nn.Module, widths: set[int]) -> dict[str, dict[str, int]]:
    """The depthwise convolutions in ``parent`` over as many channels as a column's block (LFM2's short
    convolution over ``[B | C | x]``'s channels, RecurrentGemma's over ``linear_x``'s): cut with the blocks."""
    found: dict[str, dict[str, int]] = {}
    for rel, m in parent.named_modules():
        if isinstance(m, CONVOLUTIONS) and m.groups == m.in_channels == m.out_channels > 1 and m.groups in widths:
            found[rel] = {name: 0 for name, _ in m.named_parameters(recurse=False)}
    return found


def depthwise_counts(parent: nn.Module, params: dict[str, dict[str, int]]) -> tuple[str, ...]:
    """The channel and group counts of the depthwise convolutions whose weight ``params`` cuts by heads
    (Nystromformer's convolution over the heads' values, ``groups = heads``): each rank's holds its heads
    only, so its counts are per rank too."""
    found = []
    for rel, dims in params.items():
        m = parent.get_submodule(rel)
        if isinstance(m, CONVOLUTIONS) and m.groups == m.in_channels == m.out_channels > 1 and dims.get("weight") == 0:
            found += [f"{rel}.{name}" if rel else name for name in ("in_channels", "out_channels", "groups")]
    return tuple(found)


def head_lists(parent: nn.Module, tp: int) -> dict[str, int]:
    """``{path: length}`` of the lists of one module per head in the parent (StableLM's per-head
    LayerNorms): an ``nn.ModuleList`` of modules of one class holding parameters, not projections, as
    long as a head count that splits over ``tp``."""
    counts = head_counts(parent, tp)
    found = {}
    for rel, module in parent.named_modules():
        items = list(module) if type(module) is nn.ModuleList else []
        alike = len(items) in counts and len({type(m) for m in items}) == 1
        if alike and not is_projection(items[0]) and any(True for _ in items[0].parameters()):
            found[rel] = len(items)
    return found


def distinct_heads(parent: nn.Module, lists: dict[str, int], row: str, args, kwargs) -> tuple[nn.Module, object]:
    """A copy of ``parent`` whose per-head modules (``lists``) hold different weights, and its row's output
    on the recorded inputs: a tiny copy's per-head norms are all alike, so a cut that hands a rank
    another head's module would pass for exact on it."""
    local = copy.deepcopy(parent)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rel in lists:
            for p in local.get_submodule(rel).parameters():
                p.add_(torch.randn(p.shape, generator=generator).to(p) * 0.5)
    captured: list = []
    handle = local.get_submodule(row).register_forward_hook(lambda _m, _a, out: captured.append(out))
    with torch.no_grad():
        local(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    handle.remove()
    return local, captured[0]


def _head_input_options(args, kwargs, counts: dict[int, str], batch: int, stream_width: int) -> dict:
    """``{kwarg or position: [HeadCut, ...]}`` for the float tensors handed in that may be per head."""
    found = {}
    for key, t in [*enumerate(args), *kwargs.items()]:
        if not torch.is_tensor(t) or not t.is_floating_point() or t.dim() < 2 or t.shape[-1] == stream_width:
            continue
        options = [HeadCut(d) for d, n in enumerate(t.shape) if n in counts]
        options += [HeadCut(0, name) for h, name in counts.items() if batch > 1 and t.shape[0] == batch * h]
        if options:
            found[key] = options
    return found


def bias_options(parent: nn.Module, col_rels: list[str], widths: set[int]) -> dict[str, dict[str, int]]:
    """1-D float tensors held by the modules owning the columns, as long as a column's block (timm's
    ``q_bias``, ``k_bias``, ``v_bias`` beside a fused ``qkv``, added to its output): cut with the blocks."""
    found: dict[str, dict[str, int]] = {}
    for owner in dict.fromkeys(rel.rpartition(".")[0] for rel in col_rels):
        module = parent.get_submodule(owner)
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if t.dim() == 1 and t.is_floating_point() and t.shape[0] in widths:
                found.setdefault(owner, {})[name] = 0
    return found


def channel_options(parent: nn.Module, row_rel: str, widths: set[int]) -> dict[str, dict[str, int]]:
    """Leaves computing per channel on a column's output (LeViT's BatchNorm1d after its ``qkv``: its
    weight, bias and running statistics ``[C]``): every float tensor 1-D and as long as a column's
    output, not a norm over the features (`SplitLayerNorm`'s) nor beside the row (on the stream): cut
    with the columns' channels."""
    found: dict[str, dict[str, int]] = {}
    row_owner = row_rel.rpartition(".")[0]
    for rel, module in parent.named_modules():
        if not rel or list(module.children()) or is_projection(module) or splits_features(module):
            continue
        if row_owner and (rel == row_owner or rel.startswith(f"{row_owner}.")):
            continue
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        floats = [(n, t) for n, t in tensors if t.is_floating_point()]
        if floats and all(t.dim() == 1 and t.shape[0] in widths for _, t in floats):
            found[rel] = {name: 0 for name, _ in floats}
    return found


def head_options(parent, args, kwargs, tp, inputs, stream_width, biases=None, lists=None, config=None) -> list[tuple]:
    """Per-head parameter, input and module-list cuts to try, ``(params, inputs, lists)`` (with ``biases``,
    `bias_options`, cut alike; ``lists``: `head_lists`; ``config``: the model's, whose head counts count
    too), the fewest cut tensors first."""
    counts = head_counts(parent, tp, config)
    if not counts and not biases:
        return []
    params = _head_param_options(parent, counts)
    for rel, dims in (biases or {}).items():
        params.setdefault(rel, {}).update(dims)
    first = next((t for t in tree_leaves(inputs) if torch.is_tensor(t)), None)
    batch = first.shape[0] if first is not None else 0
    per_input = _head_input_options(args, kwargs, counts, batch, stream_width)
    keys = list(per_input)
    combos = []
    for picks in itertools.product(*[[None, *per_input[k]] for k in keys]):
        chosen = {k: c for k, c in zip(keys, picks) if c is not None}
        for with_params, with_lists in itertools.product(
            [params, {}] if params else [{}], [lists, {}] if lists else [{}]
        ):
            if chosen or with_params or with_lists:
                combos.append((with_params, chosen, with_lists))
    combos.sort(key=lambda c: sum(len(d) for d in c[0].values()) + len(c[1]) + len(c[2]))
    return combos[:MAX_HEAD_OPTIONS]


class HeadInputs:
    """A module handed whole per-head tensors the model computes outside the blocks (ALiBi): each is
    cut to this rank's heads on the way in. ``cuts`` ({kwarg or position: HeadCut}) and ``counts``
    (the head count of a batch × heads dimension) are set on the subclass `head_inputs_layer` makes."""

    cuts: dict = {}
    counts: dict = {}

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        rank, world = group_rank(process_group), group_size(process_group)
        cuts, counts = cls.cuts, cls.counts

        def cut_inputs(_m, args, kwargs):
            args = list(args)
            for key, cut in cuts.items():
                where = args if isinstance(key, int) else kwargs
                if (key < len(where) if isinstance(key, int) else key in where) and where[key] is not None:
                    where[key] = slice_heads(where[key], cut, counts.get(key, 0), rank, world)
            return tuple(args), kwargs

        if world > 1:
            module.register_forward_pre_hook(cut_inputs, with_kwargs=True)
        return module


def head_inputs_layer(cuts: dict, counts: dict) -> type[HeadInputs]:
    return type("HeadInputs", (HeadInputs,), {"cuts": dict(cuts), "counts": dict(counts)})
