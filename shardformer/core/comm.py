"""The collectives shardformer issues: primitives, the flat ones ZeRO uses, and the one differentiable
sum below tensor parallelism (`reduce_from_parallel`). Megatron's other region functions, and the
sequence-parallel ones, build on these in `shardformer.tensor_parallel.regions` and
`shardformer.tensor_parallel.sequence_regions`.

Groups. ``None`` always means torch's default group: the whole world once torch.distributed is
initialised, this one process before. `LOCAL` (a `VirtualGroup` of one) stands for a
parallel dimension that is absent: nothing ever communicates over it. A ``VirtualGroup`` of more
ranks (``shardformer plan``) gives sizes and ranks to shard by, and must never reach a collective.

Every tensor collective issued here is recorded by any active `CollectiveCounter`
(`shardformer.core.counting`, which also records FSDP2's), so tests and benchmarks count
communication instead of trusting it. Under ``torch.compile`` the collectives
are torch's functional ones, which dynamo traces into the graph (an in-place ``dist`` call inside an
autograd function, or the counter's list append, would break it); counting is eager-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from shardformer.core.counting import CollectiveCounter  # noqa: F401 (where callers import it from)
from shardformer.core.counting import record as _record
from shardformer.core.shard_spec import ShardSpec, merge_shards

# torch 2.14 renamed the single-tensor collectives; older releases only have the *_tensor names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# -- groups -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VirtualGroup:
    """A stand-in process group: sharding reads its rank and size, and nothing ever communicates
    over it (``shardformer plan`` shards for rank 0 of a size; `LOCAL` is a group of one)."""

    rank: int
    size: int


LOCAL = VirtualGroup(0, 1)  # a parallel dimension that is absent


def group_size(group) -> int:
    """Ranks in ``group`` (None: the default group; 1 when torch.distributed is not started)."""
    if isinstance(group, VirtualGroup):
        return group.size
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    """This process's rank in ``group`` (None: the default group)."""
    if isinstance(group, VirtualGroup):
        return group.rank
    return dist.get_rank(group) if dist.is_initialized() else 0


def global_rank(group, group_rank_: int) -> int:
    """The global rank of rank ``group_rank_`` of ``group`` (None: the default group)."""
    return group_rank_ if group is None else dist.get_global_rank(group, group_rank_)


def _functional_group(group):
    return dist.group.WORLD if group is None else group


# -- primitives -------------------------------------------------------------------------------------


class Handle:
    """What a started collective returns: ``wait()`` it before reading the result."""

    def __init__(self, *works) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class _CopyOnWait:
    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src = dst, src

    def wait(self) -> None:
        self.dst.copy_(self.src)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce of a contiguous tensor (a no-op on one rank); use the result. Eager: in place and
    counted. Compiling: a functional all-reduce into a new tensor (dynamo cannot trace mutation)."""
    if group_size(group) == 1:
        return tensor
    if torch.compiler.is_compiling():
        return funcol.all_reduce(tensor, "max" if op == dist.ReduceOp.MAX else "sum", _functional_group(group))
    _record("all_reduce", tensor, group)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def every_rank(flag: bool, *groups, device=None) -> bool:
    """Whether ``flag`` holds on every rank of ``groups`` (all-reduced over each in turn). A proof asks it
    before using a cached verdict: a cache filled on some ranks only, or a key that came out differently on
    one rank, would otherwise leave the ranks that prove waiting in collectives the others skip."""
    missing = torch.tensor([0.0 if flag else 1.0], device=device)
    for group in groups:
        missing = all_reduce(missing, group)
    return missing.item() == 0


def start_all_reduce(tensor: torch.Tensor, group) -> tuple[torch.Tensor, Handle]:
    """Start a sum all-reduce of a contiguous tensor in place; returns ``(result, handle)``: compute that
    does not need the result may run before ``handle.wait()``. Compiling, the functional collective
    is already asynchronous in the graph (its wait sits at the first use), so the handle is empty."""
    if group_size(group) == 1 or torch.compiler.is_compiling():
        return all_reduce(tensor, group), Handle()
    _record("all_reduce", tensor, group)
    return tensor, Handle(dist.all_reduce(tensor, group=group, async_op=True))


def broadcast(tensor: torch.Tensor, group, src_group_rank: int = 0) -> torch.Tensor:
    """In-place broadcast from the group's ``src_group_rank`` (a no-op on one rank)."""
    if group_size(group) > 1:
        _record("broadcast", tensor, group)
        dist.broadcast(tensor, src=global_rank(group, src_group_rank), group=group)
    return tensor


def broadcast_object(obj, group, src_group_rank: int = 0):
    """``obj`` of the group's ``src_group_rank`` on every rank (picklable control data, not counted)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(group, src_group_rank), group=group)
    return box[0]


def all_gather_control(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's small fixed-size ``tensor`` stacked in rank order: a check's data, not the model's,
    so not counted (like `broadcast_object`; counted collectives stay what the model issues)."""
    world = group_size(group)
    if world == 1:
        return tensor.unsqueeze(0)
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(out, tensor.contiguous().view(-1), group=group)
    return out.view(world, *tensor.shape)


