"""The same step as `shardformer.pipeline.schedule.run_pipeline`, on torch.distributed.pipelining.

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
schedule are kept by a `TorchPipeline` (one per engine) and rebuilt only when the
micro-batch shapes change.

A rank of a virtual-stage schedule (interleaved 1F1B, ZBV, DualPipeV) runs one PipelineStage per
model chunk, each a `_Stage` over the same model whose forward runs the chunk's view
(`shardformer.pipeline.virtual`). ZBV and DualPipeV split a backward into an input part and a
weight part, torch's weight step computing the weight gradients from what the input step kept and
writing ``.grad`` itself. That skips what hooks into autograd's accumulation of ``.grad`` (ZeRO-3's
FSDP2, the tensor-parallel and context-parallel gradient sums): with any of those the input part
runs the whole backward (see `_no_weight_step`), keeping the schedule's order but not the
bubble the separate weight part fills. ZeRO-1/2's overlapped reduction only loses its overlap there:
a bucket whose gradients no hook announced is reduced at the step from ``.grad``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from shardformer.core.config import EngineConfig
from shardformer.core.counting import count_torch_collectives
from shardformer.core.rng import get_rng_state, set_rng_state
from shardformer.pipeline.spec import PipelineSpec
from shardformer.tensor_parallel.recompute import seeded_dropouts


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch sends the gradient of a stage's
    input as autograd computed it, and gloo sends only contiguous tensors (a conv net's first op may
    permute its input to channels-last)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


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
        # a stage may hand on several tensors (an encoder-decoder's); their gradients go back contiguous
        index, received = args[-1], tuple(_ContiguousGrad.apply(a) for a in args[:-1])
        hidden = None if not received else received[0] if len(received) == 1 else received
        value = torch.nan_to_num(index.detach().reshape(-1)[:1].double(), nan=0.0, posinf=0.0, neginf=0.0)
        i = int(value.round().clamp(0, len(self.micro) - 1).item())
        batch = self.micro[i]
        out = self.stage_forward(self.model, hidden, batch)
        if not self.last:  # not a view nor an input (torch's split backward detaches the stage's outputs in place),
            parts = out if isinstance(out, tuple) else (out,)  # and contiguous (gloo sends only contiguous tensors)
            copy = lambda t: t._base is not None or any(t is r for r in received) or not t.is_contiguous()  # noqa: E731
            return *(t.clone(memory_format=torch.contiguous_format) if copy(t) else t for t in parts), index
        loss = self.loss_of(out, batch)
        self.losses[i] = loss.detach()
        return (loss * self.scale).reshape(1)


def _announcing(stage, n, before_backward):
    """``stage.backward_one_chunk`` calling ``before_backward(last, stage index)`` first, ``last`` for the stage's
    last micro-batch (counted here: split-backward schedules call it with last_backward=False and
    announce the last one to the weight step). Its own FSDP2 handling applies only when the stage
    module itself is the FSDP2 root, and ours wraps it."""
    backward_one_chunk, seen = stage.backward_one_chunk, [0]

    def run(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        seen[0] = seen[0] % n + 1
        before_backward(seen[0] == n, stage.stage_index)
        return backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    return run


def _no_weight_step():
    """A ``dw_builder`` for the split-backward schedules (ZBV, DualPipeV) where gradient hooks must run:
    the input-gradient step runs the whole backward through autograd, as every other schedule does
    (FSDP2 and the tensor-parallel gradient sums hook into autograd's accumulation of ``.grad``, which
    torch's own weight step bypasses), and the weight step has nothing left to do."""
    return lambda: None


def split_backward_is_exact(config: EngineConfig, spec: PipelineSpec | None, model: nn.Module) -> bool:
    """ZBV / DualPipeV may use torch's weight step, which writes ``.grad`` outside autograd's
    accumulation, only where nothing hooks into it: no FSDP2 (ZeRO-3), no gradient hooks on the
    parameters (tensor-/context-parallel sums), no recompute in backward."""
    if config.zero_stage == 3 or config.activation_checkpointing or config.tp > 1 or config.cp > 1:
        return False
    if spec is not None and spec.second_layers is not None:
        # an encoder-decoder's chunks hand on received tensors (the encoder's output, T5's position bias):
        # torch's weight step walks a graph its input step already freed there ("backward a second time")
        return False
    return not any(p._backward_hooks for p in model.parameters())


def _signature(micro_batches) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype) for k, v in micro_batches[0].items() if torch.is_tensor(v)), len(
        micro_batches
    )


