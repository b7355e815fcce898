"""Megatron's region functions for tensor parallelism: autograd functions, so HuggingFace code runs unchanged.

    copy_to_parallel          forward: identity          backward: all-reduce
    copy_all_to_parallel      the same for several tensors, in one all-reduce
    reduce_from_parallel      forward: all-reduce        backward: identity
    split_to_parallel         forward: keep own shard    backward: all-gather
    gather_from_parallel      forward: all-gather        backward: keep own shard

``reduce_from_parallel`` is in `shardformer.core.comm`, as context parallelism sums its loss with it;
the same regions along the sequence, for sequence parallelism, are in `.sequence_regions`.

Split and gather take a `shardformer.core.shard_spec.ShardSpec` for the last dimension, so
fused blocks (``n_cast``) and vocabulary padding come back in the original order and size.
Their collectives are `shardformer.core.comm`'s, counted as every other.
"""

from __future__ import annotations

import weakref

import torch

from shardformer.core.comm import all_gather, all_reduce, group_rank, group_size
from shardformer.core.shard_spec import ShardSpec, merge_shards, slice_tensor


def activation_spec(x: torch.Tensor, group, full_size: int | None = None, n_cast=1) -> ShardSpec:
    """ShardSpec of an activation split along its last dim into shards of ``x.shape[-1]``
    (``n_cast``: the number of fused blocks, or their full sizes when they differ)."""
    world = group_size(group)
    padded = x.shape[-1] * world
    blocks = None if isinstance(n_cast, int) else tuple(n_cast)
    count = n_cast if blocks is None else len(blocks)
    return ShardSpec(x.dim() - 1, world, group_rank(group), full_size or padded, padded, count, blocks)


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, shared):
        ctx.group, ctx.shared = group, shared
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.shared is not None:
            ctx.shared.release()  # forward is over: nothing left to share
        return all_reduce(grad.contiguous(), ctx.group), None, None


class _SplitToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, group):
        ctx.spec, ctx.group = spec, group
        return slice_tensor(x, spec)

    @staticmethod
    def backward(ctx, grad):
        return merge_shards(all_gather(grad, ctx.group), ctx.spec), None, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, group):
        ctx.spec = spec
        return merge_shards(all_gather(x, group), spec)

    @staticmethod
    def backward(ctx, grad):
        return slice_tensor(grad, ctx.spec), None, None


class _CopyAllToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # an output this rank did not use comes as zeros
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), ctx.group)
        return None, *(part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads))


def copy_all_to_parallel(tensors: list[torch.Tensor], group) -> tuple[torch.Tensor, ...]:
    """`copy_to_parallel` of several tensors in one node: their gradients summed over ``group`` in one
    all-reduce, in the order given, whichever of them this rank's graph used (or used first)."""
    return _CopyAllToParallel.apply(group, *tensors)