def all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order."""
    tensor = tensor.contiguous()
    world = group_size(group)
    if world == 1:
        return [tensor]
    if torch.compiler.is_compiling():
        return list(funcol.all_gather_single(tensor, 0, _functional_group(group)).chunk(world))
    out = [torch.empty_like(tensor) for _ in range(world)]
    _record("all_gather", tensor, group)
    dist.all_gather(out, tensor, group=group)
    return out


def start_all_gather(tensor: torch.Tensor, group) -> tuple[list[torch.Tensor], Handle]:
    """Start gathering every rank's ``tensor``; returns ``(parts, handle)``: the parts, in rank order, are
    valid once the handle is waited on. Compiling (or on one rank) it is done at once."""
    tensor = tensor.contiguous()
    world = group_size(group)
    if world == 1 or torch.compiler.is_compiling():
        return all_gather(tensor, group), Handle()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    _record("all_gather", tensor, group)
    return parts, Handle(dist.all_gather(parts, tensor, group=group, async_op=True))


def isend(tensor: torch.Tensor, dst: int, group) -> dist.Work:
    """Start sending ``tensor`` to global rank ``dst`` (pipeline stages); counted as a "send"."""
    _record("send", tensor, group)
    return dist.isend(tensor, dst, group)


def irecv(out: torch.Tensor, src: int, group) -> dist.Work:
    """Start receiving into ``out`` from global rank ``src``; counted as a "recv"."""
    _record("recv", out, group)
    return dist.irecv(out, src, group)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of shape ``[world, ...]``: row ``r`` goes to rank ``r``; returns the rows every rank sent
    here, in rank order (context parallelism's Ulysses exchange)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single(x, None, None, _functional_group(group))
    out = torch.empty_like(x)
    _record("all_to_all", x, group)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all_uneven(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(send_counts[:r]) : ...]`` go to rank ``r``; returns the rows every rank sent here,
    in rank order (``recv_counts[r]`` from rank ``r``): expert parallelism's token exchange."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    _record("all_to_all", x, group)
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def start_ring_shift(tensors: list[torch.Tensor], group) -> tuple[list[torch.Tensor], Handle]:
    """Start sending ``tensors`` to the next rank of ``group`` and receiving the previous rank's
    (same shapes); the received tensors are valid once the handle is waited on (ring attention)."""
    world, rank = group_size(group), group_rank(group)
    nxt, prev = global_rank(group, (rank + 1) % world), global_rank(group, (rank - 1) % world)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = []
    for t, r in zip(tensors, received):
        _record("send", t, group)
        ops.append(dist.P2POp(dist.isend, t.contiguous(), nxt, group))
        ops.append(dist.P2POp(dist.irecv, r, prev, group))
    return received, Handle(*dist.batch_isend_irecv(ops))


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group; this rank keeps its equal chunk along ``dim``."""
    world = group_size(group)
    if world == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, _functional_group(group))
    chunks = [c.contiguous() for c in x.chunk(world, dim=dim)]
    out = torch.empty_like(chunks[0])
    _record("reduce_scatter", x, group)
    dist.reduce_scatter(out, chunks, group=group)
    return out


def gather_tensor(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """All-gather a sharded tensor over ``group`` and return the full tensor (same on every rank)."""
    if spec.world_size == 1:
        return local.narrow(spec.dim, 0, spec.full_size)
    return merge_shards(all_gather(local, group), spec)


# -- flat buffers (ZeRO) ----------------------------------------------------------------------------
# gloo's native reduce-scatter and all-gather measure 1.6-2.7x slower than doing the same work with
# one ``reduce`` (resp. ``broadcast``) per rank (10M floats, 2 and 4 CPU ranks), so on gloo they are
# built from those (``per_rank=True``, what `per_rank_is_faster` picks); other backends (NCCL)
# use the native collectives. Results are identical.


def per_rank_is_faster(group) -> bool:
    """Whether reduce-scatter / all-gather over ``group`` are faster built from per-rank collectives."""
    return dist.get_backend(group) == "gloo"


def start_reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, per_rank: bool) -> Handle:
    """Start summing ``inp`` (``size * out.numel()`` elements) over ``group``; this rank's slice lands
    in ``out`` once the handle is waited on. The per-rank form reduces row ``r`` onto rank ``r`` in
    place (other ranks' rows of ``inp`` may be overwritten)."""
    if group_size(group) == 1:
        out.view(-1).copy_(inp.view(-1))
        return Handle()
    _record("reduce_scatter", inp, group)
    if not per_rank:
        return Handle(_reduce_scatter_single(out, inp, group=group, async_op=True))
    size, rank = group_size(group), group_rank(group)
    rows = inp.view(size, -1)
    works = [dist.reduce(rows[r], dst=global_rank(group, r), group=group, async_op=True) for r in range(size)]
    return Handle(*works, _CopyOnWait(out, rows[rank]))


def start_all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, per_rank: bool) -> Handle:
    """Start concatenating every rank's ``inp`` into ``out`` (``size * inp.numel()`` elements), in rank order."""
    size = group_size(group)
    if size == 1:
        if inp.data_ptr() != out.data_ptr():
            out.view(-1).copy_(inp.view(-1))
        return Handle()
    _record("all_gather", out, group)
    if not per_rank:
        return Handle(_all_gather_single(out, inp, group=group, async_op=True))
    rows = out.view(size, -1)
    rank = group_rank(group)
    if inp.data_ptr() != rows[rank].data_ptr():  # already in place when the caller wrote its row
        rows[rank].copy_(inp)
    return Handle(
        *[dist.broadcast(rows[r], src=global_rank(group, r), group=group, async_op=True) for r in range(size)]
    )


# -- the differentiable sum -------------------------------------------------------------------------


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


def reduce_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ``group`` of every rank's ``x`` (forward: all-reduce); the gradient reaches each rank's
    own ``x`` unchanged (backward: identity), as what follows runs the same on every rank. Megatron's
    reduce-from region of a row-parallel output; context parallelism sums its ranks' losses with it, which
    is why it sits here, below both."""
    return _ReduceFromParallel.apply(x, group) if group_size(group) > 1 else x