class TorchPipeline:
    """Runs training steps of one model's stage(s) on torch.distributed.pipelining, keeping its
    PipelineStages and schedule between steps of the same micro-batch shapes.

    ``stage_forwards``: ``{stage index: stage forward}`` of the stages this rank runs, among
    ``num_stages`` (default: one, ``stage_forward`` as stage ``pp_rank`` of ``pp``)."""

    def __init__(
        self,
        model: nn.Module,
        stage_forward,
        mesh,
        device=None,
        before_backward=None,
        stage_forwards=None,
        num_stages=None,
        split_backward=False,
    ) -> None:
        self.model, self.mesh = model, mesh
        self.stage_forwards = stage_forwards or {mesh.pp_rank: stage_forward}
        self.num_stages = num_stages or mesh.pp_size
        self.split_backward = split_backward  # ZBV / DualPipeV: torch's weight step (see _no_weight_step)
        self.device = device or torch.device("cpu")
        self.before_backward = before_backward  # (last: bool, stage: int) -> None, before each backward
        self._built = None  # (key, stage modules, schedule)

    def step(self, micro_batches, loss_of, *, schedule="1f1b", scale=1.0) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch; the rank of the last stage returns their losses."""
        device, n = self.device, len(micro_batches)
        key = (_signature(micro_batches), schedule)
        if self._built is None or self._built[0] != key:
            self._built = (key, *self._build(schedule, n, loss_of))
        _, modules, sched = self._built
        for module in modules.values():
            module.micro, module.scale, module.losses, module.loss_of, module.calls = (
                micro_batches,
                scale,
                {},
                loss_of,
                0,
            )
        built = next(iter(modules.values())).shape_probe
        kwargs = {}
        if 0 in modules:
            kwargs["arg_mbs"] = [(torch.full((1,), float(i), device=device),) for i in range(n)]
        last = modules.get(self.num_stages - 1)
        if last is not None:
            kwargs["target_mbs"] = [torch.zeros(1, device=device) for _ in range(n)]
        sched.step(**kwargs)
        for index, module in modules.items():
            if module.calls != n + built:
                raise RuntimeError(
                    f"torch.distributed.pipelining ran stage {index}'s forward {module.calls} times for {n} "
                    f"micro-batches{' on its first step (one shape inference expected)' if built else ''}; dropout "
                    f"masks would not be those of EngineConfig(backend='p2p'): use backend='p2p'"
                )
        return [last.losses[i] for i in range(n)] if last is not None else []

    def _build(self, schedule, n, loss_of):
        mesh, fused = self.mesh, schedule in ("zbv", "dualpipev") and not self.split_backward
        count_torch_collectives()  # torch's schedule sends between stages itself: counters see it through a dispatch mode
        modules, stages = {}, []
        for index, forward in sorted(self.stage_forwards.items()):
            module = modules[index] = _Stage(self.model, forward, loss_of, index == self.num_stages - 1)
            stage = PipelineStage(
                module, index, self.num_stages, self.device, group=mesh.pp_group,
                dw_builder=_no_weight_step if fused else None,
            )  # fmt: skip
            if self.before_backward is not None:
                stage.backward_one_chunk = _announcing(stage, n, self.before_backward)
            stages.append(stage)
        # scale_grads=False: ``scale`` already divides by the number of micro-batches
        options = {"n_microbatches": n, "loss_fn": lambda out, _: out.sum(), "scale_grads": False}
        if schedule == "1f1b" and n < self.num_stages:  # every rank has the same n: all raise, none waits
            raise ValueError(
                f"num_microbatches={n} with schedule='1f1b' at pp={self.num_stages}: torch's 1F1B keeps a "
                f"micro-batch in flight per stage and needs at least {self.num_stages}; use "
                f"EngineConfig(num_microbatches={self.num_stages}) or more (the bubble shrinks), or schedule='gpipe'"
            )
        if schedule in _SINGLE:
            return modules, _SINGLE[schedule](stages[0], **options)
        return modules, MULTI_SCHEDULES[schedule](stages, **options)


_SINGLE = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
MULTI_SCHEDULES = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
