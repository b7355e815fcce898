"""ZeroOptimizer at dp=4, resharding between dp=2 and dp=4, and the grad norm under tp x dp and tp x pp.

One spawn of 4 gloo ranks runs every check. ``ProcessMesh(tp_size=2)`` over the 4 ranks gives
dp groups of 2 ([0, 2] and [1, 3]), so a dp=2 world and a dp=4 world live in the same spawn.
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from shardformer.core.mesh import ProcessMesh
from shardformer.data_parallel import DynamicLossScaler, ZeroOptimizer
from shardformer.tensor_parallel.slicer import make_shard_param, make_spec, slice_tensor
from tests.helpers import check_table
from tests.zero.common import (
    OPTIMIZERS,
    STEPS,
    Net,
    accumulate_run,
    assert_same_on_all_ranks,
    assert_same_weights,
    batch,
    local_rows,
    loss_of,
    mixed_reference,
    poisoned_grad,
    reference_run,
    state_bytes_check,
    zero_run,
)


def weights_match_for_both_stages_and_optimizers():
    # dp=2 covers every (stage, optimizer) pair; here a spread of them, with and without overlap.
    runs = []
    configs = ((1, "adam", False, False), (2, "adamw", True, False), (2, "sgd", False, True), (1, "sgd", True, True))
    for stage, name, overlap, native in configs:
        make_opt = OPTIMIZERS[name]
        # native: torch's own reduce-scatter / all-gather on gloo
        kw = {"overlap_communication": overlap, "bucket_size": 64, "native_collectives": native}
        model = zero_run(make_opt, stage=stage, **kw)[0]
        runs.append((f"stage {stage} {name} overlap={overlap} native={native}", model, reference_run(make_opt)[0]))
    assert_same_on_all_ranks(runs[1][1])
    for what, model, ref in runs:
        assert_same_weights(model, ref, what=what)


def clipping_accumulation_and_skipped_layer():
    make_opt = OPTIMIZERS["adamw"]
    clipped = zero_run(make_opt, stage=2, clip=0.05)
    ref_clipped, _, ref_norms = reference_run(make_opt, clip=0.05)
    accumulated = accumulate_run(make_opt, stage=1, overlap_communication=True, bucket_size=64)[0]
    skip_at = (1, 2, 7)
    skipped = zero_run(make_opt, stage=2, skip_at=skip_at, overlap_communication=True, bucket_size=64)[0]

    assert_same_weights(clipped[0], ref_clipped, what="clipped")
    torch.testing.assert_close(torch.tensor(clipped[2]), torch.tensor(ref_norms), atol=1e-5, rtol=1e-4)
    assert_same_weights(accumulated, reference_run(make_opt)[0], what="accumulated")
    assert_same_weights(skipped, reference_run(make_opt, skip_at=skip_at)[0], what="skipped layer")


def fp16_overflow_on_the_last_rank_skips_the_step_everywhere():
    make_opt, skipped, rank = OPTIMIZERS["sgd"], 4, dist.get_rank()
    model = Net(torch.float16)
    zero = ZeroOptimizer(make_opt(model.parameters()), stage=2, loss_scaler=DynamicLossScaler(1024.0))
    flags = []
    for step in range(STEPS):
        x, y = batch(step)
        poison = step == skipped and rank == 3
        with poisoned_grad(model.out.bias, 1, float("nan")) if poison else contextlib.nullcontext():
            zero.backward(loss_of(model, local_rows(x, rank, 4), local_rows(y, rank, 4)))
        zero.step()
        zero.zero_grad()
        flags.append(zero.last_step_skipped)
    ref = mixed_reference(make_opt, torch.float16, 4, scale=1024.0, skipped_step=skipped)[0]
    assert flags == [step == skipped for step in range(STEPS)], flags
    assert zero.loss_scale == 512.0
    assert_same_weights(model, ref, atol=1e-3, rtol=1e-3, what="fp16")


def resharding_between_dp2_and_dp4():
    """Save the full state at one dp size and continue at the other; equal to 10 plain steps."""
    mesh = ProcessMesh(tp_size=2)  # dp groups of 2; both tp "copies" train the same thing
    dp2 = mesh.dp_group
    results = {}
    for name, stage in (("adam", 2), ("sgd", 1)):
        make_opt = OPTIMIZERS[name]
        # dp=2 -> dp=4
        model, zero, _ = zero_run(make_opt, group=dp2, steps=5, stage=stage)
        full = zero.full_state_dict()
        wide = copy.deepcopy(model)
        wide_zero = ZeroOptimizer(make_opt(wide.parameters()), stage=stage)
        wide_zero.load_full_state_dict(full)
        zero_run(make_opt, model=wide, zero=wide_zero, first_step=5, steps=5)
        # dp=4 -> dp=2
        model, zero, _ = zero_run(make_opt, steps=5, stage=stage)
        full, sharded = zero.full_state_dict(), zero.state_dict()
        narrow = copy.deepcopy(model)
        narrow_zero = ZeroOptimizer(make_opt(narrow.parameters()), dp_group=dp2, stage=3 - stage)
        narrow_zero.load_full_state_dict(full)
        zero_run(make_opt, group=dp2, model=narrow, zero=narrow_zero, first_step=5, steps=5)
        results[name] = (wide, narrow, reference_run(make_opt)[0])
    with pytest.raises(ValueError, match=r"saved by dp rank \d of 4, but this is dp rank \d of 2"):
        narrow_zero.load_state_dict(sharded)
    for name, (wide, narrow, ref) in results.items():
        assert_same_weights(wide, ref, what=f"{name} dp=2 -> dp=4")
        assert_same_weights(narrow, ref, what=f"{name} dp=4 -> dp=2")


def _full_tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"col": (8, 6), "row": (6, 8), "qkv": (12, 4), "vocab": (10, 4), "bias": (6,), "ln": (8,)}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


# How each fake tensor-parallel param is cut (None: replicated over tp).
CUTS = {"col": (0, 1, None), "row": (1, 1, None), "qkv": (0, 3, None), "vocab": (0, 1, 4), "bias": None, "ln": None}


def _tp_params(weights, tp_rank, tp_size):
    params = {}
    for name, full in weights.items():
        if CUTS[name] is None:
            params[name] = torch.nn.Parameter(full.clone())
        else:
            dim, n_cast, pad = CUTS[name]
            params[name] = make_shard_param(full, make_spec(full.shape, dim, tp_rank, tp_size, n_cast, pad))
    return params


def _set_grads(params, grads):
    for name, p in params.items():
        spec = getattr(p, "shard_spec", None)
        p.grad = grads[name].clone() if spec is None else slice_tensor(grads[name], spec)


def grad_norm_under_tp2_x_dp2_equals_the_full_model_norm():
    mesh = ProcessMesh(tp_size=2)
    weights = _full_tensors(0)
    per_dp_grads = [_full_tensors(100 + d) for d in range(mesh.dp_size)]
    mean_grads = {n: sum(g[n] for g in per_dp_grads) / mesh.dp_size for n in weights}

    params = _tp_params(weights, mesh.tp_rank, mesh.tp_size)
    zero = ZeroOptimizer(torch.optim.SGD(params.values(), lr=1.0), mesh.dp_group, stage=2, tp_group=mesh.tp_group)
    _set_grads(params, per_dp_grads[mesh.dp_rank])
    norm = zero.clip_grad_norm(1.0)
    zero.step()

    ref = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    for n, p in ref.items():
        p.grad = mean_grads[n].clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.values(), 1.0)
    torch.optim.SGD(ref.values(), lr=1.0).step()
    assert ref_norm > 1.0
    torch.testing.assert_close(torch.tensor(norm, dtype=torch.float64), ref_norm.double(), atol=1e-5, rtol=1e-5)
    expected = _tp_params({n: p.detach() for n, p in ref.items()}, mesh.tp_rank, mesh.tp_size)
    for name, p in params.items():
        torch.testing.assert_close(p.detach(), expected[name].detach(), atol=1e-6, rtol=1e-5, msg=name)


def grad_norm_and_overflow_under_tp2_x_pp2():
    mesh = ProcessMesh(tp_size=2, pp_size=2)  # dp = 1
    weights, grads = _full_tensors(1), _full_tensors(2)
    stage_names = [("col", "qkv", "bias"), ("row", "vocab", "ln")][mesh.pp_rank]
    params = _tp_params({n: weights[n] for n in stage_names}, mesh.tp_rank, mesh.tp_size)
    zero = ZeroOptimizer(
        torch.optim.SGD(params.values(), lr=0.1), mesh.dp_group, tp_group=mesh.tp_group, pp_group=mesh.pp_group
    )
    _set_grads(params, grads)
    norm, found_inf = zero.grad_norm()
    zero.zero_grad()
    _set_grads(params, grads)
    if mesh.rank == 3:
        next(iter(params.values())).grad.view(-1)[0] = float("inf")
    _, found_inf_after = zero.grad_norm()
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
    torch.testing.assert_close(torch.tensor(norm, dtype=torch.float64), expected.double(), atol=1e-5, rtol=1e-5)
    assert not found_inf and found_inf_after, "an inf on one rank is seen by every tp/pp rank"


def optimizer_state_per_rank_is_one_over_dp():
    return state_bytes_check(dp=4)


test_dp4 = check_table(
    [
        weights_match_for_both_stages_and_optimizers,
        clipping_accumulation_and_skipped_layer,
        fp16_overflow_on_the_last_rank_skips_the_step_everywhere,
        resharding_between_dp2_and_dp4,
        grad_norm_under_tp2_x_dp2_equals_the_full_model_norm,
        grad_norm_and_overflow_under_tp2_x_pp2,
        optimizer_state_per_rank_is_one_over_dp,
    ],
    4,
)
