"""Sharded against unsharded: the one tolerance table, and the comparisons that apply it.

The tolerances are the README's fp32 ones, used by ``shardformer verify``, the conformance sweep and
the tests: outputs, activations and loss within ``ATOL`` / ``RTOL``; gradients, and weights after an
optimizer step, within ``GRAD_ATOL`` / ``GRAD_RTOL``. A value is within tolerance where
``|sharded - unsharded| <= atol + rtol * |unsharded|`` (``torch.isclose``: equal infinities match,
NaN never does).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from shardformer.core.comm import all_gather, gather_tensor, group_rank, group_size
from shardformer.core.shard_spec import ShardSpec, merge_shards, shard_spec

ATOL, RTOL = 1e-5, 1e-4  # outputs, activations and loss (fp32)
GRAD_ATOL, GRAD_RTOL = 1e-4, 1e-4  # gradients, and weights after an optimizer step (fp32)


def max_error(actual: torch.Tensor, expected: torch.Tensor, atol=ATOL, rtol=RTOL) -> tuple[float, bool]:
    """The largest ``|actual - expected|`` (inf when the shapes differ) and whether all is within tolerance."""
    a, b = actual.detach().double(), expected.detach().double()  # float64 runs compared in float64
    if a.shape != b.shape:
        return float("inf"), False
    err = torch.where(a == b, 0.0, (a - b).abs())
    worst = err.max().item() if err.numel() else 0.0
    return worst, bool(torch.isclose(a, b, rtol=rtol, atol=atol).all())


def _split_dim(local: torch.Size, full: torch.Size, world: int) -> int | None:
    """The one dimension a tp split cut (``local * world`` covers ``full``, padding allowed), or None."""
    if len(local) != len(full):
        return None
    dims = [d for d, (a, b) in enumerate(zip(local, full)) if a != b]
    if len(dims) == 1 and local[dims[0]] * world >= full[dims[0]] > local[dims[0]] * (world - 1):
        return dims[0]
    return None


def gather_like(local: torch.Tensor, full_shape: torch.Size, group, n_cast=1) -> torch.Tensor | None:
    """The full activation behind this rank's piece of it (None when the split cannot be told).

    Every rank of ``group`` must call it (an all-gather) unless ``local`` already has ``full_shape``.
    ``n_cast``: the fused blocks along the split dimension, or their sizes when they differ.
    """
    if local.shape == full_shape:
        return local
    world = group_size(group)
    dim = _split_dim(local.shape, full_shape, world)
    if dim is None:
        return None
    if isinstance(n_cast, ShardSpec):  # the layer's own layout (pieces replicated over ranks)
        spec = replace(n_cast, dim=dim, full_size=full_shape[dim], padded_size=full_shape[dim])
        return merge_shards(all_gather(local, group), spec)
    blocks = None if isinstance(n_cast, int) else tuple(n_cast)
    count = n_cast if blocks is None else len(blocks)
    spec = ShardSpec(dim, world, group_rank(group), full_shape[dim], local.shape[dim] * world, count, blocks)
    return merge_shards(all_gather(local, group), spec)


@dataclass
class ParamDiff:
    """One parameter (or its gradient) of the sharded model, gathered, against the unsharded one's."""

    name: str
    error: float  # largest |difference|; inf when only one model has it
    ok: bool
    only_in: str | None = None  # "sharded" or "unsharded": the one model that has it


def compare_params(
    ref: nn.Module, sharded: nn.Module, group, grads: bool, atol=GRAD_ATOL, rtol=GRAD_RTOL
) -> list[ParamDiff]:
    """Every parameter of ``sharded`` (``grads``: its gradient), gathered over ``group`` by its
    ``shard_spec``, against ``ref``'s of the same name, in ``sharded``'s order. Gradients that
    neither model has are left out. Every rank of ``group`` must call it (the gathers)."""
    full = dict(ref.named_parameters())
    diffs = []
    for name, p in sharded.named_parameters():
        r = full.get(name)
        if r is None:
            diffs.append(ParamDiff(name, float("inf"), False, "sharded"))
            continue
        t, rt = (p.grad, r.grad) if grads else (p, r)
        if t is None and rt is None:
            continue
        if t is None or rt is None:
            diffs.append(ParamDiff(name, float("inf"), False, "unsharded" if t is None else "sharded"))
            continue
        spec = shard_spec(p)
        t = t.detach() if spec is None else gather_tensor(t.detach().contiguous(), spec, group)
        diffs.append(ParamDiff(name, *max_error(t, rt, atol, rtol)))
    return diffs


def gradient_failures(
    ref: nn.Module, sharded: nn.Module, group, scale_rtol: float, floor_rtol: float, tighter: float = 1.0
) -> list[str]:
    """What differs among the gradients of ``sharded`` (gathered over ``group``) and ``ref``'s, each within
    ``scale_rtol`` of its own largest entry plus ``floor_rtol`` of the model's largest (a proof's tolerance:
    a tiny copy's small gradients, a per-head scale before a near-uniform softmax, would hide a missing
    rank's part inside an absolute one; gradients zero in exact arithmetic, a key bias, are rounding only;
    ``tighter`` scales the elementwise tolerances too). Every rank of ``group`` must call it."""
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    largest = max((g.abs().max().item() for g in ref_grads.values() if g is not None and g.numel()), default=0.0)
    failures = []
    for diff in compare_params(ref, sharded, group, grads=True, atol=GRAD_ATOL * tighter, rtol=GRAD_RTOL * tighter):
        scale = ref_grads[diff.name].abs().max().item() if ref_grads.get(diff.name) is not None else 0.0
        if diff.only_in is not None or not diff.ok or diff.error > scale_rtol * scale + floor_rtol * largest:
            failures.append(f"gradient of {diff.name} differs" + ("" if diff.only_in else f" by {diff.error:.2e}"))
    return failures


def call_on_own_inputs(model, inputs: dict):
    """``model`` run on its own clone of each tensor of ``inputs`` (timm models take their images, ``x``,
    positionally): a copy of the model that writes into its inputs (FSMT's ``shift_tokens_right`` fills the
    caller's ids in place) cannot change what the other copy reads."""
    given = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
    return model(given.pop("x"), **given) if "x" in given else model(**given)
