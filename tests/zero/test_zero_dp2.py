"""ZeroOptimizer at dp=2 against one process running the wrapped optimizer on the whole batch.

All checks share one spawn of 2 gloo ranks (see CheckTable); each is reported as its own test.
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from shardformer.core.comm import CollectiveCounter
from shardformer.data_parallel import DynamicLossScaler, ZeroOptimizer
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


def weights_match_for_every_optimizer_and_stage():
    runs = []
    # On gloo, reduce-scatter and all-gather are built from per-rank reduce/broadcast; native=True
    # runs torch's own collectives instead (what NCCL uses).
    for stage, native in ((1, False), (2, False), (2, True)):
        for name, make_opt in OPTIMIZERS.items():
            model, _, _ = zero_run(make_opt, stage=stage, native_collectives=native)
            assert_same_on_all_ranks(model)
            runs.append((f"stage {stage} native={native} {name}", model, reference_run(make_opt)[0]))
    for what, model, ref in runs:
        assert_same_weights(model, ref, what=what)


def clipping_matches_torch_clip_grad_norm():
    make_opt = OPTIMIZERS["adamw"]
    ref, _, ref_norms = reference_run(make_opt, clip=0.05)
    # ZeRO-2 as the engine runs it: gradients released into small buckets, with and without overlap
    options = {
        "stage 1": {"stage": 1},
        "stage 2": {"stage": 2},
        "stage 2 release_grads": {"stage": 2, "release_grads": True, "bucket_size": 64},
        "stage 2 release_grads, no overlap": {
            "stage": 2, "release_grads": True, "bucket_size": 64, "overlap_communication": False,
        },
    }  # fmt: skip
    runs = [zero_run(make_opt, clip=0.05, **kw) for kw in options.values()]
    assert min(ref_norms) > 0.05, "the clip must be active for this check to mean anything"
    for stage, (model, _, norms) in zip(options, runs):
        assert_same_weights(model, ref, what=stage)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), atol=1e-5, rtol=1e-4)


def accumulation_of_four_micro_steps_equals_one_big_batch():
    make_opt = OPTIMIZERS["adam"]
    ref = reference_run(make_opt)[0]
    runs = {
        "stage 1 without overlap": accumulate_run(make_opt, stage=1, overlap_communication=False)[0],
        "stage 2 overlap": accumulate_run(make_opt, stage=2, bucket_size=64)[0],
        "stage 1 overlap": accumulate_run(make_opt, stage=1, bucket_size=64)[0],
        "stage 1 overlap, backwards_per_step=4": accumulate_run(
            make_opt, stage=1, bucket_size=64, no_sync=False, backwards_per_step=4
        )[0],
        "stage 2 overlap, backwards_per_step=4, release_grads": accumulate_run(
            make_opt, stage=2, bucket_size=64, no_sync=False, backwards_per_step=4, release_grads=True
        )[0],
    }
    # Backward passes nobody announced: the buckets sent during the first are stale, so every bucket
    # is reduced again at step(): still exact, with a warning that says how to avoid the waste.
    with pytest.warns(UserWarning, match="reduced again at step"):
        runs["stage 2 overlap, unannounced micro-steps"] = accumulate_run(
            make_opt, stage=2, bucket_size=64, no_sync=False
        )[0]
    for what, model in runs.items():
        assert_same_weights(model, ref, what=what)


def no_communication_until_the_last_micro_step():
    counted = {}
    for how in ("no_sync", "backwards_per_step"):
        model = Net()
        zero = ZeroOptimizer(
            OPTIMIZERS["sgd"](model.parameters()),
            stage=2,
            bucket_size=64,
            backwards_per_step=4 if how == "backwards_per_step" else 1,
        )
        with CollectiveCounter() as counter:  # the constructor's consistency check is not part of a step
            x, y = batch(0)
            for _ in range(3):
                with zero.no_sync() if how == "no_sync" else contextlib.nullcontext():
                    zero.backward(loss_of(model, x[:2], y[:2]))
            during_micro_steps = [op for op, _, _ in counter.calls]
            zero.backward(loss_of(model, x[:2], y[:2]))
            counted[how] = (during_micro_steps, len(counter.calls) - len(during_micro_steps), len(zero.buckets))
        zero.step()
    for how, (during_micro_steps, during_last_backward, buckets) in counted.items():
        assert during_micro_steps == [], f"{how}: collectives during the micro-steps: {during_micro_steps}"
        assert during_last_backward == buckets > 1, f"{how}: each bucket is sent during the last backward"


def extra_backward_with_released_grads_is_a_clear_error():
    model = Net()
    zero = ZeroOptimizer(OPTIMIZERS["sgd"](model.parameters()), stage=2, release_grads=True)
    x, y = batch(0)
    zero.backward(loss_of(model, x[:2], y[:2]))
    with pytest.raises(RuntimeError, match="no_sync.*backwards_per_step"):
        zero.backward(loss_of(model, x[:2], y[:2]))
    zero.zero_grad()  # waits for the bucket in flight, so both ranks leave in step
    zero.backward(loss_of(model, x[:2], y[:2]))
    zero.clip_grad_norm(1.0)
    with pytest.raises(RuntimeError, match="clip_grad_norm, grad_norm or sync_grads ran already"):
        zero.backward(loss_of(model, x[:2], y[:2]))
    zero.zero_grad()


def skipped_layer_is_not_updated_and_matches_reference():
    skip_at = (0, 3, 4, 8)
    make_opt = OPTIMIZERS["adamw"]  # weight decay: a param without grad must not even decay
    ref = reference_run(make_opt, skip_at=skip_at)[0]
    runs = [
        zero_run(make_opt, stage=1, skip_at=skip_at)[0],
        zero_run(make_opt, stage=2, skip_at=skip_at, overlap_communication=True, bucket_size=64)[0],
    ]
    for model in runs:
        assert_same_weights(model, ref)
    untouched = reference_run(make_opt, steps=1, skip_at=(0,))[0]
    model = zero_run(make_opt, stage=2, steps=1, skip_at=(0,))[0]
    assert torch.equal(model.skippable.weight, untouched.skippable.weight)
    assert torch.equal(model.skippable.weight, Net().skippable.weight)


def layer_skipped_on_one_rank_only_gets_the_averaged_gradient():
    """Rank 1 skips the layer, rank 0 uses it: no hang; equal to the same mixed batch in one process."""
    make_opt = OPTIMIZERS["adam"]
    rank = dist.get_rank()
    model, ref = Net(), Net()
    zero = ZeroOptimizer(make_opt(model.parameters()), stage=2, overlap_communication=True, bucket_size=64)
    ref_opt = make_opt(ref.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        zero.backward(loss_of(model, local_rows(x, rank, 2), local_rows(y, rank, 2), use_skippable=rank == 0))
        zero.step()
        zero.zero_grad()
        out = torch.cat([ref(local_rows(x, 0, 2)), ref(local_rows(x, 1, 2), use_skippable=False)])
        torch.nn.functional.mse_loss(out, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_on_all_ranks(model)
    assert_same_weights(model, ref)


def fp16_overflow_on_one_rank_skips_the_step_everywhere():
    make_opt, skipped = OPTIMIZERS["adam"], 3
    results = []
    for stage in (1, 2):
        model = Net(torch.float16)
        zero = ZeroOptimizer(make_opt(model.parameters()), stage=stage, loss_scaler=DynamicLossScaler(1024.0))
        for step in range(STEPS):
            x, y = batch(step)
            poison = step == skipped and dist.get_rank() == 1
            with poisoned_grad(model.fc2.weight, (0, 0), float("inf")) if poison else contextlib.nullcontext():
                zero.backward(loss_of(model, local_rows(x, dist.get_rank(), 2), local_rows(y, dist.get_rank(), 2)))
            before = [p.detach().clone() for p in model.parameters()]
            zero.step()
            zero.zero_grad()
            if step == skipped:
                results.append(
                    (zero.last_step_skipped, zero.loss_scale, before, [p.detach().clone() for p in model.parameters()])
                )
        results.append(model)
    ref = mixed_reference(make_opt, torch.float16, 2, scale=1024.0, skipped_step=skipped)[0]
    for skipped_flag, scale, before, after in results[0::2]:
        assert skipped_flag and scale == 512.0
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step changed the weights"
    for model in results[1::2]:
        assert model.fc1.weight.dtype == torch.float16
        assert_same_weights(model, ref, atol=1e-3, rtol=1e-3, what="fp16")


def bf16_matches_mixed_precision_reference():
    make_opt = OPTIMIZERS["adamw"]
    model = Net(torch.bfloat16)
    zero = ZeroOptimizer(make_opt(model.parameters()), stage=2, overlap_communication=True, bucket_size=64)
    assert zero.loss_scaler is None and all(s.master.dtype == torch.float32 for s in zero.slots)
    zero_run(make_opt, model=model, zero=zero)
    # fp32 params, gradients summed in bf16: half the traffic, bf16-close to the reference.
    summed_in_bf16 = zero_run(OPTIMIZERS["sgd"], stage=1, reduce_dtype=torch.bfloat16)[0]
    ref, ref_master = mixed_reference(make_opt, torch.bfloat16, 2, scale=1.0)
    assert_same_weights(model, ref, atol=1e-2, rtol=1e-2, what="bf16")
    assert_same_weights(summed_in_bf16, reference_run(OPTIMIZERS["sgd"])[0], atol=1e-3, rtol=1e-2, what="bf16 sum")
    full_masters = zero.full_state_dict()["zero"]["master_params"]
    for i, p in enumerate(ref_master.parameters()):
        torch.testing.assert_close(full_masters[i], p, atol=1e-5, rtol=1e-4)


def grads_are_readable_after_backward():
    make_opt = OPTIMIZERS["sgd"]
    rank = dist.get_rank()
    x, y = batch(0)
    ref = Net()
    loss_of(ref, x, y).backward()
    local = Net()
    loss_of(local, local_rows(x, rank, 2), local_rows(y, rank, 2)).backward()
    seen = {}
    for stage, release in ((1, False), (2, False), (2, True)):
        model = Net()
        zero = ZeroOptimizer(
            make_opt(model.parameters()), stage=stage, overlap_communication=True, release_grads=release
        )
        zero.backward(loss_of(model, local_rows(x, rank, 2), local_rows(y, rank, 2)))
        after_backward = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        zero.sync_grads()
        seen[(stage, release)] = (after_backward, {n: p.grad for n, p in model.named_parameters()})
        zero.step()
    ref_grads, local_grads = dict(ref.named_parameters()), dict(local.named_parameters())
    for name in ref_grads:
        for key in ((1, False), (2, False)):
            torch.testing.assert_close(seen[key][0][name], local_grads[name].grad)  # backward: this rank's
        torch.testing.assert_close(seen[(1, False)][1][name], ref_grads[name].grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(seen[(2, False)][1][name], local_grads[name].grad)
        assert seen[(2, True)][0][name] is None, "release_grads frees param.grad once bucketed"


def zero2_holds_only_its_rows_after_backward():
    """Bytes of ``param.grad`` and of the reduction's buffers, read from the real tensors: after backward
    ZeRO-1 holds the full gradient and full-size fp32 buckets, ZeRO-2 (release_grads, as the engine runs
    it) only this rank's 1/dp rows; during backward at most two buckets are in flight."""
    torch.manual_seed(5)
    width, layers = 64, 10
    x = torch.randn(8, width)
    make = lambda: torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])  # noqa: E731
    numels = [p.numel() for p in make().parameters()]
    n, rows = sum(numels), sum(-(-k // 2) for k in numels)
    bucket = width * width + width  # elements, both dp rows together: one layer per bucket
    held, largest_in_backward = {}, {}
    for what, kw in {
        "ZeRO-1": {"stage": 1},
        "ZeRO-2": {"stage": 2, "release_grads": True},
        "ZeRO-2 no overlap": {"stage": 2, "release_grads": True, "overlap_communication": False},
    }.items():
        model = make()
        zero = ZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), stage=kw.pop("stage"), bucket_size=bucket, **kw
        )
        assert len(zero.buckets) == layers
        seen = []
        for p in model.parameters():  # after the optimizer's own hook: what the rank holds as backward goes on
            p.register_post_accumulate_grad_hook(
                lambda _, seen=seen, zero=zero: seen.append(zero.gradient_bytes()["gradient buffers"])
            )
        zero.backward(model(x).square().mean())
        held[what] = zero.gradient_bytes()
        largest_in_backward[what] = max(seen)
        zero.step()
    assert held["ZeRO-1"] == {"gradients": 4 * n, "gradient buffers": 4 * 2 * rows}, held
    assert held["ZeRO-2"] == {"gradients": 0, "gradient buffers": 4 * rows}, held
    # without overlap nothing is reduced during backward: the gradients wait in param.grad
    assert held["ZeRO-2 no overlap"] == {"gradients": 4 * n, "gradient buffers": 0}, held
    for what in held:
        assert sum(held[what].values()) <= sum(held["ZeRO-1"].values())
    assert sum(held["ZeRO-2"].values()) < sum(held["ZeRO-1"].values()) / 2
    # the bucket filling, two in flight and the rows reduced so far: never every bucket at once
    assert largest_in_backward["ZeRO-2"] <= 4 * (3 * bucket + rows) < 4 * 2 * rows, largest_in_backward
    return held


