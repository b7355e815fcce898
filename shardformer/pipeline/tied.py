"""Weights that several pipeline stages hold: an input embedding tied to the head (first and last
stage), an encoder-decoder's embeddings (the stages of its encoder's first layer, its decoder's first
layer and its head), a chunk's ends on a rank holding several chunks. Found from the spec's placement
before the model is split; each rank holding such a weight sums its gradient with the others' after
the backward (`Tied`; `tied_grads` makes the groups, `sum_tied_grads` sums), so the
copies stay one parameter in effect and take the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardformer.core import comm
from shardformer.pipeline.spec import PipelineSpec


@dataclass(frozen=True)
class Tied:
    """One weight several chunks hold: its names in the unsplit model (the first is its own; a stage
    without that module knows it by another), the pp ranks holding it and how many of this rank's chunks
    use it."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    chunks_here: int

    def param(self, model: nn.Module) -> nn.Parameter:
        """This rank's copy in ``model`` (split, perhaps wrapped by FSDP2 since)."""
        held = dict(model.named_parameters(remove_duplicate=False))
        return next(held[n] for n in self.names if n in held)


def tied_weights(spec: PipelineSpec, model: nn.Module, placement: list[list], rank: int) -> list[Tied]:
    """The weights of ``model`` (not yet split) held by more than one chunk, on any rank, in name order;
    ``placement[r]``: the global layer indices of each chunk of pp rank ``r`` (one chunk: its stage)."""
    stacks, offset = [], 0
    for path in spec.stacks():
        stacks.append((path, offset))
        offset += len(model.get_submodule(path))
    ends = {path for paths, _ in spec.sections(model).values() for path in paths}
    where: dict[int, tuple[int | None, list[str]]] = {}  # id -> (its layer, or the end modules holding it)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        layer, holders = where.get(id(p), (None, []))
        for path, start in stacks:
            if name.startswith(path + "."):
                layer = start + int(name[len(path) + 1 :].split(".")[0])
        holders += [e for e in ends if name == e or name.startswith(e + ".")]
        where[id(p)] = (layer, holders)
    uses: dict[int, dict[int, int]] = {}
    for r, chunks in enumerate(placement):
        for layers in chunks:
            dropped = set(spec.dropped(model, layers))
            for key, (layer, holders) in where.items():
                held = layer in layers if layer is not None else any(h not in dropped for h in holders) or not holders
                if held:
                    uses.setdefault(key, {})[r] = uses.setdefault(key, {}).get(r, 0) + 1
    found = [
        Tied(tuple(names[key]), tuple(sorted(by_rank)), by_rank.get(rank, 0))
        for key, by_rank in uses.items()
        if len(by_rank) > 1 or max(by_rank.values()) > 1
    ]
    return sorted(found, key=lambda t: t.names[0])


@dataclass(frozen=True)
class TiedGrads:
    """The tied weights this rank holds, as the optimizer and the step treat them (every list holds this
    rank's copies, after any FSDP2 wrapping)."""

    shared: list  # (group of the ranks holding it, weight): gradients summed over those ranks after backward
    late: list  # changed after the backward, or by two chunks' backwards
    counted_elsewhere: list  # counted once in the gradient norm: the first holder's copy


def tied_grads(tied: list[Tied], model: nn.Module, mesh) -> TiedGrads:
    """The gradient duties of ``tied`` (every rank's list) on this rank. Weights held on several ranks get
    a group of those ranks, made on every rank in one order (collective); two chunks of one rank (a
    V-shaped schedule's first and last) share one parameter, and autograd adds up their gradients."""
    held = [t for t in tied if t.chunks_here]
    groups = {ranks: mesh.stages_group(ranks) for ranks in sorted({t.ranks for t in tied if len(t.ranks) > 1})}
    return TiedGrads(
        shared=[(groups[t.ranks], t.param(model)) for t in held if len(t.ranks) > 1],
        late=[t.param(model) for t in held],
        counted_elsewhere=[t.param(model) for t in held if mesh.pp_rank != t.ranks[0]],
    )


def sum_tied_grads(shared: list) -> None:
    """Sum the gradients of ``TiedGrads.shared`` over the ranks holding each weight."""
    for group, p in shared:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        # at ZeRO-3 the stages hold the same dp shard of the tied weight: sum the shards
        comm.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group)
