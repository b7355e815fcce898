"""Split a model into pipeline stages in place, keeping parameter names unchanged.

Layers not on this stage become None in their container (``h._modules["3"] = None``), so the
remaining layers keep their indices and every parameter its unsharded name; modules a stage does
not need (embeddings off the first stage, head off the last) are set to None the same way.
"""

from __future__ import annotations

import torch.nn as nn


def _get(root, path: str):
    obj = root
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _set_none(root: nn.Module, path: str) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = _get(root, parent_path) if parent_path else root
    if parent is None:
        return
    if name in parent._modules:
        parent._modules[name] = None
    elif name in parent._parameters:
        parent._parameters[name] = None
    elif hasattr(parent, name):
        setattr(parent, name, None)


def balanced_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; extra layers go to the middle stages first (the first
    stage also runs the embeddings and the last the head), then to the first, then to the last."""
    counts = [num_layers // num_stages] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 1 else [0]
    for i in range(num_layers % num_stages):
        counts[order[i]] += 1
    return counts


def check_split(num_layers: int, num_stages: int, layers_per_stage=None) -> list[int]:
    """Validate and return the layers per stage (no communication: safe before any collective)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size={num_stages!r} must be a positive integer")
    if layers_per_stage is None:
        if num_layers < num_stages:
            raise ValueError(
                f"pipeline_parallel_size={num_stages} is more stages than the model's {num_layers} layers; "
                f"use pipeline_parallel_size <= {num_layers}"
            )
        return balanced_split(num_layers, num_stages)
    counts = list(layers_per_stage)
    if len(counts) != num_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"layers_per_stage={counts} must list {num_stages} positive integers (one per pipeline stage)")
    if sum(counts) != num_layers:
        raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}; it must sum to the {num_layers} layers")
    return counts


def num_layers_of(policy, model: nn.Module) -> tuple[str, int]:
    path = policy.pipeline_layers(model)
    if path is None:
        raise NotImplementedError(
            f"{type(policy).__name__} has no pipeline split for {type(model).__name__}; implement "
            f"pipeline_layers / pipeline_first / pipeline_last / stage_forward in the policy, or use "
            f"pipeline_parallel_size=1"
        )
    layers = _get(model, path)
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"pipeline_layers {path!r} of {type(policy).__name__} is not a ModuleList in the model")
    return path, len(layers)


def keep_stage(policy, model: nn.Module, stage: int, num_stages: int, layers_per_stage=None) -> nn.Module:
    path, n = num_layers_of(policy, model)
    counts = check_split(n, num_stages, layers_per_stage)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} must be in [0, {num_stages})")
    start = sum(counts[:stage])
    mine = range(start, start + counts[stage])
    layers = _get(model, path)
    for i in range(n):
        if i not in mine:
            layers._modules[str(i)] = None
    first, last = stage == 0, stage == num_stages - 1
    for p in policy.pipeline_first(model):
        if not first:
            _set_none(model, p)
    for p in policy.pipeline_last(model):
        if not last:
            _set_none(model, p)
    for p in policy.pipeline_shared(model):
        if not (first or last):
            _set_none(model, p)
    model.shardformer_stage = (stage, num_stages)
    model.shardformer_layers = list(mine)
    return model


def shared_parameters(policy, model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the modules held by both first and last stage (tied input/output weights)."""
    seen, out = set(), []
    for path in policy.pipeline_shared(model):
        module = _get(model, path)
        if module is None:
            continue
        params = [module] if isinstance(module, nn.Parameter) else list(module.parameters())
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def local_layers(model: nn.Module, container) -> list:
    """This stage's layers of ``container`` in order (all of them on an unsplit model)."""
    indices = getattr(model, "shardformer_layers", None)
    if indices is None:
        return list(container)
    return [container[i] for i in indices]
