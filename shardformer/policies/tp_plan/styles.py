"""transformers' tensor-parallel styles, carried out by our layers.

Each style a dense plan uses maps onto a layer descriptor of the Policy API; a style that is not
here is refused (by name, with the module path) before anything is cut.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from shardformer.core.comm import all_reduce, group_rank, group_size, reduce_from_parallel
from shardformer.core.refusal import Refusal
from shardformer.policies.tp_plan.lm import embedding_layer
from shardformer.tensor_parallel.layers import Linear1D_Row
from shardformer.tensor_parallel.layers.attention_dropout import AttentionDropoutRng  # noqa: F401 - a style's layer
from shardformer.tensor_parallel.policy import Col_Layer, Layer, Row_Layer
from shardformer.tensor_parallel.regions import copy_to_parallel, sum_replicas
from shardformer.tensor_parallel.slicer import Slicer, make_shard_param, slice_tensor


class SplitInputRow(Linear1D_Row):
    """``rowwise_split_input``: the input arrives replicated; each rank keeps its slice of it."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> SplitInputRow:
        return super().from_native(module, process_group, input_is_parallel=False)


class PackedRow(Linear1D_Row):
    """``packed_rowwise`` on a 2-D weight: input features ``[a | b]`` packed; each rank holds
    ``[a_r | b_r]`` (the matching packed column layer produced exactly that)."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, n_cast=2, **options) -> PackedRow:
        slicer = Slicer(group_rank(process_group), group_size(process_group))
        weight = make_shard_param(module.weight, slicer.spec(module.weight.shape, 1, n_cast))
        sp = {k: options[k] for k in ("sequence_parallel", "sequence_parallel_name") if k in options}
        return cls(weight, module.bias, process_group, True, False, **sp)


class GradAllReduce:
    """``replicated_with_grad_allreduce``: the module stays as it is (weights replicated), but it
    runs on this rank's heads only (Qwen3's per-head q/k norms), so each rank's gradient is a part
    of the whole: a hook sums it over the group. The hook sees each backward's gradient before it
    is accumulated, so gradient accumulation over micro-batches stays exact."""

    supports_sequence_parallel = True  # per-token, per-head or no-op: exact on sequence chunks
    keeps_weights = True  # the hook is on the Parameter: every module tied to it is summed too
    names: tuple[str, ...] | None = None  # the module's own parameters summed (`grad_all_reduce_of`); None: all

    @classmethod
    def _summed(cls, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in module.named_parameters(recurse=False) if cls.names is None or n in cls.names]

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        if group_size(process_group) > 1:
            for _, param in cls._summed(module):
                if param.requires_grad:
                    param.register_hook(lambda grad: all_reduce(grad.clone(), process_group))
        return module

    @classmethod
    def sequence_parallel_exact_params(cls, module: nn.Module) -> list[str]:
        """It reads this rank's heads, not the gathered input: exact under sequence parallelism."""
        return [name for name, _ in cls._summed(module)]


def grad_all_reduce_of(names) -> type[GradAllReduce]:
    """`GradAllReduce` for some of a module's own parameters only (VideoPrism's pooling head: its per-dim
    scale, read on this rank's heads, summed; its query, read by the cut query projection, not)."""
    return type("GradAllReduce", (GradAllReduce,), {"names": tuple(names), "keeps_weights": True})


class OutputAllReduce:
    """``all_reduce``: the module's output is a partial sum over ranks; one all-reduce completes it."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        module.register_forward_hook(lambda _m, _args, out: reduce_from_parallel(out, process_group))
        return module


class IdentityExpert:
    """``moe_identity_expert``: an expert that returns its input sits inside experts whose output is
    summed over ranks; its input is divided by the group size first, so the sum counts it once."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        world = group_size(process_group)
        module.register_forward_pre_hook(lambda _m, args: (args[0] / world, *args[1:]))
        return module


class Replicated:
    """``replicate``: every rank keeps the whole module; nothing to do."""

    supports_sequence_parallel = True  # per-token, per-head or no-op: exact on sequence chunks

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        return module


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


# style -> (module check and what it needs, descriptor factory(path, module))
STYLES = {
    "colwise": (_linear, lambda path, _module: Col_Layer(path)),
    "colwise_gather_output": (_linear, lambda path, _module: Col_Layer(path, gather_output=True)),
    "rowwise": (_linear, lambda path, _module: Row_Layer(path)),
    "rowwise_split_input": (_linear, lambda path, _module: Row_Layer(path, replace_layer=SplitInputRow)),
    "packed_colwise": (_linear, lambda path, _module: Col_Layer(path, n_cast=2)),
    "packed_rowwise": (_linear, lambda path, _module: Row_Layer(path, replace_layer=PackedRow, n_cast=2)),
    "embedding_rowwise": (  # Gemma's scaled embedding too: its own forward, the lookup vocab-parallel
        lambda m: embedding_layer(m) is not None,
        lambda path, module: Col_Layer(path, bias=None, replace_layer=embedding_layer(module)),
    ),
    "replicated_with_grad_allreduce": (lambda m: True, lambda path, _module: Layer(path, replace_layer=GradAllReduce)),
    "all_reduce": (lambda m: True, lambda path, _module: Layer(path, replace_layer=OutputAllReduce)),
    "moe_identity_expert": (lambda m: True, lambda path, _module: Layer(path, replace_layer=IdentityExpert)),
    "replicate": (lambda m: True, lambda path, _module: Layer(path, replace_layer=Replicated)),
    "local_params": (
        lambda m: True,
        lambda path, _module: Layer(path, replace_layer=Replicated),
    ),  # its params: own entries
}
_NEEDS = {"embedding_rowwise": "an nn.Embedding whose forward looks its ids up through nn.Embedding's own"}


