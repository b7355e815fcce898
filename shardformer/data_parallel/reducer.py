"""Averaging gradients over the data-parallel group, bucket by bucket, into per-rank shards.

Gradients are copied from ``param.grad`` into bucket buffers laid out ``[dp, row]`` (see
`shardformer.data_parallel.layout`). Stage 1 all-reduces a bucket, stage 2 reduce-scatters it; either
way this rank ends with its row: the summed gradient of its shard of every parameter in the bucket.

With ``overlap=True`` a post-accumulate-grad hook copies each gradient as soon as autograd has
finished it (in the last of ``backwards_per_step`` backward passes: the micro-batches of a step),
and a full bucket is sent while backward goes on. Buckets are always *launched in bucket order*,
on every rank: collectives match by issue order, so a bucket whose params got no gradient on some
rank (a skipped layer) is simply sent later, at `GradientReducer.sync`, filled with zeros,
and no rank ever waits on a different collective than its peers.

A gradient edited after backward (a user's own ``clip_grad_norm_``, ``grad.mul_``, a new
``param.grad``) after its bucket was copied would be ignored: each copy records the gradient
tensor and its version counter (every in-place op bumps it), and ``sync`` compares them before it
uses the reduction. Any rank that sees an edit makes every rank raise, naming a parameter and the
fixes, before the optimizer changes anything.

With a ``sum_group`` (context parallelism: its ranks hold the same parameters and computed parts
of the same sequences) each bucket is first summed over it, then averaged over dp.

With a ``replicate_group`` (hybrid sharding: the ranks at this rank's place in the other shard groups)
each bucket's reduced rows are summed over it once reduced in the shard group, in bucket order on every
rank: at stage 2 only this rank's row crosses to the replicas (1/dp_shard of the gradient). The flags
(who has a gradient, stale or edited ones) are agreed over both groups, so every replica acts alike.

Stage 2 holds what ZeRO-2 promises: with ``release_grads`` each ``param.grad`` is freed once copied
into its bucket, and a bucket's ``[dp, row]`` buffer is freed once its reduce-scatter is done, keeping
only this rank's row. At most ``IN_FLIGHT`` buckets are in flight (older ones are waited on), and the
end of the backward that sent them waits for the rest, so after backward a rank holds its 1/dp rows
and no full-size gradient.

A gradient that changes after its bucket was sent (one backward more than announced) makes the
reduction stale. It is never used: ``sync`` finishes that round on every rank, and when any rank
saw a stale gradient, all ranks reduce every bucket again from ``param.grad`` (exact, at the cost
of the wasted round; with ``release_grads`` the earlier gradients are gone, so it is an error).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from shardformer.core import comm
from shardformer.data_parallel.layout import Bucket, ParamSlot, copy_rows_into, write_rows

EDITED_ERROR = (
    "ZeroOptimizer: the gradient of {name} was changed after backward, once its bucket had been reduced "
    "during backward (overlap_communication=True), so the change would be ignored{where}. Clip with "
    "optimizer.clip_grad_norm(max_norm) (the global norm over every rank) instead of "
    "torch.nn.utils.clip_grad_norm_, change gradients inside backward with a tensor hook, or pass "
    "overlap_communication=False (EngineConfig(overlap_grad_reduce=False)) to reduce param.grad as it "
    "is at step()"
)
STALE_WARNING = (
    "ZeroOptimizer: a gradient changed after its bucket was reduced during backward (more backward passes "
    "per step than backwards_per_step={n}); every bucket was reduced again at step(), which is exact but "
    "wastes that communication. Run all but the last backward of an accumulation inside "
    "`with optimizer.no_sync():`, or pass backwards_per_step=<backward passes per step>"
)

# Stage 2: buckets whose reduce-scatter may still be running. A newer launch waits for the older ones
# and frees their buffers, so backward holds at most this many full-size fp32 buckets, plus the one filling.
IN_FLIGHT = 2


class GradientReducer:
    def __init__(
        self,
        slots: list[ParamSlot],
        buckets: list[Bucket],
        group: dist.ProcessGroup | None,
        stage: int,
        reduce_dtype: torch.dtype | None,
        overlap: bool,
        release_grads: bool,
        per_rank: bool,
        backwards_per_step: int = 1,
        late_grads=(),
        sum_group=None,
        names: dict[int, str] | None = None,
        divisor: int | None = None,
        replicate_group=None,
    ) -> None:
        self.slots, self.buckets, self.group, self.stage = slots, buckets, group, stage
        self.sum_group = sum_group  # summed over first (context parallelism's cp ranks), then averaged over dp
        self.replicate_group = replicate_group  # HSDP: reduced rows summed over the replicas too
        self.per_rank = per_rank
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.divisor = divisor or self.dp  # the summed gradients' average: over dp, or what the owner says
        self.reduce_dtype, self.overlap, self.release_grads = reduce_dtype, overlap, release_grads
        self.backwards_per_step = backwards_per_step
        self.names = names or {}  # id(param) -> its name in the model, for errors
        self.accumulating = False
        # Only params that can receive a gradient count towards "bucket complete". A late param
        # (its caller still changes .grad after backward) gets no hook, so its bucket waits for sync.
        self._expected = [sum(s.param.requires_grad for s in b.slots) for b in buckets]
        late = {id(p) for p in late_grads}
        self._hooks = []
        if overlap:
            for slot in slots:
                if slot.param.requires_grad and id(slot.param) not in late:
                    self._hooks.append(slot.param.register_post_accumulate_grad_hook(partial(self._on_grad, slot)))
        self._pending: list[tuple[Bucket, dist.Work | None, torch.Tensor]] = []
        self._reduced: list[tuple[Bucket, torch.Tensor]] = []  # stage 2: waited on, buffer freed
        self._drain_queued = False
        # Stage 1 keeps its communication buffers from step to step: allocating ~the model's size
        # afresh every step costs page faults (large CPU blocks are mmapped). Stage 2 is about memory:
        # it frees the [dp, row] buffers once reduced and its rows after each step.
        self._buffers: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Forget this step's gradients (waiting for anything still in flight, so ranks stay in step)."""
        self._new_round()
        if self.stage == 2:
            self._buffers, self._outputs = {}, {}
        self._stale = False  # a gradient changed after its bucket was sent
        self.synced = False

    def _new_round(self) -> None:
        for _, work, _ in self._pending:
            if work is not None:
                work.wait()
        self._copied: list[set[int]] = [set() for _ in self.buckets]
        self._copied_grads: dict[int, tuple] = {}  # slot -> (the gradient tensor or None, its version)
        self._has_grad = [0] * len(self.slots)  # a list: hooks must not launch device ops one flag at a time
        self._backwards = [0] * len(self.slots)  # backward passes that reached each param this step
        self._pending, self._reduced = [], []
        self._next_launch = 0

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into ``param.grad``; nothing is sent."""
        previous, self.accumulating = self.accumulating, True
        try:
            yield
        finally:
            self.accumulating = previous

    # -- filling buckets ------------------------------------------------------------------------

    def _buffer(self, bucket: Bucket) -> torch.Tensor:
        buf = self._buffers.get(bucket.index)
        if buf is None:
            first = bucket.slots[0]
            dtype = self.reduce_dtype or first.master.dtype
            buf = torch.empty(self.dp, bucket.row_numel, dtype=dtype, device=first.master.device)
            self._buffers[bucket.index] = buf
        return buf

    def _copy(self, slot: ParamSlot) -> None:
        region = self._buffer(self.buckets[slot.bucket])[:, slot.offset : slot.offset + slot.shard_numel]
        grad = slot.param.grad
        if grad is None:
            region.zero_()
            return
        if grad.is_sparse:
            raise TypeError(
                f"parameter {slot.index} has a sparse gradient; ZeroOptimizer supports dense gradients only"
            )
        write_rows(region, grad.detach().reshape(-1))
        self._has_grad[slot.index] = 1
        self._copied[slot.bucket].add(slot.index)
        if self.release_grads:
            slot.param.grad = None  # the bucket holds it now; this is what saves memory in stage 2
        kept = slot.param.grad
        self._copied_grads[slot.index] = (kept, None if kept is None else kept._version)

    def _edited(self) -> int | None:
        """The first slot whose gradient changed since its copy (another tensor, or an in-place op)."""
        for index, (grad, version) in self._copied_grads.items():
            now = self.slots[index].param.grad
            if now is not grad or (now is not None and now._version != version):
                return index
        return None

    def _on_grad(self, slot: ParamSlot, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
            # a slice of a gradient other parameters' share (autograd keeps cat's backward output whole:
            # BEiT's q_bias and v_bias): its own storage, or their accumulation would look like an edit of it
            param.grad = grad.clone()
        if self.accumulating:
            return
        if self.synced:
            raise RuntimeError(
                f"parameter {slot.index} received a gradient after this step's gradients were reduced "
                f"(clip_grad_norm, grad_norm or sync_grads ran already); run every backward of a step before "
                f"those, or call optimizer.step()/zero_grad() first"
            )
        self._backwards[slot.index] += 1
        seen = self._backwards[slot.index]
        if self._stale or seen < self.backwards_per_step:
            return
        if seen > self.backwards_per_step or slot.bucket < self._next_launch:
            if self.release_grads:
                raise RuntimeError(
                    f"parameter {slot.index} received a gradient after its bucket was already reduced and its "
                    f"gradient released (release_grads=True): a backward more than backwards_per_step="
                    f"{self.backwards_per_step}. Run every backward but the last of an accumulation inside "
                    f"`with optimizer.no_sync():`, pass backwards_per_step=, call optimizer.step()/zero_grad() "
                    f"in between, or reduce everything at step (overlap_communication=False; in ParallelEngine "
                    f"EngineConfig(overlap_grad_reduce=False))"
                )
            self._stale = True  # sync reduces everything again from param.grad
            return
        self._copy(slot)
        launched = self._next_launch
        while self._next_launch < len(self.buckets) and (
            len(self._copied[self._next_launch]) >= self._expected[self._next_launch]
        ):
            self._launch(self.buckets[self._next_launch])
        if self.stage == 2 and self._next_launch > launched and not self._drain_queued:
            # at the end of this backward, wait for the buckets still in flight and free their buffers
            self._drain_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._drain)

    def _drain(self) -> None:
        self._drain_queued = False
        while self._pending:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        """Stage 2: wait for the oldest bucket in flight; keep its row, free its ``[dp, row]`` buffer."""
        bucket, work, out = self._pending.pop(0)
        if work is not None:
            work.wait()
        self._buffers.pop(bucket.index, None)
        self._reduced.append((bucket, out))

    def _launch(self, bucket: Bucket) -> None:
        buf = self._buffer(bucket)
        for slot in bucket.slots:
            if slot.index not in self._copied[bucket.index]:
                buf[:, slot.offset : slot.offset + slot.shard_numel].zero_()  # no gradient here: adds nothing
        if self.sum_group is not None:  # every rank of it holds the same slots: one sum of the whole bucket
            comm.all_reduce(buf, self.sum_group)
        work = None
        if self.stage == 2:
            out = self._outputs.get(bucket.index)
            if out is None:
                out = self._outputs[bucket.index] = buf.new_empty(bucket.row_numel)
            if self.dp > 1:
                work = comm.start_reduce_scatter_flat(out, buf.view(-1), self.group, self.per_rank)
            else:
                out.copy_(buf[0])
        else:
            out = buf
            if self.dp > 1:
                _, work = comm.start_all_reduce(buf, self.group)
        self._pending.append((bucket, work, out))
        self._next_launch += 1
        if self.stage == 2:
            while len(self._pending) > IN_FLIGHT:
                self._retire_oldest()

    def _launch_the_rest(self) -> None:
        """Copy the gradients no hook has copied, then launch every bucket not yet sent, in order."""
        for bucket in self.buckets[self._next_launch :]:
            for slot in bucket.slots:
                if slot.param.grad is not None and slot.index not in self._copied[bucket.index]:
                    self._copy(slot)
            self._launch(bucket)

    def _agree_on_flags(self, edited: bool = False) -> tuple[list[bool], bool, bool]:
        """Who has a gradient, whether any rank saw a stale one, and whether any rank's gradient was
        edited after its copy: one small all-reduce, every rank."""
        device = self.slots[0].master.device
        device = "cpu" if device.type == "meta" else device  # a job simulated on meta (tools/simulate)
        flags = torch.tensor([*self._has_grad, int(self._stale), int(edited)], dtype=torch.int32, device=device)
        if self.dp > 1:
            comm.all_reduce(flags, self.group, op=dist.ReduceOp.MAX)
        if self.replicate_group is not None:
            comm.all_reduce(flags, self.replicate_group, op=dist.ReduceOp.MAX)
        values = [bool(flag) for flag in flags.tolist()]
        return values[:-2], values[-2], values[-1]

    # -- finishing --------------------------------------------------------------------------------

    def sync(self, grad_scale: float) -> None:
        """Finish reducing this step's gradients and set every master shard's ``.grad``.

        ``master.grad`` becomes this rank's shard of the summed gradient times ``grad_scale``
        (``1 / (dp * loss_scale)``: the dp average, unscaled), or None for a parameter that got no
        gradient on any rank, so the wrapped optimizer skips it exactly as it would skip a param
        whose ``grad`` is None. Stage 1 also writes the dp-averaged gradient back into ``param.grad``.
        """
        if self.synced:
            return
        # Remaining buckets in bucket order, then the flags: the same sequence of collectives on
        # every rank, whatever each rank's backward produced.
        edited = None if self._stale else self._edited()  # stale: everything is copied again from param.grad
        self._launch_the_rest()
        has_grad, stale, edited_anywhere = self._agree_on_flags(edited is not None)
        if edited_anywhere and not stale:
            self._new_round()  # waits for this round (the same collectives on every rank) and drops it
            slot = self.slots[edited] if edited is not None else None
            name = "a parameter" if slot is None else self.names.get(id(slot.param), f"parameter {slot.index}")
            where = "" if edited is not None else " (on another data-parallel rank)"
            raise RuntimeError(EDITED_ERROR.format(name=name, where=where))
        if stale:
            warnings.warn(STALE_WARNING.format(n=self.backwards_per_step), stacklevel=3)
            self._new_round()  # waits for the stale round and drops it
            self._launch_the_rest()
            has_grad, _, _ = self._agree_on_flags()
        for bucket, out in self._reduced:
            self._finish(bucket, out, has_grad, grad_scale)
        for bucket, work, out in self._pending:
            if work is not None:
                work.wait()
            self._finish(bucket, out, has_grad, grad_scale)
        self._pending, self._reduced = [], []
        if self.stage == 2:
            self._buffers = {}
        self.synced = True

    def held_buffers(self) -> list[torch.Tensor]:
        """The fp32 tensors the reduction holds now: ``[dp, row]`` bucket buffers and reduced rows."""
        return [*self._buffers.values(), *self._outputs.values()]

    def spare_buffer(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor | None:
        """The bucket's ``[dp, row]`` buffer, free between ``sync`` and the next backward (the
        parameter all-gather reuses it), if it has ``dtype``."""
        buf = self._buffers.get(bucket.index)
        return buf if buf is not None and buf.dtype == dtype and not self._pending else None

    def _finish(self, bucket: Bucket, out: torch.Tensor, has_grad: list[bool], grad_scale: float) -> None:
        if self.replicate_group is not None:  # stage 2: this rank's row; stage 1: every row (written back)
            comm.all_reduce(out, self.replicate_group)
        if self.stage == 2:
            row = out.mul_(grad_scale)
        else:
            out.div_(self.divisor)  # the dp average, still loss-scaled: what DDP leaves in param.grad
            for slot in bucket.slots:
                if has_grad[slot.index]:
                    self._write_back(slot, out[:, slot.offset : slot.offset + slot.shard_numel])
            row = out[self.rank]  # written back already: unscaled in place, the masters' grads view it
            if grad_scale * self.divisor != 1.0:
                row.mul_(grad_scale * self.divisor)
        for slot in bucket.slots:
            piece = row[slot.offset : slot.offset + slot.shard_numel]
            slot.master.grad = piece.to(slot.master.dtype) if has_grad[slot.index] else None

    @staticmethod
    def _write_back(slot: ParamSlot, region: torch.Tensor) -> None:
        p = slot.param
        if p.grad is None:  # no gradient here, but some on another rank
            p.grad = torch.empty_like(p)
        copy_rows_into(p.grad, region)
