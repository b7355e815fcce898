"""Collectives as autograd functions: Megatron's conjugate pairs, so HuggingFace code runs unchanged.

    copy_to_parallel       forward: identity          backward: all-reduce
    reduce_from_parallel   forward: all-reduce        backward: identity
    split_to_parallel      forward: keep own shard    backward: all-gather
    gather_from_parallel   forward: all-gather        backward: keep own shard

Split and gather take a :class:`~shardformer.slicer.ShardSpec` for the last dimension, so fused
blocks (``n_cast``) and vocabulary padding come back in the original order and size.

Every collective issued here is recorded by any active :class:`CollectiveCounter`, so tests and
benchmarks can count communication instead of trusting it. Under ``torch.compile`` the collectives
are torch's functional ones, which dynamo traces into the graph (an in-place ``dist`` call inside an
autograd function, or the counter's list append, would break it); counting is eager-only.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from shardformer.mesh import group_rank, group_size
from shardformer.slicer import ShardSpec, merge_shards, slice_tensor

_active_counters: list[CollectiveCounter] = []


class CollectiveCounter:
    """Context manager recording ``(op, numel, bytes)`` for each collective issued inside it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __enter__(self) -> CollectiveCounter:
        _active_counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active_counters.remove(self)

    @property
    def counts(self) -> Counter:
        return Counter(op for op, _, _ in self.calls)

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.calls)

    def wire_bytes(self, world: int) -> float:
        """Bytes each rank sends under ring algorithms: an all-reduce of N bytes sends 2(w-1)/w N, a
        reduce-scatter of N bytes or an all-gather into N bytes (w-1)/w N. An all-reduce costs what a
        reduce-scatter plus an all-gather cost, which makes sequence parallelism comparable to plain tp."""
        share = (world - 1) / world
        per_op = {"all_reduce": 2 * share, "reduce_scatter": share, "all_gather": world * share}
        return sum(per_op[op] * b for op, _, b in self.calls if op in per_op)

    def reset(self) -> None:
        self.calls.clear()


def _record(op: str, tensor: torch.Tensor) -> None:
    for counter in _active_counters:
        counter.calls.append((op, tensor.numel(), tensor.numel() * tensor.element_size()))


def _functional_group(group):
    return dist.group.WORLD if group is None else group


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce of a contiguous tensor (a no-op on one rank); use the result. Eager: in place and
    counted. Compiling: a functional all-reduce into a new tensor (dynamo cannot trace mutation)."""
    if group_size(group) == 1:
        return tensor
    if torch.compiler.is_compiling():
        return funcol.all_reduce(tensor, "max" if op == dist.ReduceOp.MAX else "sum", _functional_group(group))
    _record("all_reduce", tensor)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, group, src_group_rank: int = 0) -> torch.Tensor:
    """In-place broadcast from the group's ``src_group_rank`` (a no-op on one rank)."""
    if group_size(group) > 1:
        _record("broadcast", tensor)
        src = src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def start_all_reduce(tensor: torch.Tensor, group):
    """Start a sum all-reduce of a contiguous tensor; returns ``(result, wait)``: compute that does not
    need the result may run before ``wait()``. Compiling, the functional collective is already
    asynchronous in the graph (its wait sits at the first use), so ``wait`` does nothing."""
    if group_size(group) == 1 or torch.compiler.is_compiling():
        return all_reduce(tensor, group), _nothing_to_wait
    _record("all_reduce", tensor)
    return tensor, dist.all_reduce(tensor, group=group, async_op=True).wait


def _nothing_to_wait() -> None:
    return None


def all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    world = group_size(group)
    if torch.compiler.is_compiling():
        return list(funcol.all_gather_single(tensor, 0, _functional_group(group)).chunk(world))
    out = [torch.empty_like(tensor) for _ in range(world)]
    _record("all_gather", tensor)
    dist.all_gather(out, tensor, group=group)
    return out


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


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = all_reduce(x.contiguous(), group)
        if y is x:  # reduced in place: say so, or a later in-place op on the output (Llama 4's add_) is refused
            ctx.mark_dirty(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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
    :meth:`reads_alone` tells such a layer it may all-reduce its own input gradient, overlapped with
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


def reduce_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, group) if group_size(group) > 1 else x


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