class UnsupportedStyleError(Refusal):
    """A plan entry shardformer cannot carry out exactly (the fix first: by default your own Policy)."""


def descriptor(style: str, path: str, module: nn.Module) -> Layer:
    """Our layer descriptor for ``module`` at ``path`` under ``style``, or UnsupportedStyleError."""
    if style not in STYLES:
        raise UnsupportedStyleError(
            f"tp plan style {style!r} at {path} ({type(module).__name__}) is not supported; supported styles: "
            f"{', '.join(sorted(STYLES))}"
        )
    fits, make = STYLES[style]
    if not fits(module):
        needs = _NEEDS.get(style, "an nn.Linear")
        raise UnsupportedStyleError(
            f"tp plan style {style!r} at {path} needs {needs}, but the module is {type(module).__name__}"
        )
    return make(path, module)


class MlaKvAProj:
    """``mla_kv_a_proj`` (multi-head latent attention): the replicated projection's output is
    ``[compressed kv | rope key]``. The compressed part feeds a column-parallel layer (which sums
    its gradient); the rope key goes straight into attention on this rank's heads, so its gradient
    is partial: it passes through copy_to_parallel (identity forward, one all-reduce backward)."""

    rope_dim = 0

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        rope = cls.rope_dim

        def split_rope_grad(_m, _args, out):
            kv, rope_key = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([kv, copy_to_parallel(rope_key, process_group)], dim=-1)

        module.register_forward_hook(split_rope_grad)
        return module


def mla_layer(rope_dim: int) -> type[MlaKvAProj]:
    return type("MlaKvAProj", (MlaKvAProj,), {"rope_dim": rope_dim})


class HeadParams:
    """Parameters a plan cuts by themselves (``colwise`` on attention sinks ``[num_heads]``): each
    rank keeps the entries of its own heads. ``names`` is set on the subclass `params_layer` makes."""

    supports_sequence_parallel = True  # per-token, per-head or no-op: exact on sequence chunks

    names: tuple[str, ...] = ()
    dims: tuple[int, ...] = ()  # the heads' dimension of each (0 when not given)
    blocks: tuple[int | tuple[int, ...], ...] = ()  # fused blocks along it, each cut on its own (1 when not given)
    units: tuple[tuple[int, ...] | None, ...] = ()  # the blocks' unit widths: fewer units than ranks replicated

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        forget_cached_tensors(module)  # computed from the whole parameters before the cut
        slicer = Slicer(group_rank(process_group), group_size(process_group))
        buffers = dict(module.named_buffers(recurse=False))
        dims, blocks = cls.dims or (0,) * len(cls.names), cls.blocks or (1,) * len(cls.names)
        for name, dim, n_cast, units in zip(cls.names, dims, blocks, cls.units or (None,) * len(cls.names)):
            param = getattr(module, name)
            spec = slicer.spec(param.shape, dim, n_cast, head_width=units)
            if name in buffers:  # a buffer beside the parameters (timm's zero k_bias) stays a buffer
                buffer = slice_tensor(param, spec)
                buffer.shard_spec = spec  # a persistent one is gathered whole on export
                setattr(module, name, buffer)
                continue
            param = make_shard_param(param, spec)
            if spec.splits and param.requires_grad:  # replicas (a mixer's one group of B and C) sum their gradients
                param.register_hook(functools.partial(sum_replicas, spec=spec, group=process_group))
            setattr(module, name, param)
        return module

    @classmethod
    def sequence_parallel_exact_params(cls, module: nn.Module) -> list[str]:
        return list(cls.names)  # per-head entries: exact under sequence parallelism


def params_layer(path: str, module: nn.Module, named: dict[str, str]) -> type[HeadParams]:
    """A HeadParams class for ``named`` (``{parameter: style}``), or UnsupportedStyleError."""
    for name, style in named.items():
        if style != "colwise" or getattr(module, name).dim() != 1:
            raise UnsupportedStyleError(
                f"tp plan style {style!r} on the parameter {path}.{name} {tuple(getattr(module, name).shape)} is "
                f"not supported (only 'colwise' on a 1-D per-head parameter, or inside 'moe_tp_experts')"
            )
    return type("HeadParams", (HeadParams,), {"names": tuple(named)})


def forget_cached_tensors(module: nn.Module) -> None:
    """Empty the module's own caches of tensors (LeViT's ``attention_bias_cache``: its per-head biases
    gathered once in eval mode): what they hold was computed from parameters a cut now replaces."""
    for name, value in vars(module).items():
        if not name.startswith("_") and isinstance(value, dict) and value and all(map(torch.is_tensor, value.values())):
            value.clear()


def head_params_layer(dims: dict[str, int], blocks: dict[str, int | tuple[int, ...]] | None = None, units=None):
    """A HeadParams class cutting each parameter named in ``dims`` along its heads' dimension (in the
    fused ``blocks`` given for it: a Mamba-2 convolution's ``[x | B | C]`` channels; of the ``units``
    given for it, ``{name: widths}``: fewer groups than ranks are held whole by every rank)."""
    fused = tuple((blocks or {}).get(name, 1) for name in dims)
    widths = tuple((units or {}).get(name) for name in dims)
    attrs = {"names": tuple(dims), "dims": tuple(dims.values()), "blocks": fused, "units": widths}
    return type("HeadParams", (HeadParams,), attrs)
