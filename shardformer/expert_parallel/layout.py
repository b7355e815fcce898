"""How a module holds its experts, read from the module: which parameters are split by expert, how
many rows of each belong to one expert, and how the module is called.

Three calls are known, each named after what the module receives:

- ``routed``: ``experts(hidden, top_k_index, top_k_weights)``, the tokens and the router's choices
  (transformers' fused experts, DBRX's); the experts' parameters stacked ``[E, ...]`` or flattened
  ``[E * rows, ...]`` (DBRX keeps ``[E * ffn, hidden]`` in a child module);
- ``grouped``: ``experts(inputs, expert_size)``, rows already sorted by expert, with each expert's
  row count (JetMoE's ``JetMoeParallelExperts``, twice per layer and in its attention);
- ``dense``: ``experts(inputs)``, every token once per expert, in equal blocks by expert (Llama 4's
  routed experts, which take each token pre-scaled by its router score, zero where not chosen).

A module that matches is a hypothesis; the proof on a tiny copy accepts or refuses it.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardformer.core.comm import all_gather


@dataclass(frozen=True)
class ExpertSpec:
    """How an expert parameter is split over the ep group along dim 0: ``local`` experts per rank, rank
    ``rank`` holding experts ``[rank * local, (rank + 1) * local)`` of ``num_experts``, each expert
    ``rows`` consecutive rows (1 for stacked ``[E, ...]`` parameters)."""

    num_experts: int
    ep_size: int
    rank: int
    rows: int = 1

    @property
    def local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.rank * self.local

    @property
    def row_span(self) -> tuple[int, int]:
        """This rank's rows of the unsharded dim 0."""
        return self.first * self.rows, (self.first + self.local) * self.rows

    @property
    def full_rows(self) -> int:
        return self.num_experts * self.rows

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an unsharded tensor of the parameter's shape (a gradient, a weight)."""
        start, stop = self.row_span
        return full[start:stop]


def is_expert_param(param) -> bool:
    """Whether ``param`` is one rank's slice of the experts (split by expert parallelism)."""
    return getattr(param, "expert_spec", None) is not None


def gather_experts(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's experts of a split parameter, in expert order (a collective over the ep group)."""
    return torch.cat(all_gather(local.contiguous(), group), dim=0)


def expert_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of ``module`` split by expert: dim 0 a multiple of ``num_experts``, its own or a
    direct child's, for the routed call; its own three-dimensional ``[E, in, out]`` ones for the grouped
    and dense calls."""
    count = module.num_experts
    if call_kind(module) == "routed":
        params = {n: p for n, p in module.named_parameters() if n.count(".") == 0 or _in_leaf_child(module, n)}
        return {n: p for n, p in params.items() if p.dim() >= 1 and p.shape[0] and p.shape[0] % count == 0}
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() >= 3 and p.shape[0] == count}


def _in_leaf_child(module: nn.Module, name: str) -> bool:
    """``name`` is a parameter of a direct child whose parameters are all its own (DBRX's ``mlp``: the
    experts' weights, and an activation)."""
    child, _, leaf = name.partition(".")
    holder = module.get_submodule(child)
    return "." not in leaf and all("." not in n for n, _ in holder.named_parameters())


def call_kind(module: nn.Module) -> str | None:
    """``routed``, ``grouped`` or ``dense`` (see the module's docstring) from ``forward``'s signature:
    three positional parameters (more only with defaults), else two or one, none with a default."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 and all(p.default is not p.empty for p in positional[3:]):
        return "routed"
    required = [p for p in positional if p.default is p.empty]
    return {1: "dense", 2: "grouped"}.get(len(required)) if len(positional) == len(required) else None


def _count(module: nn.Module) -> int | None:
    count = getattr(module, "num_experts", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 1 else None


def one_module_per_expert(module: nn.Module) -> bool:
    """Experts kept as ``num_experts`` modules of one class (Switch Transformers', NLLB-MoE's ModuleDict),
    which the block's own loop calls by index: not split by expert parallelism."""
    kinds = Counter(type(child) for child in module.children())  # NLLB-MoE's also holds a dropout
    return _count(module) is not None and bool(kinds) and max(kinds.values()) >= module.num_experts


def split_by_expert(module: nn.Module) -> bool:
    """Whether ``module`` holds experts expert parallelism can split: an integer ``num_experts`` (2 or
    more), a known call, every parameter under it split by expert, and not one module per expert."""
    if _count(module) is None or call_kind(module) is None or one_module_per_expert(module):
        return False
    every = dict(module.named_parameters())
    return bool(every) and len(expert_params(module)) == len(every)
