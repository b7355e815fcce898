"""Pipeline schedules (GPipe, 1F1B) over micro-batches, with point-to-point activation transfer.

Each stage runs its pipeline spec's ``stage_forward`` on its micro-batches and passes hidden states to the next
stage's rank with the same (dp, tp) place (``mesh.stage_rank``); gradients flow back the same way.
Sends are non-blocking (waited at the end of the step). With ``overlap`` (the default) each step
of the schedule posts its own receive and the next step's before computing, so the next input
arrives while this one computes; without it a receive is posted only when its tensor is needed.
Both are deadlock-free: only a tensor that is needed now is ever waited on (see `.p2p`).
The schedule names, ``SCHEDULES``, live in `shardformer.core.config` with the settings that name them.
"""

from __future__ import annotations

import contextlib

import torch

from shardformer.core.config import SCHEDULES, check_choice
from shardformer.pipeline.p2p import P2P, pack, unpack


def order(schedule: str, num_microbatches: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    """The sequence of ("F", i) / ("B", i) steps this stage runs."""
    check_choice("schedule", schedule, SCHEDULES)
    n = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]
    warmup = min(num_stages - stage - 1, n)  # 1f1b
    steps = [("F", i) for i in range(warmup)]
    for i in range(n - warmup):
        steps += [("F", warmup + i), ("B", i)]
    return steps + [("B", i) for i in range(n - warmup, n)]


def run_pipeline(
    model,
    stage_forward,
    mesh,
    micro_batches,
    loss_of,
    *,
    schedule="1f1b",
    backward=True,
    scale=1.0,
    device=None,
    overlap=True,
    before_backward=None,
):
    """Run one step over ``micro_batches`` on this stage.

    ``loss_of(output, micro_batch)`` gives the loss of a last-stage output. With ``backward``,
    each micro-batch's loss times ``scale`` is back-propagated (gradients accumulate in
    ``param.grad``). ``overlap`` posts receives one schedule step early. Returns ``(losses,
    outputs)`` on the last stage (detached; ``outputs`` only without backward), ``([], [])`` elsewhere.
    ``before_backward(last)`` runs before each micro-batch's backward, ``last`` for this stage's last
    one (ZeRO-3 reduces gradients only then).
    """
    stage, num_stages = mesh.pp_rank, mesh.pp_size
    first, last = stage == 0, stage == num_stages - 1
    device = device or torch.device("cpu")
    p2p = P2P(mesh, device, early_receives=overlap)
    saved: dict[int, tuple] = {}
    losses, outputs = [], []

    def forward(i):
        hidden = received = None
        if not first:
            hidden = p2p.take(("act", i))
            if backward:
                hidden.requires_grad_(True)
            received = unpack(hidden, p2p.layouts.pop(i))  # several tensors: views of one message
        out = stage_forward(model, received, micro_batches[i])
        if last:
            if backward or loss_of is not None:
                loss = loss_of(out, micro_batches[i])
                losses.append(loss.detach())
            if backward:
                saved[i] = (hidden, loss * scale)
            else:
                outputs.append(out)
        else:
            p2p.send_activation(out, i)
            if backward:
                saved[i] = (hidden, pack(out))  # one tensor, as sent: its gradient comes back as one

    def backward_step(i):
        hidden, out = saved.pop(i)
        if before_backward is not None:
            before_backward(i == last_backward)
        if last:
            out.backward()
        else:
            torch.autograd.backward(out, p2p.take(("grad", i)))
        if not first:
            p2p.send_grad(hidden.grad)

    n = len(micro_batches)
    steps = order(schedule, n, stage, num_stages) if backward else [("F", i) for i in range(n)]
    last_backward = next((i for kind, i in reversed(steps) if kind == "B"), None)  # this stage's last backward
    # What each step receives: its micro-batch's activation (F) or gradient (B), if from a neighbour.
    receives = [("act", i) if kind == "F" else ("grad", i) for kind, i in steps]
    receives = [None if (key[0] == "act" and first) or (key[0] == "grad" and last) else key for key in receives]
    with contextlib.nullcontext() if backward else torch.no_grad():
        for k, (kind, i) in enumerate(steps):
            if overlap:  # in step order, so each direction's receives are posted in send order
                for key in receives[k : k + 2]:
                    if key is not None:
                        p2p.post(key)
            forward(i) if kind == "F" else backward_step(i)
    p2p.wait()
    return losses, outputs
