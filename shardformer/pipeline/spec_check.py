"""Check a pipeline spec against the model before any process waits on another.

A spec names the layer list (divided among stages) and the modules held by the first stage, the
last stage, or both (``shared``: weights tied between the input embedding and the output head,
whose gradients are summed over the two stages). Mistakes there do not raise on their own: a module
in two lists deadlocks the engine, a tied weight held by two stages but not declared shared trains
two drifting copies. :func:`check_pipeline_lists` refuses both, naming the module:

- every path exists in the model (a module or parameter; one the model sets to None is fine);
- the lists are disjoint, no path lies inside another listed path or inside the layer list;
- every parameter of the model is in exactly one place (the layer list, first, last or shared);
- parameters tied across places (one tensor under two names) are held by the same stages, or the
  tie spans the first and last stage through a module in ``shared``.
"""

from __future__ import annotations

import torch.nn as nn

from shardformer.pipeline.spec import check_split
from shardformer.tensor_parallel.detect import find_ties


class PipelineSpecError(ValueError):
    """A pipeline spec that would hang or train wrongly; raised before any collective."""


def _resolve(model: nn.Module, path: str, what: str) -> None:
    obj = model
    for name in path.split("."):
        if obj is None:
            return
        if not hasattr(obj, name):
            raise PipelineSpecError(f"{what} names {path!r}, which is not in {type(model).__name__} (no {name!r})")
        obj = getattr(obj, name)


def _under(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".")


def stages_of_layers(num_layers: int, num_stages: int, layers_per_stage=None) -> list[int]:
    counts = check_split(num_layers, num_stages, layers_per_stage)
    return [s for s, c in enumerate(counts) for _ in range(c)]


def check_pipeline_lists(
    model: nn.Module,
    layers: str,
    first=(),
    last=(),
    shared=(),
    num_stages: int = 2,
    layers_per_stage=None,
    second_layers: str | None = None,
) -> None:
    """Raise :class:`PipelineSpecError` naming the module if the spec cannot split ``model`` correctly."""
    lists = {"first": list(first), "last": list(last), "shared": list(shared)}
    stacks = [layers] + ([second_layers] if second_layers is not None else [])
    offsets, count = {}, 0
    for stack in stacks:
        _resolve(model, stack, "the layer list")
        container = model.get_submodule(stack)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise PipelineSpecError(f"the layer list {stack!r} is {type(container).__name__}, not a ModuleList")
        offsets[stack], count = count, count + len(container)
    placed: list[tuple[str, str]] = [(stack, "layers") for stack in stacks]
    for kind, paths in lists.items():
        for path in paths:
            _resolve(model, path, f"pipeline {kind}")
            for other, other_kind in placed:
                if _under(path, other) or _under(other, path):
                    same = "listed twice" if path == other else f"overlaps {other!r}"
                    raise PipelineSpecError(
                        f"{path!r} is in pipeline {kind} and {same} (in {other_kind}); every module belongs to "
                        f"exactly one of layers / first / last / shared (a module in two lists deadlocks the stages)"
                    )
            placed.append((path, kind))

    layer_stage = stages_of_layers(count, num_stages, layers_per_stage)
    last_stage = num_stages - 1
    if second_layers is not None:
        _check_two_stacks(stacks, offsets[second_layers], count, layer_stage, num_stages)
    held = {"first": {0}, "last": {last_stage}, "shared": {0, last_stage}}

    def place(name: str) -> tuple[str, frozenset[int]]:
        for path, kind in placed:
            if _under(name, path):
                if kind == "layers":
                    index = offsets[path] + int(name[len(path) + 1 :].split(".")[0])
                    return f"layer {index}", frozenset({layer_stage[index]})
                return kind, frozenset(held[kind])
        raise PipelineSpecError(
            f"parameter {name!r} is in no pipeline list; add its module to first (embeddings), last (norm, head) "
            f"or shared (tied to the head), so exactly one place holds it"
        )

    for name, _ in model.named_parameters():
        place(name)
    for names in find_ties(model):
        places = {n: place(n) for n in names}
        stage_sets = {s for _, s in places.values()}
        if len(stage_sets) == 1:
            continue
        spans_ends = set().union(*stage_sets) <= {0, last_stage}
        if spans_ends and any(kind == "shared" for kind, _ in places.values()):
            continue
        desc = ", ".join(f"{n} ({kind})" for n, (kind, _) in places.items())
        owner = names[0].rpartition(".")[0]
        raise PipelineSpecError(
            f"{desc} are one tied tensor held by different stages; list {owner!r} in pipeline shared (and not in "
            f"first or last) so the stages hold one weight and sum its gradients, or untie them"
        )


def _check_two_stacks(stacks, decoder_start: int, count: int, layer_stage: list[int], num_stages: int) -> None:
    """Two stacks (an encoder-decoder) split in two stages, the encoder's layers on the first and the
    decoder's on the last: the decoder's embeddings are tied to the encoder's and to the head, which
    only the two end stages can share, and a decoder stage would need the encoder's output besides."""
    split = [decoder_start, count - decoder_start]
    if num_stages != 2 or layer_stage != [0] * split[0] + [1] * split[1]:
        raise PipelineSpecError(
            f"an encoder-decoder ({stacks[0]!r}, {stacks[1]!r}) splits into two pipeline stages at the encoder/"
            f"decoder boundary only (the decoder's embeddings, tied to the encoder's and the head, and the "
            f"encoder's output must be on the decoder's stage); use pipeline_parallel_size=2 with "
            f"layers_per_stage={split}"
        )


def check_pipeline_spec(spec, model: nn.Module, num_stages: int, layers_per_stage=None) -> None:
    """:func:`check_pipeline_lists` over a :class:`~shardformer.pipeline.PipelineSpec`."""
    check_pipeline_lists(
        model, spec.layers, spec.first, spec.last, spec.shared, num_stages, layers_per_stage, spec.second_layers
    )
