"""The channel cut of a convolutional network (ResNet, RegNet, MobileNet, timm's convnets), Megatron-style.

One forward under a ``TorchFunctionMode`` follows, for every convolution's output, the channels it
writes: a **column** candidate. Its channels stay cut through the functions that work on each channel
alone (batch norm, activations, pooling, padding, elementwise products and sums of tensors cut alike,
parameters with one entry per channel: cut with them) and through grouped convolutions whose groups split
over the ranks (depthwise ones: cut with them); a convolution of ``groups=1`` that reads them is their
**row** (partial sums, all-reduced). Anything else that reads them (a residual sum with the whole stream,
a norm over channels, a flatten, the model's output, a reshape) keeps them whole.

Columns whose channels meet in one function (a squeeze-excitation gate times the features it gates)
are cut together or not at all; the first of them run is decided first, and a convolution is never
both a row and a column. The proof on the tiny copy decides whether the cut is exact.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardformer.core.inputs import make_inputs
from shardformer.core.refusal import CONVOLUTIONS
from shardformer.policies.derived.blocks import run_hooked
from shardformer.policies.tp_plan.styles import head_params_layer
from shardformer.tensor_parallel.layers.conv import PLAIN_CONVS, ConvColumn, ConvGroups, ConvRow
from shardformer.tensor_parallel.policy import Layer

# torch functions that compute each channel from that channel alone (dim 1 of [batch, channels, ...])
PER_CHANNEL = frozenset(
    [
        "batch_norm",
        "instance_norm",
        "relu",
        "relu_",
        "relu6",
        "gelu",
        "silu",
        "silu_",
        "sigmoid",
        "sigmoid_",
        "tanh",
        "tanh_",
        "hardswish",
        "hardswish_",
        "hardsigmoid",
        "hardsigmoid_",
        "hardtanh",
        "hardtanh_",
        "leaky_relu",
        "leaky_relu_",
        "elu",
        "elu_",
        "mish",
        "selu",
        "celu",
        "softplus",
        "dropout",
        "dropout_",
        "dropout2d",
        "dropout1d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "clone",
        "contiguous",
        "add",
        "add_",
        "__add__",
        "__iadd__",
        "__radd__",
        "sub",
        "sub_",
        "__sub__",
        "__isub__",
        "__rsub__",
        "mul",
        "mul_",
        "__mul__",
        "__imul__",
        "__rmul__",
        "div",
        "div_",
        "__truediv__",
        "__itruediv__",
        "__rtruediv__",
        "neg",
        "__neg__",
        "abs",
        "exp",
        "sqrt",
        "rsqrt",
        "pow",
        "__pow__",
        "clamp",
        "clamp_",
        "clip",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
        "max_pool2d_with_indices",
        "pad",
        "interpolate",
        "upsample",
        "to",
        "float",
        "type_as",
    ]
)

# reductions that are per channel when every dimension they reduce is spatial (timm's squeeze-excitation
# ``x.mean((2, 3), keepdim=True)``)
OVER_DIMS = frozenset(["mean", "sum", "amax", "amin", "std", "var", "logsumexp"])


@dataclass
class ChannelCut:
    """Paths of the convolutions cut by output channels (``columns``), by input channels (``rows``), by
    groups (``groups``), and ``{module: {tensor: dim}}`` of the per-channel tensors cut with them."""

    columns: list[str] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)  # convs whose output channels stay whole, with why
    rows: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)


class _ChannelMode(TorchFunctionMode):
    """Tags each tensor with the columns whose channels it holds, and records who reads them."""

    def __init__(self, names: dict[int, tuple[str, str]]) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.names = names  # id of a parameter or buffer -> (module path, tensor name)
        self.links: list[frozenset[str]] = []  # tags that met in one function: cut together or not at all
        self.bad: dict[str, str] = {}  # tag -> what reads its channels across them (the first seen)
        self.tensors: dict[frozenset[str], set[tuple[str, str, int]]] = defaultdict(set)
        self.quiet = 0  # inside a convolution module: its own functions are judged by its hooks

    def tag(self, t) -> frozenset[str]:
        return self.tags.get(id(t), frozenset()) if torch.is_tensor(t) else frozenset()

    def set(self, out, tags: frozenset[str]) -> None:
        for t in tree_leaves(out):
            if torch.is_tensor(t):
                self.tags[id(t)] = tags
                self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet:
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)]
        tagged = [t for t in tensors if self.tag(t)]
        if not tagged or not any(torch.is_tensor(t) for t in tree_leaves(out)):
            return out
        tags = frozenset().union(*(self.tag(t) for t in tagged))
        if len({self.tag(t) for t in tagged}) > 1:
            self.links.append(tags)
        if self._per_channel(func, tensors, tagged, tags, args, kwargs):
            self.set(out, tags)
        else:
            self.spoil(tags, f"torch's {getattr(func, '__name__', func)} reads them, not channel by channel")
        return out

    def spoil(self, tags, why: str) -> None:
        for t in tags:
            self.bad.setdefault(t, why)

    def _per_channel(self, func, tensors, tagged, tags, args, kwargs) -> bool:
        """Whether ``func`` computes each channel of its tagged inputs on its own; the whole tensors it
        reads with one entry per channel (parameters, buffers) are noted to be cut with them."""
        ref = tagged[0]
        if getattr(func, "__name__", "") in OVER_DIMS:  # over the spatial dimensions alone: per channel
            dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
            dims = [dims] if isinstance(dims, int) else dims
            return len(tagged) == 1 and bool(dims) and all(d % ref.dim() >= 2 for d in dims)
        if getattr(func, "__name__", "") not in PER_CHANNEL:
            return False
        if ref.dim() < 2 or any(t.dim() != ref.dim() or t.shape[1] != ref.shape[1] for t in tagged):
            return False
        channels = ref.shape[1]
        for t in tensors:
            if self.tag(t) or t.dim() == 0:
                continue
            # where the channel dimension falls in ``t`` under broadcasting (1-D: a norm's per-channel entries)
            dim = 0 if t.dim() == 1 and getattr(func, "__name__", "") in ("batch_norm", "instance_norm") else None
            if dim is None and t.dim() >= ref.dim() - 1:
                dim = t.dim() - (ref.dim() - 1)
            if dim is None or dim < 0 or t.shape[dim] == 1:
                continue  # the same for every channel (a scalar, a spatial map)
            if t.shape[dim] != channels or not self.names.get(id(t), ("",))[0]:
                return False  # a whole tensor over the channels (a residual, a computed gate), or the root's
            path, name = self.names[id(t)]
            self.tensors[tags].add((path, name, dim))
        return True


def _grouped(conv: nn.Module, tp: int) -> bool:
    return conv.groups > 1 and conv.groups % tp == 0 and conv.out_channels % tp == 0


def channel_cut(model: nn.Module, inputs: dict, tp: int) -> ChannelCut:
    """The channel cut of ``model`` at ``tp``, read off one forward on ``inputs``."""
    convs = {p: m for p, m in model.named_modules() if isinstance(m, CONVOLUTIONS)}
    names = {id(t): (p.rpartition(".")[0], p.rpartition(".")[2]) for p, t in model.named_parameters()}
    names |= {id(t): (p.rpartition(".")[0], p.rpartition(".")[2]) for p, t in model.named_buffers()}
    mode = _ChannelMode(names)
    order: list[str] = []
    reads: dict[str, frozenset[str]] = {}  # conv -> the tags of its input
    passes: dict[str, frozenset[str]] = {}  # grouped conv -> the tags it carries on
    candidates: set[str] = set()  # convs whose output channels may be cut

    def before(path):
        def hook(_m, args):
            x = next((t for t in tree_leaves(args) if torch.is_tensor(t)), None)
            reads[path] = reads.get(path, frozenset()) | mode.tag(x)
            mode.quiet += 1

        return hook

    def after(path, conv):
        def hook(_m, _args, out):
            mode.quiet -= 1
            order.append(path)
            if not isinstance(conv, PLAIN_CONVS):  # transposed convolutions stay whole
                return
            if reads[path] and _grouped(conv, tp):
                passes[path] = reads[path]
                mode.set(out, reads[path])
            elif conv.groups == 1 and conv.out_channels % tp == 0:
                candidates.add(path)
                mode.set(out, frozenset([path]))

        return hook

    handles = []
    for path, conv in convs.items():
        handles += [conv.register_forward_pre_hook(before(path)), conv.register_forward_hook(after(path, conv))]
    output = run_hooked(model, inputs, handles, mode)
    for t in tree_leaves(list(output.values()) if isinstance(output, dict) else output):
        mode.spoil(mode.tag(t), "they are the model's output")
    return _choose(convs, [p for p in order if p in candidates], reads, passes, mode)


def _kept_whole(members, readers, convs, bad, rows, columns) -> str | None:
    """Why the linked columns ``members`` stay whole (None: they are cut), their ``readers`` the rows."""
    spoilt = sorted(members & set(bad))
    if spoilt:
        return f"{bad[spoilt[0]]} ({spoilt[0]}'s output channels)"
    if readers & members:
        reader = sorted(readers & members)[0]
        return (
            f"{reader} reads them and its output is summed with them (a residual around convolutions, TextNet's "
            f"identity branch): the same channels are read and written, so no convolution can sum over a rank's part"
        )
    if members & rows:
        return f"{sorted(members & rows)[0]} reads channels cut by an earlier convolution already (a row)"
    if readers & columns:
        return f"{sorted(readers & columns)[0]} reads them, and its own output channels are cut already"
    odd = sorted(p for p in readers if type(convs[p]) not in PLAIN_CONVS or convs[p].groups != 1)
    if odd:
        kind = type(convs[odd[0]]).__name__
        return (
            f"{odd[0]} reads them ({kind}, groups={convs[odd[0]].groups}): only torch's own convolution of one group "
            f"sums over a rank's input channels exactly"
        )
    return None if readers else "no convolution reads them"


def _choose(convs, order, reads, passes, mode: _ChannelMode) -> ChannelCut:
    """The classes of linked columns cut, the first run first, each only where all its readers can be rows."""
    parent = {}

    def find(t):
        while parent.setdefault(t, t) != t:
            t = parent[t]
        return t

    for linked in [*mode.links, *reads.values(), *passes.values()]:
        first, *rest = sorted(linked) or [None]
        for t in rest:
            parent[find(t)] = find(first)
    classes: dict[str, set[str]] = defaultdict(set)
    for path in order:
        classes[find(path)].add(path)
    first = {m: min(order.index(p) for p in m) for m in map(frozenset, classes.values())}
    # two orders, the better kept: the first run first (a stem and the residual stream it links), or the
    # classes of one convolution first (a bottleneck's 1x1 -> 3x3 pair before the residual stream)
    cuts = [
        _cut_classes(sorted(first, key=key), convs, order, reads, passes, mode)
        for key in (first.get, lambda m: (len(m) > 1, first[m]))
    ]
    return max(cuts, key=lambda c: sum(convs[p].weight.numel() for p in [*c.columns, *c.rows, *c.groups]))


def _cut_classes(ordered, convs, order, reads, passes, mode: _ChannelMode) -> ChannelCut:
    """Each class of linked columns in ``ordered`` cut where all its readers can be rows."""
    cut = ChannelCut()
    columns: set[str] = set()
    rows: set[str] = set()
    for members in map(set, ordered):
        readers = {p for p, r in reads.items() if r & members and p not in passes}
        why = _kept_whole(members, readers, convs, mode.bad, rows, columns)
        if why:
            cut.whole.update(dict.fromkeys(sorted(members), why))
            continue
        columns |= members
        rows |= readers
        cut.groups += [p for p, r in passes.items() if r & members]
        for tags, found in mode.tensors.items():
            if tags & members:
                for path, name, dim in found:
                    cut.tensors.setdefault(path, {})[name] = dim
    cut.columns = list(dict.fromkeys(p for p in order if p in columns))
    cut.rows = sorted(rows)
    return cut


def channel_layers(model: nn.Module, tp: int) -> tuple[list[Layer], dict[str, str]]:
    """The layers cutting ``model``'s convolutions over channels (`channel_cut` of one forward of
    ``model`` itself on the recipe's inputs: on the meta device where its weights are), and the
    convolutions whose output channels stay whole, with why."""
    inputs = make_inputs(model, seed=0)
    inputs.pop("labels", None)
    like = next(model.parameters())  # its device (meta: the user's model not loaded yet) and float dtype
    inputs = {
        k: v.to(like.device, like.dtype if v.is_floating_point() else v.dtype) if torch.is_tensor(v) else v
        for k, v in inputs.items()
    }
    cut = channel_cut(model, inputs, tp)
    layers = [Layer(p, replace_layer=ConvColumn) for p in cut.columns]
    layers += [Layer(p, replace_layer=ConvRow) for p in cut.rows]
    layers += [Layer(p, replace_layer=ConvGroups) for p in cut.groups]
    layers += [Layer(p, replace_layer=head_params_layer(dims)) for p, dims in cut.tensors.items()]
    return layers, cut.whole
