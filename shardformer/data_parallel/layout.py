"""Where each parameter's fp32 master shard and gradient live in the ZeRO layout.

Every parameter is flattened, padded to a multiple of the data-parallel size ``dp`` and cut into
``dp`` equal pieces of ``shard_numel`` elements; rank ``r`` owns piece ``r``. Parameters are packed
into buckets. A bucket's communication buffer is a ``[dp, shard_numel_total]`` tensor: row ``r``
holds rank ``r``'s piece of every parameter of the bucket, side by side. A reduce-scatter of the
flattened buffer hands each rank exactly its row, an all-gather of the rows rebuilds every param.

Half-precision parameters get an fp32 master copy of this rank's piece. A parameter that already
is fp32 (or fp64) needs no copy: its storage is moved into a padded flat buffer and the master is
this rank's piece of that buffer, a view, so the optimizer updates the parameter in place and ZeRO
holds no second copy of the weights (the padding, under ``dp`` elements, is never read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision parameters; fp32 and fp64 parameters keep their own precision."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


@dataclass(eq=False)
class ParamSlot:
    """One model parameter: its shard geometry, its bucket and this rank's master shard."""

    index: int  # position over all param groups, as torch's optimizer state_dict numbers params
    param: torch.nn.Parameter
    numel: int
    shard_numel: int  # elements per rank, ceil(numel / dp)
    master: torch.Tensor  # this rank's fp32 shard, the tensor the wrapped optimizer updates
    bucket: int = -1
    offset: int = 0  # start of this param's piece inside a bucket row


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel together in one collective."""

    index: int
    slots: list[ParamSlot] = field(default_factory=list)
    row_numel: int = 0  # sum of the slots' shard_numel: the length of one rank's row

    def add(self, slot: ParamSlot) -> None:
        slot.bucket, slot.offset = self.index, self.row_numel
        self.slots.append(slot)
        self.row_numel += slot.shard_numel


def shard_numel_for(numel: int, dp: int) -> int:
    return -(-numel // dp)


def write_rows(region: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` (n elements) row-major into the ``[dp, k]`` view ``region``; zero the padding."""
    dp, k = region.shape
    n = flat.numel()
    full_rows = n // k
    if full_rows:
        region[:full_rows].copy_(flat[: full_rows * k].view(full_rows, k))
    rest = n - full_rows * k
    if full_rows < dp:
        if rest:
            region[full_rows, :rest].copy_(flat[full_rows * k :])
        region[full_rows, rest:].zero_()
        region[full_rows + 1 :].zero_()


def read_rows(region: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `write_rows`: the first ``numel`` elements of ``region`` row-major (a copy)."""
    return region.reshape(-1)[:numel]


def copy_rows_into(dst: torch.Tensor, region: torch.Tensor) -> None:
    """Inverse of `write_rows` straight into ``dst`` (any shape and dtype), without a temporary."""
    if not dst.is_contiguous():
        dst.copy_(read_rows(region, dst.numel()).view_as(dst))
        return
    flat, k = dst.view(-1), region.shape[1]
    full_rows = flat.numel() // k
    if full_rows:
        flat[: full_rows * k].view(full_rows, k).copy_(region[:full_rows])
    if flat.numel() > full_rows * k:
        flat[full_rows * k :].copy_(region[full_rows, : flat.numel() - full_rows * k])


def shard_of(flat: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``flat`` after padding to a multiple of ``dp`` (a new tensor)."""
    k = shard_numel_for(flat.numel(), dp)
    piece = flat[rank * k : (rank + 1) * k]
    if piece.numel() == k:
        return piece.clone()
    out = flat.new_zeros(k)
    out[: piece.numel()] = piece
    return out


def build_slots(param_groups: list[list[torch.nn.Parameter]], dp: int, rank: int) -> list[ParamSlot]:
    slots = []
    for params in param_groups:
        for p in params:
            k = shard_numel_for(p.numel(), dp)
            if master_dtype_for(p.dtype) == p.dtype:
                master = _piece_in_place(p, dp * k)[rank * k : (rank + 1) * k]
            else:
                master = shard_of(p.detach().reshape(-1).to(master_dtype_for(p.dtype)), dp, rank)
            slots.append(ParamSlot(len(slots), p, p.numel(), k, master))
    return slots


@torch.no_grad()
def _piece_in_place(p: torch.nn.Parameter, padded: int) -> torch.Tensor:
    """Move ``p``'s values into a zero-padded flat buffer of ``padded`` elements that ``p`` then views."""
    buffer = torch.zeros(padded, dtype=p.dtype, device=p.device)
    buffer[: p.numel()].copy_(p.detach().reshape(-1))
    p.data = buffer[: p.numel()].view(p.shape)
    return buffer


def build_buckets(slots: list[ParamSlot], bucket_size: int, dp: int) -> list[Bucket]:
    """Pack params into buckets of about ``bucket_size`` elements (padded, all ranks).

    Packing follows reverse registration order, roughly the order backward produces gradients,
    so with overlap the first bucket fills (and can be sent) first. A bucket is one tensor in
    each direction, so params share one only when their master and model dtypes match.
    """
    buckets: list[Bucket] = []
    open_by_dtype: dict[tuple[torch.dtype, torch.dtype], Bucket] = {}
    for slot in reversed(slots):
        key = (slot.master.dtype, slot.param.dtype)
        bucket = open_by_dtype.get(key)
        if bucket is not None and (bucket.row_numel + slot.shard_numel) * dp > bucket_size:
            bucket = None
        if bucket is None:
            bucket = Bucket(len(buckets))
            buckets.append(bucket)
            open_by_dtype[key] = bucket
        bucket.add(slot)
    return buckets
