"""The token exchange of expert parallelism: each (token, chosen expert) pair goes to the rank that
holds the expert, is computed there, and comes back, by two all-to-alls over the ep group, after
a small one of the row counts per expert (which also tells the receiver each row's expert).

Every rank of the group issues the same collectives in the same order, forward and backward: a
rank that receives no token still takes part in both exchanges (with zero rows), and its output stays
in the autograd graph, so no backward all-to-all waits on a rank that skipped it.
"""

from __future__ import annotations

import torch

from shardformer.core.comm import all_to_all, all_to_all_uneven


class _Exchange(torch.autograd.Function):
    """Forward: send ``x``'s rows out by ``send`` counts; backward: the gradients come back the same way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_uneven(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_uneven(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    return _Exchange.apply(x, send, recv, group)


def exchange_counts(sent: torch.Tensor, group) -> torch.Tensor:
    """``sent[r]``: how many rows this rank sends rank ``r`` for each of its experts ([ep, experts per
    rank]); returns what every rank sends here, the same way (row ``r``: from rank ``r``)."""
    return all_to_all(sent, group)


def kept_in_graph(y: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """``y``, tied into the autograd graph of ``sources`` when it is not already (a rank whose experts
    got no token computed nothing from them): its backward exchange then runs like every peer's."""
    if not torch.is_grad_enabled() or y.requires_grad:
        return y
    live = [t for t in sources if t.requires_grad]
    if not live:
        return y
    return y + sum(t.reshape(-1)[:0].sum() for t in live)  # zero, with a gradient path (zero gradients)
