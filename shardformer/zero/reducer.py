"""Averaging gradients over the data-parallel group, bucket by bucket, into per-rank shards.

Gradients are copied from ``param.grad`` into bucket buffers laid out ``[dp, row]`` (see
:mod:`shardformer.zero.layout`). Stage 1 all-reduces a bucket, stage 2 reduce-scatters it; either
way this rank ends with its row: the summed gradient of its shard of every parameter in the bucket.

With ``overlap=True`` a post-accumulate-grad hook copies each gradient as soon as autograd has
finished it, and a full bucket is sent while backward goes on. Buckets are always *launched in
bucket order*, on every rank: collectives match by issue order, so a bucket whose params got no
gradient on some rank (a skipped layer) is simply sent later, at :meth:`GradientReducer.sync`,
filled with zeros, and no rank ever waits on a different collective than its peers.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from shardformer.zero import comm
from shardformer.zero.layout import Bucket, ParamSlot, copy_rows_into, write_rows


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
    ) -> None:
        self.slots, self.buckets, self.group, self.stage = slots, buckets, group, stage
        self.per_rank = per_rank
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.reduce_dtype, self.overlap, self.release_grads = reduce_dtype, overlap, release_grads
        self.accumulating = False
        # Only params that can receive a gradient count towards "bucket complete".
        self._expected = [sum(s.param.requires_grad for s in b.slots) for b in buckets]
        self._hooks = []
        if overlap:
            for slot in slots:
                if slot.param.requires_grad:
                    self._hooks.append(slot.param.register_post_accumulate_grad_hook(partial(self._on_grad, slot)))
        self.reset()

    def reset(self) -> None:
        """Forget this step's gradients (waiting for anything still in flight, so ranks stay in step)."""
        for _, work, _ in getattr(self, "_pending", []):
            work.wait()
        self._buffers: dict[int, torch.Tensor] = {}
        self._copied: list[set[int]] = [set() for _ in self.buckets]
        self._has_grad = [0] * len(self.slots)  # a list: hooks must not launch device ops one flag at a time
        self._pending: list[tuple[Bucket, dist.Work | None, torch.Tensor]] = []
        self._next_launch = 0
        self.synced = False

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

    def _on_grad(self, slot: ParamSlot, param: torch.Tensor) -> None:
        if self.accumulating:
            return
        if slot.bucket < self._next_launch:
            raise RuntimeError(
                f"parameter {slot.index} received a gradient after its bucket was already reduced: a second "
                f"backward without stepping. Run every backward but the last of an accumulation inside "
                f"`with optimizer.no_sync():`, or call optimizer.step()/zero_grad() in between"
            )
        self._copy(slot)
        while self._next_launch < len(self.buckets) and (
            len(self._copied[self._next_launch]) >= self._expected[self._next_launch]
        ):
            self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        buf = self._buffer(bucket)
        for slot in bucket.slots:
            if slot.index not in self._copied[bucket.index]:
                buf[:, slot.offset : slot.offset + slot.shard_numel].zero_()  # no gradient here: adds nothing
        work = None
        if self.stage == 2:
            out = buf.new_empty(bucket.row_numel)
            if self.dp > 1:
                work = comm.reduce_scatter(out, buf.view(-1), self.group, self.per_rank, async_op=True)
            else:
                out.copy_(buf[0])
        else:
            out = buf
            if self.dp > 1:
                work = comm.all_reduce(buf, self.group, async_op=True)
        self._pending.append((bucket, work, out))
        self._next_launch += 1

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
        if not self.overlap:
            for slot in self.slots:
                if slot.param.grad is not None:
                    self._copy(slot)
        # Remaining buckets in bucket order, then the "who has a gradient" flags: the same
        # sequence of collectives on every rank, whatever each rank's backward produced.
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        flags = torch.tensor(self._has_grad, dtype=torch.int32, device=self.slots[0].master.device)
        if self.dp > 1:
            comm.all_reduce(flags, self.group, op=dist.ReduceOp.MAX)
        has_grad = [bool(flag) for flag in flags.tolist()]
        for bucket, work, out in self._pending:
            if work is not None:
                work.wait()
            self._finish(bucket, out, has_grad, grad_scale)
        self._pending, self._buffers = [], {}
        self.synced = True

    def _finish(self, bucket: Bucket, out: torch.Tensor, has_grad: list[bool], grad_scale: float) -> None:
        if self.stage == 2:
            row = out.mul_(grad_scale)
        else:
            out.div_(self.dp)  # the dp average, still loss-scaled: what DDP leaves in param.grad
            for slot in bucket.slots:
                if has_grad[slot.index]:
                    self._write_back(slot, out[:, slot.offset : slot.offset + slot.shard_numel])
            row = out[self.rank].mul(grad_scale * self.dp)
        for slot in bucket.slots:
            piece = row[slot.offset : slot.offset + slot.shard_numel]
            slot.master.grad = piece.to(slot.master.dtype) if has_grad[slot.index] else None

    @staticmethod
    def _write_back(slot: ParamSlot, region: torch.Tensor) -> None:
        p = slot.param
        if p.grad is None:  # no gradient here, but some on another rank
            p.grad = torch.empty_like(p)
        copy_rows_into(p.grad, region)
