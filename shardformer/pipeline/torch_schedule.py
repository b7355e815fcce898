"""The same step as :func:`~shardformer.pipeline.schedule.run_pipeline`, on torch.distributed.pipelining.

``PipelineStage`` passes only positional tensors between stages, and keyword inputs reach the first
stage only, while our stages need their micro-batch everywhere (attention masks, labels). Every rank
holds the whole batch, so the micro-batch's index travels with the activations as a second output
and each stage looks its micro-batch up. The last stage returns the scaled loss itself; the
schedule's loss function only passes it on.

``PipelineStage`` infers shapes at its first step by running each stage once on uninitialised
tensors (a real forward, tensor-parallel collectives included), so the index it sees then is
garbage: it is clamped, and the loss of that call is overwritten by the real one. That extra
forward would draw dropout masks (on stage 0 from the first micro-batch's real input), shifting
every later mask by when the stage was built (a resumed run, new micro-batch shapes): it runs with
every RNG the model draws from (global, seeded dropout layers, attention streams) put back after it.
A build step must see exactly one forward more than its micro-batches, or it is refused. Stage and
schedule are kept by a :class:`TorchPipeline` (one per engine) and rebuilt only when the
micro-batch shapes change.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from shardformer.core.rng import get_rng_state, set_rng_state
from shardformer.tensor_parallel.recompute import seeded_dropouts


class _Stage(nn.Module):
    def __init__(self, model, stage_forward, loss_of, last) -> None:
        super().__init__()
        self.model = model
        self.stage_forward, self.loss_of, self.last = stage_forward, loss_of, last
        self.micro: list[dict] = []
        self.scale = 1.0
        self.losses: dict[int, torch.Tensor] = {}
        self.shape_probe = True  # the first call of a new PipelineStage infers shapes
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        if not self.shape_probe:
            return self._run(*args)
        self.shape_probe = False
        dropouts = seeded_dropouts(self.model)
        kept, streams = get_rng_state(), [d.rng_snapshot() for d in dropouts]
        try:
            return self._run(*args)
        finally:
            set_rng_state(kept)
            for d, state in zip(dropouts, streams):
                d.rng_restore(state)

    def _run(self, *args):
        index = args[-1]
        hidden = args[0] if len(args) > 1 else None
        value = torch.nan_to_num(index.detach().reshape(-1)[:1].double(), nan=0.0, posinf=0.0, neginf=0.0)
        i = int(value.round().clamp(0, len(self.micro) - 1).item())
        batch = self.micro[i]
        out = self.stage_forward(self.model, hidden, batch)
        if not self.last:
            return out, index
        loss = self.loss_of(out, batch)
        self.losses[i] = loss.detach()
        return (loss * self.scale).reshape(1)


def _announcing(backward_one_chunk, before_backward):
    """``PipelineStage.backward_one_chunk`` calling ``before_backward(last_backward)`` first: the
    schedules say which micro-batch's backward is the stage's last (its own FSDP2 handling applies
    only when the stage module itself is the FSDP2 root, and ours wraps it)."""

    def run(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        before_backward(last_backward)
        return backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    return run


def _signature(micro_batches) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype) for k, v in micro_batches[0].items() if torch.is_tensor(v)), len(
        micro_batches
    )


class TorchPipeline:
    """Runs training steps of one model's stage on torch.distributed.pipelining, keeping its
    PipelineStage and schedule between steps of the same micro-batch shapes."""

    def __init__(self, model: nn.Module, stage_forward, mesh, device=None, before_backward=None) -> None:
        self.model, self.stage_forward, self.mesh = model, stage_forward, mesh
        self.device = device or torch.device("cpu")
        self.before_backward = before_backward  # (last: bool) -> None, before each micro-batch's backward
        self._built = None  # (key, stage module, schedule)

    def step(self, micro_batches, loss_of, *, schedule="1f1b", scale=1.0) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch; the last stage returns their losses."""
        mesh, device, n = self.mesh, self.device, len(micro_batches)
        key = (_signature(micro_batches), schedule)
        if self._built is None or self._built[0] != key:
            module = _Stage(self.model, self.stage_forward, loss_of, mesh.is_last_stage)
            stage = PipelineStage(module, mesh.pp_rank, mesh.pp_size, device, group=mesh.pp_group)
            if self.before_backward is not None:
                stage.backward_one_chunk = _announcing(stage.backward_one_chunk, self.before_backward)
            cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            # scale_grads=False: ``scale`` already divides by the number of micro-batches
            sched = cls(stage, n_microbatches=n, loss_fn=lambda out, _: out.sum(), scale_grads=False)
            self._built = (key, module, sched)
        _, module, sched = self._built
        module.micro, module.scale, module.losses, module.loss_of = micro_batches, scale, {}, loss_of
        kwargs = {}
        if mesh.is_first_stage:
            kwargs["arg_mbs"] = [(torch.full((1,), float(i), device=device),) for i in range(n)]
        if mesh.is_last_stage:
            kwargs["target_mbs"] = [torch.zeros(1, device=device) for _ in range(n)]
        module.calls, built = 0, module.shape_probe
        sched.step(**kwargs)
        if module.calls != n + built:
            raise RuntimeError(
                f"torch.distributed.pipelining ran stage {mesh.pp_rank}'s forward {module.calls} times for {n} "
                f"micro-batches{' on its first step (one shape inference expected)' if built else ''}; dropout masks "
                f"would not be those of EngineConfig(backend='p2p'): use backend='p2p'"
            )
        return [module.losses[i] for i in range(n)] if mesh.is_last_stage else []
