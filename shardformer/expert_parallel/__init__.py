"""Expert parallelism: the experts of every mixture-of-experts layer split over ep ranks (drawn from the
data-parallel ranks), tokens exchanged with all-to-all, dropless and exact.

`plan_expert_parallel` finds the stacked experts (`.find`) and proves the split on a tiny
copy (`.proof`) before tensor parallelism cuts anything; `split_experts` splits them after
(`.experts`); `.dispatch` holds the token exchange.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from shardformer.core.comm import group_rank
from shardformer.expert_parallel.experts import make_expert_parallel
from shardformer.expert_parallel.find import ExpertParallelError, find_experts
from shardformer.expert_parallel.layout import ExpertSpec, is_expert_param
from shardformer.expert_parallel.proof import prove_expert_parallel

__all__ = [
    "ExpertLayout",
    "ExpertParallelError",
    "ExpertSpec",
    "check_expert_parallel",
    "is_expert_param",
    "plan_expert_parallel",
    "split_experts",
]

logger = logging.getLogger("shardformer")


@dataclass(frozen=True)
class ExpertLayout:
    """Where a model's experts went: the split modules' paths, where they were read from ("ep plan" or
    "derived"), ep, and the groups (ep: the ranks splitting the experts; expert_dp: the ranks holding
    the same experts, over which their gradients are summed)."""

    paths: tuple[str, ...]
    source: str
    ep_size: int
    ep_group: Any
    expert_dp_group: Any
    proven: bool


def check_expert_parallel(model: nn.Module, ep: int) -> tuple[list[str], str]:
    """The experts to split, found before any collective (an ExpertParallelError naming why not)."""
    return find_experts(model, ep)


def plan_expert_parallel(model: nn.Module, mesh, prove: bool = True) -> ExpertLayout:
    """Where ``model``'s experts will go over ``mesh.ep_group``, proven on a tiny copy (``prove``) before
    anything is cut. Every rank of the mesh calls it."""
    ep = mesh.ep_size
    paths, source = find_experts(model, ep)
    if prove:
        reason = prove_expert_parallel(model, mesh.ep_group)
        if reason is not None:
            raise ExpertParallelError(
                f"expert_parallel_size={ep} is not exact on {type(model).__name__} (proven on a tiny copy): {reason}; "
                f"use expert_parallel_size=1"
            )
    else:
        logger.warning("expert parallelism on %s is not proven (prove=False)", type(model).__name__)
    return ExpertLayout(tuple(paths), source, ep, mesh.ep_group, mesh.expert_dp_group, prove)


def split_experts(model: nn.Module, layout: ExpertLayout) -> None:
    """Keep this rank's experts of every module ``layout`` names (after tensor parallelism's cut)."""
    for path in layout.paths:
        make_expert_parallel(model.get_submodule(path), layout.ep_group)
    if group_rank(None) == 0:
        local = model.get_submodule(layout.paths[0]).num_experts
        logger.info(
            "expert parallelism: %d MoE layers (%s), %d of %d experts per rank at ep=%d%s",
            len(layout.paths), layout.source, local, local * layout.ep_size, layout.ep_size,
            ", proven on a tiny copy" if layout.proven else "",
        )  # fmt: skip
