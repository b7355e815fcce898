"""Shared pieces of the ZeRO tests: a small model, per-step data, the single-process reference.

Every rank builds the same model from one seed and the same global batch for each step; rank r
trains on rows ``[r*B, (r+1)*B)`` with ZeroOptimizer, and computes the reference locally too: the
plain optimizer on the full model and the whole batch. Results must be equal.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

from shardformer.data_parallel import ZeroOptimizer

ATOL, RTOL = 1e-5, 1e-4
GLOBAL_BATCH = 16  # 8 rows per rank at dp=2, 4 at dp=4: enough for 4 micro-steps
STEPS = 10


class Net(nn.Module):
    """Odd sizes (nothing divides by dp: every param is padded), a 0-dim param, a skippable layer."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(1234)
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 11)
        self.skippable = nn.Linear(11, 11)
        self.out = nn.Linear(11, 3)
        self.gain = nn.Parameter(torch.tensor(1.25))
        self.to(dtype)

    def forward(self, x, use_skippable=True):
        h = torch.tanh(self.norm(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        if use_skippable:
            h = h + torch.tanh(self.skippable(h))
        return self.out(h) * self.gain


def batch(step: int, rows: int = GLOBAL_BATCH):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 7, generator=gen), torch.randn(rows, 3, generator=gen)


def local_rows(tensor, rank: int, world: int):
    per = tensor.shape[0] // world
    return tensor[rank * per : (rank + 1) * per]


def loss_of(model, x, y, **kw):
    out = model(x.to(next(model.parameters()).dtype), **kw)
    return torch.nn.functional.mse_loss(out.float(), y)


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=5e-2, momentum=0.9, weight_decay=1e-3),
}


def reference_run(make_opt, steps=STEPS, clip=None, skip_at=(), start=None, schedule=None, first_step=0, state=None):
    """The plain optimizer on the full model and the full batch; returns (model, optimizer, norms).

    ``start``/``state``/``first_step`` continue from a given model, optimizer state and step.
    """
    model = Net() if start is None else copy.deepcopy(start)
    opt = make_opt(model.parameters())
    if state is not None:
        opt.load_state_dict(state)
    sched = schedule(opt) if schedule else None
    norms = []
    for step in range(first_step, first_step + steps):
        x, y = batch(step)
        loss_of(model, x, y, use_skippable=step not in skip_at).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return model, opt, norms


def zero_run(make_opt, group=None, steps=STEPS, clip=None, skip_at=(), first_step=0, model=None, zero=None, **kw):
    """ZeroOptimizer over ``group`` on this rank's rows; returns (model, zero optimizer, norms)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = Net() if model is None else model
    zero = zero or ZeroOptimizer(make_opt(model.parameters()), dp_group=group, **kw)
    norms = []
    for step in range(first_step, first_step + steps):
        x, y = batch(step)
        zero.backward(
            loss_of(model, local_rows(x, rank, world), local_rows(y, rank, world), use_skippable=step not in skip_at)
        )
        if clip is not None:
            norms.append(zero.clip_grad_norm(clip))
        zero.step()
        zero.zero_grad()
    return model, zero, norms


def accumulate_run(make_opt, group=None, micro=4, steps=STEPS, no_sync=True, **kw):
    """ZeroOptimizer with ``micro`` accumulation micro-steps per step (mean loss / micro each), all
    but the last inside ``no_sync()`` unless ``no_sync=False``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = Net()
    zero = ZeroOptimizer(make_opt(model.parameters()), dp_group=group, **kw)
    for step in range(steps):
        x, y = batch(step)
        xs, ys = local_rows(x, rank, world).chunk(micro), local_rows(y, rank, world).chunk(micro)
        for i in range(micro):
            ctx = zero.no_sync() if no_sync and i < micro - 1 else contextlib.nullcontext()
            with ctx:
                zero.backward(loss_of(model, xs[i], ys[i]) / micro)
        zero.step()
        zero.zero_grad()
    return model, zero


@contextlib.contextmanager
def poisoned_grad(param, index, value):
    """Backward inside writes ``value`` at ``index`` of ``param``'s gradient. A tensor hook, because
    with overlap the optimizer copies each gradient as soon as autograd finishes it."""

    def poison(grad):
        grad = grad.clone()
        grad[index] = value
        return grad

    handle = param.register_hook(poison)
    try:
        yield
    finally:
        handle.remove()


def mixed_reference(make_opt, dtype, world, steps=STEPS, scale=1024.0, skipped_step=None):
    """Single-process mixed precision, as ZeRO does it: per-rank half-precision grads of the scaled
    loss, summed in fp32 and unscaled into fp32 master weights; ``skipped_step`` is not applied."""
    model, master = Net(dtype), Net()
    with torch.no_grad():
        for p32, p16 in zip(master.parameters(), model.parameters()):
            p32.copy_(p16.float())
    opt = make_opt(master.parameters())
    for step in range(steps):
        x, y = batch(step)
        sums = [torch.zeros_like(p) for p in master.parameters()]
        for r in range(world):
            model.zero_grad()
            (loss_of(model, local_rows(x, r, world), local_rows(y, r, world)) * scale).backward()
            for acc, p in zip(sums, model.parameters()):
                acc += p.grad.float()
        if step == skipped_step:
            scale /= 2
            continue
        for p32, acc in zip(master.parameters(), sums):
            p32.grad = acc / (world * scale)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p32, p16 in zip(master.parameters(), model.parameters()):
                p16.copy_(p32)
    return model, master


def state_bytes_check(dp: int, group=None):
    """Adam's state per rank is 1/dp of the full state plus padding (< dp elements per param)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(257, 255), nn.ReLU(), nn.Linear(255, 129))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    zero = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), dp_group=group, stage=2)
    x = torch.randn(4, 257)
    ref(x).square().mean().backward()
    ref_opt.step()
    zero.backward(model(x).square().mean())
    zero.step()
    full = sum(v.numel() * v.element_size() for st in ref_opt.state.values() for v in st.values())
    mine = zero.state_bytes()
    # exp_avg and exp_avg_sq: fp32, ceil(n / dp) elements each; plus one fp32 `step` per param.
    expected = sum(2 * 4 * -(-p.numel() // dp) + 4 for p in model.parameters())
    assert mine["optimizer_states"] == expected, (mine, expected)
    assert mine["optimizer_states"] <= full / dp * 1.001, (mine, full)
    # fp32 parameters are stepped in place: the master shard is a view of the parameter, not a copy
    assert mine["master_params"] == 0, mine
    for slot in zero.slots:
        assert slot.master.untyped_storage().data_ptr() == slot.param.untyped_storage().data_ptr()
    params = sum(p.numel() for p in model.parameters())
    return {
        "dp": dp,
        "params": params,
        "full_state_bytes": full,
        "per_rank": mine,
        "ratio": mine["optimizer_states"] / full,
    }


def assert_same_weights(model, ref, atol=ATOL, rtol=RTOL, what=""):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{what} {n}: {m}")


def assert_same_on_all_ranks(model, group=None):
    """Every dp rank holds bit-identical weights (the all-gather went everywhere)."""
    for name, p in model.named_parameters():
        gathered = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, p.detach().contiguous(), group=group)
        for other in gathered:
            assert torch.equal(other, p), f"{name} differs between dp ranks"
