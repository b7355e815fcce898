"""Norms over the features a row projection reads, between it and its columns: their means span the ranks.

BitNet normalises the heads' concatenated output (an RMS norm over ``heads x head_dim``) before
``o_proj``, and its MLP's product before ``down_proj``; ConvNeXt-V2's GRN divides each channel by the
mean over channels of the channels' spatial norms before ``pwconv2``. Cut with the columns, each rank
holds ``1/tp`` of those features: the module's parameters over them are cut with them, and its means
over the last dimension become the mean of the ranks' means (`NormOverRanks`, all-reduced both ways).
In the single-process simulation (`.simulate`) each rank's copy replays the whole module's means, as
the all-reduce would give them; the proof on ranks confirms.
"""

from __future__ import annotations

import copy
import functools
import types

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from shardformer.core.refusal import DATA_PARALLEL, Reason
from shardformer.policies.derived.blocks import is_projection
from shardformer.tensor_parallel.layers.norm import is_mean_over_last, splits_features


class _Means(TorchFunctionMode):
    """Records the means over the last dimension a forward takes, or (``recorded`` given) hands those back
    in turn in their place."""

    def __init__(self, recorded: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.recorded, self.seen = recorded, []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_mean_over_last(func, args, kwargs):
            if self.recorded is not None:
                whole = self.recorded[len(self.seen)]
                if whole.shape != out.shape:
                    raise RuntimeError(
                        f"a mean of shape {tuple(out.shape)} where the whole one is {tuple(whole.shape)}"
                    )
                out = whole
            self.seen.append(out.detach())
        return out


def feature_norm_options(model, parent_path: str, parent: nn.Module, width: int, inputs, record_calls) -> dict:
    """``{leaf: ({parameter: dim}, its means)}`` of the leaves in ``parent`` (not projections, not LayerNorms,
    which `SplitLayerNorm` stands in for) with parameters over ``width`` features and called on them, with
    the means over the last dimension each takes whole (``record_calls``: `.simulate.record_calls`)."""
    found: dict[str, dict[str, int]] = {}
    for rel, module in parent.named_modules():
        if not rel or is_projection(module) or splits_features(module) or list(module.children()):
            continue
        dims = {
            name: list(p.shape).index(width)
            for name, p in module.named_parameters(recurse=False)
            if list(p.shape).count(width) == 1
        }
        if dims:
            found[rel] = dims
    if not found:
        return {}
    paths = {rel: f"{parent_path}.{rel}" if parent_path else rel for rel in found}
    calls = record_calls(model, list(paths.values()), inputs)
    options = {}
    for rel, path in paths.items():
        args = calls[path][0] if path in calls else ()
        if args and torch.is_tensor(args[0]) and args[0].shape[-1] == width:
            options[rel] = (found[rel], whole_means(model.get_submodule(path), calls[path]))
    return options


def whole_means(module: nn.Module, call: tuple) -> list[torch.Tensor]:
    """The means over the last dimension ``module`` takes on its recorded call."""
    mode = _Means()
    args, kwargs, _ = call
    with torch.no_grad(), mode:
        module(*args, **kwargs)
    return mode.seen


def _replaying(module: nn.Module, *args, recorded, **kwargs):
    with _Means(recorded):
        return type(module).forward(module, *args, **kwargs)


def replay_means(module: nn.Module, recorded: list[torch.Tensor]) -> None:
    """``module`` (a rank's copy) runs with the whole module's means in place of its own."""
    module.forward = types.MethodType(functools.partial(_replaying, recorded=recorded), module)


_STATISTICS = {torch.mean: "mean", torch.Tensor.mean: "mean", torch.std: "std", torch.Tensor.std: "std"}
_STATISTICS |= {torch.var: "var", torch.Tensor.var: "var"}


class _OwnStatistics(TorchFunctionMode):
    """Records the statistics over the last dimension of a tensor of one of ``widths`` features that a module's
    own code takes (not its children's: a norm leaf over them is `feature_norm_options`' to cut)."""

    def __init__(self, widths: set[int]) -> None:
        super().__init__()
        self.widths, self.children_running, self.seen = widths, 0, {}

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, x = _STATISTICS.get(func), args[0] if args else None
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        cut = torch.is_tensor(x) and x.dim() > 0 and x.shape[-1] in self.widths
        if name and cut and not self.children_running and any(d in (-1, x.dim() - 1) for d in dims):
            self.seen.setdefault(name, x.shape[-1])
        return func(*args, **kwargs)


def own_statistics(parent: nn.Module, args, kwargs, widths: set[int]) -> Reason | None:
    """Why no cut of a group in ``parent`` is exact where ``parent``'s own forward (on its recorded call) takes
    a mean, standard deviation or variance over the last dimension of features the cut splits (Gemma 3n's MLP:
    its activation sparsity's cutoff, ``mean + std * k`` over the gate's whole width): each rank would take it
    over its share alone; None where it takes none."""
    mode = _OwnStatistics(widths)

    def enter(*_):
        mode.children_running += 1

    def leave(*_):
        mode.children_running -= 1

    children = [m for _, m in parent.named_children()]
    handles = [h for m in children for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.no_grad(), mode:
            parent(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except Exception:  # noqa: BLE001 - the forward is the simulation's to judge, not this check's
        return None
    finally:
        for handle in handles:
            handle.remove()
    if not mode.seen:
        return None
    taken = ", ".join(f"the {name} over {width}" for name, width in mode.seen.items())
    return Reason(
        f"{type(parent).__name__}'s own forward takes {taken} features, which the cut splits over the ranks (each "
        f"would take it over its share alone, and no layer here reduces such a statistic over them)",
        DATA_PARALLEL,
    )
