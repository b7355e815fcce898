"""PipelineSpec: how one model family splits into pipeline stages, apart from how it is tensor-parallel.

A spec names, by dotted path, the ``nn.ModuleList`` of transformer layers that is divided among
the stages, the modules only the first stage needs (embeddings), those only the last needs (final
norm, head), and those both ends hold (input embeddings tied to the output head: their gradients
are summed over the two stages; `shardformer.pipeline.tied` finds every weight several stages
hold). Its ``stage_forward(model, hidden, inputs)`` runs one stage on a micro-batch: ``hidden`` is
the previous stage's output (None on the first stage; a tuple where a stage hands on several
tensors), ``inputs`` the micro-batch (every stage sees it: masks and labels come from it); it
returns the hidden states (or a tuple of tensors) for the next stage, or on the last stage the model's output (a ModelOutput with ``loss`` when labels are
given, or a tensor of logits). The built-in ones run the model's own forward while
`shardformer.pipeline.stage_view.stage_view` fills the holes of the stage; a custom one may
loop over `local_layers`.

Keeping a stage sets every module of other stages to None in place, so parameter names never change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.nn as nn

from shardformer.core.config import check_positive_int, is_positive_int
from shardformer.core.record import ATTRIBUTE, ShardedModelInfo, attach, sharding_of, with_stage
from shardformer.pipeline.skeleton import keep_skeleton

# what only a head reads (its loss's targets): given to the last stage only
HEAD_INPUTS = ("labels", "start_positions", "end_positions", "next_sentence_label", "mc_labels")


@dataclass(frozen=True)
class PipelineSpec:
    layers: str
    stage_forward: Callable[[nn.Module, Any, dict], Any]
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    # an encoder-decoder's decoder stack, after ``layers`` (the encoder's): the layers of both are numbered
    # as one list, cut anywhere its stage forward proved exact (checked by spec_check)
    second_layers: str | None = None
    # an encoder-decoder's modules between its stacks: those that end the first (its final norm), held with
    # the first stack's last layer, and those that start the second (its embeddings), held with its first
    # layer. With two stacks a module may be listed in several of first / first_end / second_start / last:
    # every stage holding one of them keeps it, and the stages holding a weight sum its gradients
    first_end: tuple[str, ...] = ()
    second_start: tuple[str, ...] = ()
    # modules every stage holds, as every layer reads them (DeBERTa's relative position embeddings and their
    # norm, handed to each layer beside the hidden states): each stage's gradient is summed with the others'
    every: tuple[str, ...] = ()

    def layer_list(self, model: nn.Module) -> nn.ModuleList:
        return self._stack(model, self.layers)

    def _stack(self, model: nn.Module, path: str) -> nn.ModuleList:
        layers = _find(model, path)
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"PipelineSpec layers {path!r} is not a ModuleList in {type(model).__name__}")
        return layers

    def stacks(self) -> tuple[str, ...]:
        return (self.layers,) if self.second_layers is None else (self.layers, self.second_layers)

    def layer_paths(self, model: nn.Module) -> list[str]:
        """The path of every layer, in the one numbering of all the spec's stacks."""
        return [f"{path}.{i}" for path in self.stacks() for i in range(len(self._stack(model, path)))]

    def layer_modules(self, model: nn.Module) -> list[nn.Module | None]:
        """Every layer, numbered as `layer_paths` (None where a stage dropped it)."""
        out = []
        for path in self.layer_paths(model):
            parent, _, name = path.rpartition(".")
            out.append(model.get_submodule(parent)._modules[name])
        return out

    def keep_stage(self, model: nn.Module, stage: int, num_stages: int, layers_per_stage=None) -> nn.Module:
        """Keep only stage ``stage`` of ``num_stages`` in ``model`` (in place) and return it.

        ``layers_per_stage``: how many layers each stage gets (default: balanced). The stage and its
        layers are recorded in ``model.shardformer`` (an unsharded model gets a tp=1 record).
        """
        paths = self.layer_paths(model)
        counts = check_split(len(paths), num_stages, layers_per_stage)
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage={stage} must be in [0, {num_stages})")
        start = sum(counts[:stage])
        mine = range(start, start + counts[stage])
        for i, path in enumerate(paths):
            if i not in mine:
                _set_none(model, path)
        for path in self.dropped(model, mine):
            _set_none(model, path)
        if ATTRIBUTE not in model.__dict__:
            attach(model, ShardedModelInfo.unsharded())
        with_stage(model, stage, num_stages, mine, self)
        if num_stages > 1 and callable(getattr(model, "generate", None)):
            model.generate = partial(_refuse_generate, type(model).__name__, stage, num_stages)
        return model

    def sections(self, model: nn.Module) -> dict[str, tuple[tuple[str, ...], int]]:
        """{kind: (its module paths, the global index of the layer whose stage holds them)}; ``shared``
        goes with the first and the last layer (two entries), ``every`` with each layer."""
        count = len(self.layer_paths(model))
        found = {"first": (self.first, 0), "last": (self.last, count - 1)}
        found |= {"shared first": (self.shared, 0), "shared last": (self.shared, count - 1)}
        if self.second_layers is not None:
            boundary = len(self._stack(model, self.layers))  # the second stack's first layer
            found |= {"first_end": (self.first_end, boundary - 1), "second_start": (self.second_start, boundary)}
        if self.every:  # held with each layer: every stage keeps them
            found |= {f"every {i}": (self.every, i) for i in range(count)}
        return found

    def dropped(self, model: nn.Module, layers) -> list[str]:
        """The paths of the end modules a stage holding the (global) layer indices ``layers`` does not hold."""
        held = set(layers)
        kept, drop = set(), []
        for paths, layer in self.sections(model).values():
            if layer in held:
                kept.update(paths)
            else:
                drop += [p for p in paths if p not in drop]
        return [p for p in drop if p not in kept]


