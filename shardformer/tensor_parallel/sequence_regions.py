"""Megatron's region functions along the sequence (dim 1 of ``[batch, seq, hidden]``), for sequence
parallelism; the tensor-parallel ones are in `.regions`, the collectives in `shardformer.core.comm`.

    split_sequence            forward: keep own chunk    backward: all-gather
    gather_sequence           forward: all-gather        backward: keep own chunk
    gather_sequence_for_tp    forward: all-gather        backward: reduce-scatter
    reduce_scatter_sequence   forward: reduce-scatter    backward: all-gather

(`GatheredSequence` lets the layers reading a ``gather_sequence_for_tp`` output, or the LM head
reading the final norm's ``gather_sequence`` output, keep the chunk for their backward and all-gather
it again there.) A sequence of ``full_len`` tokens is cut into chunks of ``ceil(full_len / world)``;
the padding of the last chunks never leaves the split region. The collectives are
`shardformer.core.comm`'s, counted as every other.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from shardformer.core.comm import Handle, all_gather, group_rank, group_size, reduce_scatter, start_all_gather

SEQ_DIM = 1


def chunk_length(full_len: int, world: int) -> int:
    return -(-full_len // world)


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - x.shape[SEQ_DIM]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - SEQ_DIM - 1) + [0, missing]  # F.pad counts dimensions from the last
    return F.pad(x, pad)


def own_chunk(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """This rank's chunk of a full-length ``x`` (padded at the end where the length does not divide)."""
    world = group_size(group)
    local = chunk_length(full_len, world)
    return _pad(x, local * world).narrow(SEQ_DIM, group_rank(group) * local, local).contiguous()


def _all_gather_sequence(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    return torch.cat(all_gather(x, group), dim=SEQ_DIM).narrow(SEQ_DIM, 0, full_len)


def _reduce_scatter_sequence(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    local = chunk_length(full_len, group_size(group))
    return reduce_scatter(_pad(x, local * group_size(group)), group, SEQ_DIM)


class _ToChunk(torch.autograd.Function):
    """Full sequence -> this rank's chunk: of the replicated input (``reduce`` False) or of the sum
    over ranks (``reduce`` True). Backward all-gathers the chunks' gradients either way."""

    @staticmethod
    def forward(ctx, x, group, full_len, reduce):
        ctx.group, ctx.full_len = group, full_len
        return _reduce_scatter_sequence(x, group, full_len) if reduce else own_chunk(x, group, full_len)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group, ctx.full_len), None, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, full_len, reduce_grad):
        ctx.group, ctx.full_len, ctx.reduce_grad = group, full_len, reduce_grad
        return _all_gather_sequence(x, group, full_len)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:  # each rank holds a partial gradient of the whole sequence
            return _reduce_scatter_sequence(grad, ctx.group, ctx.full_len), None, None, None
        return own_chunk(grad, ctx.group, ctx.full_len), None, None, None


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated full sequence -> this rank's chunk (the gradient is all-gathered back)."""
    return _ToChunk.apply(x, group, x.shape[SEQ_DIM], False)


def gather_sequence(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """Chunks -> the replicated full sequence (each rank's gradient of it is whole: keep own chunk)."""
    return _GatherSequence.apply(x, group, full_len, False)


def gather_sequence_for_tp(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """Chunks -> the full sequence as input of column-parallel layers, whose input gradients are
    partial sums over the ranks: backward reduce-scatters them (Megatron's sequence parallelism)."""
    return _GatherSequence.apply(x, group, full_len, True)


def reduce_scatter_sequence(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """Partial sums of the full sequence (a row-parallel output) -> this rank's chunk of the total."""
    return _ToChunk.apply(x, group, full_len, True)


class _SequenceGathering:
    """A started all-gather along the sequence: `wait` returns the full tensor."""

    def __init__(
        self, parts: list[torch.Tensor] | None, handle: Handle, full_len: int, full: torch.Tensor | None = None
    ):
        self.parts, self.handle, self.full_len, self.full = parts, handle, full_len, full

    def wait(self) -> torch.Tensor:
        if self.full is None:
            self.handle.wait()
            self.full = torch.cat(self.parts, dim=SEQ_DIM).narrow(SEQ_DIM, 0, self.full_len)
            self.parts = self.handle = None
        return self.full


def start_gather_sequence(x: torch.Tensor, group, full_len: int) -> _SequenceGathering:
    """Start the all-gather of every rank's chunk (what `gather_sequence` does, without autograd):
    compute that does not need the result may run before ``wait()``. Compiling: done at once."""
    return _SequenceGathering(*start_all_gather(x, group), full_len)


class GatheredSequence:
    """One all-gathered sequence (`gather_sequence_for_tp`'s output, or `gather_sequence`'s
    at the end of the region, read by the LM head) and the chunk it came from,
    for column-parallel layers that keep this rank's chunk for their backward instead of the gathered
    tensor, and all-gather it again there (Megatron-LM's sequence parallelism: ``1/world`` of the
    memory, one more all-gather). The readers of one gathered tensor (q, k and v; gate and up) share
    one re-gather: it is kept from the first of their backwards to the last.

    Only weak references to the two tensors are held: the readers save the chunk themselves (so
    autograd checks its version, and activation checkpointing can drop and recompute it)."""

    def __init__(self, full: torch.Tensor, chunk: torch.Tensor, group, full_len: int) -> None:
        self._full, self._full_version = weakref.ref(full), full._version
        # what a view of it must match to read exactly its elements (``full`` itself may be gone by then:
        # ``hidden.view(shape)`` keeps only the storage's base alive)
        self._root = weakref.ref(full._base if full._base is not None else full)
        self._layout = (full.shape, full.stride(), full.storage_offset(), full.dtype, full.requires_grad)
        self._chunk, self._chunk_version = weakref.ref(chunk), chunk._version
        self.group, self.full_len = group, full_len
        self._pending = 0  # readers whose backward has not run yet
        self._regathered: torch.Tensor | None = None

    def chunk_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """The chunk ``x`` was gathered from, if ``x`` is that gathered tensor (or a view of it with the same
        elements in the same places, as ``hidden[:, slice(0, None)]`` or ``.view(same shape)`` give), both
        unchanged."""
        if not (x is self._full() or self._is_whole_view(x)) or x._version != self._full_version:
            return None
        chunk = self._chunk()
        return chunk if chunk is not None and chunk._version == self._chunk_version else None

    def _is_whole_view(self, x: torch.Tensor) -> bool:
        """A view of the gathered tensor's storage base through autograd (not a ``detach()``ed alias: its
        gradient must flow into the same history) with exactly its elements in the same places."""
        root = self._root()
        layout = (x.shape, x.stride(), x.storage_offset(), x.dtype, x.requires_grad)
        return root is not None and x._base is root and layout == self._layout

    def add_reader(self) -> None:
        self._pending += 1

    def start(self, chunk: torch.Tensor) -> _SequenceGathering:
        """Start re-gathering ``chunk`` (this rank's, as saved); nothing is sent if another reader did."""
        if self._regathered is not None:
            return _SequenceGathering(None, Handle(), self.full_len, self._regathered)
        return start_gather_sequence(chunk, self.group, self.full_len)

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the sum over ranks of ``grad``, partial gradients of the full sequence
        (no autograd: for a backward)."""
        return _reduce_scatter_sequence(grad, self.group, self.full_len)

    def done(self, full: torch.Tensor) -> None:
        """A reader's backward ran with ``full``: keep it for the others, drop it after the last."""
        self._pending -= 1
        self._regathered = full if self._pending > 0 else None
