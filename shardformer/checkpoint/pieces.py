"""Which pieces of each HuggingFace (unsharded) tensor a rank holds, and where they sit in what it stores.

A `Piece` says that the box ``local[local_offset : local_offset + size]`` of what a rank stores is the box
``full[global_offset : global_offset + size]`` of the unsharded tensor. A tensor-parallel shard holds one
piece per fused block (Q, K and V of a fused QKV weight each come from their own place), a vocab-padded
shard its rows without the padding, an expert-parallel slice its experts' rows; a ZeRO-3 (FSDP2) shard
holds the rows of those pieces its dp rank keeps, a ZeroOptimizer a flat range of them (`flat_range`).
`compose` chains two such maps, so each layout is described once, on its own.

`checkpointable` turns a stored tensor and its pieces into what torch.distributed.checkpoint (DCP) saves
and loads as chunks of the global tensor (its ``CheckpointableTensor`` protocol); a HuggingFace export
can read the same pieces to write each rank's share.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardformer.checkpoint.files import expert_spec
from shardformer.core.shard_spec import ShardSpec
from shardformer.expert_parallel.layout import ExpertSpec
from shardformer.tensor_parallel.slicer import shard_spec

MODEL = "model."  # a training checkpoint's model tensors: "model.<HF name>", as torchtitan and accelerate write


@dataclass(frozen=True)
class Piece:
    """``local[local_offset : local_offset + size]`` is ``full[global_offset : global_offset + size]``."""

    local_offset: tuple[int, ...]
    global_offset: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)


def _spans(size: int, spec: ShardSpec | None) -> tuple[int, list[tuple[int, int, int]]]:
    """The full size of one dimension and its (local start, global start, length) spans."""
    if spec is None:
        return size, [(0, 0, size)]
    spans, local = [], 0
    for block, local_size in enumerate(spec.local_block_sizes):
        start = sum(spec.block_sizes[:block]) + spec.piece(block) * local_size
        length = min(local_size, spec.full_size - start)  # padding rows (past the vocabulary) are no piece
        if length > 0:
            spans.append((local, start, length))
        local += local_size
    return spec.full_size, spans


def tp_pieces(
    shape: tuple[int, ...], spec: ShardSpec | None, experts: ExpertSpec | None
) -> tuple[tuple[int, ...], list[Piece]]:
    """The unsharded shape and the pieces of a tensor-parallel (and expert-parallel) local tensor."""
    full, per_dim = [], []
    for dim, size in enumerate(shape):
        if spec is not None and spec.dim == dim:
            whole, spans = _spans(size, spec)
        else:
            whole, spans = size, [(0, 0, size)]
        if experts is not None and dim == 0:  # this rank's experts: their rows of dim 0
            whole, spans = experts.full_rows, [(lo, g + experts.row_span[0], n) for lo, g, n in spans]
        full.append(whole)
        per_dim.append(spans)
    pieces = [
        Piece(tuple(s[0] for s in combo), tuple(s[1] for s in combo), tuple(s[2] for s in combo))
        for combo in itertools.product(*per_dim)
    ]
    return tuple(full), pieces


def compose(outer: list[Piece], inner: list[Piece]) -> list[Piece]:
    """Pieces of ``storage -> full`` from ``inner`` (storage -> middle) and ``outer`` (middle -> full)."""
    out = []
    for i in inner:
        for o in outer:
            lo = [max(a, b) for a, b in zip(i.global_offset, o.local_offset)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(i.global_offset, i.size, o.local_offset, o.size)]
            if all(a < b for a, b in zip(lo, hi)):
                out.append(Piece(
                    tuple(il + x - ig for il, x, ig in zip(i.local_offset, lo, i.global_offset)),
                    tuple(og + x - ol for og, x, ol in zip(o.global_offset, lo, o.local_offset)),
                    tuple(b - a for a, b in zip(lo, hi)),
                ))  # fmt: skip
    return out


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offset, size) boxes that the flat range ``[start, stop)`` of a row-major ``shape`` covers."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:
        return [((first, *o), (1, *s)) for o, s in _boxes(shape[1:], start - first * row, stop - first * row)]
    head_end, tail_start = (first + 1) * row, last * row
    out = _boxes(shape, start, head_end) if start % row else []
    whole_first = first + (1 if start % row else 0)
    whole_last = last + (1 if stop % row == 0 else 0)
    if whole_first < whole_last:
        out.append(((whole_first, *(0,) * (len(shape) - 1)), (whole_last - whole_first, *shape[1:])))
    if stop % row:
        out += _boxes(shape, tail_start, stop)
    return out


def flat_range(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, list[Piece]]:
    """A flat range of a tensor of ``shape`` stored as the whole rows it touches (dim 0): the first of those
    rows, and the pieces (local: within those rows) of the range."""
    if not shape:
        return 0, [Piece((), (), ())] if start < stop else []
    row = math.prod(shape[1:])
    first = start // row if row else 0
    return first, [Piece((o[0] - first, *o[1:]), o, s) for o, s in _boxes(tuple(shape), start, stop)]


def storage_pieces(tensor: torch.Tensor, spec: ShardSpec | None, experts: ExpertSpec | None):
    """(what this rank stores, the unsharded shape, its pieces) of a model tensor: a ZeRO-3 DTensor's
    local rows, placed within its tensor-parallel shard, or the tensor itself."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        full_shape, outer = tp_pieces(tuple(tensor.shape), spec, experts)
        chunks = tensor.__create_chunk_list__()  # where this dp rank's rows sit in the tp shard
        inner = [Piece((0,) * local.dim(), tuple(c.offsets), tuple(c.sizes)) for c in chunks if local.numel()]
        return local, full_shape, compose(outer, inner)
    full_shape, pieces = tp_pieces(tuple(tensor.shape), spec, experts)
    return tensor, full_shape, pieces