def state_dict_round_trip_and_full_state_match_the_plain_optimizer():
    make_opt = OPTIMIZERS["adam"]
    _, ref_opt5, _ = reference_run(make_opt, steps=5)
    ref10 = reference_run(make_opt)[0]
    model, zero, _ = zero_run(make_opt, steps=5, stage=2)
    sharded, full = zero.state_dict(), zero.full_state_dict()
    resumed = {}
    for how in ("sharded", "full"):
        m = copy.deepcopy(model)
        z = ZeroOptimizer(make_opt(m.parameters()), stage=2)
        z.load_state_dict(sharded) if how == "sharded" else z.load_full_state_dict(full)
        resumed[how] = zero_run(make_opt, model=m, zero=z, first_step=5, steps=5)[0]
    # The full state is a plain torch state: a plain optimizer on the whole model continues from it.
    resumed["plain optimizer"] = reference_run(make_opt, steps=5, first_step=5, start=model, state=copy.deepcopy(full))[
        0
    ]
    wrong = copy.deepcopy(sharded)
    wrong["zero"]["dp_size"] = 4
    with pytest.raises(ValueError, match=r"saved by dp rank \d of 4, but this is dp rank \d of 2"):
        ZeroOptimizer(make_opt(Net().parameters())).load_state_dict(wrong)
    with pytest.raises(ValueError, match=r"load_full_state_dict"):
        ZeroOptimizer(make_opt(Net().parameters())).load_state_dict(ref_opt5.state_dict())

    expected = ref_opt5.state_dict()
    assert full["param_groups"] == expected["param_groups"]
    assert full["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(full["state"][index][key], value, atol=1e-6, rtol=1e-4)
    for how, m in resumed.items():
        assert_same_weights(m, ref10, what=f"resumed from {how}")


def optimizer_state_per_rank_is_one_over_dp():
    return state_bytes_check(dp=2)


def lr_scheduler_drives_the_wrapper():
    make_opt = OPTIMIZERS["adamw"]
    schedule = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref = reference_run(make_opt, schedule=schedule)[0]
    model = Net()
    zero = ZeroOptimizer(make_opt(model.parameters()), stage=2)
    sched = schedule(zero)
    for step in range(STEPS):
        x, y = batch(step)
        zero.backward(loss_of(model, local_rows(x, dist.get_rank(), 2), local_rows(y, dist.get_rank(), 2)))
        zero.step()
        zero.zero_grad()
        sched.step()
    assert zero.optim.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert_same_weights(model, ref)
    # after loading a state the scheduler must still reach the wrapped optimizer
    zero.load_state_dict(zero.state_dict())
    for _ in range(3):
        sched.step()
    assert zero.optim.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**4)