def _refuse_generate(name: str, stage: int, num_stages: int, *args, **kwargs):
    raise RuntimeError(
        f"generate() on pipeline stage {stage} of {num_stages}: this {name} holds only its stage's layers, and "
        f"generation runs the whole model in one process. Generate with pipeline_parallel_size=1 (tensor "
        f"parallelism shards generate), or export it with shardformer.checkpoint.save_pretrained and generate "
        f"from the exported folder; ParallelEngine.forward gives the logits of a batch at any pipeline size"
    )


def local_layers(model: nn.Module, container) -> list:
    """This stage's layers of ``container`` in order (all of them on a model that was not split)."""
    indices = sharding_of(model).layers
    return list(container) if indices is None else [container[i] for i in indices]


def stage_of(model: nn.Module) -> tuple[int, int]:
    """``(stage, num_stages)`` of a sharded model."""
    info = sharding_of(model)
    return info.stage, info.num_stages


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
    check_positive_int("pipeline_parallel_size", num_stages)
    if layers_per_stage is None:
        if num_layers < num_stages:
            raise ValueError(
                f"pipeline_parallel_size={num_stages} is more stages than the model's {num_layers} layers; "
                f"use pipeline_parallel_size <= {num_layers}"
            )
        return balanced_split(num_layers, num_stages)
    counts = list(layers_per_stage)
    if len(counts) != num_stages or not all(map(is_positive_int, counts)):
        raise ValueError(f"layers_per_stage={counts} must list {num_stages} positive integers (one per pipeline stage)")
    if sum(counts) != num_layers:
        raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}; it must sum to the {num_layers} layers")
    return counts


def _find(root: nn.Module, path: str):
    """The module or parameter at ``path``, or None where a stage already dropped it."""
    obj = root
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _set_none(root: nn.Module, path: str) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = _find(root, parent_path) if parent_path else root
    if parent is None:
        return
    if name in parent._modules:
        keep_skeleton(root, path, parent._modules[name])
        parent._modules[name] = None
    elif name in parent._parameters:
        parent._parameters[name] = None
    elif hasattr(parent, name):
        setattr(parent, name, None)
