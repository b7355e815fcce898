"""Which tokens each context-parallel rank holds: the load-balanced ("zigzag") split.

Causal attention costs a token in proportion to its position, so cutting the sequence into cp
contiguous pieces would leave the last rank with most of the work. The sequence is cut into
``2 * cp`` chunks instead and rank ``r`` holds chunk ``r`` and its mirror ``2 * cp - 1 - r`` (a head
and a tail chunk), as the ring/zigzag schemes do: every rank then does the same work.

A length that ``2 * cp`` does not divide is padded at the end (ids 0, labels -100, and key
positions masked out of every attention); the padded positions are computed and never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from shardformer.core.comm import all_gather, group_rank, group_size

SEQ = 1  # the sequence dimension of [batch, seq, ...]


@dataclass(frozen=True)
class ZigzagLayout:
    """The split of a ``full_len``-token sequence over ``world`` ranks, seen from ``rank``."""

    full_len: int
    world: int
    rank: int

    @property
    def chunk(self) -> int:
        return -(-self.full_len // (2 * self.world))

    @property
    def padded_len(self) -> int:
        return self.chunk * 2 * self.world

    @property
    def local_len(self) -> int:
        return 2 * self.chunk

    def starts(self, rank: int) -> tuple[int, int]:
        """Global start of the head and the tail chunk of ``rank``."""
        return rank * self.chunk, (2 * self.world - 1 - rank) * self.chunk

    def indices_of(self, rank: int, device=None) -> torch.Tensor:
        head, tail = self.starts(rank)
        c = self.chunk
        return torch.cat([torch.arange(head, head + c, device=device), torch.arange(tail, tail + c, device=device)])

    def indices(self, device=None) -> torch.Tensor:
        """Global positions of this rank's tokens, in the order it holds them."""
        return self.indices_of(self.rank, device)

    @cached_property
    def rank_major(self) -> torch.Tensor:
        """Global positions of every rank's tokens, rank after rank (what an all-gather concatenates)."""
        return torch.cat([self.indices_of(r) for r in range(self.world)])

    @cached_property
    def to_natural(self) -> torch.Tensor:
        """Index that puts a rank-major concatenation back into sequence order."""
        return torch.argsort(self.rank_major)

    def pad(self, x: torch.Tensor, value=0) -> torch.Tensor:
        """``x`` (full length along dim 1) padded at the end to ``padded_len`` with ``value``."""
        missing = self.padded_len - x.shape[SEQ]
        if missing == 0:
            return x
        return F.pad(x, [0, 0] * (x.dim() - SEQ - 1) + [0, missing], value=value)

    def take(self, x: torch.Tensor, value=0) -> torch.Tensor:
        """This rank's tokens of a full-length (replicated) ``x``, padded with ``value`` where needed."""
        return self.pad(x, value).index_select(SEQ, self.indices(x.device))


class _SplitReplicated(torch.autograd.Function):
    """Replicated full sequence -> this rank's tokens. Every rank's gradient covers only its own
    tokens: backward all-gathers them into the gradient of the whole (replicated) input."""

    @staticmethod
    def forward(ctx, x, layout, group):
        ctx.layout, ctx.group = layout, group
        return layout.take(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.layout, ctx.group), None, None


class _GatherSplit(torch.autograd.Function):
    """This rank's tokens -> the full sequence on every rank. Backward keeps this rank's tokens of
    the gradient (each rank's gradient of the replicated output is already whole)."""

    @staticmethod
    def forward(ctx, x, layout, group):
        ctx.layout = layout
        return _gather(x, layout, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.layout.take(grad), None, None


def _gather(x: torch.Tensor, layout: ZigzagLayout, group) -> torch.Tensor:
    rank_major = torch.cat(all_gather(x.contiguous(), group), dim=SEQ)
    natural = rank_major.index_select(SEQ, layout.to_natural.to(x.device))
    return natural.narrow(SEQ, 0, layout.full_len)


def split_replicated(x: torch.Tensor, layout: ZigzagLayout, group) -> torch.Tensor:
    """This rank's tokens of ``x`` (the same full tensor on every cp rank); differentiable."""
    if x.requires_grad and torch.is_grad_enabled():
        return _SplitReplicated.apply(x, layout, group)
    return layout.take(x)


def gather_split(x: torch.Tensor, layout: ZigzagLayout, group) -> torch.Tensor:
    """The full sequence (in order, padding cut) from every rank's tokens; differentiable."""
    return _GatherSplit.apply(x, layout, group)


def layout_for(full_len: int, group) -> ZigzagLayout:
    return ZigzagLayout(full_len, group_size(group), group_rank(group))