def copy_to_parallel(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1 or not (torch.is_grad_enabled() and x.requires_grad):
        return x  # identity forward, and no backward to reduce in
    return _CopyToParallel.apply(x, group, None)


class SharedInputCopy:
    """One ``copy_to_parallel`` for the column layers that read the same input one after another
    (BERT's query/key/value, Llama's gate/up): autograd sums their input gradients locally and
    backward all-reduces once, as a fused QKV would.

    The sharder gives one instance to every column layer it builds inside one policy target (a
    BertLayer, a GPT2Block). Only the latest input is remembered, by identity and version (an input
    changed in place is copied anew); its backward, or the next input, releases it.

    It also learns which readers read an input alone (GPT-2's c_attn and c_fc: each its own input):
    `reads_alone` tells such a layer it may all-reduce its own input gradient, overlapped with
    its weight gradient, without costing a collective. Either way is exact (the all-reduces of the
    parts sum to the all-reduce of the sum); a layer becomes a sharer for good once seen sharing.
    """

    def __init__(self) -> None:
        self._latest = None  # (weakref(input), input version, group, output, readers)
        self._alone: weakref.WeakSet = weakref.WeakSet()
        self._sharing: weakref.WeakSet = weakref.WeakSet()

    def __call__(self, x: torch.Tensor, group, reader=None) -> torch.Tensor:
        if group_size(group) == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if torch.compiler.is_compiling():
            # No Python-side cache inside a traced graph: dynamo would bake a stale entry in (a
            # module-level cache did, and gave wrong losses). One all-reduce per layer: exact.
            return _CopyToParallel.apply(x, group, None)
        if self._latest is not None:
            x_ref, version, cached_group, y, readers = self._latest
            if x_ref() is x and version == x._version and cached_group is group:
                readers.append(reader)
                return y
        self._settle()
        y = _CopyToParallel.apply(x, group, self)
        self._latest = (weakref.ref(x), x._version, group, y, [reader])
        return y

    def reads_alone(self, reader) -> bool:
        """Whether every input ``reader`` read so far, no other reader read (False before its first)."""
        return reader in self._alone

    def release(self) -> None:
        self._settle()
        self._latest = None

    def _settle(self) -> None:
        """The latest input's readers are all known (forward moved on): remember who read it alone."""
        if self._latest is None:
            return
        readers = self._latest[4]
        if len(readers) == 1 and readers[0] is not None and readers[0] not in self._sharing:
            self._alone.add(readers[0])
        elif len(readers) > 1:
            for reader in readers:
                if reader is not None:
                    self._sharing.add(reader)
                    self._alone.discard(reader)

    def __deepcopy__(self, memo) -> SharedInputCopy:
        return SharedInputCopy()  # a copied model shares among its own layers, never with the original


def split_to_parallel(x: torch.Tensor, group, n_cast: int = 1) -> torch.Tensor:
    """Keep this rank's shard of the last dim (forward); all-gather the gradient (backward)."""
    world = group_size(group)
    if world == 1:
        return x
    size = x.shape[-1]
    if size % (n_cast * world) != 0:
        raise ValueError(f"last dim {size} does not split into n_cast={n_cast} x {world} ranks")
    spec = ShardSpec(x.dim() - 1, world, group_rank(group), size, size, n_cast)
    return _SplitToParallel.apply(x, spec, group)


def gather_from_parallel(x: torch.Tensor, group, full_size: int | None = None, n_cast=1) -> torch.Tensor:
    """All-gather the last dim (forward): fused blocks reordered, padding past ``full_size`` cut."""
    if group_size(group) == 1:
        return x if full_size is None else x[..., :full_size]
    return _GatherFromParallel.apply(x, activation_spec(x, group, full_size, n_cast), group)


def sum_replicas(grad: torch.Tensor, spec: ShardSpec, group=None) -> torch.Tensor:
    """``grad`` of a shard whose ``spec`` replicates pieces on several ranks (key/value heads fewer
    than ranks), with each replicated piece summed over the ranks that hold it: each of them ran it
    for its own query heads only. Pieces cut over every rank are left as they are. One all-reduce
    for all replicated blocks (K and V together): each rank fills its piece's slot, zeros elsewhere."""
    parts = list(grad.split(spec.local_block_sizes, dim=spec.dim))
    replicated = [b for b, pieces in enumerate(spec.block_splits) if pieces < spec.world_size]
    if not replicated:
        return grad
    slots = []
    for block in replicated:
        slot = grad.new_zeros((spec.block_splits[block], *parts[block].shape))
        slot[spec.piece(block)] = parts[block]
        slots.append(slot)
    summed = all_reduce(torch.cat([slot.flatten() for slot in slots]), group)
    for block, slot in zip(replicated, summed.split([slot.numel() for slot in slots])):
        parts[block] = slot.view(spec.block_splits[block], *parts[block].shape)[spec.piece(block)]
    return torch.cat(parts, dim=spec.dim)
