"""Expert-internal tensor parallelism for transformers' stacked 3-D expert weights (``moe_tp_experts``).

Every rank holds every expert, each cut along its intermediate dimension: ``gate_up_proj``
``[E, 2I, H]`` as two blocks (``[gate_r | up_r]`` per expert), ``down_proj`` ``[E, H, I]`` by input
features (or the transposed layouts, as the plan's styles say: Llama 4's ``[E, H, 2I]``). The router stays replicated, so every rank routes every token the same way; each rank
computes its part of every chosen expert and one all-reduce sums the parts. The input and the
routing weights are replicated with partial gradients: one all-reduce each in backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardformer.core.comm import group_rank, group_size, reduce_from_parallel
from shardformer.tensor_parallel.regions import copy_to_parallel
from shardformer.tensor_parallel.slicer import Slicer, make_shard_param, make_spec

# plan style of an expert weight -> (dim, fused blocks), counted from the end as transformers does:
# "col" styles cut dim -2 of [E, a, b], "row" styles dim -1; "packed" ones as two blocks (gate | up)
_PARAM_CUTS = {"colwise": (-2, 1), "packed_colwise": (-2, 2), "rowwise": (-1, 1), "packed_rowwise": (-1, 2)}


def param_cut(module: nn.Module, name: str, style: str, path: str) -> tuple[int, int]:
    """(dim, n_cast) for expert parameter ``name`` of ``module`` under ``style``, or a ValueError."""
    param = getattr(module, name)
    if style not in _PARAM_CUTS:
        raise ValueError(f"expert parameter {path}.{name}: style {style!r} is not supported for stacked experts")
    dim, n_cast = _PARAM_CUTS[style]
    if style == "colwise" and "gate_up" in name:  # fused [gate | up] called plain colwise (Inkling's plans): the
        n_cast = 2  # forward chunks it in two halves, so each is cut on its own, as packed_colwise does
    if param.dim() == 3:
        return 3 + dim, n_cast
    if param.dim() == 2 and "bias" in name and style.endswith("colwise"):  # [E, out] beside a cut output
        return 1, n_cast
    raise ValueError(
        f"expert parameter {path}.{name} {tuple(param.shape)} under {style!r} cannot be cut exactly (a bias "
        f"after a row-parallel product would be added once per rank)"
    )


class ExpertsTP:
    """Cuts a stacked-experts module's parameters in place and sums its output over the group.
    ``param_styles`` (set on the subclass `experts_layer` makes) is ``{name: plan style}``."""

    param_styles: dict[str, str] = {}

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        slicer = Slicer(group_rank(process_group), group_size(process_group))
        for name, style in cls.param_styles.items():
            dim, n_cast = param_cut(module, name, style, type(module).__name__)
            param = getattr(module, name)
            setattr(module, name, make_shard_param(param, slicer.spec(param.shape, dim, n_cast)))

        def inputs(_m, args, kwargs):
            # the hidden states and the routing weights (or shared experts' gammas), replicated: each rank's
            # gradient is a part; indices pass as they are
            copy = lambda v: copy_to_parallel(v, process_group) if _floating(v) else v  # noqa: E731
            return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}

        def output(_m, _args, out):
            if isinstance(out, tuple):
                return (reduce_from_parallel(out[0], process_group), *out[1:])
            return reduce_from_parallel(out, process_group)

        module.register_forward_pre_hook(inputs, with_kwargs=True)
        module.register_forward_hook(output)
        return module


def _floating(value) -> bool:
    return torch.is_tensor(value) and value.is_floating_point()


def stacked(module: nn.Module, param_styles: dict[str, str]) -> bool:
    """Whether every planned parameter of ``module`` is a stack of 3-D expert weights."""
    return all(getattr(module, name).dim() == 3 for name in param_styles)


_CLASSES: dict[tuple, type] = {}


def experts_layer(param_styles: dict[str, str]) -> type[ExpertsTP]:
    key = tuple(sorted(param_styles.items()))
    if key not in _CLASSES:
        _CLASSES[key] = type("ExpertsTP", (ExpertsTP,), {"param_styles": dict(param_styles)})
    return _CLASSES[key]


def check_experts(path: str, module: nn.Module, param_styles: dict[str, str], tp: int) -> None:
    """Before anything is cut: every parameter of the experts is planned and divides over tp."""
    for name, param in module.named_parameters(recurse=False):
        if name not in param_styles:
            raise ValueError(f"expert parameter {path}.{name} {tuple(param.shape)} is not in the tp plan")
    if not param_styles:
        raise ValueError(f"{path} is planned as 'moe_tp_experts' but the plan names none of its parameters")
    for name, style in param_styles.items():
        dim, n_cast = param_cut(module, name, style, path)
        make_spec(getattr(module, name).shape, dim, 0, tp, n_cast)
