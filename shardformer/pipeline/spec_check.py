"""Check a pipeline spec against the model before any process waits on another.

A spec names the layer list (divided among stages) and the modules held by the first stage, the
last stage, or both (``shared``: weights tied between the input embedding and the output head,
whose gradients are summed over the two stages). Mistakes there do not raise on their own: a module
in two lists deadlocks the engine, a tied weight held by two stages but not declared shared trains
two drifting copies. `check_pipeline_lists` refuses both, naming the module:

- every path exists in the model (a module or parameter; one the model sets to None is fine);
- the lists are disjoint, no path lies inside another listed path or inside the layer list;
- every parameter of the model is in exactly one place (the layer list, first, last, shared or every);
- parameters tied across places (one tensor under two names) are held by the same stages, or the
  tie spans the first and last stage through a module in ``shared``.

An encoder-decoder (two stacks) places its modules in four sections, each held with one layer: first
(layer 0), first_end (the encoder's last layer), second_start (the decoder's first) and last; a module
may be in several, and a weight held by several stages has its gradients summed over them (the
engine finds the stages from the placement). Where its stages may be cut is the stage forward's to
say (``split_refusal``): the proof on a tiny copy decides.
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
    first_end=(),
    second_start=(),
    every=(),
) -> None:
    """Raise `PipelineSpecError` naming the module if the spec cannot split ``model`` correctly."""
    lists = {"first": list(first), "last": list(last), "shared": list(shared), "every": list(every)}
    two = second_layers is not None
    if two:
        lists |= {"first_end": list(first_end), "second_start": list(second_start)}
    elif first_end or second_start:
        raise PipelineSpecError("first_end and second_start place the modules between two stacks: set second_layers")
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
                if two and path == other and "layers" not in (kind, other_kind) and "shared" not in (kind, other_kind):
                    continue  # two stacks: a module in several sections is held with each
                if _under(path, other) or _under(other, path):
                    same = "listed twice" if path == other else f"overlaps {other!r}"
                    raise PipelineSpecError(
                        f"{path!r} is in pipeline {kind} and {same} (in {other_kind}); every module belongs to "
                        f"exactly one of layers / first / last / shared / every (a module in two lists deadlocks the stages)"
                    )
            placed.append((path, kind))

    layer_stage = stages_of_layers(count, num_stages, layers_per_stage)
    last_stage = num_stages - 1
    held = {"first": {0}, "last": {last_stage}, "shared": {0, last_stage}, "every": set(range(num_stages))}
    if two:
        boundary = offsets[second_layers]
        held |= {"first_end": {layer_stage[boundary - 1]}, "second_start": {layer_stage[boundary]}}

    def place(name: str) -> tuple[str, frozenset[int]]:
        kinds, stages = [], set()
        for path, kind in placed:
            if _under(name, path):
                if kind == "layers":
                    index = offsets[path] + int(name[len(path) + 1 :].split(".")[0])
                    return f"layer {index}", frozenset({layer_stage[index]})
                kinds.append(kind)
                stages |= held[kind]
        if kinds:
            return " and ".join(kinds), frozenset(stages)
        raise PipelineSpecError(
            f"parameter {name!r} is in no pipeline list; add its module to first (embeddings), last (norm, head) "
            f"or shared (tied to the head), so exactly one place holds it"
        )

    for name, _ in model.named_parameters():
        place(name)
    for names in find_ties(model):
        places = {n: place(n) for n in names}
        stage_sets = {s for _, s in places.values()}
        if len(stage_sets) == 1 or two:  # two stacks: every stage holding the weight sums its gradient
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


def check_pipeline_spec(spec, model: nn.Module, num_stages: int, layers_per_stage=None) -> None:
    """`check_pipeline_lists` over a `shardformer.pipeline.PipelineSpec`."""
    check_pipeline_lists(
        model, spec.layers, spec.first, spec.last, spec.shared, num_stages, layers_per_stage, spec.second_layers,
        spec.first_end, spec.second_start, spec.every,
    )  # fmt: skip
    if spec.second_layers is None:
        return
    counts = check_split(len(spec.layer_paths(model)), num_stages, layers_per_stage)
    boundary = len(model.get_submodule(spec.layers))
    refusal = getattr(spec.stage_forward, "split_refusal", None)
    why = refusal(counts, boundary) if refusal is not None else _boundary_only(counts, boundary)
    if why is not None:
        raise PipelineSpecError(f"{spec.layers!r} and {spec.second_layers!r} cannot be split as {counts}: {why}")


def _boundary_only(counts: list[int], boundary: int) -> str | None:
    """A two-stack spec whose stage forward says nothing of its cuts: two stages at the boundary only."""
    if counts == [boundary, sum(counts) - boundary]:
        return None
    return (
        f"this stage forward splits an encoder-decoder into two stages at the encoder/decoder boundary only; use "
        f"pipeline_parallel_size=2 with layers_per_stage={[boundary, sum(counts) - boundary]}"
    )