def gradients_edited_after_backward_are_refused_on_every_rank_before_the_step():
    """With overlap the buckets are reduced during backward: a later edit (torch's clip_grad_norm_, an
    in-place op on one rank, a new .grad) would be ignored, so step() raises everywhere first."""
    rank = dist.get_rank()
    x, y = batch(0)
    edits = {
        "fc2.weight": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3),
        "out.bias": lambda m: m.out.bias.grad.mul_(2.0) if rank == 1 else None,
        "gain": lambda m: setattr(m.gain, "grad", torch.zeros_like(m.gain)) if rank == 0 else None,
    }
    for stage in (1, 2):
        for name, edit in edits.items():
            model = Net()
            zero = ZeroOptimizer(OPTIMIZERS["sgd"](model.parameters()), stage=stage, model=model)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            zero.backward(loss_of(model, local_rows(x, rank, 2), local_rows(y, rank, 2)))
            edit(model)
            edited_here = name in ("fc2.weight",) or (name == "out.bias") == (rank == 1)
            expected = r"the gradient of \S+ was changed after backward" if edited_here else "another data-parallel"
            with pytest.raises(RuntimeError, match=expected):
                zero.step()
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), before[n]), f"stage {stage} {name}: {n} changed in a refused step"
            zero.zero_grad()  # the optimizer is usable again
            zero.backward(loss_of(model, local_rows(x, rank, 2), local_rows(y, rank, 2)))
            zero.step()
    # without overlap param.grad is reduced as it is at step(): the edit counts, nothing is refused
    model = Net()
    zero = ZeroOptimizer(OPTIMIZERS["sgd"](model.parameters()), overlap_communication=False)
    zero.backward(loss_of(model, local_rows(x, rank, 2), local_rows(y, rank, 2)))
    edits["fc2.weight"](model)
    zero.step()
    # two parameters read through one cat: autograd gives each a slice of one gradient buffer, so adding
    # into one moves the other's version counter; not an edit (BEiT's q_bias and v_bias)
    pair = [torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    ref = [p.detach().clone().requires_grad_() for p in pair]
    zero, plain = ZeroOptimizer(torch.optim.SGD(pair, lr=0.1), backwards_per_step=2), torch.optim.SGD(ref, lr=0.1)
    for _ in range(2):
        zero.backward(torch.cat(pair).mul(torch.arange(8.0)).square().sum())
        torch.cat(ref).mul(torch.arange(8.0)).square().sum().backward()
    zero.step()
    plain.step()
    for got, expected in zip(pair, ref, strict=True):
        torch.testing.assert_close(got.detach(), expected.detach(), atol=1e-6, rtol=1e-5)


def errors_name_the_value_and_the_fix():
    model = Net()
    with pytest.raises(ValueError, match=r"stage=3 is not supported; use stage=1"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    with pytest.raises(ValueError, match=r"backwards_per_step=0 must be a positive integer: the number of backward"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backwards_per_step=0)
    with pytest.raises(ValueError, match=r"release_grads=True needs stage=2"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=1, release_grads=True)
    with pytest.raises(
        ValueError, match=r"2 trainable parameters of the model are not in the optimizer: out.weight, out.bias"
    ):
        ZeroOptimizer(torch.optim.SGD(list(model.parameters())[:-2], lr=0.1), model=model)
    stepped = torch.optim.Adam(model.parameters())
    loss_of(model, *batch(0)).backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"wrap it before its first step"):
        ZeroOptimizer(stepped)
    with pytest.raises(TypeError, match=r"wraps a torch.optim.Optimizer"):
        ZeroOptimizer(model.parameters())
    # A disagreement between ranks fails on every rank, naming the field, instead of hanging.
    with pytest.raises(ValueError, match=r"disagree on bucket_size \(100 vs 101\)"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_size=100 + dist.get_rank())


test_dp2 = check_table(
    [
        weights_match_for_every_optimizer_and_stage,
        clipping_matches_torch_clip_grad_norm,
        accumulation_of_four_micro_steps_equals_one_big_batch,
        no_communication_until_the_last_micro_step,
        extra_backward_with_released_grads_is_a_clear_error,
        skipped_layer_is_not_updated_and_matches_reference,
        layer_skipped_on_one_rank_only_gets_the_averaged_gradient,
        fp16_overflow_on_one_rank_skips_the_step_everywhere,
        bf16_matches_mixed_precision_reference,
        grads_are_readable_after_backward,
        zero2_holds_only_its_rows_after_backward,
        state_dict_round_trip_and_full_state_match_the_plain_optimizer,
        optimizer_state_per_rank_is_one_over_dp,
        lr_scheduler_drives_the_wrapper,
        errors_name_the_value_and_the_fix,
        gradients_edited_after_backward_are_refused_on_every_rank_before_the_step,
    ],
    2,
)
