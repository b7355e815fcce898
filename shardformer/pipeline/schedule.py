"""Pipeline schedules (GPipe, 1F1B) over micro-batches, with point-to-point activation transfer.

Each stage runs its pipeline spec's ``stage_forward`` on its micro-batches and passes hidden states to the next
stage's rank with the same (dp, tp) place (``mesh.stage_rank``); gradients flow back the same way.
Sends are non-blocking (waited at the end of the step), receives block, so both schedules are
deadlock-free. A shape header precedes every tensor, so stages need no shape inference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SCHEDULES = ("gpipe", "1f1b")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_MAX_DIMS = 8


class P2P:
    """Send/receive tensors of any shape between neighbouring stages of one pipeline."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.pending: list = []

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.contiguous()
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
        header[0], header[1] = tensor.ndim, _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape, dtype=torch.int64)
        dst = self.mesh.stage_rank(stage)
        for t in (header, tensor):
            self.pending.append((dist.isend(t.to(tensor.device) if t is header else t, dst, self.mesh.pp_group), t))

    def recv(self, stage: int, device) -> torch.Tensor:
        src = self.mesh.stage_rank(stage)
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=device)
        dist.recv(header, src, self.mesh.pp_group)
        header = header.cpu()
        shape = header[2 : 2 + int(header[0])].tolist()
        out = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device)
        dist.recv(out, src, self.mesh.pp_group)
        return out

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def order(schedule: str, num_microbatches: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    """The sequence of ("F", i) / ("B", i) steps this stage runs."""
    n = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, n)
        steps = [("F", i) for i in range(warmup)]
        for i in range(n - warmup):
            steps += [("F", warmup + i), ("B", i)]
        return steps + [("B", i) for i in range(n - warmup, n)]
    raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")


def run_pipeline(
    model, stage_forward, mesh, micro_batches, loss_of, *, schedule="1f1b", backward=True, scale=1.0, device=None
):
    """Run one step over ``micro_batches`` on this stage.

    ``loss_of(output, micro_batch)`` gives the loss of a last-stage output. With ``backward``,
    each micro-batch's loss times ``scale`` is back-propagated (gradients accumulate in
    ``param.grad``). Returns ``(losses, outputs)`` on the last stage (detached; ``outputs`` only
    without backward), ``([], [])`` elsewhere.
    """
    stage, num_stages = mesh.pp_rank, mesh.pp_size
    first, last = stage == 0, stage == num_stages - 1
    device = device or torch.device("cpu")
    p2p = P2P(mesh)
    saved: dict[int, tuple] = {}
    losses, outputs = [], []

    def forward(i):
        hidden = None
        if not first:
            hidden = p2p.recv(stage - 1, device)
            if backward:
                hidden.requires_grad_(True)
        out = stage_forward(model, hidden, micro_batches[i])
        if last:
            if backward or loss_of is not None:
                loss = loss_of(out, micro_batches[i])
                losses.append(loss.detach())
            if backward:
                saved[i] = (hidden, loss * scale)
            else:
                outputs.append(out)
        else:
            p2p.send(out.detach(), stage + 1)
            if backward:
                saved[i] = (hidden, out)

    def backward_step(i):
        hidden, out = saved.pop(i)
        if last:
            out.backward()
        else:
            grad = p2p.recv(stage + 1, device)
            torch.autograd.backward(out, grad)
        if not first:
            p2p.send(hidden.grad, stage - 1)

    steps = order(schedule, len(micro_batches), stage, num_stages) if backward else None
    try:
        if steps is None:
            with torch.no_grad():
                for i in range(len(micro_batches)):
                    forward(i)
        else:
            for kind, i in steps:
                forward(i) if kind == "F" else backward_step(i)
    finally:
        p2p.wait()
    return losses, outputs