def checkpointable(local: torch.Tensor, full_shape: tuple[int, ...], pieces: list[Piece]) -> torch.Tensor:
    """A view of ``local`` that DCP saves and loads as ``pieces`` of a tensor of ``full_shape``."""
    view = local.detach().view_as(local)
    view.global_shape = tuple(full_shape)
    view.global_offsets = tuple(p.global_offset for p in pieces)
    view.local_offsets = tuple(p.local_offset for p in pieces)
    view.local_sizes = tuple(p.size for p in pieces)
    return view


def covered(pieces: list[Piece], chunks) -> bool:
    """Whether the saved ``chunks`` (DCP ``ChunkStorageMetadata``, not overlapping) hold all of ``pieces``."""
    for piece in pieces:
        found = 0
        for chunk in chunks:
            ends = zip(piece.global_offset, piece.size, chunk.offsets, chunk.sizes)
            found += math.prod(max(0, min(a + n, b + m) - max(a, b)) for a, n, b, m in ends)
        if found != piece.numel:
            return False
    return True


def staged_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` on CPU; a `checkpointable` view's copy saves as the same pieces."""
    copy = tensor.detach().to("cpu", copy=True)
    if hasattr(tensor, "global_shape"):
        for key in ("global_shape", "global_offsets", "local_offsets", "local_sizes"):
            setattr(copy, key, getattr(tensor, key))
    return copy


def unique_named(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """(all state-dict names, tensor) for every distinct tensor of the model, in state-dict order."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(groups.values())


def model_entries(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Every model tensor under each of its state-dict names, as the pieces this rank holds; the tied names."""
    entries, ties = {}, []
    for names, tensor in unique_named(model):
        view = checkpointable(*storage_pieces(tensor, shard_spec(tensor), expert_spec(tensor)))
        entries.update(dict.fromkeys(names, view))
        if len(names) > 1:
            ties.append(names)
    return entries, ties


def merged_names(per_rank: list[list[str]]) -> list[str]:
    """Every rank's state-dict names in one order: rank by rank, each name where it first appears (a
    pipeline's stages in turn), so that an export and a checkpoint of one model list its tensors alike."""
    return list(dict.fromkeys(name for names in per_rank for name in names))
