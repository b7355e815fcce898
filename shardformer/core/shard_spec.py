"""How a tensor is laid out over tensor-parallel ranks: the ``ShardSpec`` every sharded parameter
carries (``param.shard_spec``), and the math that cuts a full tensor into one rank's shard and puts
the shards back together.

Gathering, checkpoint export and gradient norms read this layout instead of guessing it.
Parameters without a spec are replicated over the tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor was split over ``world_size`` tensor-parallel ranks.

    ``dim``: the tensor dimension that is split. ``n_cast``: fused blocks along ``dim`` (3 for a
    fused Q/K/V weight): each block is split on its own, so a rank holds ``[Q_r | K_r | V_r]``.
    ``blocks``: the blocks' sizes when they differ (Q/K/V with fewer key/value heads); None: equal.
    ``full_size``: size along ``dim`` before padding; ``padded_size``: after padding (a vocabulary
    that ``world_size`` does not divide is padded with zero rows up to a multiple of it).
    """

    dim: int
    world_size: int
    rank: int
    full_size: int
    padded_size: int
    n_cast: int = 1
    blocks: tuple[int, ...] | None = None
    splits: tuple[int, ...] | None = None  # pieces per block when fewer than world_size (see below)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Sizes of the fused blocks along ``dim`` (padded; one block when ``n_cast == 1``)."""
        return self.blocks or (self.padded_size // self.n_cast,) * self.n_cast

    @property
    def block_splits(self) -> tuple[int, ...]:
        """Pieces each block is cut into: ``world_size``, or fewer for a block of fewer heads than
        ranks (key/value heads of multi-query attention): then each piece is held, whole, by
        ``world_size // pieces`` consecutive ranks (replicas whose gradients are summed)."""
        return self.splits or (self.world_size,) * self.n_cast

    def piece(self, block: int) -> int:
        """Which piece of ``block`` this rank holds."""
        return self.rank * self.block_splits[block] // self.world_size

    @property
    def local_block_sizes(self) -> list[int]:
        return [size // pieces for size, pieces in zip(self.block_sizes, self.block_splits)]

    @property
    def local_size(self) -> int:
        return sum(self.local_block_sizes) if self.splits else self.padded_size // self.world_size

    @property
    def start(self) -> int:
        """First index (in the padded tensor) this rank holds; meaningful when ``n_cast == 1``."""
        return self.rank * self.local_size


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def make_spec(
    shape: torch.Size | tuple[int, ...],
    dim: int,
    rank: int,
    world_size: int,
    n_cast: int | tuple[int, ...] = 1,
    pad_to_multiple: int | None = None,
    head_width: int | tuple[int, ...] | None = None,
) -> ShardSpec:
    """Check that ``shape[dim]`` can be split and describe the cut.

    Without ``pad_to_multiple`` the size must divide by ``n_cast * world_size``; with it the size is
    padded up to a multiple of ``pad_to_multiple * world_size`` (vocabularies; ``n_cast`` must be 1).
    ``n_cast`` may also be the fused blocks' sizes, each of which must divide by ``world_size``.
    ``head_width``: the blocks hold heads of this width (or each block its own: a Mamba-2 mixer's
    ``[z | x | B | C | dt]`` holds heads, groups and one dt per head) that must not be cut; a block
    of fewer heads than ranks (whose head count divides ``world_size``) is cut into its heads, each
    replicated on ``world_size // heads`` consecutive ranks.
    """
    dim = dim % len(shape)
    size = shape[dim]
    if head_width is not None:
        return _heads_spec(n_cast, head_width, size, shape, dim, rank, world_size)
    if not isinstance(n_cast, int):
        return _blocks_spec(tuple(n_cast), size, shape, dim, rank, world_size, pad_to_multiple)
    if pad_to_multiple is not None:
        if n_cast != 1:
            raise ValueError(f"padding a fused tensor (n_cast={n_cast}) is not supported")
        padded = round_up(size, pad_to_multiple * world_size)
    else:
        if size % (n_cast * world_size) != 0:
            raise ValueError(
                f"size {size} of dim {dim} (shape {tuple(shape)}) does not divide into n_cast={n_cast} x "
                f"tensor_parallel_size={world_size} parts; pick a tensor_parallel_size that divides "
                f"{size // n_cast if size % n_cast == 0 else size}"
            )
        padded = size
    return ShardSpec(dim=dim, world_size=world_size, rank=rank, full_size=size, padded_size=padded, n_cast=n_cast)


def _blocks_spec(blocks, size, shape, dim, rank, world_size, pad_to_multiple) -> ShardSpec:
    if pad_to_multiple is not None:
        raise ValueError(f"padding a fused tensor (blocks {blocks}) is not supported")
    if sum(blocks) != size:
        raise ValueError(
            f"fused blocks {blocks} add up to {sum(blocks)}, not to size {size} of dim {dim} {tuple(shape)}"
        )
    if any(b % world_size for b in blocks):
        raise ValueError(
            f"fused blocks {blocks} of dim {dim} (shape {tuple(shape)}) do not each divide into "
            f"tensor_parallel_size={world_size} parts"
        )
    equal = len(set(blocks)) == 1  # equal blocks: the plain n_cast form
    return ShardSpec(dim, world_size, rank, size, size, len(blocks), None if equal else blocks)


def _heads_spec(n_cast, head_width, size, shape, dim, rank, world_size) -> ShardSpec:
    blocks = (size // n_cast,) * n_cast if isinstance(n_cast, int) else tuple(n_cast)
    widths = tuple(head_width) if isinstance(head_width, tuple) else (head_width,) * len(blocks)
    if sum(blocks) != size or len(widths) != len(blocks) or any(b % w for b, w in zip(blocks, widths)):
        raise ValueError(f"blocks {blocks} of dim {dim} {tuple(shape)} are not whole heads of width {head_width}")
    splits = []
    for block, width in zip(blocks, widths):
        heads = block // width
        if heads % world_size == 0:
            splits.append(world_size)
        elif world_size % heads == 0:
            splits.append(heads)  # fewer heads than ranks: each rank holds one, replicated
        else:
            raise ValueError(
                f"a block of {heads} heads (dim {dim} of {tuple(shape)}) neither splits over nor replicates "
                f"evenly on tensor_parallel_size={world_size}; pick a size that divides or is a multiple of {heads}"
            )
    equal = len(set(blocks)) == 1
    return ShardSpec(
        dim, world_size, rank, size, size, len(blocks), None if equal else blocks,
        None if all(p == world_size for p in splits) else tuple(splits),
    )  # fmt: skip


def slice_tensor(tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's shard of ``tensor`` (a new contiguous tensor; the full one can be freed)."""
    if spec.padded_size != spec.full_size:
        pad_shape = list(tensor.shape)
        pad_shape[spec.dim] = spec.padded_size - spec.full_size
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=spec.dim)
    if spec.world_size == 1:
        return tensor
    blocks = tensor.split(list(spec.block_sizes), dim=spec.dim)
    pieces = [block.chunk(spec.block_splits[b], dim=spec.dim)[spec.piece(b)] for b, block in enumerate(blocks)]
    return torch.cat(pieces, dim=spec.dim).contiguous() if len(pieces) > 1 else pieces[0].clone()


def merge_shards(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `slice_tensor` over all ranks' shards: the full tensor, padding removed."""
    per_rank = [shard.split(spec.local_block_sizes, dim=spec.dim) for shard in shards]
    holders = [range(0, spec.world_size, spec.world_size // pieces) for pieces in spec.block_splits]
    blocks = [torch.cat([per_rank[r][c] for r in holders[c]], dim=spec.dim) for c in range(spec.n_cast)]
    full = torch.cat(blocks, dim=spec.dim) if len(blocks) > 1 else blocks[0]
    return full.narrow(spec.dim, 0, spec.full_size)


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The `ShardSpec` a tensor-parallel parameter carries, or None if it is replicated."""
    return getattr(tensor, "shard_spec", None)


def make_shard_param(source: torch.Tensor, spec: ShardSpec, requires_grad: bool | None = None) -> torch.nn.Parameter:
    """A Parameter holding this rank's shard of ``source``, tagged with ``spec``.

    Keeps dtype and device; reuses ``source``'s storage when nothing is cut (one rank, no padding).
    """
    data = slice_tensor(source.detach(), spec)
    if requires_grad is None:
        requires_grad = source.requires_grad
    param = torch.nn.Parameter(data, requires_grad=requires_grad)
    param.shard_spec = spec
    return param


def replica_weights(spec: ShardSpec, shape) -> torch.Tensor | None:
    """Per-element weights of a local shard that count a replicated piece once over the group
    (``pieces / world_size`` on the pieces of a block held by several ranks), or None if none is."""
    if spec.splits is None:
        return None
    parts = []
    for size, pieces in zip(spec.local_block_sizes, spec.block_splits):
        part_shape = list(shape)
        part_shape[spec.dim] = size
        parts.append(torch.full(part_shape, pieces / spec.world_size, dtype=torch.float64))
    return torch.cat(parts, dim=spec.dim)
